"""The multi-turn environment contract (RL2's ``step`` signature).

An episode is text growing turn by turn. The driver (``relign.rollout``) starts from the
record's prompt as ``state``, samples an ``action`` (the model's turn), and calls::

    result = await env.step(state, action, extra_info)
    # {"next_state": str, "reward": float, "score": float, "done": bool, "extra_info": dict}

until ``done`` or its own turn limit. ``reward`` trains, ``score`` is logged. ``extra_info``
starts as the record's and is whatever the env returns for the next call (state the env
wants to carry between turns). When ``state + action`` is a prefix of ``next_state`` the
driver appends only the new text (the observation) as tokens, masked out of the loss, and
never re-tokenizes the model's own tokens; otherwise it must re-encode ``next_state``.

There is no ``reset``: the initial state is the record's prompt, as in RL2. An env that must
build it may define ``async def reset(self, extra_info: dict) -> str``; a driver that finds
it calls it instead of using the prompt (``initial_state``).
"""

from __future__ import annotations

import math
from typing import Any, Protocol, TypedDict, runtime_checkable


class StepResult(TypedDict):
    next_state: str
    reward: float
    score: float
    done: bool
    extra_info: dict


@runtime_checkable
class Env(Protocol):
    async def step(self, state: str, action: str, extra_info: dict) -> dict:
        """One turn: the model's ``action`` after ``state``. Returns a ``StepResult`` dict."""
        ...


async def initial_state(env: Any, prompt: str, extra_info: dict) -> str:
    """The episode's first state: ``env.reset(extra_info)`` if the env defines it, else the prompt."""
    reset = getattr(env, "reset", None)
    return await reset(extra_info) if reset is not None else prompt


def check_step_result(result: Any, state: str, action: str) -> tuple[StepResult, bool]:
    """Validate what ``step`` returned; also say whether ``state + action`` prefixes ``next_state``.

    Raises ``TypeError``/``ValueError`` naming the bad key, so a broken env fails loudly in
    the driver instead of training on garbage.
    """
    if not isinstance(result, dict):
        raise TypeError(f"Env.step must return a dict, got {type(result).__name__}")
    missing = [k for k in StepResult.__annotations__ if k not in result]
    if missing:
        raise ValueError(f"Env.step result lacks {missing}; needs next_state, reward, score, done, extra_info")
    if not isinstance(result["next_state"], str):
        raise TypeError(f"Env.step 'next_state' must be a string, got {type(result['next_state']).__name__}")
    for key in ("reward", "score"):
        v = result[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"Env.step '{key}' must be a finite number, got {v!r}")
    if not isinstance(result["done"], bool):
        raise TypeError(f"Env.step 'done' must be a bool, got {type(result['done']).__name__}")
    if not isinstance(result["extra_info"], dict):
        raise TypeError(f"Env.step 'extra_info' must be a dict, got {type(result['extra_info']).__name__}")
    out: StepResult = {
        "next_state": result["next_state"],
        "reward": float(result["reward"]),
        "score": float(result["score"]),
        "done": result["done"],
        "extra_info": result["extra_info"],
    }
    return out, result["next_state"].startswith(state + action)
