"""The reward contract: what a reward function may return and how it is called.

A reward function follows one of two signatures (``detect_reward_style`` tells which from the
signature; ``Task.reward_style`` overrides it)::

    def reward(prompt: str, response: str, extra_info: dict, **options) -> float | dict     # per sample
    def reward(prompts: list, completions: list, **kwargs) -> list[float | dict | None]     # batched (TRL)

and returns a number, or ``{"reward": float, "score": float, "components": {name: float}}``
(per sample, or one per completion in a list), which ``normalize_reward`` / ``normalize_batch``
turn into ``RewardResult``s. ``reward`` trains, ``score`` is logged as accuracy. The built-in
tasks return ``combine(correct, format, format_weight)``.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RewardResult:
    """One scored response. ``error`` is None, "exception" or "timeout" (then reward = score = 0)."""

    reward: float
    score: float
    components: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    message: str | None = field(default=None, compare=False, repr=False)
    """What went wrong (``"RuntimeError: boom"``) when ``error`` is set; not part of equality."""


def _finite(value: Any, what: str) -> float:
    if not isinstance(value, numbers.Real):  # bool, int, float, numpy scalars, Fraction
        raise TypeError(f"{what} must be a number, got {type(value).__name__}: {value!r:.80}")
    out = float(value)
    if not math.isfinite(out):
        # A NaN reward silently poisons every advantage in its group; refuse it here.
        raise ValueError(f"{what} must be finite, got {out}")
    return out


def normalize_reward(value: Any) -> RewardResult:
    """Turn what a reward function returned into a ``RewardResult``.

    A number (float, int, bool) gives ``reward = score = float(value)``. A dict needs
    "reward" and may hold "score" (defaults to the reward) and "components" (name -> number).
    Anything else is a ``TypeError``; a NaN or infinite value is a ``ValueError``.
    """
    if isinstance(value, numbers.Real):
        r = _finite(value, "reward")
        return RewardResult(reward=r, score=r)
    if isinstance(value, dict):
        if "reward" not in value:
            raise TypeError(f"a reward dict needs a 'reward' key, got keys {sorted(value)}")
        unknown = set(value) - {"reward", "score", "components"}
        if unknown:
            raise TypeError(f"unknown reward dict keys {sorted(unknown)} (allowed: reward, score, components)")
        r = _finite(value["reward"], "reward")
        s = _finite(value["score"], "score") if value.get("score") is not None else r
        comps = value.get("components") or {}
        if not isinstance(comps, dict):
            raise TypeError(f"reward 'components' must be a dict of numbers, got {type(comps).__name__}")
        comps = {str(k): _finite(v, f"component '{k}'") for k, v in comps.items()}
        return RewardResult(reward=r, score=s, components=comps)
    raise TypeError(
        f"a reward function must return a number or a dict with 'reward' (and optional 'score', "
        f"'components'), got {type(value).__name__}: {value!r:.80}"
    )


REWARD_STYLES = ("auto", "sample", "batch")
# TRL's reward functions take the batch as ``prompts=[...], completions=[...]``.
_BATCH_FIRST_PARAMS = ("prompts", "completions")
# Keywords a batched call always sets; an extra_info key of the same name is not passed.
_BATCH_RESERVED = ("prompts", "completions", "completion_ids")


def detect_reward_style(fn: Callable[..., Any], style: str = "auto") -> str:
    """``"sample"`` (``fn(prompt, response, extra_info, **options)``) or ``"batch"`` (TRL's
    ``fn(prompts, completions, **kwargs) -> list``).

    ``style="auto"`` reads the signature: a function whose first parameter is named ``prompts``
    or ``completions`` is batched, any other is per-sample. ``"sample"``/``"batch"`` override it
    (``task.reward_style``), e.g. for a batched function with other parameter names.
    """
    if style not in REWARD_STYLES:
        raise ValueError(f"task.reward_style={style!r}: expected one of {', '.join(REWARD_STYLES)}")
    if style != "auto":
        return style
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return "sample"
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return "batch" if named and named[0].name in _BATCH_FIRST_PARAMS else "sample"


def call_batch(
    fn: Callable[..., Any],
    prompts: list[Any],
    completions: list[str],
    extra_infos: list[dict],
    options: dict[str, Any],
    completion_ids: list[list[int]] | None = None,
) -> Any:
    """Call a batched (TRL-style) reward function the way TRL does: all keywords.

    Each ``extra_info`` key becomes a list over the batch (None where a sample lacks it), as TRL
    passes a dataset's other columns; ``options`` (``format_weight``, ...) pass as they are and
    win over a column of the same name.
    """
    columns: dict[str, list[Any]] = {}
    for info in extra_infos:
        for key in info:
            if key not in columns and key not in _BATCH_RESERVED:
                columns[key] = [i.get(key) for i in extra_infos]
    kwargs: dict[str, Any] = {**columns, **options, "prompts": list(prompts), "completions": list(completions)}
    if completion_ids is not None:
        kwargs["completion_ids"] = [list(ids) for ids in completion_ids]
    return fn(**kwargs)


def normalize_batch(value: Any, n: int) -> list[RewardResult | str]:
    """Turn what a batched reward function returned for ``n`` completions into one entry each:
    a ``RewardResult``, or an error message (str) for an element that is not a valid reward.

    The whole return value must be a list (tuple, numpy array, tensor) of exactly ``n``
    elements, else ``TypeError``/``ValueError`` (every sample of the batch fails). ``None`` is
    TRL's "this function does not apply to this sample": it scores 0 and is counted as an
    error, so a function that returns only None is as loud as one that raises.
    """
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()  # numpy array / torch tensor -> python numbers
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"a batched reward function must return a list of {n} rewards (one per completion), "
            f"got {type(value).__name__}: {value!r:.80}"
        )
    if len(value) != n:
        raise ValueError(f"a batched reward function returned {len(value)} rewards for {n} completions")
    out: list[RewardResult | str] = []
    for i, v in enumerate(value):
        if v is None:
            out.append(f"reward {i} of the batch is None (TRL's 'not applicable'): scored 0")
            continue
        try:
            out.append(normalize_reward(v))
        except (TypeError, ValueError) as e:
            out.append(f"reward {i} of the batch: {type(e).__name__}: {e}")
    return out


def combine(correct: float, fmt: float, format_weight: float = 0.0) -> dict[str, Any]:
    """The built-in tasks' reward: correctness plus a weighted format bonus; score = correctness."""
    return {
        "reward": float(correct) + float(format_weight) * float(fmt),
        "score": float(correct),
        "components": {"correct": float(correct), "format": float(fmt)},
    }
