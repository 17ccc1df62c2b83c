"""Proper scoring rules and calibration measures for linguistic calibration (Band et al.,
"Linguistic Calibration of Long-Form Generations", arXiv 2404.00474).

A reader turns a paragraph z into a forecast f(x, z) over the answers to a question x; the
paragraph is linguistically calibrated when those forecasts are calibrated. Training maximizes a
strictly proper scoring rule of the forecast of the true answer y:

    log score      S_log(f, y)   = log clip(f_y, eps, 1)                              (eps = 1e-4)
    Brier score    S_brier(f, y) = -sum_a (f_a - 1[a = y])^2
    normalization  P(f)          = lam * |sum_{a in extracted} f_a - 1|               (lam = 5)
    reader reward  R(z)          = S(f, y) - P(f) + offset                            (offset = 5)
                                 = unfinished_reward                 if z never stopped (-1)

(the reference code's ``compute_cross_entropy``, ``compute_answer_extractor_normalization``,
``reward_offset`` and ``penalty_reward_value``). The forecaster scores each answer on its own
(sigma(logit) per answer), so nothing makes the forecasts sum to 1: the penalty does, and the
offset keeps PPO's value targets away from the clipped log's floor.

Evaluation measures calibration of a confidence c_i against correctness o_i in {0, 1}:

    ECE   = sum_b (n_b / N) |acc_b - conf_b|     equal-width bins [k/B, (k+1)/B), the last closed
    Brier = (1/N) sum_i (c_i - o_i)^2

where (c_i, o_i) is the reader's top answer: its forecast and whether it is the gold one, and a
paragraph the reader extracts no answer from counts as (1, 0), confident and wrong (``top_answer``:
the worst case for both accuracy and ECE, as the reference's ``process_eval_results.py`` scores an
empty extraction). Read as (0, 0), an abstention would be a perfectly calibrated point, and
abstaining would lower ECE and Brier.

Pure functions of floats: no torch, no config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

RULES = ("log", "brier")


def log_score(p_true: float, eps: float = 1e-4) -> float:
    """S_log = log clip(p_true, eps, 1): the log of the forecast of the true answer, floored at
    log eps so that a forecast of 0 costs a finite log(1e-4) = -9.21 (the reference's epsilon)."""
    return math.log(min(max(float(p_true), eps), 1.0))


def brier_score(forecast: Mapping[str, float], truth: str) -> float:
    """S_brier = -sum_a (f_a - 1[a = y])^2 over the answers of ``forecast``; a truth the forecast
    does not name counts as f_y = 0 (a term of -1). 0 is perfect, -2 the worst a distribution gets."""
    total = sum((f - (1.0 if a == truth else 0.0)) ** 2 for a, f in forecast.items())
    if truth not in forecast:
        total += 1.0
    return -total


def normalization_penalty(forecasts: Sequence[float], lam: float) -> float:
    """P = lam * |sum_a f_a - 1| over the forecasts of the extracted answers. An empty extraction
    ("No Answer") sums to 0 and pays lam: abstaining is not free, as in the reference."""
    return lam * abs(sum(float(f) for f in forecasts) - 1.0)


def lc_reward(forecast_true: float, forecasts_extracted: Sequence[float], *, true_index: int | None = None,
              rule: str = "log", eps: float = 1e-4, lam: float = 5.0, offset: float = 5.0, finished: bool = True,
              unfinished_reward: float = -1.0) -> dict[str, float]:
    """The reader reward R = S(f, y) - lam |sum_a f_a - 1| + offset of one paragraph.

    ``forecast_true``: the reader's forecast of the gold answer (the reference's first reader row,
    always the gold answer, whether or not it was extracted). ``forecasts_extracted``: one forecast
    per deduplicated extracted answer; ``true_index`` is the position of the gold answer among them
    (None: not extracted). The Brier rule scores the forecast over {gold} U extracted:
    -(1 - f_y)^2 - sum_{a != y} f_a^2. A paragraph that did not stop gets ``unfinished_reward`` and
    nothing else (the reference's ``penalty_reward_value``).

    Returns ``{"reward", "lc_<rule>", "lc_norm_penalty", "lc_forecast", "lc_unfinished"}``."""
    if rule not in RULES:
        raise ValueError(f"unknown scoring rule {rule!r} (log or brier)")
    if not finished:
        return {"reward": float(unfinished_reward), f"lc_{rule}": 0.0, "lc_norm_penalty": 0.0,
                "lc_forecast": float(forecast_true), "lc_unfinished": 1.0}
    if rule == "log":
        s = log_score(forecast_true, eps)
    else:
        others = {f"_{i}": float(f) for i, f in enumerate(forecasts_extracted) if i != true_index}
        s = brier_score({**others, "_y": float(forecast_true)}, "_y")
    pen = normalization_penalty(forecasts_extracted, lam)
    return {"reward": s - pen + offset, f"lc_{rule}": s, "lc_norm_penalty": pen, "lc_forecast": float(forecast_true),
            "lc_unfinished": 0.0}


NO_ANSWER_POINT = (1.0, 0.0)
"""(confidence, correct) of a paragraph with no extracted answer: the reference's worst case."""


def top_answer(forecasts: Sequence[float], correct: Sequence[bool]) -> tuple[float, float, bool]:
    """(confidence, correct, answered) of a reader's top answer: the largest forecast among the
    extracted answers (the first on a tie), clipped to [0, 1], and whether that answer is right.
    No extracted answer gives ``NO_ANSWER_POINT`` and answered = False."""
    if len(forecasts) != len(correct):
        raise ValueError(f"{len(forecasts)} forecasts but {len(correct)} correctness flags")
    if not forecasts:
        return (*NO_ANSWER_POINT, False)
    top = max(range(len(forecasts)), key=lambda j: forecasts[j])
    return min(max(float(forecasts[top]), 0.0), 1.0), float(bool(correct[top])), True


@dataclass(frozen=True)
class Bin:
    """One bin of a reliability diagram: confidences in [lo, hi), how many, their mean, the accuracy."""

    lo: float
    hi: float
    count: int
    confidence: float
    accuracy: float


def reliability_bins(conf: Sequence[float], correct: Sequence[float], bins: int = 10) -> list[Bin]:
    """The ``bins`` equal-width bins of [0, 1] (c = 1 falls in the last), each with its count,
    mean confidence and accuracy (0 and 0 for an empty bin)."""
    if len(conf) != len(correct):
        raise ValueError(f"{len(conf)} confidences but {len(correct)} outcomes")
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    sums = [[0, 0.0, 0.0] for _ in range(bins)]
    for c, o in zip(conf, correct):
        c = float(c)
        if not 0.0 <= c <= 1.0:
            raise ValueError(f"confidence {c} outside [0, 1]")
        k = min(int(c * bins), bins - 1)
        sums[k][0] += 1
        sums[k][1] += c
        sums[k][2] += float(o)
    return [Bin(k / bins, (k + 1) / bins, n, s / n if n else 0.0, a / n if n else 0.0)
            for k, (n, s, a) in enumerate(sums)]


def ece(conf: Sequence[float], correct: Sequence[float], bins: int = 10) -> float:
    """ECE = sum_b (n_b / N) |acc_b - conf_b| over equal-width bins (0 for no data)."""
    n = len(conf)
    if n == 0:
        return 0.0
    return sum(b.count / n * abs(b.accuracy - b.confidence) for b in reliability_bins(conf, correct, bins))


def brier(conf: Sequence[float], correct: Sequence[float]) -> float:
    """Brier = (1/N) sum_i (c_i - o_i)^2 of confidences against 0/1 outcomes (0 for no data)."""
    if len(conf) != len(correct):
        raise ValueError(f"{len(conf)} confidences but {len(correct)} outcomes")
    if not conf:
        return 0.0
    return sum((float(c) - float(o)) ** 2 for c, o in zip(conf, correct)) / len(conf)


__all__ = ["NO_ANSWER_POINT", "RULES", "Bin", "brier", "brier_score", "ece", "lc_reward", "log_score",
           "normalization_penalty", "reliability_bins", "top_answer"]
