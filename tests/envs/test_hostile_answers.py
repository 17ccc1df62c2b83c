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


@pytest.fixture
def no_math_verify(monkeypatch):
    """math_verify's parse and verify fail the test if they are ever called."""
    import math_verify

    def no_parse(*args, **kwargs):
        raise AssertionError(f"math_verify saw {str(args)[:60]}")

    monkeypatch.setattr(math_verify, "parse", no_parse)
    monkeypatch.setattr(math_verify, "verify", no_parse)


def test_math_refuses_costly_answers_before_math_verify(no_math_verify):
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


# --------------------------------------------------------------------------- the math task's new paths:
# box groups (several boxes read as one answer) and final-answer statements (answer_format)

MATH_FORMATS = ("boxed", "boxed_or_final", "any")
MANY_BOXES = [
    "".join(f"\\boxed{{{i}}}, " for i in range(100_000)),  # one long list: the group stops growing, then is refused
    "\\boxed{1}, " * 100_000,  # the same answer, over and over
    "".join(f"\\boxed{{{10_000 + i}}}, " for i in range(51)),  # a list just over MAX_ANSWER_CHARS
    "\\boxed{9^{9^{9^9}}}, \\boxed{1}",  # one hostile member spoils the group
    "\\boxed{1}, \\boxed{100000000!}",
    "\\boxed{" * 100_000 + "1" + "}, \\boxed{2" * 1000,
]
LONG_STATEMENTS = [
    "Final Answer: The final answer is " + MEGA,
    "Final Answer: The final answer is $9^{9^{9^9}}$. I hope it is correct.",
    "The answer is " + "(" * 10_000 + "1" + ")" * 10_000,
    "Final Answer: The final answer is $\\binom{100000}{50000}$.",
    "the answer is " + "\\frac{" * 5_000 + "1" + "}{2}" * 5_000,
    "final answer " * 100_000,
    "Answer:" + " " * 1_000_000 + "5",
    "the answer is 4" + "\n" * 1_000_000,
    "The final answer is " + "9" * 250 + "^{9^9}",  # the tower at the end of the window
]


@pytest.mark.parametrize("answer_format", MATH_FORMATS)
def test_math_many_boxes_and_long_statements_are_wrong_and_fast(answer_format, no_exec):
    t0 = time.perf_counter()
    for response in MANY_BOXES + LONG_STATEMENTS + [slot for a in HOSTILE for slot in
                                                    (f"Final Answer: The final answer is ${a}$. I hope it is correct.",
                                                     f"The answer is {a}", a)]:
        out = math_task.reward("prompt", response, {"answer": "5"}, answer_format=answer_format)
        assert out["score"] == 0.0 and out["reward"] == 0.0, (answer_format, response[:40])
    assert time.perf_counter() - t0 < 10


def test_math_group_and_statement_bounds_hold_before_math_verify(no_math_verify):
    group = math_task.boxed_answer(MANY_BOXES[0])
    assert math_task.MAX_ANSWER_CHARS < len(group) < 2 * math_task.MAX_ANSWER_CHARS  # stopped growing, then refused
    assert math_task.answer_problem(group) is not None
    for response in MANY_BOXES[2:5] + LONG_STATEMENTS[1:5] + [LONG_STATEMENTS[-1]]:
        for answer_format in MATH_FORMATS:
            assert not math_task.is_correct(response, "5", answer_format), response[:40]
    assert len(math_task.final_statement(LONG_STATEMENTS[0])) == math_task.MAX_ANSWER_CHARS


def test_math_statements_never_reach_a_timeout(caplog):
    with caplog.at_level(logging.WARNING, logger="math_verify"):
        for response in LONG_STATEMENTS:
            for answer_format in ("boxed_or_final", "any"):
                assert not math_task.is_correct(response, "5", answer_format)
    assert not [r for r in caplog.records if "Timeout" in r.getMessage()]


def test_math_box_group_and_statement_scans_stay_linear():
    t0 = time.perf_counter()
    assert math_task.boxed_answer("\\boxed{1}" * 100_000) == "1"
    assert math_task.final_statement("final answer " * 100_000).startswith("final answer")
    assert math_task.final_statement("answer\n" * 100_000) is not None  # "Answer" at a line's start
    assert math_task.final_statement("\n" * 1_000_000) is None
    assert time.perf_counter() - t0 < 10
