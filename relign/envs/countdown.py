"""Countdown: combine the given numbers with + - * / to reach a target (as in TinyZero, d1).

The response must put the expression in ``<answer>EXPR</answer>``; the last such tag counts.
EXPR is checked by ``relign.envs.safe_arith`` (never ``eval``): integer literals only, binary
``+ - * /`` and parentheses (no unary minus, no decimals — see safe_arith's docstring), at most
200 characters. It is correct when its integer literals are exactly the given numbers, each
used once (the multiset is equal: the shipped data is "each solvable using every number
once"), and its exact value (``Fraction``; ``6/4*2 == 3``) equals the target. The tag holds
the expression only: ``<answer>(1 + 2) * 3</answer>``, not ``... = 9`` (which fails to parse).

Data: the shipped d1 test set (256 rows ``{"input": "30,100,93", "output": "23"}``, Apache-2.0)
or rows ``{"nums": [...], "target": n}`` such as the hub's ``"Jiayi-Pan/Countdown-Tasks-3to4"``
(only a ``train`` split: ``load("Jiayi-Pan/Countdown-Tasks-3to4", split="train")``).
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from typing import Any

from relign.data.readers import DataError
from relign.envs.base import DATA_DIR, Task, builtin_task
from relign.envs.reward_fn import combine
from relign.envs.safe_arith import ArithError, analyze

NAME = "countdown"
DEFAULT_PATH = str(DATA_DIR / "d1_countdown_cd3_test.jsonl")
HUB_ID = "Jiayi-Pan/Countdown-Tasks-3to4"
MAX_EXPR_LEN = 200
TEMPLATE = (
    "Using the numbers {numbers}, create an equation that equals {target}. "
    "You can use the basic arithmetic operations (+, -, *, /) and parentheses, and each number must be used exactly once. "
    "Think step by step, then give only the expression inside <answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>."
)

_OPEN, _CLOSE = "<answer>", "</answer>"


def extract_answer(response: str) -> str | None:
    """The content of the last ``<answer>...</answer>``, stripped; None if there is none.

    The same pairs as ``re.findall(r"<answer>(.*?)</answer>", DOTALL)`` (each ``<answer>``
    with the first ``</answer>`` after it, left to right), found with ``str.find`` in one pass:
    the regex rescans to the end from every unclosed ``<answer>``, which is quadratic on a
    hostile response made of thousands of them."""
    last = None
    pos = 0
    while (start := response.find(_OPEN, pos)) >= 0:
        end = response.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            break
        last = (start + len(_OPEN), end)
        pos = end + len(_CLOSE)
    return response[last[0] : last[1]].strip() if last else None


def check_expression(expr: str, nums: list[int], target: int | Fraction) -> bool:
    """True if ``expr`` uses exactly ``nums`` (each once) and equals ``target``. Never raises
    on bad input: any syntax, forbidden construct or division by zero is simply False."""
    try:
        value, used = analyze(expr, max_len=MAX_EXPR_LEN)
    except ArithError:
        return False
    return Counter(used) == Counter(Fraction(n) for n in nums) and value == Fraction(target)


def final_answer(response: str, extra_info: dict) -> str | None:
    """For voting: the exact value of the last ``<answer>`` expression (``"7/2"``, ``"24"``).

    Many different expressions are correct, so samples vote on the value they reach, not on
    their text. An expression that does not parse, or does not use exactly the given numbers,
    gives None (it does not vote): then a value equal to the target is exactly a correct sample.
    """
    expr = extract_answer(response)
    if expr is None:
        return None
    try:
        value, used = analyze(expr, max_len=MAX_EXPR_LEN)
    except ArithError:
        return None
    if Counter(used) != Counter(Fraction(n) for n in extra_info["nums"]):
        return None
    return str(value)  # Fraction's str is canonical ("3", "-7/2"), so string equality suffices


def format_ok(response: str) -> bool:
    """Exactly one ``<answer>``, one ``</answer>``, in that order, with something inside."""
    if response.count("<answer>") != 1 or response.count("</answer>") != 1:
        return False
    content = extract_answer(response)
    return bool(content)


def reward(prompt: str, response: str, extra_info: dict, *, format_weight: float = 0.0) -> dict[str, Any]:
    """1 if the last <answer> reaches ``extra_info["target"]`` with ``extra_info["nums"]``."""
    expr = extract_answer(response)
    correct = expr is not None and check_expression(expr, extra_info["nums"], extra_info["target"])
    return combine(float(correct), float(format_ok(response)), format_weight)


def _int(value: Any, source: str, row: int, field: str) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(str(value).strip()) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise DataError(source, row, field, f"expected an integer, got {value!r}") from None


def parse_row(raw: dict, source: str, row: int) -> tuple[dict, dict]:
    if "nums" in raw:
        nums_field, raw_nums = "nums", raw["nums"]
        if not isinstance(raw_nums, (list, tuple)):
            raise DataError(source, row, "nums", f"expected a list of integers, got {type(raw_nums).__name__}")
    elif "input" in raw:
        nums_field = "input"
        if not isinstance(raw["input"], str):
            raise DataError(source, row, "input", f"expected a string like '3,5,7', got {type(raw['input']).__name__}")
        raw_nums = [p for p in raw["input"].split(",")]
    else:
        raise DataError(source, row, "nums", "missing (expected 'nums' or 'input')")
    nums = [_int(n, source, row, nums_field) for n in raw_nums]
    if not nums:
        raise DataError(source, row, nums_field, "no numbers")
    target_field = "target" if "target" in raw else "output"
    if target_field not in raw:
        raise DataError(source, row, "target", "missing (expected 'target' or 'output')")
    target = _int(raw[target_field], source, row, target_field)
    numbers = ", ".join(str(n) for n in nums)
    return {"numbers": numbers, "target": target}, {"nums": nums, "target": target}


def task(*, template: str = TEMPLATE, default_path: str = DEFAULT_PATH, **options: Any) -> Task:
    """The countdown task; ``options``: format_weight, chat, system_prompt, split (see ``builtin_task``)."""
    return builtin_task(NAME, parse_row, "relign.envs.countdown:reward", template=template, default_path=default_path,
                        extract_spec="relign.envs.countdown:final_answer", answer_marker="</answer>", reward_needs_reference=False, **options)
