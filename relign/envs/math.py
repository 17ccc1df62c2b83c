"""MATH (Hendrycks et al., 2021), MATH-500 by default: competition problems, LaTeX answers.

The response's answer is the content of its last ``\\boxed{...}`` (nested braces and escaped
``\\{ \\}`` handled; ``\\fbox{...}`` and the brace-less ``\\boxed 5`` too). A response without
one scores 0: there is no fallback to "the last number", which would reward unboxed guesses.
Equivalence is decided by ``math_verify`` (Hugging Face Math-Verify): the gold answer is
parsed as ``$<answer>$``, the prediction as ``\\boxed{<content>}``; all 500 MATH-500 gold
answers verify against themselves this way (tests/envs/test_math.py).

Hostile answers: model output is untrusted, and sympy will happily spend minutes building
``9^{9^{9^9}}`` or ``100000000!``. Before math_verify sees a boxed answer, ``answer_problem``
refuses, in microseconds and without parsing: answers longer than ``MAX_ANSWER_CHARS``, nested
deeper than ``MAX_NESTING``, powers whose exponent is a number above ``MAX_EXPONENT`` or itself a
numeric power (a tower), factorials of numbers above ``MAX_FACTORIAL``, and binomials of numbers
above ``MAX_EXPONENT``. Such an answer is simply wrong. (No MATH-500 answer comes near: the
longest has 53 characters, the deepest nests 2 groups.) Nothing is ever executed: math_verify
parses LaTeX with its own grammar, and its plain-expression fallback admits only digits and
operators. Its log lines (a timeout logs the whole expression) are cut to 80 characters.

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
import logging
import re
import threading
from typing import Any

from relign.data.readers import DataError
from relign.envs.base import DATA_DIR, Task, builtin_task
from relign.envs.reward_fn import combine

NAME = "math"
DEFAULT_PATH = str(DATA_DIR / "math500_test.jsonl")
HUB_ID = "HuggingFaceH4/MATH-500"
TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."
# Seconds for each math_verify parse/compare when signal-based timeouts are usable.
MATH_VERIFY_TIMEOUT = 5

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BOX_START = re.compile("|".join(re.escape(c) for c in _BOX_COMMANDS))
_BRACE_EVENTS = re.compile(r"\\.|[{}]", re.DOTALL)

# Bounds on a boxed answer before math_verify parses it (see the module docstring).
MAX_ANSWER_CHARS = 300
MAX_NESTING = 12
MAX_EXPONENT = 10_000
MAX_FACTORIAL = 1_000
LOG_CHARS = 80


def _balanced(text: str, start: int) -> int | None:
    """Index just past the brace group opening at ``text[start] == "{"``; None if unbalanced."""
    depth = 0
    # only braces and escapes matter: the regex skips everything else in C (a 1 MB answer is one scan)
    for m in _BRACE_EVENTS.finditer(text, start):
        c = m.group()
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return m.end()
        # else an escaped character (\{, \}, \\): never opens or closes a group
    return None


def _boxes(text: str) -> list[tuple[int, int, str]]:
    """Top-level ``\\boxed``/``\\fbox`` groups as (start, end, content), left to right.

    Linear in ``len(text)``: the scan only moves forward and copies nothing after its position
    (a response of 100k boxes must not cost 100k scans of the rest)."""
    found = []
    n = len(text)
    i = 0
    while True:
        m = _BOX_START.search(text, i)
        if m is None:
            return found
        s, j = m.span()
        k = j
        while k < n and text[k].isspace():
            k += 1
        if k < n and text[k] == "{":
            end = _balanced(text, k)
            if end is None:  # unclosed: nothing after it can be a complete box either
                return found
            found.append((s, end, text[k + 1 : end - 1].strip()))
            i = end
        elif k > j and k < n:
            # "\boxed 5" / "\boxed -3$": up to the next whitespace or "$"
            e = k
            while e < n and not text[e].isspace() and text[e] != "$":
                e += 1
            content = text[k:e].rstrip(".,;")
            if content:
                found.append((s, e, content))
            i = e
        else:  # "\boxedfoo" or "\boxed" at the end: not a box
            i = j
        if i >= n:
            return found


def last_boxed(text: str) -> str | None:
    """The content of the last top-level ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed x``."""
    boxes = _boxes(text)
    return boxes[-1][2] if boxes else None


# A number, or a group of digits and operators only (no variable): its value is a concrete
# integer that sympy will compute.
_INT = re.compile(r"\d+")
_NUMERIC = re.compile(r"[\d\s.+\-*/^!(){}\[\]]*")
_LATEX_NOISE = re.compile(r"\\(?:left|right|cdot|times|div|,|;|!| )")
_BINOMIAL = re.compile(r"\\[dt]?binom|\\choose")


def _nesting(text: str) -> int:
    depth = deepest = 0
    for c in text:
        if c in "({[":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")}]":
            depth -= 1
    return deepest


def _numeric_size(group: str) -> float | None:
    """A bound on the value of a group of digits and operators (the product of its integers,
    or infinity if it holds a power or a factorial); None if it holds a variable."""
    group = _LATEX_NOISE.sub(" ", group)
    if not _NUMERIC.fullmatch(group):
        return None
    if "^" in group or "!" in group:
        return float("inf")
    bound = 1.0
    for m in _INT.finditer(group):
        bound *= max(1.0, float(int(m.group()[:20])))  # 20 digits already exceed every limit
    return bound


def _exponent(text: str, at: int) -> str:
    """The exponent of the ``^`` at ``text[at]``: a ``{...}`` group, a run of digits, or one
    token; with a ``^`` right after it (``9^9^9``, ``9**9**9`` read as a tower) included."""
    k = at + 1
    while k < len(text) and text[k].isspace():
        k += 1
    if k < len(text) and text[k] == "{":
        end = _balanced(text, k) or len(text)
        exp = text[k + 1 : end - 1]
    else:
        m = _INT.match(text, k)
        end = m.end() if m else k + 1
        exp = text[k:end]
    return exp + "^" if text[end:].lstrip().startswith("^") else exp


def _factorial_operand(text: str, at: int) -> str:
    """What the ``!`` at ``text[at]`` applies to: the digits, or the bracket group, before it."""
    k = at
    while k > 0 and text[k - 1].isspace():
        k -= 1
    if k > 0 and text[k - 1] in ")}]":
        depth = 0
        for j in range(k - 1, -1, -1):
            depth += text[j] in ")}]"
            depth -= text[j] in "({["
            if depth == 0:
                return text[j + 1 : k - 1]
        return text[:k]
    j = k
    while j > 0 and text[j - 1].isdigit():
        j -= 1
    return text[j:k]


def answer_problem(content: str) -> str | None:
    """Why a boxed answer is refused before parsing (too long, too deep, or an integer too
    large to compute), or None if math_verify may grade it. Cheap: a few linear scans."""
    if len(content) > MAX_ANSWER_CHARS:
        return f"longer than {MAX_ANSWER_CHARS} characters"
    if _nesting(content) > MAX_NESTING:
        return f"nested deeper than {MAX_NESTING}"
    text = content.replace("**", "^")
    for at in (i for i, c in enumerate(text) if c == "^"):
        size = _numeric_size(_exponent(text, at))
        if size is not None and size > MAX_EXPONENT:
            return f"a power with an exponent above {MAX_EXPONENT} or a power tower"
    for at in (i for i, c in enumerate(text) if c == "!" and (i == 0 or text[i - 1] != "\\")):
        size = _numeric_size(_factorial_operand(text, at))
        if size is not None and size > MAX_FACTORIAL:
            return f"a factorial of a number above {MAX_FACTORIAL}"
    if _BINOMIAL.search(text) and any(len(m.group()) > len(str(MAX_EXPONENT)) for m in _INT.finditer(text)):
        return f"a binomial of numbers above {MAX_EXPONENT}"
    return None


class _ShortLogs(logging.Filter):
    """Cut math_verify's log lines: a parsing timeout logs the whole expression (1 MB, if that
    is what a model wrote)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if len(text) > LOG_CHARS:
            record.msg, record.args = text[:LOG_CHARS] + "...", None
        return True


for _name in ("math_verify.parser", "math_verify.grader", "math_verify.metric"):
    logging.getLogger(_name).addFilter(_ShortLogs())


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

    if answer_problem(predicted) is not None or answer_problem(gold) is not None:
        return False
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
    content = last_boxed(response)  # once: a long response is scanned a single time
    correct = float(bool(content) and is_equivalent(str(extra_info["answer"]), content))
    return combine(correct, float(bool(content)), format_weight)


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
