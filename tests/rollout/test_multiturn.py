"""run_episodes: token in / token out multi-turn rollouts with the calculator environment."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from relign.envs.calculator import CalculatorEnv, make_calculator_records
from relign.envs.env import EnvError
from relign.rollout.engine import Completion, SamplingParams, derive_seed
from relign.rollout.hf_engine import HFEngine
from relign.rollout.multiturn import Episode, episode_from_completion, run_episodes

from .conftest import trainer_logps


class ScriptedEngine:
    """Replays scripted turns: ``scripts[e][k]`` is episode e's k-th model turn (token ids).

    The first call's rows are episodes 0..R-1 in order. A later row belongs to the first
    unused live episode whose previous input + output is a prefix of it, so every call also
    checks that the driver sent back exactly the ids it got (no re-tokenization). Each turn
    ends with finish_reason 'stop' unless cut by ``max_new_tokens`` ('length'). ``calls``
    holds (prompts, params, owners, seeds) per call.
    """

    def __init__(self, tokenizer, scripts: list[list[list[int]]]):
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.calls: list[tuple[list[list[int]], SamplingParams, list[int], list[int] | None]] = []
        self.seen: list[list[int]] = [[] for _ in scripts]  # each episode's last input + output
        self.live = list(range(len(scripts)))  # episodes in the last call (all, at first)
        self.turn = [0] * len(scripts)

    @staticmethod
    def logps(e: int, k: int, n: int) -> list[float]:
        return [-(1 + e + 0.1 * k + 0.001 * j) for j in range(n)]

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seeds: list[int] | None = None
                 ) -> list[list[Completion]]:
        assert params.n == 1
        assert seeds is None or len(seeds) == len(prompts)
        if not self.calls:
            assert len(prompts) == len(self.scripts)
        owners, lo = [], 0
        for p in prompts:
            e = next(e for e in self.live[lo:] if p[: len(self.seen[e])] == self.seen[e])
            owners.append(e)
            lo = self.live.index(e) + 1
        self.live = owners
        self.calls.append(([list(p) for p in prompts], params, owners, None if seeds is None else list(seeds)))
        out = []
        for p, e in zip(prompts, owners):
            k = self.turn[e]
            ids = list(self.scripts[e][k])
            finish = "stop"
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[: params.max_new_tokens], "length"
            self.turn[e] += 1
            self.seen[e] = list(p) + ids
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append([Completion(ids, self.logps(e, k, len(ids)), finish, text)])
        return out


class ShapedCalculatorEnv(CalculatorEnv):
    """The calculator, plus 0.25 reward for each tool call (to see per-turn reward placement)."""

    async def step(self, state, action, extra_info):
        res = await super().step(state, action, extra_info)
        if not res["done"]:
            res["reward"] += 0.25
        return res


class RaisingEnv(CalculatorEnv):
    async def step(self, state, action, extra_info):
        if "boom" in action:
            raise RuntimeError("tool crashed")
        return await super().step(state, action, extra_info)


class ShapedRaisingEnv(RaisingEnv, ShapedCalculatorEnv):
    pass


class RewritingEnv(CalculatorEnv):
    """Summarises history: next_state no longer starts with state + action."""

    async def step(self, state, action, extra_info):
        res = await super().step(state, action, extra_info)
        if not res["done"]:
            res["next_state"] = "[summary] " + res["next_state"]
        return res


PROMPT = "Compute 12 * 3."
INFO = {"answer": "36"}
OBS = "<result>36</result>\n"


@pytest.fixture
def calc_ids(enc):
    """'<calc>12*3</calc>' as the model might sample it: one token per character, which
    re-tokenizing its decoded text would merge (so any decode/re-encode shows)."""
    ids = [i for ch in "<calc>12*3</calc>" for i in enc(ch)]
    return ids


def _params(**kw):
    return SamplingParams(**{"temperature": 1.0, "max_new_tokens": 64, "seed": 17, **kw})


def test_token_in_token_out_two_turns(tokenizer, enc, calc_ids):
    prompt_ids, ans_ids, obs_ids = enc(PROMPT), enc("<answer>36</answer>"), enc(OBS)
    assert tokenizer.decode(calc_ids) == "<calc>12*3</calc>"
    assert enc(tokenizer.decode(calc_ids)) != calc_ids  # re-encoding would change the ids
    engine = ScriptedEngine(tokenizer, [[calc_ids, ans_ids]])
    [[ep]] = run_episodes(
        engine, tokenizer, CalculatorEnv(), [prompt_ids], [INFO], _params(), max_turns=4, max_response_tokens=100
    )
    # turn 2 gets exactly prompt + the model's own turn-1 ids + the observation's ids
    assert len(engine.calls) == 2
    assert engine.calls[0][0] == [prompt_ids]
    assert engine.calls[1][0] == [prompt_ids + calc_ids + obs_ids]
    # every call asks for one sample; only the first carries the seed
    assert [c[1].n for c in engine.calls] == [1, 1]
    assert [c[1].seed for c in engine.calls] == [17, 18]  # each turn: its own seed derived from params.seed
    assert [c[3] for c in engine.calls] == [None, None]  # no per-prompt seeds: no per-row streams
    assert [c[1].max_new_tokens for c in engine.calls] == [64, 64]

    assert ep.prompt_ids == prompt_ids
    assert ep.response_ids == calc_ids + obs_ids + ans_ids
    assert ep.response_mask == [1] * len(calc_ids) + [0] * len(obs_ids) + [1] * len(ans_ids)
    assert ep.sampling_logps == (
        ScriptedEngine.logps(0, 0, len(calc_ids)) + [0.0] * len(obs_ids) + ScriptedEngine.logps(0, 1, len(ans_ids))
    )
    assert ep.token_rewards == [0.0] * (len(ep.response_ids) - 1) + [1.0]
    assert (ep.reward, ep.score, ep.turns, ep.finish_reason, ep.env_errors) == (1.0, 1.0, 2, "stop", 0)
    assert ep.text == "<calc>12*3</calc>" + OBS + "<answer>36</answer>"
    assert ep.extra_info == INFO


def test_each_turn_reward_on_its_last_model_token(tokenizer, enc, calc_ids):
    prompt_ids, ans_ids, obs_ids = enc(PROMPT), enc("<answer>36</answer>"), enc(OBS)
    engine = ScriptedEngine(tokenizer, [[calc_ids, calc_ids, ans_ids]])
    [[ep]] = run_episodes(
        engine, tokenizer, ShapedCalculatorEnv(), [prompt_ids], [INFO], _params(), max_turns=3,
        max_response_tokens=200,
    )
    turn = len(calc_ids) + len(obs_ids)
    expected = [0.0] * len(ep.response_ids)
    expected[len(calc_ids) - 1] = 0.25
    expected[turn + len(calc_ids) - 1] = 0.25
    expected[-1] = 1.0
    assert ep.token_rewards == expected
    assert ep.reward == pytest.approx(1.5) and ep.score == 1.0 and ep.turns == 3
    assert sum(ep.token_rewards) == pytest.approx(ep.reward)
    # rewards sit on model tokens only
    assert all(m == 1 for m, r in zip(ep.response_mask, ep.token_rewards) if r)


def test_n_episodes_per_prompt_and_finish_reasons(tokenizer, enc, calc_ids):
    p0, p1 = enc(PROMPT), enc("Compute 2 + 3.")
    right, wrong = enc("<answer>36</answer>"), enc("<answer>35</answer>")
    chatter = enc("I am not sure")
    scripts = [
        [calc_ids, right],  # p0: tool call then right answer
        [wrong],  # p0: wrong answer at once
        [calc_ids, calc_ids, calc_ids],  # p1: keeps calling until the turn limit
        [chatter],  # p1: neither tag: the env ends it, reward 0
    ]
    # episodes are prompt-major: p0's two, then p1's two
    engine = ScriptedEngine(tokenizer, scripts)
    out = run_episodes(
        engine, tokenizer, CalculatorEnv(), [p0, p1], [INFO, {"answer": "5"}], _params(n=2), max_turns=2,
        max_response_tokens=200,
    )
    assert [len(g) for g in out] == [2, 2]
    (a, b), (c, d) = out
    assert [e.prompt_ids for e in (a, b, c, d)] == [p0, p0, p1, p1]
    assert [c_[2] for c_ in engine.calls] == [[0, 1, 2, 3], [0, 2]]
    assert (a.reward, a.turns, a.finish_reason) == (1.0, 2, "stop")
    assert (b.reward, b.turns, b.finish_reason, b.response_ids) == (0.0, 1, "stop", wrong)
    assert (c.reward, c.turns, c.finish_reason) == (0.0, 2, "max_turns")
    # the turn limit came after the env answered: its observation is part of the response
    obs2 = enc("<result>36</result>\n")
    assert c.response_ids == calc_ids + obs2 + calc_ids + obs2
    assert c.response_mask == [1] * len(calc_ids) + [0] * len(obs2) + [1] * len(calc_ids) + [0] * len(obs2)
    assert (d.reward, d.turns, d.finish_reason, d.text) == (0.0, 1, "stop", "I am not sure")
    assert all(e.env_errors == 0 for e in (a, b, c, d))


def test_max_turns_one(tokenizer, enc, calc_ids):
    engine = ScriptedEngine(tokenizer, [[calc_ids]])
    [[ep]] = run_episodes(
        engine, tokenizer, CalculatorEnv(), [enc(PROMPT)], [INFO], _params(), max_turns=1, max_response_tokens=100
    )
    assert (ep.turns, ep.finish_reason, ep.reward) == (1, "max_turns", 0.0)
    assert len(engine.calls) == 1


def test_length_when_model_turn_hits_max_response_tokens(tokenizer, enc, calc_ids):
    engine = ScriptedEngine(tokenizer, [[calc_ids]])
    [[ep]] = run_episodes(
        engine, tokenizer, CalculatorEnv(), [enc(PROMPT)], [INFO], _params(), max_turns=4, max_response_tokens=10
    )
    assert engine.calls[0][1].max_new_tokens == 10  # min(max_new_tokens, budget)
    assert ep.response_ids == calc_ids[:10] and ep.response_mask == [1] * 10
    assert ep.sampling_logps == ScriptedEngine.logps(0, 0, 10)
    assert (ep.finish_reason, ep.turns, ep.reward) == ("length", 1, 0.0)


def test_length_when_observation_does_not_fit(tokenizer, enc, calc_ids):
    obs_ids = enc(OBS)
    engine = ScriptedEngine(tokenizer, [[calc_ids, enc("<answer>36</answer>")]])
    [[ep]] = run_episodes(
        engine, tokenizer, CalculatorEnv(), [enc(PROMPT)], [INFO], _params(), max_turns=4,
        max_response_tokens=len(calc_ids) + len(obs_ids) - 1,
    )
    assert ep.response_ids == calc_ids and ep.response_mask == [1] * len(calc_ids)
    assert (ep.finish_reason, ep.turns) == ("length", 1)
    assert len(engine.calls) == 1
    # ... and when it just fits, the next turn gets no room
    engine = ScriptedEngine(tokenizer, [[calc_ids, enc("<answer>36</answer>")]])
    [[ep]] = run_episodes(
        engine, tokenizer, CalculatorEnv(), [enc(PROMPT)], [INFO], _params(), max_turns=4,
        max_response_tokens=len(calc_ids) + len(obs_ids),
    )
    assert len(ep.response_ids) <= len(calc_ids) + len(obs_ids)
    assert ep.finish_reason == "length" and len(engine.calls) == 1


@pytest.mark.parametrize("case", ["length", "env_error"])
def test_text_matches_response_ids_when_cut(tokenizer, enc, calc_ids, case):
    engine = ScriptedEngine(tokenizer, [[calc_ids, enc("<answer>36</answer>")]])
    env, room = (CalculatorEnv(), len(calc_ids) + 2) if case == "length" else (RewritingEnv(), 100)
    [[ep]] = run_episodes(
        engine, tokenizer, env, [enc(PROMPT)], [INFO], _params(), max_turns=4, max_response_tokens=room
    )
    assert ep.finish_reason == case
    assert ep.text == tokenizer.decode(ep.response_ids)


def test_completion_cut_by_episode_budget_is_length(tokenizer, enc, calc_ids):
    short = enc("<calc>1</calc>")
    long_answer = enc(" so the final answer is <answer>36</answer>")
    obs36, obs1 = enc(OBS), enc("<result>1</result>\n")
    budget = len(calc_ids) + len(obs36) + 8  # episode 0 has 8 tokens left at turn 2
    assert len(long_answer) > 8 and budget - len(short) - len(obs1) >= len(long_answer)
    engine = ScriptedEngine(tokenizer, [[calc_ids, long_answer], [short, enc("<answer>1</answer>")]])
    out = run_episodes(
        engine, tokenizer, CalculatorEnv(), [enc(PROMPT), enc("Compute 1.")], [INFO, {"answer": "1"}], _params(),
        max_turns=4, max_response_tokens=budget,
    )
    ep = out[0][0]
    assert len(ep.response_ids) == budget and ep.response_ids[-8:] == long_answer[:8]
    assert ep.finish_reason == "length"


def test_env_exception_ends_episode_with_zero_reward(tokenizer, enc, calc_ids):
    boom = enc("<calc>boom</calc>")
    engine = ScriptedEngine(tokenizer, [[calc_ids, boom], [calc_ids, enc("<answer>36</answer>")]])
    out = run_episodes(
        engine, tokenizer, ShapedRaisingEnv(), [enc(PROMPT)], [INFO], _params(n=2), max_turns=4, max_response_tokens=200
    )
    bad, good = out[0]
    assert bad.env_errors == 1 and bad.turns == 2
    assert bad.reward == pytest.approx(0.25)  # the first turn's reward stays, the failed turn adds 0
    assert bad.response_ids[-len(boom):] == boom and bad.response_mask[-1] == 1
    assert (good.env_errors, good.reward, good.finish_reason, good.turns) == (0, pytest.approx(1.25), "stop", 2)
    assert [c[2] for c in engine.calls] == [[0, 1], [0, 1]]  # no third call: the bad one ended


def test_env_exception_on_first_turn(tokenizer, enc):
    engine = ScriptedEngine(tokenizer, [[enc("boom")]])
    [[ep]] = run_episodes(
        engine, tokenizer, RaisingEnv(), [enc(PROMPT)], [INFO], _params(), max_turns=4, max_response_tokens=50
    )
    assert (ep.reward, ep.score, ep.env_errors, ep.turns) == (0.0, 0.0, 1, 1)
    assert ep.token_rewards == [0.0] * len(ep.response_ids)


def test_env_rewriting_history_ends_with_env_error(tokenizer, enc, calc_ids):
    engine = ScriptedEngine(tokenizer, [[calc_ids, enc("<answer>36</answer>")]])
    [[ep]] = run_episodes(
        engine, tokenizer, RewritingEnv(), [enc(PROMPT)], [INFO], _params(), max_turns=4, max_response_tokens=100
    )
    assert (ep.finish_reason, ep.env_errors, ep.turns) == ("env_error", 1, 1)
    assert ep.response_ids == calc_ids and ep.response_mask == [1] * len(calc_ids)
    assert len(engine.calls) == 1


# ---------------------------------------------------------------------------- contract: reset


class ResetEnv(CalculatorEnv):
    """Builds each episode's first state from extra_info (not the record's prompt); counts
    resets and how many run at once, and records the states its first step sees."""

    def __init__(self):
        self.resets: list[dict] = []
        self.active = self.max_active = 0
        self.first_states: list[str] = []

    async def reset(self, extra_info):
        self.resets.append(dict(extra_info))
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        await asyncio.sleep(0.01)  # a remote sandbox starting up: resets should overlap
        self.active -= 1
        return f"Question {extra_info['answer']}: compute it.\n"

    async def step(self, state, action, extra_info):
        if "<result>" not in state:
            self.first_states.append(state)
        return await super().step(state, action, extra_info)


def test_reset_state_becomes_the_prompt_once_per_prompt(tokenizer, enc, calc_ids):
    p0, p1 = enc(PROMPT), enc("Compute 2 + 3.")
    s0, s1 = "Question 36: compute it.\n", "Question 5: compute it.\n"
    ans = enc("<answer>36</answer>")
    env = ResetEnv()
    engine = ScriptedEngine(tokenizer, [[calc_ids, ans], [ans], [ans], [ans], [ans], [ans]])
    out = run_episodes(
        engine, tokenizer, env, [p0, p1], [INFO, {"answer": "5"}], _params(n=3), max_turns=3, max_response_tokens=100
    )
    # one reset per prompt (not per episode), run concurrently
    assert env.resets == [INFO, {"answer": "5"}]
    assert env.max_active == 2
    # every episode of a group starts from its prompt's reset state, as tokens and as text
    assert [e.prompt_ids for g in out for e in g] == [enc(s0)] * 3 + [enc(s1)] * 3
    assert engine.calls[0][0] == [enc(s0)] * 3 + [enc(s1)] * 3
    assert sorted(env.first_states) == sorted([s0] * 3 + [s1] * 3)
    # turn 2 continues from the reset state's ids, and the text is only the response
    a = out[0][0]
    assert engine.calls[1][0] == [enc(s0) + calc_ids + enc(OBS)]
    assert a.text == "<calc>12*3</calc>" + OBS + "<answer>36</answer>" and a.reward == 1.0
    assert [e.reward for e in out[1]] == [0.0] * 3  # "36" is wrong for the answer 5


def test_reset_returning_the_prompt_keeps_the_callers_ids(tokenizer, enc, calc_ids):
    class EchoReset(CalculatorEnv):
        async def reset(self, extra_info):
            return "<calc>12*3</calc>"

    # the caller's ids are one token per character: re-tokenizing the same text would merge them
    assert enc("<calc>12*3</calc>") != calc_ids
    engine = ScriptedEngine(tokenizer, [[enc("<answer>36</answer>")]])
    [[ep]] = run_episodes(
        engine, tokenizer, EchoReset(), [calc_ids], [INFO], _params(), max_turns=2, max_response_tokens=50
    )
    assert ep.prompt_ids == calc_ids and engine.calls[0][0] == [calc_ids]


def test_reset_returning_no_string_is_an_env_error(tokenizer, enc):
    class NoneReset(CalculatorEnv):
        async def reset(self, extra_info):
            return None

    engine = ScriptedEngine(tokenizer, [[enc("<answer>36</answer>")]])
    with pytest.raises(EnvError, match=r"NoneReset\.reset returned None \(prompt 0\)"):
        run_episodes(engine, tokenizer, NoneReset(), [enc(PROMPT)], [INFO], _params(), max_turns=2, max_response_tokens=50)
    assert engine.calls == []


def test_prompt_texts_are_the_first_state(tokenizer, enc):
    class Recording(CalculatorEnv):
        def __init__(self):
            self.states: list[str] = []

        async def step(self, state, action, extra_info):
            self.states.append(state)
            return await super().step(state, action, extra_info)

    env = Recording()
    rendered = "<|user|>Compute 12 * 3.<|assistant|>"  # e.g. a chat template's text, not decode(ids)
    ans = enc("<answer>36</answer>")
    engine = ScriptedEngine(tokenizer, [[ans]])
    [[ep]] = run_episodes(
        engine, tokenizer, env, [enc(PROMPT)], [INFO], _params(), max_turns=2, max_response_tokens=50,
        prompt_texts=[rendered],
    )
    assert env.states == [rendered]
    assert ep.prompt_ids == enc(PROMPT)  # no reset: the caller's ids stay
    assert ep.text == "<answer>36</answer>" and ep.reward == 1.0


# ---------------------------------------------------------------------------- contract: step results


class BreaksAtTurnTwoEnv(CalculatorEnv):
    """The calculator, except that a turn-2 action containing '99' gets ``bad(result)``."""

    def __init__(self, bad):
        self.bad = bad

    async def step(self, state, action, extra_info):
        res = await super().step(state, action, extra_info)
        return self.bad(res) if "<result>" in state and "99" in action else res


BROKEN = {
    "reward_nan": (lambda r: {**r, "reward": float("nan")}, "reward=nan", "reward"),
    "reward_str": (lambda r: {**r, "reward": "1"}, "reward='1'", "reward"),
    "score_inf": (lambda r: {**r, "score": float("inf")}, "score=inf", "score"),
    "missing_done": (lambda r: {k: v for k, v in r.items() if k != "done"}, "no 'done'", "done"),
    "done_int": (lambda r: {**r, "done": 1}, "done=1", "done"),
    "not_a_dict": (lambda r: [r["next_state"], r["reward"]], "a list (['Compute 3 * 33.<calc>", None),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_contract_violation_raises_env_error_naming_env_turn_and_episode(tokenizer, enc, calc_ids, case):
    bad, shown, key = BROKEN[case]
    ans, ans99 = enc("<answer>36</answer>"), enc("<answer>99</answer>")
    # prompt 1, sample 1 is the only episode whose turn-2 action contains 99
    scripts = [[calc_ids, ans], [calc_ids, ans], [calc_ids, ans], [calc_ids, ans99]]
    engine = ScriptedEngine(tokenizer, scripts)
    with pytest.raises(EnvError) as info:
        run_episodes(
            engine, tokenizer, BreaksAtTurnTwoEnv(bad), [enc(PROMPT), enc("Compute 3 * 33.")],
            [INFO, {"answer": "99"}], _params(n=2), max_turns=4, max_response_tokens=200,
        )
    msg = str(info.value)
    assert msg.startswith(f"BreaksAtTurnTwoEnv.step returned {shown}"), msg
    assert " at turn 2 (prompt 1, sample 1): Env.step " in msg, msg
    assert isinstance(info.value, ValueError) and info.value.key == key
    assert len(engine.calls) == 2  # it stopped at the turn that broke


def test_good_results_pass_the_contract_check(tokenizer, enc, calc_ids):
    # an int reward is a number: the contract accepts it and the episode sums it as a float
    env = BreaksAtTurnTwoEnv(lambda r: {**r, "reward": 2, "extra_info": {}})
    engine = ScriptedEngine(tokenizer, [[calc_ids, enc("<answer>99</answer>")]])
    [[ep]] = run_episodes(
        engine, tokenizer, env, [enc(PROMPT)], [INFO], _params(), max_turns=4, max_response_tokens=200
    )
    assert (ep.reward, ep.env_errors, ep.turns) == (2.0, 0, 2) and isinstance(ep.reward, float)
    assert ep.extra_info == {}  # the env's extra_info is taken as it is, even when empty


# ---------------------------------------------------------------------------- seeds


def test_seeds_give_every_episode_and_turn_its_own_stream(tokenizer, enc, calc_ids):
    p0, p1 = enc(PROMPT), enc("Compute 2 + 3.")
    right, wrong = enc("<answer>36</answer>"), enc("<answer>35</answer>")
    scripts = [[calc_ids, right], [wrong], [calc_ids, calc_ids], [wrong]]
    engine = ScriptedEngine(tokenizer, scripts)
    run_episodes(
        engine, tokenizer, CalculatorEnv(), [p0, p1], [INFO, {"answer": "5"}], _params(n=2), max_turns=2,
        max_response_tokens=200, seeds=[100, 200],
    )
    assert [c[2] for c in engine.calls] == [[0, 1, 2, 3], [0, 2]]
    d = derive_seed
    # turn 2 has only (prompt 0, sample 0) and (prompt 1, sample 0) live: their seeds do not shift
    assert engine.calls[0][3] == [d(100, 0, 0), d(100, 1, 0), d(200, 0, 0), d(200, 1, 0)]
    assert engine.calls[1][3] == [d(100, 0, 1), d(200, 0, 1)]
    assert len(set(engine.calls[0][3] + engine.calls[1][3])) == 6
    # per-row seeds replace the call's seed (params.seed=17 is not used)
    assert [(c[1].seed, c[1].n) for c in engine.calls] == [(None, 1), (None, 1)]


def test_seeds_must_match_prompts(tokenizer, enc):
    engine = ScriptedEngine(tokenizer, [[enc("x")]])
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        run_episodes(engine, tokenizer, CalculatorEnv(), [enc(PROMPT)], [INFO], _params(), max_turns=1,
                     max_response_tokens=10, seeds=[1, 2])


def test_episode_from_completion():
    c = Completion([5, 6, 7], [-0.1, -0.2, -0.3], "length", "abc")
    ep = episode_from_completion([1, 2], c)
    assert isinstance(ep, Episode)
    assert (ep.prompt_ids, ep.response_ids, ep.response_mask) == ([1, 2], [5, 6, 7], [1, 1, 1])
    assert (ep.sampling_logps, ep.token_rewards) == ([-0.1, -0.2, -0.3], [0.0, 0.0, 0.0])
    assert (ep.finish_reason, ep.text, ep.turns) == ("length", "abc", 1)
    ep.response_ids.append(8)
    assert c.token_ids == [5, 6, 7]  # copies, not aliases


# ---------------------------------------------------------------------------- real engine


class ObservingCalculatorEnv(CalculatorEnv):
    """The calculator, but a turn with neither tag gets a hint instead of ending the episode,
    so a random tiny model still plays several turns."""

    def __init__(self):
        self.observations: list[str] = []

    async def step(self, state, action, extra_info):
        res = await super().step(state, action, extra_info)
        if res["done"] and res["reward"] == 0 and "<answer>" not in action:
            res = {**res, "done": False, "next_state": state + action + "\n<result>no call</result>\n"}
        if not res["done"]:
            self.observations.append(res["next_state"][len(state + action):])
        return res


def _runs(mask):
    runs, start = [], 0
    for j in range(1, len(mask) + 1):
        if j == len(mask) or mask[j] != mask[start]:
            runs.append((mask[start], start, j))
            start = j
    return runs


def test_real_engine_multiturn_invariants(model, tokenizer, enc):
    records = make_calculator_records(2, seed=0)
    prompts = [enc(r["prompt"]) for r in records]
    infos = [r["extra_info"] for r in records]
    engine = HFEngine(model, tokenizer, seed=0)
    completions: list[list[int]] = []
    generate = engine.generate

    def spy(ps, params):
        out = generate(ps, params)
        completions.extend(g[0].token_ids for g in out)
        return out

    engine.generate = spy
    env = ObservingCalculatorEnv()
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_new_tokens=6, stop=["</calc>", "</answer>"], seed=3)
    out = run_episodes(engine, tokenizer, env, prompts, infos, params, max_turns=2, max_response_tokens=40)
    episodes = [e for g in out for e in g]
    assert [len(g) for g in out] == [2, 2]
    assert sum(e.turns for e in episodes) >= 6  # most of them really played two turns
    obs_ids = {tuple(enc(o)) for o in env.observations}
    model_runs = []
    for e in episodes:
        n = len(e.response_ids)
        assert len(e.response_mask) == len(e.sampling_logps) == len(e.token_rewards) == n <= 40
        for m, a, b in _runs(e.response_mask):
            if m == 0:  # exactly an env observation's tokens, with no sampling logps
                assert tuple(e.response_ids[a:b]) in obs_ids
                assert e.sampling_logps[a:b] == [0.0] * (b - a)
            else:
                model_runs.append(e.response_ids[a:b])
    # every model run is a completion the engine returned, unchanged
    assert all(r in completions for r in model_runs)
    # the sampling logps are what the trainer recomputes over the whole multi-turn sequence
    ref = trainer_logps(model, [e.prompt_ids for e in episodes], [e.response_ids for e in episodes], 0.8)
    for e, r in zip(episodes, ref):
        diffs = [abs(a - b) for a, b, m in zip(e.sampling_logps, r, e.response_mask) if m]
        assert diffs and max(diffs) < 1e-4


def test_real_engine_seeded_rollout_repeats(model, tokenizer, enc):
    records = make_calculator_records(2, seed=1)
    prompts = [enc(r["prompt"]) for r in records]
    infos = [r["extra_info"] for r in records]
    engine = HFEngine(model, tokenizer, seed=0)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=11)
    state = copy.deepcopy(engine.state_dict())

    def run():
        out = run_episodes(engine, tokenizer, ObservingCalculatorEnv(), prompts, infos, params, max_turns=2,
                           max_response_tokens=30)
        return [(e.response_ids, e.sampling_logps, e.response_mask, e.finish_reason) for g in out for e in g]

    a = run()
    assert run() == a  # a seeded call repeats on its own: every turn draws from a seed derived from params.seed
    assert torch.equal(state["generator"], engine.state_dict()["generator"])  # the engine's own stream is untouched
    engine.load_state_dict(state)
    assert run() == a


def test_real_engine_seeded_episodes_do_not_depend_on_the_batch(model, tokenizer, enc):
    records = make_calculator_records(2, seed=2)
    (p0, p1), (i0, i1) = [enc(r["prompt"]) for r in records], [r["extra_info"] for r in records]
    engine = HFEngine(model, tokenizer, seed=0)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, stop=["</calc>"], seed=11)

    def run(prompts, infos, seeds):
        out = run_episodes(engine, tokenizer, ObservingCalculatorEnv(), prompts, infos, params, max_turns=3,
                           max_response_tokens=40, seeds=seeds)
        return [[(e.response_ids, e.response_mask, e.finish_reason, e.turns, e.sampling_logps) for e in g] for g in out]

    def tokens(groups):
        return [[ep[:4] for ep in g] for g in groups]

    both = run([p0, p1], [i0, i1], [5, 9])
    alone1, alone0 = run([p1], [i1], [9]), run([p0], [i0], [5])
    assert sum(ep[3] for g in both for ep in g) >= 9  # several turns each: later calls are really shared
    # token for token the same, whether p0 shares its calls with p1 or not
    assert tokens(both) == tokens(alone0) + tokens(alone1)
    for g, g_alone in zip(both, alone0 + alone1):
        for ep, ep_alone in zip(g, g_alone):
            assert max(abs(a - b) for a, b in zip(ep[4], ep_alone[4])) < 1e-5  # padding changes only rounding
    # the two samples of a group are different draws, and other seeds give other episodes
    assert all(g[0][0] != g[1][0] for g in both)
    other = run([p0, p1], [i0, i1], [6, 10])
    assert all(ep[0] != ep_other[0] for g, g_other in zip(both, other) for ep, ep_other in zip(g, g_other))
