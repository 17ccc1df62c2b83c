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
it calls it instead of using the prompt (``initial_state``), once per prompt, so the G
episodes of a group (whose rewards are compared) start from the same state.

A ``done`` result whose ``extra_info`` says ``"finish_reason": "max_turns"`` ended on the
environment's own turn limit (a game's truncation): the driver records the episode's
finish_reason as ``max_turns``, as when its own limit stops it. An env class whose constructor
takes ``tokenizer`` receives the run's (``make_env``): it renders chat turns (``GemEnv``).

Broken results are errors, not masked episodes. A ``step`` result that breaks the contract
(not a dict, a missing key, a non-finite or non-numeric reward/score, a wrong type) is a
deterministic bug in the env: it would break the same way on every run, and training around
it (reward 0, episode dropped) would hide it behind a slowly worse reward curve. So
``check_step_result`` raises ``EnvError`` and the driver lets it end the run, naming the env,
the turn and the episode. An exception raised *inside* ``step`` is different: tools fail
transiently (a timeout, a sandbox that died), so the driver ends only that episode with
reward 0 and counts it (``Episode.env_errors``).
"""

from __future__ import annotations

import inspect
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


class EnvError(ValueError):
    """An environment broke the contract (see the module docstring: an error, not a mask).

    ``key`` is the offending result key (None when the result is not a dict at all) and
    ``value`` what the env put there (the whole result when it is not a dict).
    """

    def __init__(self, message: str, *, key: str | None = None, value: Any = None):
        super().__init__(message)
        self.key = key
        self.value = value


class EnvTypeError(EnvError, TypeError):
    """A contract violation of the wrong-type kind; also a ``TypeError`` for callers that catch that."""


def make_env(factory: Any, tokenizer: Any = None) -> Any:
    """An environment from its class or factory: ``factory(tokenizer=tokenizer)`` when it takes a
    tokenizer, else ``factory()``."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        params = {}
    return factory(tokenizer=tokenizer) if "tokenizer" in params else factory()


async def initial_state(env: Any, prompt: str, extra_info: dict) -> str:
    """The episode's first state: ``env.reset(extra_info)`` if the env defines it, else the prompt."""
    reset = getattr(env, "reset", None)
    if reset is None:
        return prompt
    state = await reset(extra_info)
    if not isinstance(state, str):
        raise EnvTypeError(f"Env.reset must return a string, got {type(state).__name__}", key="state", value=state)
    return state


def check_step_result(result: Any, state: str, action: str) -> tuple[StepResult, bool]:
    """Validate what ``step`` returned; also say whether ``state + action`` prefixes ``next_state``.

    Raises ``EnvError`` (a ``ValueError``; ``EnvTypeError`` for wrong types, also a
    ``TypeError``) naming the bad key, so a broken env fails loudly in the driver instead of
    training on garbage.
    """
    if not isinstance(result, dict):
        raise EnvTypeError(f"Env.step must return a dict, got {type(result).__name__}", value=result)
    missing = [k for k in StepResult.__annotations__ if k not in result]
    if missing:
        raise EnvError(
            f"Env.step result lacks {missing}; needs next_state, reward, score, done, extra_info", key=missing[0]
        )
    if not isinstance(result["next_state"], str):
        raise EnvTypeError(
            f"Env.step 'next_state' must be a string, got {type(result['next_state']).__name__}",
            key="next_state", value=result["next_state"],
        )
    for key in ("reward", "score"):
        v = result[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise EnvError(f"Env.step '{key}' must be a finite number, got {v!r}", key=key, value=v)
    if not isinstance(result["done"], bool):
        raise EnvTypeError(
            f"Env.step 'done' must be a bool, got {type(result['done']).__name__}", key="done", value=result["done"]
        )
    if not isinstance(result["extra_info"], dict):
        raise EnvTypeError(
            f"Env.step 'extra_info' must be a dict, got {type(result['extra_info']).__name__}",
            key="extra_info", value=result["extra_info"],
        )
    out: StepResult = {
        "next_state": result["next_state"],
        "reward": float(result["reward"]),
        "score": float(result["score"]),
        "done": result["done"],
        "extra_info": result["extra_info"],
    }
    return out, result["next_state"].startswith(state + action)
