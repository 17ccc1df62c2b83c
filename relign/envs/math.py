"""MATH (Hendrycks et al., 2021), MATH-500 by default: competition problems, LaTeX answers.

The response's answer is the content of its last ``\\boxed{...}`` (nested braces and escaped
``\\{ \\}`` handled; ``\\fbox{...}`` and the brace-less ``\\boxed 5`` too). A response without
one scores 0: there is no fallback to "the last number", which would reward unboxed guesses.
Equivalence is decided by ``math_verify`` (Hugging Face Math-Verify): the gold answer is
parsed as ``$<answer>$``, the prediction as ``\\boxed{<content>}``; all 500 MATH-500 gold
answers verify against themselves this way (tests/envs/test_math.py).

Timeouts: math_verify guards parsing and comparison with ``signal.alarm``, which works only in
a process's main thread. We pass its timeout only when called from the main thread (for
example inside a ``RewardPool`` worker, where it turns a slow sympy call into a plain 0) and
disable it elsewhere; ``RewardPool`` kills a worker that runs past its own timeout either way.

Data: the shipped MATH-500 (500 rows, MIT, from PRM800K) or any file/hub id with ``problem``
and ``answer`` fields (``"HuggingFaceH4/MATH-500"``, split ``test``); rows with only a
``solution`` take the answer from its last ``\\boxed{}``.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from relign.data.readers import DataError
from relign.envs.base import DATA_DIR, Task, builtin_task, combine

NAME = "math"
DEFAULT_PATH = str(DATA_DIR / "math500_test.jsonl")
HUB_ID = "HuggingFaceH4/MATH-500"
TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."
# Seconds for each math_verify parse/compare when signal-based timeouts are usable.
MATH_VERIFY_TIMEOUT = 5

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _balanced(text: str, start: int) -> int | None:
    """Index just past the brace group opening at ``text[start] == "{"``; None if unbalanced."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":  # an escaped character (\{, \}, \\) never opens or closes a group
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _boxes(text: str) -> list[tuple[int, int, str]]:
    """Top-level ``\\boxed``/``\\fbox`` groups as (start, end, content), left to right."""
    found = []
    i = 0
    while True:
        starts = [(text.find(cmd, i), cmd) for cmd in _BOX_COMMANDS]
        starts = [(s, cmd) for s, cmd in starts if s >= 0]
        if not starts:
            return found
        s, cmd = min(starts)
        j = s + len(cmd)
        rest = text[j:]
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            open_at = j + (len(rest) - len(stripped))
            end = _balanced(text, open_at)
            if end is None:  # unclosed: nothing after it can be a complete box either
                return found
            found.append((s, end, text[open_at + 1 : end - 1].strip()))
            i = end
        elif rest[:1].isspace() and stripped:
            # "\boxed 5" / "\boxed -3$": up to the next whitespace or "$"
            k = 0
            while k < len(stripped) and not stripped[k].isspace() and stripped[k] != "$":
                k += 1
            content = stripped[:k].rstrip(".,;")
            end = j + (len(rest) - len(stripped)) + k
            if content:
                found.append((s, end, content))
            i = end
        else:  # "\boxedfoo" or "\boxed" at the end: not a box
            i = j
        if i >= len(text):
            return found


def last_boxed(text: str) -> str | None:
    """The content of the last top-level ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed x``."""
    boxes = _boxes(text)
    return boxes[-1][2] if boxes else None


def _timeout() -> int | None:
    # signal.alarm only works in the main thread; elsewhere math_verify would raise.
    return MATH_VERIFY_TIMEOUT if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout: int | None) -> tuple:
    from math_verify import parse

    return tuple(parse(f"${answer}$", parsing_timeout=timeout))


def is_equivalent(gold: str, predicted: str) -> bool:
    """math_verify's judgement of ``predicted`` (a boxed content) against ``gold``."""
    from math_verify import parse, verify

    timeout = _timeout()
    gold_parsed = list(_parse_gold(gold, timeout))
    if not gold_parsed:
        return False
    pred = parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
    if not pred:
        return False
    return bool(verify(gold_parsed, pred, timeout_seconds=timeout))


def is_correct(response: str, answer: str) -> bool:
    content = last_boxed(response)
    return content is not None and bool(content) and is_equivalent(str(answer), content)


def format_ok(response: str) -> bool:
    """The response has a complete, non-empty ``\\boxed{...}``."""
    return bool(last_boxed(response))


def reward(prompt: str, response: str, extra_info: dict, *, format_weight: float = 0.0) -> dict[str, Any]:
    """1 if the last boxed answer is equivalent to ``extra_info["answer"]``, plus format bonus."""
    correct = float(is_correct(response, extra_info["answer"]))
    return combine(correct, float(format_ok(response)), format_weight)


def final_answer(response: str, extra_info: dict | None = None) -> str | None:
    """The content of the response's last ``\\boxed{}`` (None if it has no non-empty one), for voting."""
    return last_boxed(response) or None


def same_answer(a: str, b: str) -> bool:
    """Two boxed answers are equivalent: equal strings, else math_verify with ``a`` in the
    gold role (math_verify is not exactly symmetric; voting passes a cluster's first answer as ``a``)."""
    return a == b or is_equivalent(a, b)


def parse_row(raw: dict, source: str, row: int) -> tuple[dict, dict]:
    if not isinstance(raw.get("problem"), str):
        raise DataError(source, row, "problem", "missing" if raw.get("problem") is None else "expected a string")
    answer = raw.get("answer")
    if answer is None and isinstance(raw.get("solution"), str):
        answer = last_boxed(raw["solution"])
        if answer is None:
            raise DataError(source, row, "solution", "no 'answer' field and no \\boxed{} answer in the solution")
    if answer is None:
        raise DataError(source, row, "answer", "missing (and no 'solution' to take it from)")
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise DataError(source, row, "answer", f"expected a string, got {type(answer).__name__}")
    extra_info: dict[str, Any] = {"answer": str(answer)}
    for key in ("subject", "level", "unique_id"):  # kept for per-subject/level evaluation
        if key in raw:
            extra_info[key] = raw[key]
    return {"problem": raw["problem"]}, extra_info


def task(*, template: str = TEMPLATE, default_path: str = DEFAULT_PATH, **options: Any) -> Task:
    """The math task; ``options``: format_weight, chat, system_prompt, split (see ``builtin_task``)."""
    return builtin_task(NAME, parse_row, "relign.envs.math:reward", template=template, default_path=default_path,
                        extract_spec="relign.envs.math:final_answer", answer_marker="\\boxed", step_delimiter="\n\n", equal_spec="relign.envs.math:same_answer", **options)
