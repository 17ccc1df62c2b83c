"""Voting over sampled answers (relign.strategies.voting), against hand-computed values."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from relign.strategies.voting import argmax_index, maj_at_k, majority, vote, weighted_vote

# --------------------------------------------------------------------------- vote, majority, maj@k


def test_vote_clusters_skip_missing_answers():
    assert vote(["5", None, "7", "5", None, "7", "7"]) == [[0, 3], [2, 5, 6]]
    assert vote([None, None]) == []
    assert majority([[0, 3], [2, 5, 6]]) == [2, 5, 6]
    assert majority([[1], [0, 2], [3, 4]]) == [0, 2]  # a tie goes to the answer seen first
    assert majority([]) is None


def test_maj_at_k_hand_computed():
    answers = ["5", "7", "5", None]
    # k=4: "5" has 2 votes, "7" 1, None does not vote -> "5", which is wrong -> 0
    assert maj_at_k(answers, [False, True, False, False], 4) == 0.0
    # k=2: "5" and "7" tie 1-1 -> first seen "5" -> wrong -> 0; with "5" correct -> 1
    assert maj_at_k(answers, [False, True, False, False], 2) == 0.0
    assert maj_at_k(answers, [True, False, True, False], 2) == 1.0
    # k=1: the first sample alone
    assert maj_at_k(answers, [True, False, True, False], 1) == 1.0
    # missing answers do not vote: two Nones and one "7" -> "7"
    assert maj_at_k([None, None, "7"], [False, False, True], 3) == 1.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0  # nobody voted
    # only the first k samples vote: ["1", "2", "2"]: k=1 -> "1" (right), k=3 -> "2" (wrong)
    assert maj_at_k(["1", "2", "2"], [True, False, False], 1) == 1.0
    assert maj_at_k(["1", "2", "2"], [True, False, False], 3) == 0.0
    with pytest.raises(ValueError):
        maj_at_k(["1"], [True], 2)


def test_maj_at_k_uses_the_equivalence():
    same_number = lambda a, b: float(Fraction(a)) == float(Fraction(b))  # noqa: E731
    # "1/2", "0.5", "3": with string equality each has one vote -> "1/2" first-seen; with the
    # numeric check "1/2" and "0.5" form a cluster of 2 -> same answer, but now by count
    answers, correct = ["3", "1/2", "0.5"], [False, True, True]
    assert maj_at_k(answers, correct, 3) == 0.0  # string equality: 1-1-1 tie -> "3"
    assert maj_at_k(answers, correct, 3, same_number) == 1.0  # {1/2, 0.5} x2 beats "3"


# --------------------------------------------------------------------------- weighted majority


def test_weighted_vote_hand_computed():
    answers = ["5", "7", "5", "7", "7"]
    # "5": 0.75 + 0.5 = 1.25 beats "7": 0.25 + 0.25 + 0.125 = 0.625, though "7" has more votes
    assert weighted_vote(answers, [0.75, 0.25, 0.5, 0.25, 0.125]) == [0, 2]
    assert majority(vote(answers)) == [1, 3, 4]
    # equal weights: the plain majority
    assert weighted_vote(answers, [1.0] * 5) == [1, 3, 4]
    # "b": 0.5 (one sample) beats "a": 0.25 + 0.125 = 0.375 (two samples)
    assert weighted_vote(["a", "b", "a"], [0.25, 0.5, 0.125]) == [1]


def test_weighted_vote_ties_go_to_the_answer_seen_first():
    # "a": 0.25 + 0.25 = 0.5, "b": 0.5 -> tie -> "a" (first seen), whichever comes first in the cluster list
    assert weighted_vote(["a", "b", "a"], [0.25, 0.5, 0.25]) == [0, 2]
    assert weighted_vote(["b", "a", "a"], [0.5, 0.25, 0.25]) == [0]
    # all weights zero: every cluster ties at 0 -> the first answer
    assert weighted_vote(["x", "y", "y"], [0.0, 0.0, 0.0]) == [0]


def test_weighted_vote_missing_answers_and_weights():
    # a sample without an answer does not vote, whatever its weight
    assert weighted_vote([None, "x", "y"], [10.0, 0.25, 0.5]) == [2]
    # a weight of None (unscored sample) counts 0: "a" 0.25 vs "b" 0 + 0
    assert weighted_vote(["a", "b", "b"], [0.25, None, None]) == [0]
    # all weights None: every cluster is worth 0 -> the first answer
    assert weighted_vote(["a", "b", "b"], [None, None, None]) == [0]
    # NaN counts 0 too: "a" 0 vs "b" 0.125
    assert weighted_vote(["a", "b"], [math.nan, 0.125]) == [1]
    # no sample has an answer -> None
    assert weighted_vote([None, None], [1.0, 1.0]) is None
    assert weighted_vote([], []) is None


def test_weighted_vote_refuses_negative_weights_and_uses_the_equivalence():
    # summed negative scores would elect "b" (-0.5 > -1 + -1) though more samples agree on "a"
    with pytest.raises(ValueError, match="non-negative"):
        weighted_vote(["a", "b", "a"], [-1.0, -0.5, -1.0])
    same_number = lambda a, b: Fraction(a) == Fraction(b)  # noqa: E731
    answers, weights = ["1/2", "0.5", "3"], [0.375, 0.375, 0.625]
    assert weighted_vote(answers, weights) == [2]  # string equality: 0.375, 0.375, 0.625 -> "3"
    assert weighted_vote(answers, weights, same_number) == [0, 1]  # {1/2, 0.5}: 0.75 beats "3": 0.625


def test_weighted_vote_needs_one_weight_per_answer():
    with pytest.raises(ValueError, match="one weight per answer"):
        weighted_vote(["a", "b"], [1.0])


def test_weighted_vote_with_unit_weights_is_the_majority():
    rng = random.Random(0)
    for _ in range(200):
        answers = [rng.choice(["a", "b", "c", None]) for _ in range(rng.randint(0, 9))]
        assert weighted_vote(answers, [1.0] * len(answers)) == majority(vote(answers))


# --------------------------------------------------------------------------- argmax (best-of-N)


def test_argmax_index_hand_computed():
    assert argmax_index([0.1, 0.9, 0.3]) == 1
    assert argmax_index([0.5, 0.9, 0.9]) == 1  # a tie goes to the first
    assert argmax_index([0.9, 0.9]) == 0
    assert argmax_index([-3.0, -1.0, -2.0]) == 1
    assert argmax_index([1, 3, 2]) == 1  # integers too


def test_argmax_index_skips_missing_scores():
    assert argmax_index([None, 0.2, None]) == 1
    assert argmax_index([None, -5.0]) == 1  # a negative score still beats no score
    assert argmax_index([math.nan, 0.1]) == 1 and argmax_index([0.1, math.nan, 0.05]) == 0
    assert argmax_index([None, None]) is None
    assert argmax_index([math.nan]) is None
    assert argmax_index([]) is None
