"""Multi-turn rollouts, token in / token out.

An environment follows RL2's contract (``relign.envs.env``)::

    async def step(state: str, action: str, extra_info: dict) -> dict
        # {"next_state", "reward", "score", "done", "extra_info"}
    async def reset(extra_info: dict) -> str    # optional: the first state

Each prompt's first state is ``initial_state`` (the env's ``reset`` if it has one, else the
prompt), taken once per prompt so a group's episodes start alike; a reset that returns other
text than the prompt becomes the episodes' prompt (tokenized: it is environment text).
Per turn, every live episode samples one completion from its exact token sequence so far;
the environments step concurrently. When ``state + action`` is a prefix of ``next_state``,
only the new text is tokenized and appended (``response_mask = 0``: the model is not trained
on what the environment wrote). The model's own tokens are never decoded and re-encoded.
Each turn's reward sits on that turn's last model token.

Every ``step`` result goes through ``check_step_result``. A result that breaks the contract
raises ``EnvError`` (env class, turn, prompt, sample, bad key and value) and ends the run: it
is a deterministic bug in the env, and training around it would hide it. An exception raised
inside ``step`` only ends that episode (reward 0 for the turn, ``env_errors += 1``): tools
fail transiently, and one timeout should not stop a run.

Seeds: with ``seeds`` (one per prompt), sample j of prompt i draws turn t from
``derive_seed(seeds[i], j, t)``, so an episode's tokens depend on its prompt, seed, sample
index and turn only, not on which other episodes are still live in that turn's engine call
(nor on how prompts are split over ranks). Without, each turn's call is seeded with
``params.seed + turn`` (or continues the engine's stream when ``params.seed`` is None).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from relign.envs.env import EnvError, check_step_result, initial_state

from .engine import Completion, SamplingParams, derive_seed


@dataclass
class Episode:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: model tokens and environment tokens, in order."""
    response_mask: list[int] = field(default_factory=list)
    """1 for tokens the model sampled, 0 for environment text."""
    sampling_logps: list[float] = field(default_factory=list)
    token_rewards: list[float] = field(default_factory=list)
    """Per response token; each turn's reward on its last model token."""
    reward: float = 0.0
    score: float = 0.0
    turns: int = 0
    finish_reason: str = "stop"
    text: str = ""
    """The response as text (model and environment turns)."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    components: dict[str, float] = field(default_factory=dict)
    """Named reward components from the reward function (correct, format, ...)."""
    reward_error: str | None = None
    """None, or 'exception' / 'timeout' when the reward function failed (reward 0)."""
    env_errors: int = 0
    terms: dict[str, float] = field(default_factory=dict)
    """The reward as named terms, reward = sum_k w_k terms[k] (weights: ``RolloutCollector.term_weight``)."""


def episode_from_completion(prompt_ids: list[int], c: Completion) -> Episode:
    """A single-turn episode: the whole response is the model's."""
    n = len(c.token_ids)
    return Episode(
        prompt_ids=prompt_ids, response_ids=list(c.token_ids), response_mask=[1] * n, sampling_logps=list(c.logps),
        token_rewards=[0.0] * n, finish_reason=c.finish_reason, text=c.text, turns=1,
    )


def _short(value: Any, limit: int = 120) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _contract_error(env, err: EnvError, result: Any, turn: int, prompt: int, sample: int) -> EnvError:
    """``err`` from ``check_step_result``, with what a bug report needs: env, turn, episode, key=value."""
    if err.key is None:
        what = f"a {type(result).__name__} ({_short(result)})"
    elif isinstance(result, dict) and err.key not in result:
        what = f"no {err.key!r}"
    else:
        what = f"{err.key}={_short(err.value)}"
    msg = f"{type(env).__name__}.step returned {what} at turn {turn} (prompt {prompt}, sample {sample}): {err}"
    return EnvError(msg, key=err.key, value=err.value)


