"""The task registry, tasks as the recipes build them, and the one way a task record becomes a prompt.

    TASKS, get_task(name_or_spec, **options)         the built-in tasks by name, or a factory spec
    build_task(name, path=..., reward_fn=..., ...)   config values -> Task   (rl, eval, demo)
    render_prompt(tokenizer, record)                 record -> (prompt text, prompt ids)
    problem_text(record)                             record -> the question, without chat markup
    encode_problems(tokenizer, records)              records -> [Problem] (what strategies search)

RL's ``RolloutCollector`` and the eval loop both render prompts through ``render_prompt``, so
a model is evaluated on exactly the token ids it was trained on.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

from relign.envs.base import Task, load_function, make_custom_task
# each task's factory from its module, not through the package (relign/envs/__init__.py imports this module)
from relign.envs.calculator import task as calculator_task
from relign.envs.calibration import lc_task
from relign.envs.calibration import task as calibration_task
from relign.envs.countdown import task as countdown_task
from relign.envs.gem_env import task as gem_task
from relign.envs.gsm8k import task as gsm8k_task
from relign.envs.math import task as math_task
from relign.envs.reasoning_gym import task as reasoning_gym_task
from relign.envs.reward_fn import detect_reward_style
from relign.errors import ConfigError


@dataclass
class Problem:
    """One problem as every strategy sees it: rendered and tokenized once (``encode_problems``)."""

    id: int
    """Stable identity (the record's index in its file): seeds derive from it, never from the
    problem's position in a batch, so results do not depend on the batch composition."""
    prompt_ids: list[int]
    """The rendered prompt (chat template applied) as token ids: what the engine continues."""
    prompt_text: str
    """The rendered prompt as text (what a rule reward receives as ``prompt``)."""
    question: str
    """The problem as the user wrote it, without chat markup (what a learned scorer reads)."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """The task's ground truth (the gold answer): used to grade, never to search unless allowed."""


@dataclass(frozen=True)
class TaskRow:
    """A registered task: its factory, and what of the ``task`` config it reads beyond the common
    options (``chat``, ``system_prompt``, ``format_weight``, ``reward_fn``): ``build_task`` checks a
    config against the row, never against the task's name."""

    factory: Callable[..., Task]
    section: str = ""
    """The ``TaskConfig`` section handed to the factory whole (``task.rg``, ``task.gem``), "" for none."""
    options: tuple[str, ...] = ()
    """The other ``task.*`` options it takes (``answer_format``: the math grader's; ``features``: the
    calibration rooms')."""
    from_file: bool = False
    """A task of the user's own file: ``task.path`` and ``task.reward_fn`` are required (``custom``)."""


# The registry is a plain dict of rows (DESIGN.md, principle 5). Importing the task modules is
# cheap: the math task loads math_verify/sympy only when its reward runs.
TASKS: dict[str, TaskRow] = {
    "gsm8k": TaskRow(gsm8k_task),
    "math": TaskRow(math_task, options=("answer_format",)),
    "math500": TaskRow(math_task, options=("answer_format",)),
    "countdown": TaskRow(countdown_task),
    "calculator": TaskRow(calculator_task),
    "reasoning_gym": TaskRow(reasoning_gym_task, section="rg"),  # needs relign[reasoning-gym]; imported when built
    "gem": TaskRow(gem_task, section="gem"),  # needs relign[gem]
    "calibration": TaskRow(calibration_task, options=("features",)),
    "lc": TaskRow(lc_task),
    "custom": TaskRow(make_custom_task, from_file=True),
}


def get_task(name_or_spec: str, **kwargs: Any) -> Task:
    """A task by registered name (``"gsm8k"``, ``"math"``, ``"math500"``, ``"countdown"``,
    ``"custom"``) or by a factory spec (``"my_tasks.py:make_task"``), called with ``kwargs``.

    Built-in factories take ``template``, ``chat``, ``system_prompt``, ``default_path``,
    ``split`` and reward options such as ``format_weight``; ``"custom"`` takes the arguments
    of ``make_custom_task``.
    """
    if name_or_spec in TASKS:
        factory = TASKS[name_or_spec].factory
    elif ":" in name_or_spec:
        factory = load_function(name_or_spec)
    else:
        raise ValueError(f"unknown task {name_or_spec!r}; known: {', '.join(TASKS)}, or a 'file.py:factory' spec")
    task = factory(**kwargs)
    if not isinstance(task, Task):
        raise TypeError(f"task factory {name_or_spec!r} returned {type(task).__name__}, not a Task")
    return task


def from_file(name: str) -> bool:
    """Whether the registered task ``name`` reads the user's own file (``task.path``, ``task.reward_fn``)."""
    return name in TASKS and TASKS[name].from_file


def is_multi_turn(name: str) -> bool:
    """Whether the registered task ``name`` runs its episodes in a multi-turn environment."""
    return name in TASKS and not TASKS[name].from_file and TASKS[name].factory().env is not None


def build_task(name: str, *, path: str = "", reward_fn: str = "", chat: bool = True, system_prompt: str = "",
               format_weight: float = 0.0, extract_fn: str = "", equal_fn: str = "", single_turn: bool = True,
               reward_style: str = "auto", answer_format: str = "boxed", sections: Any = None,
               features: dict[str, float] | None = None) -> Task:
    """The task as ``relign rl`` builds it (``reward_fn`` replaces a built-in task's reward; a
    custom task needs ``path`` and ``reward_fn``), with optional answer extractor / equivalence
    overrides for maj@k. ``single_turn`` refuses a task that runs in a multi-turn environment
    (evaluation samples single completions). ``answer_format`` is the math task's (``"boxed"``,
    ``"boxed_or_final"``, ``"any"``). ``sections`` (the ``TaskConfig``, or any object with its
    ``rg`` / ``gem`` attributes) gives a procedural task its own section (``SECTIONS``). Problems a
    user can fix raise ``ConfigError``."""
    row = TASKS.get(name, TaskRow(load_function))  # a 'file.py:factory' spec takes the common options only
    opts: dict[str, Any] = {"chat": chat, "system_prompt": system_prompt or None}
    if row.section and sections is not None:
        section = getattr(sections, row.section)
        opts[row.section] = dataclasses.asdict(section) if dataclasses.is_dataclass(section) else dict(section)
    for key, value, given, shown in (("answer_format", answer_format, answer_format != "boxed", f"={answer_format}"),
                                     ("features", dict(features or {}), bool(features), "")):
        if given:
            if key not in row.options:
                takers = " or ".join(n for n, r in TASKS.items() if key in r.options)
                raise ConfigError(f"task.{key}{shown} applies to task.name={takers}, not task.name={name}")
            opts[key] = value
    if reward_fn and ":" not in reward_fn:
        reward_fn += ":reward"  # 'my_reward.py' means its function named reward, as in relign rl
    try:
        if row.from_file:
            if not (path and reward_fn):
                raise ConfigError(f"task.name={name} needs the problems' path and task.reward_fn ('file.py:function')")
            task = get_task(name, data_path=path, reward_fn_spec=reward_fn, reward_style=reward_style, **opts)
        else:
            task = get_task(name, format_weight=format_weight, **opts)
            if reward_fn:
                detect_reward_style(load_function(reward_fn), reward_style)  # fail now, not in a worker
                task = replace(task, reward_spec=reward_fn, reward_kwargs={}, term_weights={}, reward_style=reward_style)
        for spec in (extract_fn, equal_fn):
            if spec:
                load_function(spec)
        if extract_fn:
            task = replace(task, extract_spec=extract_fn)
        if equal_fn:
            task = replace(task, equal_spec=equal_fn)
    except ConfigError:
        raise  # already one line naming its key
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise ConfigError(f"task: {e}") from None
    if single_turn and task.env:
        raise ConfigError(f"task.name={name} is a multi-turn environment ({task.env}); evaluation covers single-turn tasks")
    return task


def render_prompt(tokenizer, record: dict) -> tuple[str, list[int]]:
    """(text, token ids) of a task record's prompt: a chat (``messages``) through the tokenizer's
    chat template with the generation prompt, tokenized without adding special tokens (the
    template holds its own); a raw ``prompt`` as it is, tokenized with the tokenizer's special
    tokens (its BOS, if it adds one)."""
    if "messages" in record:
        text = tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True)
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]
    if "prompt" not in record:
        raise ValueError(f"a task record needs 'prompt' or 'messages' (as Task.load returns), got keys {sorted(record)}")
    return record["prompt"], tokenizer(record["prompt"], add_special_tokens=True)["input_ids"]


