"""GSM8K: grade-school math word problems with a numeric answer (Cobbe et al., 2021).

The model ends with ``#### <number>``. Grading takes the first number after the last
``####``; without one, the last number anywhere in the response (the "flexible" mode of
lm-eval-harness). Numbers are normalized — thousands commas, a leading ``$``, a minus sign
(ASCII or U+2212), a trailing period, decimals (``5.00`` == ``5``) — and compared as exact
decimals within 1e-6. A "number" longer than ``MAX_NUMBER_CHARS`` characters is no answer:
model output is untrusted, and a million-digit number would overflow ``Decimal``'s exponent.

Data: the shipped test set (1319 rows, MIT) or any file/hub id with ``question`` and
``answer`` (``"...\\n#### 72"``) fields, e.g. ``"openai/gsm8k:main"`` (split ``train``/``test``).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from relign.data.readers import DataError
from relign.envs.base import DATA_DIR, Task, builtin_task
from relign.envs.reward_fn import combine

NAME = "gsm8k"
DEFAULT_PATH = str(DATA_DIR / "gsm8k_test.jsonl")
HUB_ID = "openai/gsm8k:main"
TEMPLATE = (
    "{question}\n"
    'Solve the problem step by step. At the end, write the final answer as a number on its own line, as "#### <number>".'
)
TOLERANCE = 1e-6
# Longer digit strings are not answers (GSM8K's are at most 9 characters); the bound keeps every
# Decimal small, so grading a hostile 1 MB "number" is as cheap as grading "42".
MAX_NUMBER_CHARS = 64

# A number as people write it: optional minus (ASCII or U+2212), optional $, digits with
# thousands commas or plain digits, optional decimals. "1,2,3" reads as 1, 2, 3 (not 123)
# because a comma group must have exactly three digits.
# A minus directly after a word character or a closing bracket is subtraction ("10-5" ends
# in 5, not -5), so the sign only counts elsewhere ("= -5", "#### -5", "-$5").
_NUMBER = re.compile(
    r"(?P<sign>(?<![\w)\]])[-\u2212])?(?:\$\s?)?(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
_MARKER = "####"
# The format the prompt asks for: "####" then (spaces) a number.
_FORMAT = re.compile(r"####[ \t]*" + _NUMBER.pattern)


def parse_number(text: str) -> Decimal | None:
    """The first number in ``text`` as a Decimal (``"$1,234.00"`` -> 1234), None if there is none."""
    m = _NUMBER.search(text)
    return _to_decimal(m) if m else None


def _to_decimal(m: re.Match) -> Decimal | None:
    digits = m.group("digits")
    if len(digits) > MAX_NUMBER_CHARS:
        return None
    try:
        value = Decimal(digits.replace(",", ""))
    except InvalidOperation:  # pragma: no cover - the regex only admits valid digits
        return None
    return -value if m.group("sign") else value


def extract_answer(response: str) -> Decimal | None:
    """The answer a response gives: first number after the last ``####``, else the last number."""
    if _MARKER in response:
        after = response.rsplit(_MARKER, 1)[1]
        value = parse_number(after)
        if value is not None:
            return value
    last = None
    for last in _NUMBER.finditer(response):  # keep only the last match: no list of a 1 MB answer's numbers
        pass
    return _to_decimal(last) if last is not None else None


def is_correct(response: str, answer: str | int | float) -> bool:
    gold = parse_number(str(answer))
    pred = extract_answer(response)
    if gold is None or pred is None:
        return False
    return abs(pred - gold) <= Decimal(str(TOLERANCE))


def format_ok(response: str) -> bool:
    """Exactly one ``####`` in the response, followed by a number."""
    return response.count(_MARKER) == 1 and _FORMAT.search(response) is not None


def reward(prompt: str, response: str, extra_info: dict, *, format_weight: float = 0.0) -> dict[str, Any]:
    """1 if the response's answer equals ``extra_info["answer"]``, plus ``format_weight`` * format."""
    correct = float(is_correct(response, extra_info["answer"]))
    return combine(correct, float(format_ok(response)), format_weight)


def gold_answer(solution: str) -> str | None:
    """The canonical answer of a GSM8K solution (``"...#### 1,234"`` -> ``"1234"``)."""
    if _MARKER not in solution:
        return None
    value = parse_number(solution.rsplit(_MARKER, 1)[1])
    return None if value is None else _canonical(value)


def _canonical(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return "0" if text in ("-0", "0") else text


def final_answer(response: str, extra_info: dict | None = None) -> str | None:
    """The response's answer as a canonical decimal string (``"#### 1,234.0"`` -> ``"1234"``), for voting."""
    value = extract_answer(response)
    return None if value is None else _canonical(value)


def same_answer(a: str, b: str) -> bool:
    """Two ``final_answer`` strings are the same number (within the grading tolerance)."""
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and abs(x - y) <= Decimal(str(TOLERANCE))


def parse_row(raw: dict, source: str, row: int) -> tuple[dict, dict]:
    for key in ("question", "answer"):
        if not isinstance(raw.get(key), (str, int, float)) or isinstance(raw.get(key), bool):
            raise DataError(source, row, key, "missing" if raw.get(key) is None else f"expected a string, got {type(raw[key]).__name__}")
    answer = str(raw["answer"])
    # A solution "...#### 72", or (in some copies) the bare number itself.
    gold = gold_answer(answer) if _MARKER in answer else (_canonical(v) if (v := parse_number(answer)) is not None else None)
    if gold is None:
        raise DataError(source, row, "answer", f"no final answer ('#### <number>') in {answer[-60:]!r}")
    return {"question": raw["question"]}, {"answer": gold}


def task(*, template: str = TEMPLATE, default_path: str = DEFAULT_PATH, **options: Any) -> Task:
    """The gsm8k task; ``options``: format_weight, chat, system_prompt, split (see ``builtin_task``)."""
    return builtin_task(NAME, parse_row, "relign.envs.gsm8k:reward", template=template, default_path=default_path,
                        extract_spec="relign.envs.gsm8k:final_answer", answer_marker="####", equal_spec="relign.envs.gsm8k:same_answer", **options)