async def _initial_states(env, texts: list[str], extra_infos: list[dict]) -> list[str]:
    async def one(k, text, info):
        try:
            return await initial_state(env, text, info)
        except EnvError as err:  # a reset that returned no string: the same kind of env bug as a bad step result
            msg = f"{type(env).__name__}.reset returned {_short(err.value)} (prompt {k}): {err}"
            raise EnvError(msg, key=err.key, value=err.value) from err

    return await asyncio.gather(*(one(k, t, info) for k, (t, info) in enumerate(zip(texts, extra_infos))))


async def _step_all(env, jobs) -> list[tuple[Any, str | None]]:
    """``(result, None)`` per job, or ``(None, repr(exception))`` when ``step`` raised."""
    async def one(state, action, info):
        try:
            return await env.step(state, action, info), None
        except Exception as e:  # a failing tool ends that episode, not the run
            return None, repr(e)

    return await asyncio.gather(*(one(*j) for j in jobs))


def _start(tokenizer, env, prompts, extra_infos, n, prompt_texts) -> tuple[list[Episode], list[str]]:
    """The episodes (prompt-major, ``n`` per prompt) and their first states: one reset per prompt."""
    texts = list(prompt_texts) if prompt_texts is not None else [tokenizer.decode(p) for p in prompts]
    starts = asyncio.run(_initial_states(env, texts, extra_infos))
    episodes, states = [], []
    for p, text, start, info in zip(prompts, texts, starts, extra_infos):
        # a reset's state is environment text: tokenizing it is fine (no model tokens in it)
        ids = list(p) if start == text else tokenizer(start, add_special_tokens=False)["input_ids"]
        for _ in range(n):
            episodes.append(Episode(prompt_ids=list(ids), extra_info=dict(info)))
            states.append(start)
    return episodes, states


