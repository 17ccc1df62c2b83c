"""Voting over sampled answers: clusters, the majority, maj@k, weighted majority, argmax.

Pure functions over a problem's samples (their extracted final answers, and optionally a
weight or score per sample); the eval loop (``relign.evaluate``) and the search strategies
share them. Answers are compared by the task's own equivalence (``Task.answers_equal``),
passed as ``equal``; a sample without an answer (None) never votes.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence


def vote(answers: Sequence[str | None], equal: Callable[[str, str], bool] = operator.eq) -> list[list[int]]:
    """Group samples by answer: clusters of sample indices, in the order each answer first appears.

    A sample without an answer (None) does not vote. A new answer joins the first cluster whose
    first answer it equals (``equal(first, new)``), so an equivalence that is not transitive
    still gives a well-defined grouping.
    """
    clusters: list[list[int]] = []
    for i, a in enumerate(answers):
        if a is None:
            continue
        for cluster in clusters:
            if equal(answers[cluster[0]], a):
                cluster.append(i)
                break
        else:
            clusters.append([i])
    return clusters


def majority(clusters: list[list[int]]) -> list[int] | None:
    """The largest cluster; a tie goes to the answer seen first (``max`` keeps the first maximum)."""
    return max(clusters, key=len) if clusters else None


def maj_at_k(
    answers: Sequence[str | None], correct: Sequence[bool], k: int, equal: Callable[[str, str], bool] = operator.eq
) -> float:
    """maj@k of one problem: 1.0 if the majority answer among the first ``k`` samples is correct.

    The majority answer is correct when the first sample that gave it is (all samples of a
    cluster give the same answer). No sample with an answer: 0.
    """
    if not 1 <= k <= len(answers) or len(correct) != len(answers):
        raise ValueError(f"maj@k needs 1 <= k <= len(answers) and one correctness per answer, got k={k}, "
                         f"{len(answers)} answers, {len(correct)} correctness values")
    winner = majority(vote(answers[:k], equal))
    return float(bool(correct[winner[0]])) if winner else 0.0


def _weight(w: float | None) -> float:
    """A sample's weight in a vote: None (no score) and NaN count 0."""
    return 0.0 if w is None or math.isnan(w) else float(w)


def weighted_vote(
    answers: Sequence[str | None], weights: Sequence[float | None], equal: Callable[[str, str], bool] = operator.eq
) -> list[int] | None:
    """Weighted majority voting: the cluster (as ``vote`` groups them) whose summed weight is largest.

    Each sample votes for its answer with its weight, typically a verifier's or a process
    reward model's score of the whole solution, instead of one vote each: Uesato et al. (2022),
    "Solving math word problems with process- and outcome-based feedback" (reward-model-weighted
    majority voting), and Li et al. (2023), "Making Language Models Better Reasoners with
    Step-Aware Verifier" (DIVERSE), which weighs each sampled reasoning path by its verifier's
    score (PRM-weighted voting). With equal positive weights it is
    ``majority(vote(answers, equal))``.

    A weight of None (the sample was not scored) or NaN counts 0. A tie goes to the answer seen
    first. None when no sample has an answer. Weights must be non-negative (a probability-like
    score: a verifier's P(Yes), a PRM's step probability, sigma of a reward model's r): summed
    negative weights elect the answer fewer samples agree on ([-1.2, -0.9, -1.0, -1.1] for one
    answer lose to [-0.8] for another), so a negative weight is an error, not a vote.
    """
    if len(weights) != len(answers):
        raise ValueError(f"weighted_vote needs one weight per answer, got {len(answers)} answers and {len(weights)} weights")
    negative = [w for w in weights if w is not None and w < 0]
    if negative:
        raise ValueError(f"weighted_vote needs non-negative weights (a probability-like score), got {negative[0]:g}: "
                         "map an unbounded score (a reward model's r) through a sigmoid first")
    best: list[int] | None = None
    best_total = 0.0
    for cluster in vote(answers, equal):
        total = sum(_weight(weights[i]) for i in cluster)
        if best is None or total > best_total:
            best, best_total = cluster, total
    return best


def argmax_index(scores: Sequence[float | None]) -> int | None:
    """Index of the largest score (best-of-N): the first one on a tie; None and NaN scores are
    skipped; None when no score is left."""
    best: int | None = None
    for i, s in enumerate(scores):
        if s is None or math.isnan(s):
            continue
        if best is None or s > scores[best]:
            best = i
    return best


__all__ = ["argmax_index", "maj_at_k", "majority", "vote", "weighted_vote"]
