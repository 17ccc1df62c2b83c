"""Multi-turn rollouts, token in / token out.

An environment follows RL2's contract (``relign.envs.multiturn.Env``)::

    async def step(state: str, action: str, extra_info: dict) -> dict
        # {"next_state", "reward", "score", "done", "extra_info"}

Per turn, every live episode samples one completion from its exact token sequence so far;
the environments step concurrently. When ``state + action`` is a prefix of ``next_state``,
only the new text is tokenized and appended (``response_mask = 0``: the model is not trained
on what the environment wrote). The model's own tokens are never decoded and re-encoded.
Each turn's reward sits on that turn's last model token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from .engine import Completion, SamplingParams


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


def episode_from_completion(prompt_ids: list[int], c: Completion) -> Episode:
    """A single-turn episode: the whole response is the model's."""
    n = len(c.token_ids)
    return Episode(
        prompt_ids=prompt_ids, response_ids=list(c.token_ids), response_mask=[1] * n, sampling_logps=list(c.logps),
        token_rewards=[0.0] * n, finish_reason=c.finish_reason, text=c.text, turns=1,
    )


async def _step_all(env, jobs):
    async def one(state, action, info):
        try:
            return await env.step(state, action, info)
        except Exception as e:  # an environment bug ends that episode, not the run
            return {"next_state": state + action, "reward": 0.0, "score": 0.0, "done": True, "extra_info": info, "error": repr(e)}

    return await asyncio.gather(*(one(*j) for j in jobs))


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
) -> list[list[Episode]]:
    """``params.n`` episodes per prompt, each up to ``max_turns`` model turns.

    ``max_response_tokens`` caps model + environment tokens after the prompt; an episode that
    reaches it ends with finish_reason 'length'.
    """
    n = max(1, params.n)
    turn_params = SamplingParams(**{**params.__dict__, "n": 1, "seed": None})
    episodes = [Episode(prompt_ids=list(p), extra_info=dict(info)) for p, info in zip(prompts, extra_infos) for _ in range(n)]
    states = [tokenizer.decode(e.prompt_ids) for e in episodes]
    prompt_chars = [len(st) for st in states]
    live = list(range(len(episodes)))
    for turn in range(max_turns):
        if not live:
            break
        budget = {i: max_response_tokens - len(episodes[i].response_ids) for i in live}
        live = [i for i in live if budget[i] > 0]
        if not live:
            break
        inputs = [episodes[i].prompt_ids + episodes[i].response_ids for i in live]
        p = SamplingParams(**{
            **turn_params.__dict__,
            "max_new_tokens": min(params.max_new_tokens, max(budget[i] for i in live)),
            # a seeded call is reproducible on its own: each turn gets its own derived seed
            "seed": None if params.seed is None else params.seed + turn,
        })
        outs = engine.generate(inputs, p)
        jobs = []
        for i, group in zip(live, outs):
            c = group[0]
            ids = c.token_ids[: budget[i]]
            e = episodes[i]
            e.response_ids += ids
            e.response_mask += [1] * len(ids)
            e.sampling_logps += c.logps[: len(ids)]
            e.token_rewards += [0.0] * len(ids)
            e.turns += 1
            action = tokenizer.decode(ids)
            jobs.append((states[i], action, e.extra_info))
            if len(ids) >= budget[i] and (c.finish_reason == "length" or len(c.token_ids) > len(ids)):
                e.finish_reason = "length"
        results = asyncio.run(_step_all(env, jobs))
        still = []
        for i, (state, action, _), res in zip(live, jobs, results):
            e = episodes[i]
            r = float(res.get("reward", 0.0))
            e.reward += r
            e.score = float(res.get("score", e.score))
            if e.response_mask and e.token_rewards:
                last_model = max(j for j, m in enumerate(e.response_mask) if m)
                e.token_rewards[last_model] += r
            e.extra_info = res.get("extra_info", e.extra_info) or e.extra_info
            if "error" in res:
                e.env_errors += 1
            nxt = res.get("next_state", state + action)
            if res.get("done", False) or e.finish_reason == "length":
                # the episode's text is what its tokens hold: prompt + ... + this action
                states[i] = state + action
                continue
            if not nxt.startswith(state + action):
                # The environment rewrote history: we cannot append tokens consistently.
                states[i] = state + action
                e.env_errors += 1
                e.finish_reason = "env_error"
                continue
            obs = nxt[len(state + action):]
            obs_ids = tokenizer(obs, add_special_tokens=False)["input_ids"] if obs else []
            room = max_response_tokens - len(e.response_ids)
            if len(obs_ids) >= room:
                states[i] = state + action
                e.finish_reason = "length"
                continue
            e.response_ids += obs_ids
            e.response_mask += [0] * len(obs_ids)
            e.sampling_logps += [0.0] * len(obs_ids)
            e.token_rewards += [0.0] * len(obs_ids)
            states[i] = nxt
            still.append(i)
        live = still
    still_live = set(live)
    for i, e in enumerate(episodes):
        if i in still_live and e.finish_reason == "stop":
            e.finish_reason = "max_turns"
        e.text = states[i][prompt_chars[i]:]
    return [episodes[k * n : (k + 1) * n] for k in range(len(prompts))]
