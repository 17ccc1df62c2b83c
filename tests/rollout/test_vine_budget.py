"""VinePPO's continuations, checked from outside with a scripted engine (issue 33, bugs 5, 7, 8).

* A continuation of a state that already holds ``done`` response tokens asks the engine for the
  budget the policy had left, ``max_new_tokens - done`` (and ``max(0, min_new_tokens - done)``),
  and the values are those of continuations cut at that budget.
* ``dedup=False``: the copies of a state are independent samples (their own seeds); ``dedup=True``
  sends each state once.
* The task's reward sees each continuation's token ids, as the rollout's does: a TRL-style batched
  reward that needs ``completion_ids`` gives the expected V̂, not 0.

The test works out every expectation itself: the states from the responses' newline tokens, the
budgets from the states, the continuations from ``script`` (the engine's rule, a pure function of
the prefix and the sample), cut by hand.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from relign.envs.rewards import RewardPool
from relign.rollout.engine import Completion, SamplingParams
from relign.rollout.vine import VineEpisode, mc_step_values

EOS, NL = 0, 1  # ids 2 .. 27 are the letters a .. z
MAX, MIN, K = 12, 5, 3


class Tok:
    """ids <-> text, one character per token (EOS is "" with skip_special_tokens)."""

    eos_token_id = pad_token_id = EOS

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        return "".join(("" if skip_special_tokens else "<eos>") if t == EOS else "\n" if t == NL else chr(ord("a") + t - 2)
                       for t in map(int, ids))


def script(prefix, sample: int, seed: int | None = None) -> list[int]:
    """What the engine writes after ``prefix`` with an unbounded budget: 1 .. 12 tokens (letters and
    newlines), EOS last; a function of the prefix and the sample's index (and the seed, when given)."""
    rng = random.Random(f"{list(prefix)}|{sample}|{seed}")
    body = [rng.choice([NL, 2, 3, 3, 4, 5]) for _ in range(rng.randint(0, 11))]
    return body + [EOS]


class ScriptedEngine:
    """Writes ``script(prompt, j)`` (``j`` < n) cut at ``max_new_tokens``; records every call."""

    def __init__(self, use_seeds: bool = False):
        self.use_seeds = use_seeds
        self.calls: list[tuple[list[list[int]], SamplingParams, list[int] | None]] = []

    def generate(self, prompts, params: SamplingParams, *, seeds=None) -> list[list[Completion]]:
        self.calls.append(([list(p) for p in prompts], params, None if seeds is None else list(seeds)))
        out = []
        for i, p in enumerate(prompts):
            row = []
            for j in range(params.n):
                toks = script(p, j, seeds[i] if self.use_seeds else None)
                finish = "stop" if len(toks) <= params.max_new_tokens else "length"
                toks = toks[: params.max_new_tokens]
                row.append(Completion(toks, [0.0] * len(toks), finish, Tok().decode(toks, skip_special_tokens=True)))
            out.append(row)
        return out


def _episodes() -> list[VineEpisode]:
    a, b, c, d, e = 2, 3, 4, 5, 6
    info = {"tag": "x"}
    return [
        VineEpisode([20, 21], [a, b, NL, c, d, NL, e, EOS], "P1", info),  # states after 0, 3, 6 tokens
        VineEpisode([20, 21], [a, b, NL, a, EOS], "P1", info),  # shares s_0 and s_1 with the first
        VineEpisode([22], [c] * 9 + [NL, d, d], "P2", info),  # hit the budget (12): states after 0, 10
        VineEpisode([22], [], "P2", info),  # empty: no steps, no states
    ]


def _states(episodes) -> list[tuple[int, list[int]]]:
    """Every (episode, state) the estimate needs: the prompt + the response up to each newline that
    does not end the response (a step ends after a newline)."""
    out = []
    for i, e in enumerate(episodes):
        if not e.response_ids:
            continue
        cuts = [0] + [k + 1 for k, t in enumerate(e.response_ids) if t == NL and k + 1 < len(e.response_ids)]
        out += [(i, e.prompt_ids + e.response_ids[:c]) for c in cuts]
    return out


def _continuation_ids(e: VineEpisode, state: list[int], sample: int) -> list[int]:
    """The response a continuation makes: the steps so far + the continuation, cut at the budget."""
    head = state[len(e.prompt_ids):]
    return (head + script(state, sample))[:MAX]


def _reward_of_ids(ids) -> float:
    return sum(t == 3 for t in ids) + 0.01 * len(ids)  # depends on the head, the continuation and the cut


def _score_text(prompts, responses, infos, completion_ids):
    return [len(r) + r.count("b") * 10.0 for r in responses]


