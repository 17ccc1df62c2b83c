"""reasoning-gym's procedural generators as a relign task (``task.name=reasoning_gym``, alias ``rg``).

reasoning-gym (``pip install "relign[reasoning-gym]"``) has about 100 generators, each with its
own verifier: ``create_dataset(name, seed=, size=, **options)[i]`` is ``{"question", "answer",
"metadata"}``, deterministic in ``seed + i``, and ``dataset.score_answer(answer, entry)`` grades
an answer in [0, 1] (partial credit in some datasets). A record stores only what regenerates its
entry::

    {"prompt" | "messages": question,
     "extra_info": {"answer": "-4", "rg": {"dataset": "chain_sum", "config": {...}, "seed": 1, "size": 2048, "index": 0}}}

The entry itself is not stored (its metadata holds tuples and objects a JSON trace would turn
into strings); the reward rebuilds it in the reward worker (``_entry``, cached) and calls the
dataset's own ``score_answer``, so the reward is reasoning-gym's graded value and ``score`` is
that value thresholded (``score_threshold``).

A weighted mix of datasets follows reasoning-gym's ``CompositeDataset`` draw exactly: item ``i``
picks its dataset with ``Random(seed + i).choices(weights)``, and the k-th dataset generates with
seed ``seed + k + 1`` and the mix's size, so a record names the one dataset that made it.

Nothing from the model is executed: the answer is cut out of the response by a regex (the last
``<answer>...</answer>``, or the last ``\\boxed{}``), refused past ``MAX_ANSWER_CHARS``, and handed
to reasoning-gym's grader (string comparisons, sympy or ``ast`` parsing; in ``RewardPool`` under
its per-call timeout).
"""

from __future__ import annotations

import ast
import difflib
import enum
import functools
import importlib
import importlib.metadata
import json
import random
import typing
from typing import Any

from relign.envs.base import Task, generated, rng_guard
from relign.envs.math import last_boxed
from relign.errors import ConfigError

NAME = "reasoning_gym"
DEFAULT_DATASETS = {"chain_sum": 1.0}
ANSWER_FORMATS = ("tag", "boxed")
# An answer longer than this is not graded (score 0): no dataset's answer is near it, and a
# 1 MB string must not reach a sympy parser.
MAX_ANSWER_CHARS = 2000
BOXED_SYSTEM_PROMPT = ("Given a problem, think step by step, then give the final answer alone in \\boxed{}, "
                       "as in \\boxed{42}.")
INSTALL = 'pip install "relign[reasoning-gym]"'


def _rg():
    """The reasoning_gym package, imported on first use (it imports every generator, sympy included)."""
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError:
        raise ConfigError(f"task.name={NAME} needs the reasoning-gym package: {INSTALL}") from None


def rg_version() -> str:
    """The installed reasoning-gym's version (its ``__version__`` lags the release: read the metadata)."""
    try:
        return importlib.metadata.version("reasoning-gym")
    except importlib.metadata.PackageNotFoundError:
        return ""


def check_dataset(name: str) -> None:
    """A ``ConfigError`` naming the closest registered names when ``name`` is not a dataset."""
    known = sorted(n for n in _rg().factory.DATASETS if n != "composite")
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; {len(known)} are known (reasoning_gym.factory.DATASETS)"
        raise ConfigError(f"task.rg.datasets: unknown reasoning-gym dataset '{name}'{hint}")


# --------------------------------------------------------------------------- records


