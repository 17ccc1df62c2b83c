"""Scorers (relign.strategies.scorers): the task's rule (in process and through a RewardPool),
load_scorer's errors, and the learned scorers (PRM, verifier, reward model) on the tiny
offline model with its locally trained tokenizer."""

from __future__ import annotations

import math
import dataclasses

import pytest
import torch

from relign.envs.rewards import RewardPool
from relign.strategies.scorers import (
    SCORERS,
    PRMScorer,
    RewardModelScorer,
    Scorer,
    TaskRuleScorer,
    VerifierScorer,
    load_scorer,
)

from .fake_tree_engine import fake_task

def raising_reward(prompt: str, response: str, extra_info: dict, **kw) -> float:
    """A reward that raises on responses holding "boom" (loaded by spec from this module)."""
    if "boom" in response:
        raise RuntimeError("boom")
    return 1.0 if response.strip().endswith(extra_info["answer"]) else 0.0


def dict_reward(prompt: str, response: str, extra_info: dict, **kw) -> dict:
    """A shaped reward: the scorer reads its correctness ``score``, not the shaped ``reward``."""
    ok = float(response.strip().endswith(extra_info["answer"]))
    return {"reward": ok + 0.25, "score": ok}


def _task(reward_spec: str):
    return dataclasses.replace(fake_task(), reward_spec=reward_spec)


# --------------------------------------------------------------------------- the task's rule


def test_rule_scorer_one_score_per_solution_from_the_reward():
    scorer = TaskRuleScorer(fake_task())
    assert isinstance(scorer, Scorer)
    assert scorer.needs_reference  # the toy reward reads the gold answer
    infos = [{"answer": "A0"}] * 3
    got = scorer.score(["Q0:", "Q1:", "Q2:"], [["s0.\n", "s1.#### A0"], ["s2.\n", "s0.#### A1"], ["s0.\n"]], infos)
    assert got == [[1.0], [0.0], [0.0]]  # terminal only: one score, from the joined steps
    assert scorer.errors == 0
    assert not TaskRuleScorer(dataclasses.replace(fake_task(), reward_needs_reference=False)).needs_reference


def test_rule_scorer_reads_the_score_field():
    scorer = TaskRuleScorer(_task("tests.strategies.test_scorers:dict_reward"))
    assert scorer.score(["q", "q"], [["x = ", "5"], ["x = 4"]], [{"answer": "5"}] * 2) == [[1.0], [0.0]]


def test_rule_scorer_a_raising_reward_scores_zero_and_is_counted():
    scorer = TaskRuleScorer(_task("tests.strategies.test_scorers:raising_reward"))
    got = scorer.score(["q"] * 4, [["a\n", "5"], ["boom"], ["7"], ["boom", "5"]], [{"answer": "5"}] * 4)
    assert got == [[1.0], [0.0], [0.0], [0.0]]
    assert scorer.errors == 2


def test_rule_scorer_with_a_reward_pool():
    spec = "tests.strategies.test_scorers:raising_reward"
    with RewardPool(spec, num_workers=0) as pool:
        scorer = TaskRuleScorer(_task(spec), pool)
        got = scorer.score(["q"] * 3, [["5"], ["boom"], ["1", "2"]], [{"answer": "5"}] * 3)
        assert got == [[1.0], [0.0], [0.0]]
        assert pool.stats["calls"] == 3 and pool.stats["exceptions"] == 1  # the pool scored them
        assert scorer.errors == 0  # the pool counts its own failures
    # load_scorer passes the pool through
    with RewardPool(spec, num_workers=0) as pool:
        scorer = load_scorer("rule", task=_task(spec), pool=pool)
        assert scorer.pool is pool
        assert scorer.score(["q"], [["5"]], [{"answer": "5"}]) == [[1.0]]


# --------------------------------------------------------------------------- load_scorer errors


def test_load_scorer_errors(tmp_path):
    with pytest.raises(ValueError) as e:
        load_scorer("nope")
    for name in SCORERS:
        assert name in str(e.value)
    missing = tmp_path / "no_such_scorer"
    for name in ("verifier", "rm", "prm"):
        with pytest.raises(FileNotFoundError, match="no_such_scorer"):
            load_scorer(name, path=str(missing))
        with pytest.raises(ValueError, match="scorer_path"):
            load_scorer(name)
    with pytest.raises(ValueError, match="task"):
        load_scorer("rule")
    assert isinstance(load_scorer("rule", task=fake_task()), TaskRuleScorer)


# --------------------------------------------------------------------------- learned scorers on the tiny model


def _one_token(tok, candidates):
    for s in candidates:
        if len(tok(s, add_special_tokens=False)["input_ids"]) == 1:
            return s
    raise AssertionError(f"none of {candidates} is one token")