def _generate_turn(engine, inputs, params: SamplingParams, turn: int, live: list[int], n: int, seeds):
    """One engine call for the live episodes; per-episode seeds when given, else one per turn."""
    if seeds is None:
        # a seeded call is reproducible on its own: each turn gets its own derived seed
        p = SamplingParams(**{**params.__dict__, "seed": None if params.seed is None else params.seed + turn})
        return engine.generate(inputs, p)
    row_seeds = [derive_seed(seeds[i // n], i % n, turn) for i in live]
    return engine.generate(inputs, SamplingParams(**{**params.__dict__, "seed": None}), seeds=row_seeds)


def _append(e: Episode, ids: list[int], mask: int, logps: list[float]) -> None:
    e.response_ids += ids
    e.response_mask += [mask] * len(ids)
    e.sampling_logps += logps
    e.token_rewards += [0.0] * len(ids)


def _model_turn(engine, tokenizer, episodes, states, live, budget, turn_params, turn, n, seeds) -> list[tuple]:
    """One completion per live episode, its model tokens appended (cut at the episode's budget);
    returns the env's jobs ``(state, action, extra_info)``."""
    inputs = [episodes[i].prompt_ids + episodes[i].response_ids for i in live]
    room = min(turn_params.max_new_tokens, max(budget[i] for i in live))
    p = SamplingParams(**{**turn_params.__dict__, "max_new_tokens": room})
    outs = _generate_turn(engine, inputs, p, turn, live, n, seeds)
    jobs = []
    for i, group in zip(live, outs):
        c = group[0]
        ids = c.token_ids[: budget[i]]
        e = episodes[i]
        _append(e, ids, 1, c.logps[: len(ids)])
        e.turns += 1
        jobs.append((states[i], tokenizer.decode(ids), e.extra_info))
        if len(ids) >= budget[i] and (c.finish_reason == "length" or len(c.token_ids) > len(ids)):
            e.finish_reason = "length"
    return jobs


def _env_turn(env, tokenizer, e: Episode, job, result, max_response_tokens: int,
              turn: int, prompt: int, sample: int) -> tuple[str, bool]:
    """One episode's step result applied (reward, observation tokens, finish reason); returns the
    episode's state after it and whether the episode is still live. ``turn`` counts from 1."""
    (state, action, _), (res, error) = job, result
    if error is not None:
        # the tool failed: this turn earns 0 and the episode ends where the model left it
        e.env_errors += 1
        return state + action, False
    try:
        out, appended = check_step_result(res, state, action)
    except EnvError as err:
        raise _contract_error(env, err, res, turn, prompt, sample) from err
    e.reward += out["reward"]
    e.score = out["score"]
    last_model = next((j for j in range(len(e.response_mask) - 1, -1, -1) if e.response_mask[j]), None)
    if last_model is not None:  # None only if the model never produced a token
        e.token_rewards[last_model] += out["reward"]
    e.extra_info = out["extra_info"]
    if out["done"] and e.finish_reason == "stop" and out["extra_info"].get("finish_reason") == "max_turns":
        e.finish_reason = "max_turns"  # the environment's own turn limit (relign.envs.env)
    if out["done"] or e.finish_reason == "length":
        # the episode's text is what its tokens hold: prompt + ... + this action
        return state + action, False
    if not appended:
        # The environment rewrote history: we cannot append tokens consistently.
        e.env_errors += 1
        e.finish_reason = "env_error"
        return state + action, False
    nxt = out["next_state"]
    obs = nxt[len(state + action):]
    obs_ids = tokenizer(obs, add_special_tokens=False)["input_ids"] if obs else []
    if len(obs_ids) >= max_response_tokens - len(e.response_ids):
        e.finish_reason = "length"
        return state + action, False
    _append(e, obs_ids, 0, [0.0] * len(obs_ids))
    return nxt, True


def _finish(episodes: list[Episode], states: list[str], live: list[int], prompt_chars: list[int]) -> None:
    """An episode still live after the last turn ends with 'max_turns'; each one's text is its state past the prompt."""
    still_live = set(live)
    for i, e in enumerate(episodes):
        if i in still_live and e.finish_reason == "stop":
            e.finish_reason = "max_turns"
        e.text = states[i][prompt_chars[i]:]


def run_episodes(
    engine,
    tokenizer,
    env,
    prompts: list[list[int]],
    extra_infos: list[dict],
    params: SamplingParams,
    *,
    max_turns: int,
    max_response_tokens: int,
    prompt_texts: list[str] | None = None,
    seeds: list[int] | None = None,
) -> list[list[Episode]]:
    """``params.n`` episodes per prompt, each up to ``max_turns`` model turns.

    ``max_response_tokens`` caps model + environment tokens after the prompt; an episode that
    reaches it ends with finish_reason 'length'. ``prompt_texts``: each prompt's rendered text
    (the state an env without ``reset`` starts from); None decodes ``prompts``. ``seeds``: one
    per prompt, making each episode independent of the others (module docstring); it
    overrides ``params.seed``. Raises ``EnvError`` when the env breaks its contract.
    """
    for name, xs in (("extra_infos", extra_infos), ("prompt_texts", prompt_texts), ("seeds", seeds)):
        if xs is not None and len(xs) != len(prompts):
            raise ValueError(f"run_episodes: {len(xs)} {name} for {len(prompts)} prompts")
    n = max(1, params.n)
    turn_params = SamplingParams(**{**params.__dict__, "n": 1})  # one sample per live episode and turn
    episodes, states = _start(tokenizer, env, prompts, extra_infos, n, prompt_texts)
    prompt_chars = [len(st) for st in states]
    live = list(range(len(episodes)))
    for turn in range(max_turns):
        budget = {i: max_response_tokens - len(episodes[i].response_ids) for i in live}
        live = [i for i in live if budget[i] > 0]
        if not live:
            break
        jobs = _model_turn(engine, tokenizer, episodes, states, live, budget, turn_params, turn, n, seeds)
        results = asyncio.run(_step_all(env, jobs))
        still = []
        for i, job, result in zip(live, jobs, results):
            states[i], keep = _env_turn(env, tokenizer, episodes[i], job, result, max_response_tokens,
                                        turn + 1, i // n, i % n)
            if keep:
                still.append(i)
        live = still
    _finish(episodes, states, live, prompt_chars)
    return [episodes[k * n : (k + 1) * n] for k in range(len(prompts))]
