"""The calculator env and the multi-turn contract: a hand-played episode, prefixes, rewards."""

from __future__ import annotations

import asyncio

import pytest

from relign.envs.calculator import CalculatorEnv, make_calculator_records, observe
from relign.envs.env import Env, check_step_result, initial_state


def run(coro):
    return asyncio.run(coro)


def test_two_turn_episode_by_hand():
    env = CalculatorEnv()
    assert isinstance(env, Env)
    info = {"answer": "1613"}
    state = run(initial_state(env, "Compute (37 * 48) - 163.\n", info))
    assert state == "Compute (37 * 48) - 163.\n"

    # turn 1: a tool call; the observation is appended after the action
    action = "First the product. <calc>(37 * 48) - 163</calc>"
    out, appended = check_step_result(run(env.step(state, action, info)), state, action)
    assert appended  # state + action is a prefix of next_state: the driver appends tokens only
    assert out == {
        "next_state": state + action + "<result>1613</result>\n",  # 37*48 = 1776, 1776-163 = 1613
        "reward": 0.0,
        "score": 0.0,
        "done": False,
        "extra_info": info,
    }

    # turn 2: the answer ends the episode
    state = out["next_state"]
    action = "So the answer is <answer>1613</answer>"
    out, appended = check_step_result(run(env.step(state, action, out["extra_info"])), state, action)
    assert appended and out["next_state"] == state + action
    assert (out["reward"], out["score"], out["done"]) == (1.0, 1.0, True)


@pytest.mark.parametrize(
    "action, done, reward",
    [
        ("<answer>1612</answer>", True, 0.0),  # wrong answer
        ("<answer>1613.0</answer>", True, 1.0),
        ("<answer>x</answer>", True, 0.0),
        ("<calc>1+1</calc> and <answer>1613</answer>", True, 1.0),  # the answer wins over a call
        ("I am not sure.", True, 0.0),  # neither tag: the episode ends unrewarded
    ],
)
def test_step_outcomes(action, done, reward):
    out, appended = check_step_result(run(CalculatorEnv().step("S:", action, {"answer": 1613})), "S:", action)
    assert appended and (out["done"], out["reward"], out["score"]) == (done, reward, reward)


@pytest.mark.parametrize(
    "expr, result",
    [
        ("7/2", "3.5"),
        ("-3 + 1", "-2"),
        ("1/3", "0.333333"),
        ("0.1 + 0.2", "0.3"),
        ("1/0", "error: division by zero"),
        ("__import__('os')", "error: Call is not allowed"),
        ("2 ** 1000000", "error: operator Pow is not allowed (only + - * /)"),
    ],
)
def test_tool_results(expr, result):
    assert observe(expr) == f"<result>{result}</result>\n"


def test_only_the_last_call_is_evaluated():
    out = run(CalculatorEnv().step("", "<calc>1+1</calc><calc>2*3</calc>", {"answer": 0}))
    assert out["next_state"].endswith("<result>6</result>\n") and out["done"] is False


def test_generated_records_are_deterministic_and_correct():
    recs = make_calculator_records(20, seed=3)
    assert recs == make_calculator_records(20, seed=3) and recs != make_calculator_records(20, seed=4)
    for rec in recs:
        expr, answer = rec["extra_info"]["expression"], rec["extra_info"]["answer"]
        assert f"Compute {expr}." in rec["prompt"] and "<calc>" in rec["prompt"]
        # solving it with the tool gives reward 1
        out = run(CalculatorEnv().step(rec["prompt"], f"<calc>{expr}</calc>", rec["extra_info"]))
        value = out["next_state"].rsplit("<result>", 1)[1].split("</result>")[0]
        assert float(value) == float(answer)  # the tool computes the record's answer
        assert run(CalculatorEnv().step(out["next_state"], f"<answer>{value}</answer>", rec["extra_info"]))["reward"] == 1.0
    chat = make_calculator_records(1, seed=3, chat=True)[0]
    assert chat["messages"] == [{"role": "user", "content": recs[0]["prompt"]}]


def test_check_step_result_rejects_broken_envs():
    good = {"next_state": "ab", "reward": 0.0, "score": 0.0, "done": False, "extra_info": {}}
    assert check_step_result(good, "a", "b")[1] is True
    assert check_step_result({**good, "next_state": "xb"}, "a", "b")[1] is False  # not a prefix: re-encode
    with pytest.raises(ValueError, match="lacks"):
        check_step_result({"next_state": "ab"}, "a", "b")
    with pytest.raises(ValueError, match="'reward' must be a finite number"):
        check_step_result({**good, "reward": float("nan")}, "a", "b")
    with pytest.raises(TypeError, match="'done' must be a bool"):
        check_step_result({**good, "done": 1}, "a", "b")


def test_reset_hook_is_used_when_defined():
    class WithReset:
        async def reset(self, extra_info):
            return f"Start {extra_info['n']}"

        async def step(self, state, action, extra_info):
            return {}

    assert run(initial_state(WithReset(), "ignored", {"n": 5})) == "Start 5"