@pytest.fixture(scope="module")
def prm(tiny_model_dir, tokenizer):
    tag = _one_token(tokenizer, ["@", "~", "|", "^"])
    good = _one_token(tokenizer, ["+", "Yes"])
    bad = _one_token(tokenizer, ["-", "No"])
    return PRMScorer(str(tiny_model_dir), step_tag=tag, good_token=good, bad_token=bad, batch_size=2)


PROBLEMS = ["What is 3 + 4 times 2?", "Janet has 5 apples and buys 2 more. How many?"]
STEPS = [["First, 4 * 2 = 8.\n", "Then 3 + 8 = 11.\n", "#### 11"],
         ["5 + 2 = 7.\n\n", "#### 7\n"]]


def test_prm_one_score_per_step_in_unit_interval(prm):
    got = prm.score(PROBLEMS, STEPS)
    assert [len(g) for g in got] == [len(s) for s in STEPS]
    assert all(0.0 <= x <= 1.0 for g in got for x in g)
    assert prm.needs_reference is False


def test_prm_puts_the_tag_after_each_step(prm):
    tok = prm.tok
    for problem, steps in zip(PROBLEMS, STEPS):
        ids, tags = prm.encode(problem, steps)
        assert len(tags) == len(steps)
        assert [ids[t] for t in tags] == [prm.tag_id] * len(steps)
        assert sum(i == prm.tag_id for i in ids) == len(steps)  # no tag anywhere else
        # between two tags: the step's text (its trailing whitespace after the tag)
        starts = [len(tok(problem + " ", add_special_tokens=True)["input_ids"]), *[t + 1 for t in tags[:-1]]]
        for s, start, t in zip(steps, starts, tags):
            assert tok.decode(ids[start:t]).strip() == s.strip()
        # the whitespace a step ends with follows its tag
        for s, t, nxt in zip(steps, tags, [*tags[1:], len(ids)]):
            after = tok.decode(ids[t + 1 : nxt])
            assert after.startswith(s[len(s.rstrip()):])


def test_prm_score_is_p_good_at_each_tag(prm):
    got = prm.score(PROBLEMS, STEPS)
    for problem, steps, g in zip(PROBLEMS, STEPS, got):  # one row, no padding
        ids, tags = prm.encode(problem, steps)
        with torch.no_grad():
            logits = prm.model(input_ids=torch.tensor([ids])).logits[0].float()
        pair = torch.softmax(logits[:, [prm.good_id, prm.bad_id]], dim=-1)[:, 0]
        assert g == pytest.approx([pair[t].item() for t in tags], abs=1e-5)


def test_prm_multi_token_tag_raises(tiny_model_dir, tokenizer):
    tag = " ки"
    assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) > 1
    with pytest.raises(ValueError, match="step_tag"):
        PRMScorer(str(tiny_model_dir), step_tag=tag, good_token="+", bad_token="-")
    with pytest.raises(ValueError, match="good_token"):
        PRMScorer(str(tiny_model_dir), step_tag="@", good_token="кошка", bad_token="-")


def test_verifier_scorer_one_score_per_solution(tiny_model_dir):
    scorer = VerifierScorer(str(tiny_model_dir), batch_size=2)
    assert scorer.needs_reference is False
    got = scorer.score(PROBLEMS, STEPS)
    assert [len(g) for g in got] == [1, 1]
    assert all(0.0 < g[0] < 1.0 for g in got)
    # the verifier reads the joined steps
    want = scorer.inner.score(PROBLEMS, ["".join(s) for s in STEPS])
    assert [g[0] for g in got] == pytest.approx(want, abs=1e-6)
    assert isinstance(load_scorer("verifier", path=str(tiny_model_dir)), type(scorer))


def test_reward_model_scorer_one_score_per_solution(tiny_model_dir, tokenizer, tmp_path):
    from relign.models.reward import load_reward_model

    rm = load_reward_model(str(tiny_model_dir), pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    torch.nn.init.normal_(rm.score.weight, std=0.5)  # a fresh head is zero: give it a ranking
    rm_dir = tmp_path / "rm"
    rm.save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    scorer = RewardModelScorer(str(rm_dir), batch_size=2)
    got = scorer.score(PROBLEMS + PROBLEMS[:1], STEPS + [["something else entirely"]])
    assert [len(g) for g in got] == [1, 1, 1]
    assert len({g[0] for g in got}) == 3  # a real ranking, not the zero head
    # sigma(r): the Bradley-Terry probability of beating a response of reward 0 (weights a vote can sum)
    want = [1 / (1 + math.exp(-r)) for r in scorer.inner.score(PROBLEMS, ["".join(s) for s in STEPS])]
    assert [g[0] for g in got[:2]] == pytest.approx(want, abs=1e-6)
    again = load_scorer("rm", path=str(rm_dir)).score(PROBLEMS, STEPS)
    assert [g[0] for g in again] == pytest.approx([g[0] for g in got[:2]], abs=1e-5)
