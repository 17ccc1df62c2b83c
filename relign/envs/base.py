"""Single-turn tasks: a dataset, a prompt template and a verifiable reward.

A task turns dataset rows into RL records (DESIGN.md, "Records")::

    {"prompt": "<rendered prompt>", "extra_info": {"answer": "72", ...}}             # chat=False
    {"messages": [{"role": "system", ...}, {"role": "user", ...}], "extra_info": {...}}  # chat=True

and scores a response with ``reward(prompt, response, extra_info) -> float | dict``. The
reward is a plain module-level function named by a spec string (``"relign.envs.gsm8k:reward"``)
plus keyword options (``{"format_weight": 0.1}``), so the same reward runs in-process
(``Task.reward``) or in sandboxed worker processes (``RewardPool(task.reward_spec,
kwargs=task.reward_kwargs)`` or ``RewardPool.from_task(task)``), which load it by that spec.

Reward functions follow one of two signatures (``detect_reward_style`` tells which from the
signature; ``Task.reward_style`` overrides it)::

    def reward(prompt: str, response: str, extra_info: dict, **options) -> float | dict     # per sample
    def reward(prompts: list, completions: list, **kwargs) -> list[float | dict | None]     # batched (TRL)

returning a number, or ``{"reward": float, "score": float, "components": {name: float}}``
(per sample, or one per completion in a list): the contract is ``relign.envs.reward_fn``. A batched function is called with keywords, as
TRL calls it: ``prompts``, ``completions``, ``completion_ids`` (when the caller has them), each
``extra_info`` key as a list over the batch (``answer=[...]``) and the fixed options.
``reward`` trains, ``score`` is logged as accuracy. The built-in tasks return
``reward = correct + format_weight * format``, ``score = correct`` and
``components = {"correct": ..., "format": ...}`` (``combine``).

For majority voting (maj@k, ``relign.evaluate``) a task may also name, by spec, a final-answer
extractor ``fn(response, extra_info) -> str | None`` and an equivalence check ``fn(a, b) -> bool``
(``Task.extract_spec`` / ``Task.equal_spec``); the built-in tasks do.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relign.data.readers import DataError, read_records
from relign.data.records import check_turns
from relign.envs.reward_fn import call_batch, detect_reward_style, normalize_batch
from relign.errors import ConfigError

DATA_DIR = Path(__file__).resolve().parent / "data"


# --------------------------------------------------------------------------- loading functions by spec

_FILE_MODULES: dict[str, Any] = {}


def load_function(spec: str) -> Callable[..., Any]:
    """Load ``"path/to/file.py:function"`` or ``"package.module:function"``.

    The part after the last ":" may be dotted (``"mod:Class.method"``). Errors name the spec:
    ``FileNotFoundError`` for a missing file, ``ValueError`` for a malformed spec, a module
    that cannot be imported or a missing attribute, ``TypeError`` if it is not callable.
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"function spec {spec!r}: expected 'path/to/file.py:function' or 'package.module:function'")
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"function spec {spec!r}: expected 'path/to/file.py:function' or 'package.module:function'")
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    if is_file:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"function spec {spec!r}: file not found: {path}")
        key = str(path)
        module = _FILE_MODULES.get(key)
        if module is None:
            # A stable, unique module name per file, registered in sys.modules so that the
            # file's own dataclasses/pickling work; loaded once per process.
            name = f"relign_user_{path.stem}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
            mod_spec = importlib.util.spec_from_file_location(name, path)
            if mod_spec is None or mod_spec.loader is None:
                raise ValueError(f"function spec {spec!r}: cannot load {path} as a Python module")
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = module
            try:
                mod_spec.loader.exec_module(module)
            except Exception as e:
                # A syntax error or an exception while the file runs: one line naming the spec,
                # the file and the line, not a traceback through importlib.
                del sys.modules[name]
                raise ValueError(f"function spec {spec!r}: cannot load {path}: {_load_error(e, path)}") from None
            except BaseException:
                del sys.modules[name]
                raise
            _FILE_MODULES[key] = module
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"function spec {spec!r}: cannot import module '{target}': {e}") from e
        except Exception as e:  # a SyntaxError (or any error) inside the module
            raise ValueError(f"function spec {spec!r}: cannot import module '{target}': {_load_error(e, None)}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            where = path if is_file else target
            raise ValueError(f"function spec {spec!r}: '{where}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"function spec {spec!r}: '{attr}' is a {type(obj).__name__}, not a function")
    return obj


def _load_error(e: Exception, path: Path | None) -> str:
    """``"SyntaxError: invalid syntax (line 3)"``: the error on one line, with the line of the
    user's file where it happened."""
    if isinstance(e, SyntaxError):
        line = f" (line {e.lineno})" if e.lineno else ""
        return f"{type(e).__name__}: {e.msg}{line}"
    line = ""
    tb = e.__traceback__
    while tb is not None:  # the innermost frame in the user's file
        if path is None or Path(tb.tb_frame.f_code.co_filename).resolve() == path:
            line = f" (line {tb.tb_lineno})"
        tb = tb.tb_next
    text = " ".join(str(e).split())[:300]
    return f"{type(e).__name__}: {text}{line}"


# --------------------------------------------------------------------------- tasks

# parse_row(raw_row, source, row_number) -> (template fields, extra_info); raises DataError.
RowParser = Callable[[dict, str, int], "tuple[dict[str, Any], dict[str, Any]]"]


def render(template: str, fields: dict[str, Any]) -> str:
    """Replace each ``{key}`` in ``template`` by ``str(fields[key])``.

    Plain replacement rather than ``str.format`` so templates can hold literal braces
    (``\\boxed{}``) without doubling them.
    """
    out = template
    for key, value in fields.items():
        out = out.replace("{" + key + "}", str(value))
    return out


def generated(raw: dict, source: str, row: int) -> tuple[dict, dict]:
    """``parse_row`` of a task that generates its problems (``generate_spec``): it reads no file, and
    ``Task.load`` refuses one before its first row, so this runs only if called directly."""
    raise DataError(source, row, None, "this task generates its problems; leave task.path empty")


@dataclass
class Task:
    """A single-turn task: where the data is, how a row becomes a prompt, how to score it."""

    name: str
    parse_row: RowParser
    """Turns a raw dataset row into (fields for ``template``, ``extra_info`` with the ground truth)."""
    template: str
    """Prompt template; ``{field}`` placeholders are filled from ``parse_row``'s fields."""
    reward_spec: str
    """The reward function by spec (``"relign.envs.gsm8k:reward"``), as RewardPool loads it."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword options passed to the reward function on every call."""
    reward_style: str = "auto"
    """How the reward function is called: "sample" (``fn(prompt, response, extra_info)``),
    "batch" (TRL's ``fn(prompts=[...], completions=[...], **columns) -> list``), or "auto"
    (from its signature, ``detect_reward_style``)."""
    default_path: str | None = None
    """Used by ``load()`` without a path: the shipped file, or a hub id."""
    split: str = "test"
    """Split for hub ids and dataset folders (ignored for single files)."""
    chat: bool = False
    """True: records hold ``messages`` (optional system + user); False: a raw ``prompt`` string."""
    system_prompt: str | None = None
    """Chat: the system message. Raw text: prepended to the prompt, followed by a blank line."""
    extract_spec: str | None = None
    """The final-answer extractor by spec, ``fn(response, extra_info) -> str | None``, used by
    majority voting (maj@k); None: the task has none and maj@k is not reported."""
    equal_spec: str | None = None
    """Answer equivalence by spec, ``fn(a, b) -> bool`` on two extracted answers; None: ``a == b``."""
    env: str | None = None
    """A multi-turn environment class by spec (``"relign.envs.calculator:CalculatorEnv"``): the
    task's episodes then run turn by turn and the environment's rewards train."""
    env_max_turns: int | None = None
    """The environment's own turn limit (GEM: the game's ``max_turns``, read when the task builds
    it), which ``rollout.max_turns=0`` takes; None: the env class's ``max_turns`` attribute, if any."""
    generate_spec: str | None = None
    """A procedural task's record generator by spec, ``fn(n, seed, chat=..., **generate_kwargs) ->
    records``, used by ``load()`` (training problems, ``seed``) and ``load_heldout()`` (held-out
    problems, ``eval_seed(seed)``) when no path is given."""
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword options the generator receives on every call (reasoning-gym: the datasets, their
    generator options)."""
    generate_sizes: tuple[int, int] = (1024, 1024)
    """A procedural task's record counts when ``max_rows`` is 0: (training, held-out)."""
    term_weights: dict[str, float] = field(default_factory=dict)
    """The reward as a weighted sum of its components: reward = sum_k w_k * components[k]
    (built-in tasks: correct 1, format format_weight). Empty: unknown (custom rewards)."""
    answer_marker: str | None = None
    """Text that only a final answer holds (``"####"``, ``"\\boxed"``, ``"</answer>"``): tree search
    (step beam, MCTS) treats a step that holds it as terminal. None: not known."""
    step_delimiter: str | None = None
    """Where a reasoning step ends in this task's responses (VinePPO's steps; search's default).
    None: not known (``vine.delimiter`` must be set)."""
    reward_needs_reference: bool = True
    """Whether the reward reads the gold answer from ``extra_info`` (gsm8k, math: yes; countdown
    checks the expression against the numbers in the prompt: no). Search refuses to *score*
    with such a reward unless allowed (training-time data generation), since that would leak
    the answer into eval. Custom rewards are assumed to need it."""

    @property
    def format_weight(self) -> float:
        return float(self.reward_kwargs.get("format_weight", 0.0))

    def make_prompt(self, fields: dict[str, Any]) -> str | list[dict[str, str]]:
        """The prompt for one row: a string, or a chat message list when ``chat``."""
        if isinstance(fields.get("messages"), list):
            # A row that already is a conversation stays one (whatever ``chat`` says): joining
            # the turns into raw text would lose the roles.
            return with_system_prompt({"messages": fields["messages"]}, self.system_prompt)["messages"]
        text = render(self.template, fields)
        record = {"messages": [{"role": "user", "content": text}]} if self.chat else {"prompt": text}
        record = with_system_prompt(record, self.system_prompt)
        return record["messages"] if self.chat else record["prompt"]

    def load(self, path: str | None = None, split: str | None = None, max_rows: int = 0, seed: int = 0) -> list[dict[str, Any]]:
        """RL records from a file, a dataset folder or a hub id (``"openai/gsm8k:main"``).

        Without ``path``, ``default_path`` (the shipped test set for the built-in tasks), or
        for a procedural task ``max_rows`` (default 1024) generated records, deterministic in
        ``seed``. Bad rows raise ``DataError`` naming the file, the row and the field.
        """
        if self.generate_spec is not None:
            if path:  # one refusal for every procedural task, before a file is opened
                raise ConfigError(f"task.name={self.name} generates its problems from the seed: leave task.path empty "
                                  f"(it is {path})")
            return self.generate(max_rows or self.generate_sizes[0], seed)
        source = path or self.default_path
        if source is None:
            raise ValueError(f"task '{self.name}' has no default data; pass a path")
        records = []
        for row, raw in read_records(str(source), split or self.split, max_rows=max_rows):
            if not isinstance(raw, dict):
                raise DataError(str(source), row, None, f"expected an object, got {type(raw).__name__}")
            fields, extra_info = self.parse_row(raw, str(source), row)
            prompt = self.make_prompt(fields)
            key = "messages" if isinstance(prompt, list) else "prompt"
            records.append({key: prompt, "extra_info": extra_info})
        return records

    def generate(self, n: int, seed: int) -> list[dict[str, Any]]:
        """``n`` records from a procedural task's generator, deterministic in ``seed``."""
        if self.generate_spec is None:
            raise ValueError(f"task '{self.name}' is not procedural (it has no generate_spec)")
        with rng_guard():  # a generator may seed or draw from the global streams (reasoning-gym's pool_matrix does)
            records = load_function(self.generate_spec)(n, seed, chat=self.chat, **self.generate_kwargs)
        if "system_prompt" in self.generate_kwargs:  # the generator puts it in itself (reasoning-gym, GEM)
            return records
        return [with_system_prompt(r, self.system_prompt) for r in records]

    def load_heldout(self, path: str | None = None, split: str | None = None, max_rows: int = 0, seed: int = 0,
                     *, train_rows: int = 0, train_seed: int | None = None) -> tuple[list[dict[str, Any]], int]:
        """Evaluation records and how many were dropped because the training set holds them.

        A file (``path``, or a task's shipped test set) is read as ``load`` reads it (0 dropped).
        A procedural task generates its held-out problems from ``eval_seed(seed)``, never from
        the training ``seed`` itself (which would evaluate on the training problems), and drops
        every one whose question text occurs among the ``train_rows`` (0: the task's default
        count) training problems of ``train_seed`` (None: ``seed``; a standalone eval passes the
        seed of the run it evaluates): a small problem space repeats questions even across seeds.
        """
        if path or self.generate_spec is None:
            return self.load(path, split, max_rows=max_rows, seed=seed), 0
        train = self.generate(train_rows or self.generate_sizes[0], seed if train_seed is None else train_seed)
        heldout = self.generate(max_rows or self.generate_sizes[1], eval_seed(seed))
        return disjoint(heldout, train)

    @property
    def reward_fn(self) -> Callable[..., Any]:
        fn = self.__dict__.get("_reward_fn")
        if fn is None:
            fn = self.__dict__["_reward_fn"] = load_function(self.reward_spec)
        return fn

    def reward(self, prompt: str, response: str, extra_info: dict) -> float | dict:
        """Score one response in this process (no timeout: see ``RewardPool`` for that). A
        batched reward function is called with a batch of one."""
        fn = self.reward_fn
        if detect_reward_style(fn, self.reward_style) == "sample":
            return fn(prompt, response, extra_info, **self.reward_kwargs)
        (out,) = normalize_batch(call_batch(fn, [prompt], [response], [extra_info], self.reward_kwargs), 1)
        if isinstance(out, str):
            raise ValueError(out)
        return {"reward": out.reward, "score": out.score, "components": out.components}

    def _spec_fn(self, key: str, spec: str) -> Callable[..., Any]:
        fn = self.__dict__.get(key)
        if fn is None:
            fn = self.__dict__[key] = load_function(spec)
        return fn

    def extract_answer(self, response: str, extra_info: dict) -> str | None:
        """The response's final answer as a string (None: it gives none, or the task has no extractor)."""
        if self.extract_spec is None:
            return None
        out = self._spec_fn("_extract_fn", self.extract_spec)(response, extra_info)
        return None if out is None else str(out)

    def answers_equal(self, a: str, b: str) -> bool:
        """Whether two extracted answers are the same answer (the task's check, else string equality)."""
        if self.equal_spec is None:
            return a == b
        return bool(self._spec_fn("_equal_fn", self.equal_spec)(a, b))


def with_system_prompt(record: dict[str, Any], system_prompt: str | None) -> dict[str, Any]:
    """``record`` (its ``messages`` or its ``prompt``) with ``system_prompt`` first, as every task
    puts it: a system turn before a conversation that has none; before plain text, the prompt and
    a blank line."""
    if not system_prompt:
        return record
    if isinstance(record.get("messages"), list):
        msgs = list(record["messages"])
        if not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": system_prompt})
        return {**record, "messages": msgs}
    return {**record, "prompt": f"{system_prompt}\n\n{record['prompt']}"}


# --------------------------------------------------------------------------- train / held-out split


@contextlib.contextmanager
def rng_guard() -> Iterator[None]:
    """Save and restore Python's ``random`` and NumPy's global generator around third-party code
    that reseeds or draws from them (GEM's games, some reasoning-gym generators): the trainer's
    streams, and so resume and multi-rank runs, stay as they were."""
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


EVAL_SALT = 0x5EED


def eval_seed(seed: int) -> int:
    """The seed of a procedural task's held-out problems, derived from the training ``seed``.

    A hash (not ``seed + 1``), so that no training seed is another run's eval seed by an
    off-by-one, and the result does not depend on Python's hash randomisation."""
    digest = hashlib.blake2b(f"{EVAL_SALT}:{int(seed)}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")  # 32 bits: generators hand it to np.random.seed, which takes < 2**32


def question_text(record: dict[str, Any]) -> str:
    """A record's question: its raw prompt, or its chat's user turns joined (the system prompt,
    shared by every record, is left out)."""
    if "messages" in record:
        return "\n".join(str(m.get("content", "")) for m in record["messages"] if m.get("role") == "user")
    return str(record.get("prompt", ""))


def problem_key(record: dict[str, Any]) -> str:
    """What identifies a record's problem: ``extra_info["problem_key"]`` when the generator sets one
    (a game's first observation is often the same text for every seed: the game is its seed),
    else the question text."""
    key = (record.get("extra_info") or {}).get("problem_key")
    return str(key) if key is not None else question_text(record)


def disjoint(heldout: list[dict[str, Any]], train: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """``heldout`` without the records whose problem (``problem_key``: the question text, unless
    the generator names it) occurs in ``train``, and how many were dropped."""
    seen = {problem_key(r) for r in train}
    kept = [r for r in heldout if problem_key(r) not in seen]
    return kept, len(heldout) - len(kept)


def make_custom_task(
    data_path: str,
    reward_fn_spec: str,
    prompt_key: str = "prompt",
    *,
    template: str | None = None,
    split: str = "train",
    chat: bool = False,
    system_prompt: str | None = None,
    reward_kwargs: dict[str, Any] | None = None,
    name: str = "custom",
    reward_style: str = "auto",
) -> Task:
    """A task from any data file and a reward function given by spec.

    Each row's ``prompt_key`` field is the prompt (a string, or a message list which is used
    as it is). ``extra_info`` is the row's ``extra_info`` object if it has one, else every
    other field of the row (``{"prompt": ..., "answer": "42"}`` -> ``{"answer": "42"}``).
    ``template`` may reference any field as ``{field}``; the default is ``{<prompt_key>}``.
    The reward function is loaded once here, so a bad spec fails before training starts;
    ``reward_style`` ("auto", "sample", "batch") says how it is called (``detect_reward_style``).
    """
    detect_reward_style(load_function(reward_fn_spec), reward_style)

    def parse_row(raw: dict, source: str, row: int) -> tuple[dict, dict]:
        if raw.get(prompt_key) is None:
            raise DataError(source, row, prompt_key, "missing")
        prompt = raw[prompt_key]
        if isinstance(prompt, list):
            # checked here, naming the row: unchecked, a list of strings reached the chat
            # template and raised AttributeError there, a traceback naming no file or row.
            # The row's own messages are kept (check_turns' copies hold only role and content).
            check_turns(prompt, source, row, prompt_key)
            fields: dict[str, Any] = {"messages": prompt}
        elif isinstance(prompt, str):
            fields = dict(raw)
        else:
            raise DataError(source, row, prompt_key, f"expected a string or a message list, got {type(prompt).__name__}")
        if "extra_info" in raw:
            if not isinstance(raw["extra_info"], dict):
                raise DataError(source, row, "extra_info", f"expected an object, got {type(raw['extra_info']).__name__}")
            extra_info = dict(raw["extra_info"])
        else:
            extra_info = {k: v for k, v in raw.items() if k != prompt_key}
        return fields, extra_info

    return Task(
        name=name,
        parse_row=parse_row,
        template=template or "{" + prompt_key + "}",
        reward_spec=reward_fn_spec,
        reward_kwargs=dict(reward_kwargs or {}),
        reward_style=reward_style,
        default_path=data_path,
        split=split,
        chat=chat,
        system_prompt=system_prompt,
    )


def builtin_task(
    name: str,
    parse_row: RowParser,
    reward_spec: str,
    *,
    template: str,
    default_path: str,
    format_weight: float = 0.0,
    chat: bool = False,
    system_prompt: str | None = None,
    split: str = "test",
    extract_spec: str | None = None,
    equal_spec: str | None = None,
    answer_marker: str | None = None,
    reward_needs_reference: bool = True,
    step_delimiter: str | None = "\n",
) -> Task:
    """A built-in task: its reward is ``correct + format_weight * format`` (``combine``)."""
    return Task(name=name, parse_row=parse_row, template=template, reward_spec=reward_spec,
                reward_kwargs={"format_weight": float(format_weight)}, default_path=default_path, split=split, chat=chat,
                system_prompt=system_prompt, extract_spec=extract_spec, equal_spec=equal_spec,
                term_weights={"correct": 1.0, "format": float(format_weight)}, answer_marker=answer_marker,
                reward_needs_reference=reward_needs_reference, step_delimiter=step_delimiter)
