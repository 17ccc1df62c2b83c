"""A weighted vote counts non-negative weights (relign.strategies: weighted_majority, step_beam
select=weighted_vote, mcts answer=weighted_vote all call voting.weighted_vote).

The promise: each sample votes for its answer with a probability-like weight, so four samples
agreeing on an answer with weight sigma(r) ~ 0.25 each outvote one sample with ~0.31. A reward
model's raw Bradley-Terry scores are unbounded and often negative; summed as they are, they elect
the answer fewer samples agree on. The test scores five samples with a reward model whose raw
scores it fixes, and works out the winner itself from sigma of those scores."""

from __future__ import annotations

import math

import pytest

from relign.envs.tasks import Problem
from relign.rollout.engine import Completion
from relign.strategies import scorers
from relign.strategies.base import Budget
from relign.strategies.registry import make_strategy
from relign.strategies.voting import weighted_vote

ANSWERS = ["18", "18", "18", "18", "7"]
RAW = [-1.2, -0.9, -1.0, -1.1, -0.8]  # the reward model's r(x, y) of each sample


class _Task:
    """The least a search reads of a task: an answer extractor and (no) equivalence."""

    name, answer_marker, equal_spec, reward_needs_reference = "toy", None, None, False

    def extract_answer(self, text: str, extra_info: dict) -> str | None:
        return text.split("answer ")[-1]

    def answers_equal(self, a: str, b: str) -> bool:
        return a == b


class _Engine:
    def generate(self, prompts, params, *, seeds=None):
        return [[Completion([10 + j], [-1.0], "stop", f"sample {j} answer {ANSWERS[j]}") for j in range(params.n)]
                for _ in prompts]


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=False):  # the scorer reads the response's steps' text
        return "".join(f"<{i}>" for i in ids)


class _RawRewardModel:
    """Stands in for models.reward.RewardModelScorer: the raw r of each sample, by its text."""

    def __init__(self, path, **kwargs):
        pass

    def score(self, problems, responses):
        return [RAW[int(r.strip("<>")) - 10] for r in responses]


def _sigmoid(r: float) -> float:
    return 1 / (1 + math.exp(-r))


def test_weighted_majority_with_a_reward_model_elects_the_answer_its_probabilities_favour(monkeypatch):
    monkeypatch.setattr(scorers.reward_models, "RewardModelScorer", _RawRewardModel)
    scorer = scorers.RewardModelScorer("rm")
    problems = [Problem(0, [1, 2], "Q", "Q", {})]
    strategy = make_strategy("weighted_majority", _Tokenizer(), round_size=5, max_new_tokens=4)
    [result] = strategy.search(_Engine(), _Task(), problems, budget=Budget(max_samples=5), scorer=scorer)

    totals: dict[str, float] = {}
    for a, r in zip(ANSWERS, RAW):
        totals[a] = totals.get(a, 0.0) + _sigmoid(r)
    expected = max(totals, key=totals.get)
    assert expected == "18" and sum(RAW[:4]) < RAW[4]  # raw sums would elect "7": the case is the reversal
    assert result.answer == expected
    weights = [c.score for c in result.candidates]
    assert weights == pytest.approx([_sigmoid(r) for r in RAW]) and min(weights) >= 0


def test_a_negative_weight_is_refused_not_summed():
    with pytest.raises(ValueError, match="non-negative"):
        weighted_vote(ANSWERS, RAW)
    assert weighted_vote(ANSWERS, [_sigmoid(r) for r in RAW]) == [0, 1, 2, 3]
    assert weighted_vote(["a", "b"], [None, float("nan")]) == [0]  # unscored samples still count 0


class _RecordingScorer:
    """A user's scorer: what it reads of each problem's extra_info (which holds the gold answer)."""

    needs_reference = False  # it says it does not need the answer ...

    def __init__(self):
        self.seen: list[dict] = []

    def score(self, problems, steps, extra_infos=None):
        self.seen += list(extra_infos or [])  # ... but it could read one it was given
        return [[0.5] for _ in steps]


@pytest.mark.parametrize("allow_reference", [False, True])
def test_a_scorer_sees_the_gold_answer_only_when_the_search_may_read_it(allow_reference):
    problems = [Problem(0, [1, 2], "Q", "Q", {"answer": "18"})]
    scorer = _RecordingScorer()
    strategy = make_strategy("best_of_n", _Tokenizer(), round_size=5, max_new_tokens=4, allow_reference=allow_reference)
    strategy.search(_Engine(), _Task(), problems, budget=Budget(max_samples=5), scorer=scorer)
    assert len(scorer.seen) == 5
    assert all(info == ({"answer": "18"} if allow_reference else {}) for info in scorer.seen)
