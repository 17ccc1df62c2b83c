"""Linguistic calibration's scoring rules and calibration measures: hand values and propriety."""

from __future__ import annotations

import math

import pytest

from relign.algorithms.scoring import (
    brier, brier_score, ece, lc_reward, log_score, normalization_penalty, reliability_bins
)


def test_log_score_hand_values_and_clip():
    assert log_score(0.5) == pytest.approx(-0.6931471806)
    assert log_score(1.0) == 0.0
    assert log_score(0.0) == pytest.approx(-9.2103403720)  # log 1e-4: the clip's floor
    assert log_score(1e-9, eps=1e-2) == pytest.approx(math.log(0.01))
    assert log_score(1.3) == 0.0  # clipped to 1 from above


def test_brier_score_hand_values():
    # -( (0.7 - 1)^2 + (0.3 - 0)^2 ) = -(0.09 + 0.09)
    assert brier_score({"a": 0.7, "b": 0.3}, "a") == pytest.approx(-0.18)
    # a truth the forecast leaves out: f_y = 0 adds (0 - 1)^2 = 1: -(0.49 + 0.09 + 1)
    assert brier_score({"a": 0.7, "b": 0.3}, "c") == pytest.approx(-1.58)
    assert brier_score({"a": 1.0}, "a") == 0.0


def test_normalization_penalty():
    assert normalization_penalty([0.6, 0.6], 5.0) == pytest.approx(1.0)  # 5 * |1.2 - 1|
    assert normalization_penalty([0.25, 0.25], 2.0) == pytest.approx(1.0)  # 2 * |0.5 - 1|
    assert normalization_penalty([], 5.0) == 5.0  # "No Answer" sums to 0
    assert normalization_penalty([0.3, 0.7], 5.0) == pytest.approx(0.0, abs=1e-12)  # a normalized forecast is free


def test_lc_reward_matches_the_reference_formula():
    # gold forecast 0.6; extracted answers (gold first, another) forecast 0.6 and 0.6
    r = lc_reward(0.6, [0.6, 0.6], true_index=0, rule="log", eps=1e-4, lam=5.0, offset=5.0)
    assert r["lc_log"] == pytest.approx(-0.5108256238)  # log 0.6
    assert r["lc_norm_penalty"] == pytest.approx(1.0)
    assert r["reward"] == pytest.approx(-0.5108256238 - 1.0 + 5.0)
    # Brier over {gold} U extracted: -(1 - 0.6)^2 - 0.6^2 = -0.52
    b = lc_reward(0.6, [0.6, 0.6], true_index=0, rule="brier", lam=5.0, offset=5.0)
    assert b["lc_brier"] == pytest.approx(-0.52) and b["reward"] == pytest.approx(3.48)
    # the gold answer not extracted: its own forecast still scores, every extracted one is "other"
    b2 = lc_reward(0.1, [0.9], true_index=None, rule="brier", lam=0.0, offset=0.0)
    assert b2["reward"] == pytest.approx(-(0.9**2) - 0.81)
    # the clip: a zero forecast costs log 1e-4, and "No Answer" pays lam
    z = lc_reward(0.0, [], rule="log", lam=5.0, offset=5.0)
    assert z["reward"] == pytest.approx(math.log(1e-4) - 5.0 + 5.0)
    # a response that never stopped: the fixed penalty, nothing else
    u = lc_reward(0.9, [0.9, 0.1], true_index=0, finished=False, unfinished_reward=-1.0)
    assert u["reward"] == -1.0 and u["lc_unfinished"] == 1.0
    with pytest.raises(ValueError, match="scoring rule"):
        lc_reward(0.5, [0.5], rule="spherical")


@pytest.mark.parametrize("rule", ["log", "brier"])
def test_propriety_expected_reward_peaks_at_the_true_probability(rule):
    """Binary question, stated p for answer A and 1 - p for B, truth A with probability q:
    E_{y ~ q}[R(p, y)] over a grid of p has its argmax at p = q (the rule is strictly proper)."""
    grid = [k / 100 for k in range(1, 100)]
    for q10 in range(1, 10):
        q = q10 / 10

        def expected(p):
            r_a = lc_reward(p, [p, 1 - p], true_index=0, rule=rule)["reward"]
            r_b = lc_reward(1 - p, [p, 1 - p], true_index=1, rule=rule)["reward"]
            return q * r_a + (1 - q) * r_b

        best = max(grid, key=expected)
        assert best == pytest.approx(q), (rule, q, best)


def test_ece_and_brier_hand_values():
    conf = [0.2, 0.2, 0.8, 0.8]
    correct = [0, 1, 1, 1]
    # bin [0.2, 0.3): conf 0.2, acc 0.5 -> 0.3 * 2/4; bin [0.8, 0.9): conf 0.8, acc 1 -> 0.2 * 2/4
    assert ece(conf, correct) == pytest.approx(0.25)
    # (0.04 + 0.64 + 0.04 + 0.04) / 4
    assert brier(conf, correct) == pytest.approx(0.19)
    bins = reliability_bins(conf, correct, bins=10)
    assert [b.count for b in bins] == [0, 0, 2, 0, 0, 0, 0, 0, 2, 0]
    assert bins[2].accuracy == 0.5 and bins[8].confidence == pytest.approx(0.8)
    # 1.0 lands in the last bin, 0.0 in the first
    edge = reliability_bins([0.0, 1.0], [0, 1], bins=4)
    assert [b.count for b in edge] == [1, 0, 0, 1]
    assert ece([0.0, 1.0], [0, 1], bins=4) == 0.0
    assert ece([], []) == 0.0
    with pytest.raises(ValueError, match="outside"):
        ece([1.5], [1])