def problem_text(rec: dict) -> str:
    """What a learned reward (or a verifier) reads as the problem of an RL record: the last
    user message of a chat, or the raw prompt."""
    if "messages" in rec:
        users = [m["content"] for m in rec["messages"] if m.get("role") == "user"]
        return users[-1] if users else ""
    return rec.get("prompt", "")


def encode_problems(tokenizer, records: list[dict], *, max_prompt_length: int = 0) -> tuple[list[Problem], int]:
    """Render and tokenize every record once: the problems (``id`` = the record's index) and the
    number skipped because their prompt is longer than ``max_prompt_length`` tokens (0 = no limit)."""
    problems: list[Problem] = []
    skipped_long = 0
    for i, rec in enumerate(records):
        if "messages" not in rec and "prompt" not in rec:
            raise ValueError(f"record {i}: needs 'prompt' or 'messages' (as Task.load returns), got keys {sorted(rec)}")
        text, ids = render_prompt(tokenizer, rec)
        if max_prompt_length and len(ids) > max_prompt_length:
            skipped_long += 1
            continue
        problems.append(Problem(id=i, prompt_ids=ids, prompt_text=text, question=problem_text(rec),
                                extra_info=rec.get("extra_info", {})))
    return problems, skipped_long


__all__ = ["TASKS", "Problem", "TaskRow", "build_task", "encode_problems", "from_file", "get_task", "is_multi_turn", "problem_text", "render_prompt"]
