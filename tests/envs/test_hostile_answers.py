"""Hostile answers: every grader says False, fast, executes nothing, and never prints the answer."""

from __future__ import annotations

import logging
import os
import re
import time

import pytest

from relign.envs import arith, countdown, gsm8k
from relign.envs import math as math_task

MEGA = "9" * 1_000_000
# What a model (or an attacker writing the data a model copies) can put where an answer goes.
HOSTILE = [
    "__import__('os').system('touch /tmp/relign-pwned')",
    "9**9**9**9",
    "9^{9^{9^9}}",
    "100000000!",
    MEGA,
    "(" * 10_000 + "1" + ")" * 10_000,
    "\\frac{" * 5_000 + "1" + "}{2}" * 5_000,
    "{9^9}^{9^9}",
    "10^{-100000000}",
    "(10^9)!",
    "\\binom{100000}{50000}",
]
# Each grader's answer slot, and extra_info whose answer a hostile string can never equal.
GRADERS = {
    "gsm8k": (gsm8k.reward, lambda a: f"The answer is\n#### {a}", {"answer": "5"}),
    "arith": (arith.reward, lambda a: f"#### {a}", {"answer": 5}),
    "countdown": (countdown.reward, lambda a: f"<answer>{a}</answer>", {"nums": [1, 2, 3], "target": 6}),
    "math": (math_task.reward, lambda a: f"so \\boxed{{{a}}}", {"answer": "5"}),
}


@pytest.fixture
def no_exec(monkeypatch):
    """Any attempt to run a command fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a grader tried to run {args!r}")

    for name in ("system", "popen", "execv", "execve"):
        monkeypatch.setattr(os, name, refuse)


@pytest.mark.parametrize("name", sorted(GRADERS))
def test_hostile_answers_are_wrong_fast_and_never_run(name, no_exec):
    reward, slot, info = GRADERS[name]
    t0 = time.perf_counter()
    for answer in HOSTILE:
        for response in (slot(answer), answer):  # in the answer slot, and as the whole response
            out = reward("prompt", response, info, format_weight=0.0)
            assert out["score"] == 0.0 and out["reward"] == 0.0, (name, answer[:40])
    # a generous bound, not a benchmark: one sympy timeout alone would take 5 s
    assert time.perf_counter() - t0 < 10


def test_math_refuses_costly_answers_before_math_verify(monkeypatch):
    import math_verify

    def no_parse(*args, **kwargs):
        raise AssertionError(f"math_verify saw {str(args)[:60]}")

    monkeypatch.setattr(math_verify, "parse", no_parse)
    monkeypatch.setattr(math_verify, "verify", no_parse)
    for answer in HOSTILE[1:]:  # all but __import__ (harmless LaTeX to math_verify: a plain 0)
        assert math_task.answer_problem(answer) is not None, answer[:40]
        assert not math_task.is_correct(f"\\boxed{{{answer}}}", "5")


def test_math_never_reaches_a_timeout_on_the_hostile_set(caplog):
    # math_verify logs "Timeout during parsing/comparison" when its alarm fires: none may appear
    with caplog.at_level(logging.WARNING, logger="math_verify"):
        for answer in HOSTILE:
            assert not math_task.is_correct(f"\\boxed{{{answer}}}", "5")
    assert not [r for r in caplog.records if "Timeout" in r.getMessage()]


def test_ordinary_math_answers_still_graded():
    # the bounds let real answers through: powers, factorials, binomials and matrices of normal size
    assert math_task.answer_problem("2^{10}") is None and math_task.is_correct("\\boxed{2^{10}}", "1024")
    assert math_task.answer_problem("5!") is None and math_task.is_correct("\\boxed{5!}", "120")
    assert math_task.answer_problem("\\binom{6}{2}") is None and math_task.is_correct("\\boxed{\\binom{6}{2}}", "15")
    assert math_task.answer_problem("(n+1)!") is None and math_task.answer_problem("e^{x^2}") is None
    assert math_task.answer_problem("10,\\!080") is None  # "\!" is a LaTeX space, not a factorial
    assert math_task.answer_problem("\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}") is None
    assert math_task.answer_problem("1" * 301) == "longer than 300 characters"
    assert math_task.answer_problem("(" * 13 + "1" + ")" * 13) == "nested deeper than 12"


def test_math_verify_log_lines_are_cut():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    handler = Keep()
    logger = logging.getLogger("math_verify.parser")
    logger.addHandler(handler)
    try:
        logger.warning(f"Timeout during parsing: {MEGA}")
    finally:
        logger.removeHandler(handler)
    (line,) = records
    assert line.startswith("Timeout during parsing: 999") and len(line) == math_task.LOG_CHARS + 3


def test_box_and_tag_extraction_stay_linear_on_repeated_markers():
    # 100k unclosed tags / boxes: the old regex and slicing were quadratic here
    t0 = time.perf_counter()
    assert countdown.extract_answer("<answer>" * 100_000) is None
    # the same pairing as re.findall(r"<answer>(.*?)</answer>", re.DOTALL)[-1]
    for text in ("<answer>1<answer>2</answer>x", "<answer>1</answer><answer>2</answer>tail", "</answer><answer> 3\n</answer><answer>"):
        assert countdown.extract_answer(text) == re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)[-1].strip()
    assert math_task.last_boxed("\\boxed{1}" * 100_000) == "1"
    assert math_task.last_boxed("\\boxed{" * 100_000) is None
    assert time.perf_counter() - t0 < 10


def test_long_numbers_are_no_answer():
    # gsm8k: a 1 MB number overflowed Decimal; arith: int() of > 4300 digits raised
    assert gsm8k.extract_answer(f"#### {MEGA}") is None
    assert gsm8k.extract_answer("#### " + "1" * 64) == int("1" * 64)
    assert arith.extract_answer(f"#### {MEGA}") is None
    assert arith.extract_answer("#### -12.") == -12