def _typed(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with each value given as text turned into the enum its option is typed as: YAML and
    JSON have no enums, and a generator compares with and reads ``.value`` of its own (``aiw``'s
    ``task_types: [siblings]`` is ``[TaskType.SIBLINGS]``; ``word_sorting``'s ``transformation``)."""
    cls = _rg().factory.DATASETS[name][1]
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation this Python cannot resolve: pass the options as given
        return config
    out = dict(config)
    for key, value in config.items():
        hint = hints.get(key)
        many = typing.get_origin(hint) in (list, tuple)
        kind = typing.get_args(hint)[0] if many and typing.get_args(hint) else hint
        if not (isinstance(kind, type) and issubclass(kind, enum.Enum)):
            continue
        try:
            out[key] = [kind(v) for v in value] if many and isinstance(value, (list, tuple)) else kind(value)
        except ValueError:
            raise ConfigError(f"task.rg.config.{name}.{key}={value}: expected {'a list of ' if many else ''}"
                              f"{', '.join(str(m.value) for m in kind)}") from None
    return out


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, seed: int, size: int):
    """The dataset object (built once per worker and key: some generators load word lists)."""
    with rng_guard():
        return _rg().create_dataset(name, **_typed(name, json.loads(config_json)), seed=seed, size=size)


@functools.lru_cache(maxsize=4096)
def _entry_cached(name: str, config_json: str, seed: int, size: int, index: int) -> dict[str, Any]:
    with rng_guard():  # pool_matrix and others reseed NumPy's global generator to build an entry
        return _dataset(name, config_json, seed, size)[index]


def _key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def entry(ref: dict[str, Any]) -> dict[str, Any]:
    """The reasoning-gym entry a record's ``extra_info["rg"]`` names, regenerated (cached)."""
    return _entry_cached(ref["dataset"], _key(ref.get("config") or {}), int(ref["seed"]), int(ref["size"]),
                         int(ref["index"]))


def system_text(system_prompt: str, answer_format: str) -> str:
    """``system_prompt`` as text: a key of ``SYSTEM_PROMPTS`` (``default`` asks for the chosen
    answer format), literal text, or "" for none."""
    if system_prompt == "default" and answer_format == "boxed":
        return BOXED_SYSTEM_PROMPT
    return _rg().utils.SYSTEM_PROMPTS.get(system_prompt, system_prompt)


# Datasets whose own grader calls Python's eval(): on the model's answer (to accept "['a', 'b']"
# for "ab" with partial credit), or on the oracle (number_sorting's fallback, harmless but read the
# same way). relign never executes model text: their module's `eval` name is
# bound to ast.literal_eval, which reads such literals and nothing else (a call, an attribute,
# an import raise, and the grader scores that 0). tests/envs/test_reasoning_gym.py scans the
# installed package's graders for eval() and checks this list covers them.
GRADERS_WITH_EVAL = ("binary_matrix", "n_queens", "number_sorting", "spiral_matrix", "string_insertion")


def _literal_eval(text: Any) -> Any:
    return ast.literal_eval(text) if isinstance(text, str) else text


def _defuse(dataset) -> None:
    """Bind ``eval`` in a grader's module to ``ast.literal_eval`` (``GRADERS_WITH_EVAL``)."""
    module = importlib.import_module(type(dataset).__module__)
    if getattr(module, "eval", None) is not _literal_eval:
        module.eval = _literal_eval


def _build(name: str, config: dict[str, Any], seed: int, size: int):
    try:
        return _dataset(name, _key(config), seed, size)
    except ConfigError:
        raise
    except (TypeError, ValueError, AssertionError) as e:  # an unknown option, or one the generator's validate() rejects
        msg = " ".join(str(e).split())[:200] or type(e).__name__
        raise ConfigError(f"task.rg.config.{name}={config}: reasoning-gym refuses it: {msg}") from None


def generate(n: int, seed: int, *, chat: bool = False, datasets: dict[str, float] | None = None,
             config: dict[str, dict[str, Any]] | None = None, system_prompt: str = "") -> list[dict[str, Any]]:
    """``n`` records of the weighted mix ``datasets`` (one name: that dataset alone), deterministic in ``seed``.

    A mix draws as reasoning-gym's ``CompositeDataset``: item i picks its dataset by
    ``Random(seed + i).choices(weights)`` and takes that dataset's item i (dataset k has seed
    ``seed + k + 1``)."""
    datasets = dict(datasets or DEFAULT_DATASETS)
    config = dict(config or {})
    names = list(datasets)
    for name in names:
        check_dataset(name)
        if not float(datasets[name]) > 0:
            raise ConfigError(f"task.rg.datasets.{name}={datasets[name]}: a weight must be > 0")
    for name in config:
        if name not in datasets:
            raise ConfigError(f"task.rg.config.{name}: not one of task.rg.datasets ({', '.join(names)})")
    weights = [float(datasets[k]) for k in names]
    seeds = {name: seed if len(names) == 1 else seed + k + 1 for k, name in enumerate(names)}
    built = {name: _build(name, dict(config.get(name) or {}), seeds[name], n) for name in names}
    records = []
    for i in range(n):
        name = names[0] if len(names) == 1 else names[random.Random(seed + i).choices(range(len(names)), weights=weights)[0]]
        item = built[name][i]
        ref = {"dataset": name, "config": dict(config.get(name) or {}), "seed": seeds[name], "size": n, "index": i}
        question = str(item["question"])
        if chat:
            sys_msg = [{"role": "system", "content": system_prompt}] if system_prompt else []
            prompt: dict[str, Any] = {"messages": [*sys_msg, {"role": "user", "content": question}]}
        else:
            prompt = {"prompt": f"{system_prompt}\n\n{question}" if system_prompt else question}
        records.append({**prompt, "extra_info": {"answer": str(item["answer"]), "rg": ref}})
    return records


# --------------------------------------------------------------------------- reward


def last_tag(text: str, tag: str = "answer") -> str | None:
    """What reasoning-gym's ``extract_answer`` finds, the content of the last non-overlapping
    ``<tag>...</tag>`` pair read left to right (each opening tag closes at the first closing tag
    after it), found with ``str.find`` in one pass: its regex retries from every opening tag and
    is quadratic on a response of many unclosed tags."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    found, pos = None, 0
    while True:
        start = text.find(opening, pos)
        if start < 0:
            return found
        end = text.find(closing, start + len(opening))
        if end < 0:
            return found
        found, pos = text[start + len(opening):end], end + len(closing)


def final_answer(response: str, extra_info: dict | None = None, *, answer_format: str = "tag") -> str | None:
    """The response's answer: the content of its last ``<answer>...</answer>`` (reasoning-gym's
    ``extract_answer``: one optional space inside the tags, then stripped) or its last
    ``\\boxed{}``; None without one, or when it is longer than ``MAX_ANSWER_CHARS``."""
    out = last_boxed(response) if answer_format == "boxed" else last_tag(response)
    if out is None:
        return None
    out = out.strip()
    return out if len(out) <= MAX_ANSWER_CHARS else None


def boxed_answer(response: str, extra_info: dict | None = None) -> str | None:
    """``final_answer`` for ``answer_format=boxed`` (the extractor maj@k names by spec)."""
    return final_answer(response, extra_info, answer_format="boxed")


def reward(prompt: str, response: str, extra_info: dict, *, answer_format: str = "tag", score_threshold: float = 1.0,
           format_weight: float = 0.0) -> dict[str, Any]:
    """reasoning-gym's own grade of the response's answer: ``reward = s + format_weight * format``
    with ``s = dataset.score_answer(answer, entry)`` in [0, 1] (partial credit flows through),
    ``score = [s >= score_threshold]``, ``components = {"rg": s, "format": [an answer was found]}``."""
    answer = final_answer(response, answer_format=answer_format)
    ref = extra_info["rg"]
    s = 0.0
    if answer is not None:
        item = entry(ref)
        dataset = _dataset(ref["dataset"], _key(ref.get("config") or {}), int(ref["seed"]), int(ref["size"]))
        if ref["dataset"] in GRADERS_WITH_EVAL:
            _defuse(dataset)
        s = float(dataset.score_answer(answer, item))
    fmt = float(answer is not None)
    return {"reward": s + format_weight * fmt, "score": float(s >= score_threshold), "components": {"rg": s, "format": fmt}}


# --------------------------------------------------------------------------- the task


def task(*, chat: bool = False, system_prompt: str | None = None, format_weight: float = 0.0,
         rg: dict[str, Any] | None = None, **_: Any) -> Task:
    """The ``reasoning_gym`` task from ``task.rg`` (``ReasoningGymConfig`` as a dict): its datasets are
    checked here (the package, the names), so a bad name fails before a model loads."""
    opts = dict(rg or {})
    answer_format = opts.get("answer_format", "tag")
    if answer_format not in ANSWER_FORMATS:
        raise ConfigError(f"task.rg.answer_format={answer_format}: expected one of {', '.join(ANSWER_FORMATS)}")
    datasets = dict(opts.get("datasets") or DEFAULT_DATASETS)
    for name in datasets:
        check_dataset(name)
    system = system_prompt if system_prompt else system_text(opts.get("system_prompt", "default"), answer_format)
    size, eval_size = int(opts.get("size", 2048)), int(opts.get("eval_size", 200))
    if size < 1 or eval_size < 1:
        raise ConfigError(f"task.rg.size={size}, task.rg.eval_size={eval_size}: both must be >= 1")
    threshold = float(opts.get("score_threshold", 1.0))
    boxed = answer_format == "boxed"
    return Task(
        name=NAME, parse_row=generated, template="{question}", reward_spec="relign.envs.reasoning_gym:reward",
        reward_kwargs={"answer_format": answer_format, "score_threshold": threshold, "format_weight": float(format_weight)},
        chat=chat, system_prompt=system or None,
        extract_spec="relign.envs.reasoning_gym:" + ("boxed_answer" if boxed else "final_answer"),
        generate_spec="relign.envs.reasoning_gym:generate",
        generate_kwargs={"datasets": datasets, "config": dict(opts.get("config") or {}), "system_prompt": system},
        generate_sizes=(size, eval_size), term_weights={"rg": 1.0, "format": float(format_weight)},
        answer_marker="\\boxed" if boxed else "</answer>", step_delimiter="\n", reward_needs_reference=True,
    )