def test_each_continuation_asks_for_the_budget_left_at_its_state():
    episodes = _episodes()
    engine = ScriptedEngine()
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX, min_new_tokens=MIN)
    mc_step_values(engine, Tok(), episodes, score=_score_text, params=params, k=K, delimiter="\n")
    want = {tuple(s) for _, s in _states(episodes)}
    sent = []
    for prompts, p, _ in engine.calls:
        assert p.n == K
        for prefix in prompts:
            e = next(e for e in episodes if prefix[: len(e.prompt_ids)] == e.prompt_ids)
            done = len(prefix) - len(e.prompt_ids)  # response tokens already in the state
            assert p.max_new_tokens == MAX - done, (prefix, p)
            assert p.min_new_tokens == max(0, MIN - done), (prefix, p)
            sent.append(tuple(prefix))
    assert Counter(sent) == Counter(want)  # every state once (de-duplicated)
    # one call per distinct budget (0, 3, 6 and 10 tokens done), none for equal budgets
    assert len(engine.calls) == len({len(s) - len(episodes[i].prompt_ids) for i, s in _states(episodes)}) == 4


def test_values_are_those_of_continuations_cut_at_the_budget():
    """The engine's outputs do not depend on max_new_tokens where they fit: every V̂ is the mean
    reward of the K scripted continuations, each cut where the policy's budget would have cut it."""
    episodes = _episodes()

    def score(prompts, responses, infos, completion_ids):  # reads the texts: the ids back from each character
        return [_reward_of_ids([NL if ch == "\n" else ord(ch) - ord("a") + 2 for ch in r]) for r in responses]

    values, _ = mc_step_values(ScriptedEngine(), Tok(), episodes, score=score,
                               params=SamplingParams(temperature=1.0, max_new_tokens=MAX), k=K, delimiter="\n")
    cut = 0
    for i, e in enumerate(episodes):
        states = [s for j, s in _states(episodes) if j == i]
        want = []
        for s in states:
            rs = []
            for j in range(K):
                ids = [t for t in _continuation_ids(e, s, j) if t != EOS]  # the text holds no EOS
                cut += len(s) - len(e.prompt_ids) + len(script(s, j)) > MAX
                rs.append(_reward_of_ids(ids))
            want.append(sum(rs) / K)
        assert values[i].mc == pytest.approx(want), i
    assert cut > 0  # some continuations ran past the budget and were cut


def test_without_dedup_the_copies_of_a_state_are_independent_samples():
    episodes = _episodes()
    states = _states(episodes)
    copies = Counter(tuple(s) for _, s in states)
    assert max(copies.values()) == 2  # s_0 and s_1 of the first two responses
    for dedup in (True, False):
        engine = ScriptedEngine(use_seeds=True)
        mc_step_values(engine, Tok(), episodes, score=_score_text, params=SamplingParams(max_new_tokens=MAX), k=K,
                       delimiter="\n", dedup=dedup)
        sent: dict[tuple, list[int]] = {}
        for prompts, p, seeds in engine.calls:
            for prefix, sd in zip(prompts, seeds):
                sent.setdefault(tuple(prefix), []).append(sd)
        if dedup:
            assert {s: len(v) for s, v in sent.items()} == {s: 1 for s in copies}  # each state sent once
            continue
        assert {s: len(v) for s, v in sent.items()} == dict(copies)  # every request sent
        for s, seeds in sent.items():
            assert len(set(seeds)) == len(seeds), s  # each copy its own seed ...
            samples = [tuple(tuple(script(s, j, sd)) for j in range(K)) for sd in seeds]
            assert len(set(samples)) == len(samples), s  # ... so its own continuations


# --------------------------------------------------------------------------- the reward gets completion_ids

RECEIVED: list[list[int]] = []


def batched_reward(prompts, completions, completion_ids, **kwargs):
    """A TRL-style batched reward that needs the token ids (a TypeError without them)."""
    assert len(completion_ids) == len(completions)
    for text, ids in zip(completions, completion_ids):
        assert Tok().decode(ids, skip_special_tokens=True) == text  # the ids are the text's
        RECEIVED.append(list(ids))
    return [_reward_of_ids(ids) for ids in completion_ids]


def test_a_batched_reward_gets_each_continuations_token_ids():
    episodes = _episodes()
    RECEIVED.clear()
    with RewardPool(f"{__name__}:batched_reward", num_workers=0) as pool:
        assert pool.style == "batch"
        values, _ = mc_step_values(
            ScriptedEngine(), Tok(), episodes, params=SamplingParams(max_new_tokens=MAX), k=K, delimiter="\n",
            score=lambda p, r, i, ids: [x.reward for x in pool.score(p, r, i, completion_ids=ids)])
        assert pool.stats["exceptions"] == 0
    for i, e in enumerate(episodes):
        want = [sum(_reward_of_ids(_continuation_ids(e, s, j)) for j in range(K)) / K for k, s in _states(episodes) if k == i]
        assert values[i].mc == pytest.approx(want) and all(v > 0 for v in values[i].mc), i
    first: dict[tuple, int] = {}  # each state is scored once, for the first response that holds it
    for i, s in _states(episodes):
        first.setdefault(tuple(s), i)
    assert sorted(RECEIVED) == sorted(_continuation_ids(episodes[i], list(s), j) for s, i in first.items() for j in range(K))
