"""Countdown and the shared safe evaluator: exact arithmetic, number usage, forbidden syntax."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest

from relign.data.readers import DataError
from relign.envs import countdown
from relign.envs.safe_arith import ArithError, analyze, evaluate, format_number
from relign.envs.tasks import get_task

INFO = {"nums": [30, 100, 93], "target": 23}  # the first shipped row: 30 + 93 - 100 = 23


def score(answer: str, info=INFO) -> float:
    return countdown.reward("", f"Let me think.\n<answer>{answer}</answer>", info)["score"]


@pytest.mark.parametrize(
    "expr, correct",
    [
        ("30 + 93 - 100", True),
        ("(30 + 93) - 100", True),
        ("93 - (100 - 30)", True),
        (" 93-100+30 ", True),
        ("30 + 93 + 100", False),  # wrong value (223)
        ("30 + 93 - 100 + 0", False),  # extra number
        ("123 - 100", False),  # 30 and 93 missing, 123 is not given
        ("93 - 100 + 30 + 30 - 30", False),  # 30 reused
        ("93 - 70", False),  # right value, numbers missing
        ("30 + 93 - 100.0", False),  # decimals are not allowed
        ("-100 + 30 + 93", False),  # unary minus invents a number
        ("30 + 93 - 100 = 23", False),  # the tag holds the expression only
        ("", False),
    ],
)
def test_countdown_cases(expr, correct):
    assert score(expr) == float(correct)


def test_division_is_exact():
    # 6/4*2 = 3 exactly (floor division would give 2, floats happen to work here; Fraction always does)
    assert evaluate("6/4*2") == 3
    assert score("6/4*2", {"nums": [6, 4, 2], "target": 3}) == 1.0
    # 1/3*3 == 1 exactly; with floats 1/3*3 is 1.0 by luck but (1/3+1/3+1/3) is not always
    assert evaluate("(1/3 + 1/3 + 1/3) * 7") == 7
    assert score("(2 - 1/3) * 3", {"nums": [2, 1, 3, 3], "target": 5}) == 1.0
    assert score("7/2", {"nums": [7, 2], "target": 3}) == 0.0  # 3.5 is not 3


def test_division_by_zero_is_invalid():
    with pytest.raises(ArithError, match="division by zero"):
        evaluate("5 / (3 - 3)")
    assert score("5 / (3 - 3)", {"nums": [5, 3, 3], "target": 0}) == 0.0


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('touch relign_pwned')",
        "open('relign_pwned', 'w')",
        "x + 1",
        "(1).real",
        "2 ** 100",
        "9 ** 9 ** 9",  # would hang if evaluated
        "lambda: 1",
        "[1, 2][0]",
        "'1' + '2'",
        "True + 1",
        "1 if 1 else 2",
        "7 // 2",
        "7 % 2",
        "1 << 2",
        "1j",
        "0x10",
        "1e3",
        "1_000",
        "1 < 2",
        "(x := 5)",
        "1; 2",
        "1 +",
        "9" * 250,  # over the length cap
    ],
)
def test_forbidden_syntax_is_refused_without_executing(expr, tmp_path, monkeypatch):
    import builtins

    def trap(*a, **k):
        raise AssertionError("the evaluator called eval/exec")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(builtins, "eval", trap)
    monkeypatch.setattr(builtins, "exec", trap)
    with pytest.raises(ArithError):
        evaluate(expr)
    assert score(expr, {"nums": [1, 2], "target": 3}) == 0.0
    assert not (tmp_path / "relign_pwned").exists()


def test_deep_nesting_is_an_error_not_a_crash():
    assert evaluate("(" * 99 + "1" + ")" * 99) == 1  # the deepest the 200-character cap allows
    assert evaluate("-" * 199 + "1", allow_unary=True) == -1
    # Past Python's nesting limits (only reachable with a raised cap): an ArithError, not a RecursionError.
    for expr in ["(" * 3000 + "1" + ")" * 3000, "-" * 6000 + "1"]:
        with pytest.raises(ArithError):
            evaluate(expr, allow_unary=True, max_len=100_000)


def test_evaluator_options_used_by_the_calculator():
    assert evaluate("-3 + 1", allow_unary=True) == -2
    assert evaluate("0.1 + 0.2", allow_float=True) == Fraction(3, 10)  # exact decimals, not 0.30000000000000004
    assert analyze("(7 - 2) * 3") == (15, [7, 2, 3])  # literals in reading order
    assert [format_number(Fraction(*x)) for x in [(12, 1), (7, 2), (1, 3), (-2, 3), (-5, 1), (1, 10**9)]] == [
        "12",
        "3.5",
        "0.333333",
        "-0.666667",
        "-5",
        "0",
    ]


def test_format_reward():
    good = "thinking <answer>30 + 93 - 100</answer>"
    r = countdown.reward("", good, INFO, format_weight=0.1)
    assert r == {"reward": pytest.approx(1.1), "score": 1.0, "components": {"correct": 1.0, "format": 1.0}}
    # two answers: the last one is graded, but the format is not "exactly one"
    two = "<answer>1 + 2</answer> no: <answer>30 + 93 - 100</answer>"
    r = countdown.reward("", two, INFO, format_weight=0.1)
    assert r["components"] == {"correct": 1.0, "format": 0.0} and r["reward"] == 1.0
    assert countdown.format_ok("<answer>1 + 2</answer>")
    assert not countdown.format_ok("<answer></answer>")
    assert not countdown.format_ok("<answer>1 + 2")
    assert not countdown.format_ok("</answer>1<answer>")
    assert countdown.reward("", "30 + 93 - 100", INFO)["score"] == 0.0  # no tag, no credit


def _solve(nums: list[int], target: int) -> str | None:
    """Brute force over orders, operators and both shapes of a 3- or 4-number expression."""
    ops = "+-*/"
    for perm in itertools.permutations(nums):
        for os_ in itertools.product(ops, repeat=len(nums) - 1):
            a = [str(n) for n in perm]
            shapes = [f"({a[0]} {os_[0]} {a[1]}) {os_[1]} {a[2]}", f"{a[0]} {os_[0]} ({a[1]} {os_[1]} {a[2]})"]
            if len(nums) == 4:
                shapes = [f"({s}) {os_[2]} {a[3]}" for s in shapes] + [f"({a[0]} {os_[0]} {a[1]}) {os_[1]} ({a[2]} {os_[2]} {a[3]})"]
            for s in shapes:
                try:
                    if evaluate(s) == target:
                        return s
                except ArithError:
                    pass
    return None


def test_all_shipped_rows_load_and_are_solvable():
    records = get_task("countdown").load()
    assert len(records) == 256
    assert records[0]["extra_info"] == {"nums": [30, 100, 93], "target": 23}
    assert "Using the numbers 30, 100, 93, create an equation that equals 23." in records[0]["prompt"]
    for rec in records:
        info = rec["extra_info"]
        expr = _solve(info["nums"], info["target"])
        assert expr is not None, info
        assert countdown.reward(rec["prompt"], f"<answer>{expr}</answer>", info)["score"] == 1.0


def test_hub_rows_and_bad_rows(fake_hub, tmp_path):
    rows, calls = fake_hub
    rows[("Jiayi-Pan/Countdown-Tasks-3to4", None, "train")] = [{"nums": [44, 19, 35], "target": 98}]
    recs = get_task("countdown").load(countdown.HUB_ID, split="train")
    assert calls == [("Jiayi-Pan/Countdown-Tasks-3to4", None, "train")]
    assert recs[0]["extra_info"] == {"nums": [44, 19, 35], "target": 98}
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"input": "1,2,3", "output": "6"}) + "\n" + json.dumps({"input": "1,x,3", "output": "6"}) + "\n")
    with pytest.raises(DataError, match="row 2, field 'input': expected an integer"):
        get_task("countdown").load(str(p))
    p.write_text(json.dumps({"input": "1,2,3"}) + "\n")
    with pytest.raises(DataError, match="row 1, field 'target': missing"):
        get_task("countdown").load(str(p))
