"""MATH (Hendrycks et al., 2021), MATH-500 by default: competition problems, LaTeX answers.

The answer (``boxed_answer``): the content of the response's last ``\\boxed{...}`` (nested braces
and escaped ``\\{ \\}`` handled; ``\\fbox{...}`` and the brace-less ``\\boxed 5`` too), together
with the boxes just before it that list the same answer: ``\\boxed{(1, 2)}, \\boxed{(2, 1)}`` or
``\\boxed{-2} \\quad\\text{and}\\quad \\boxed{1}`` are one answer, the set of their contents.
Two boxes belong together when what lies between them is short (``MAX_GROUP_GAP``) and is only
spacing and markup, or holds a separator ("and", "or", a comma) and no word of a correction
("wait", "no", "actually", "finally", "so", ...): ``\\boxed{1} no wait \\boxed{2}`` is 2.

``answer_format`` (a task option, ``task.answer_format``) says what counts as an answer:

* ``"boxed"`` (the default, and what RL trains): only a box. A response without one scores 0:
  there is no fallback to "the last number" or to a sentence, which would reward unboxed
  guesses, and the box is the format RL teaches (the prompt asks for it).
* ``"boxed_or_final"`` (for eval, e.g. a model prompted with MATH's few-shot format): without a
  box, the response's final-answer statement counts: the last "final answer" (``Final Answer: The
  final answer is $X$. I hope it is correct.``), else the last "the answer is X" / "Answer: X"; its
  text from there (at most ``MAX_ANSWER_CHARS`` characters, to the end of its paragraph) goes to
  math_verify's own extraction, which reads the answer next to the anchor. A statement after
  the last box wins over the box (``... \\boxed{255} ... Final Answer: The final answer is 10455``).
* ``"any"`` (for eval, to compare with math_verify-based graders): as ``boxed_or_final``, and a
  response with neither box nor statement is read as math_verify reads a response, from its
  last ``MAX_ANSWER_CHARS`` characters (the last LaTeX span or number there). This scores an
  unstated last number as the answer: never a training reward.

The gold answer: a bare answer (the ``answer`` field) is parsed as ``$<answer>$``; a gold that is
a worked solution is read like a response: its final box group (as a MATH ``solution`` field
is), else its final-answer statement; a gold with its own ``$...$`` is parsed as it is. All 500
MATH-500 gold answers verify against themselves, and their solutions against them
(tests/envs/test_math.py).

Numbers: thousands separators (``1,000``, ``1 000``, ``1\\,000``, ``1{,}000``, ``10,\\!080``) are
removed from an answer that is one number; trailing LaTeX spacing, a trailing backslash and a
final full stop (``42.``) are dropped; and an answer ``a,b`` that is not equivalent as written
(math_verify reads it as the pair {a, b}) is tried as the decimal ``a.b`` (``1000,99``, ``2,74``).

Equivalence is decided by ``math_verify`` (Hugging Face Math-Verify). How this grader compares
with math_verify called directly, on public equivalence suites: docs/tasks.md
(``python bench/math_grader.py``, tests/envs/test_math_equivalence_suites.py).

Hostile answers: model output is untrusted, and sympy will happily spend minutes building
``9^{9^{9^9}}`` or ``100000000!``. Before math_verify sees an answer (a box group's content, or a
final-answer statement), ``answer_problem`` refuses, in microseconds and without parsing:
answers longer than ``MAX_ANSWER_CHARS``, nested deeper than ``MAX_NESTING``, powers whose
exponent is a number above ``MAX_EXPONENT`` or itself a numeric power (a tower), factorials of
numbers above ``MAX_FACTORIAL``, and binomials of numbers above ``MAX_EXPONENT``. Such an answer
is simply wrong. (No MATH-500 answer comes near: the longest has 53 characters, the deepest
nests 2 groups.) A group of many boxes stops growing past ``MAX_ANSWER_CHARS`` (and is refused);
a final-answer statement is cut to ``MAX_ANSWER_CHARS``. Nothing is ever executed: math_verify
parses LaTeX with its own grammar, and its plain-expression fallback admits only digits and
operators. Its log lines (a timeout logs the whole expression) are cut to 80 characters.

Timeouts: math_verify guards parsing and comparison with ``signal.alarm``, which works only in
a process's main thread. We pass its timeout only when called from the main thread (for
example inside a ``RewardPool`` worker, where it turns a slow sympy call into a plain 0) and
disable it elsewhere; ``RewardPool`` kills a worker that runs past its own timeout either way.

Data: the shipped MATH-500 (500 rows, MIT, from PRM800K) or any file/hub id with ``problem``
and ``answer`` fields (``"HuggingFaceH4/MATH-500"``, split ``test``); rows with only a
``solution`` take the answer from its final box group.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from dataclasses import replace
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
# Two boxes further apart than this are two answers (the last one counts), never one.
MAX_GROUP_GAP = 70
ANSWER_FORMATS = ("boxed", "boxed_or_final", "any")


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


# Between two boxes of one answer: markup and spacing only, or a separator and no correction.
_GAP_MARKUP = re.compile(r"\\(?:q?quad|text\w*|math\w*|mbox|[,;:! ()\[\]])|[\s${}~&]")
_SEPARATOR = re.compile(r"\b(?:and|or)\b|[,;]", re.IGNORECASE)
_CORRECTION = re.compile(
    r"\b(?:wait|no|not|actually|instead|but|however|wrong|incorrect|mistake|oops|sorry|hmm+|rather|finally|"
    r"earlier|so|thus|therefore|hence|answer|final|correct\w*|check\w*|recheck\w*|again|previous\w*|before|"
    r"mean|meant|reconsider\w*|recompute\w*|fix\w*)\b",
    re.IGNORECASE,
)


def _joins(gap: str) -> bool:
    """Whether the text between two boxes makes them one answer (a list), not a correction."""
    if len(gap) > MAX_GROUP_GAP:
        return False
    if not re.search(r"[^\W\d_]", _GAP_MARKUP.sub("", gap)):
        return True  # no word between: "\boxed{1}, \boxed{2}", "$\boxed{1}$ $\boxed{2}$", "\boxed{1} \\ \boxed{2}"
    return bool(_SEPARATOR.search(gap)) and not _CORRECTION.search(gap)


def _box_group(text: str, boxes: list[tuple[int, int, str]]) -> str | None:
    """The last box's content joined (", ") with the boxes before it that list the same answer.
    Past ``MAX_ANSWER_CHARS`` characters (or boxes) the group stops growing; an over-long result
    is then refused."""
    if not boxes:
        return None
    parts = [boxes[-1][2]]
    size = len(parts[0])
    i = last = len(boxes) - 1
    while i > 0 and parts[0] and size <= MAX_ANSWER_CHARS and last - i < MAX_ANSWER_CHARS:
        start = boxes[i][0]
        _, prev_end, prev = boxes[i - 1]
        if not prev or start - prev_end > MAX_GROUP_GAP or not _joins(text[prev_end:start]):
            break
        if prev != parts[-1]:  # the same answer boxed twice in a row is one answer
            parts.append(prev)
            size += len(prev) + 2
        i -= 1
    return ", ".join(reversed(parts))


def boxed_answer(text: str) -> str | None:
    """The response's boxed answer: the last box's content, with the boxes just before it that
    list the same answer (``\\boxed{1}, \\boxed{2}`` -> ``1, 2``); None without a complete box."""
    return _box_group(text, _boxes(text))


# A final-answer statement: the last "final answer", else the last "answer is" / "answer:" / a
# line that starts with "Answer".
_FINAL_ANSWER = re.compile(r"final\s+answer", re.IGNORECASE)
_ANSWER_LEAD = re.compile(r"[\s:*]*")  # between the anchor and the answer
_ANSWER_IS = re.compile(r"\banswer\s*(?:\*\*\s*)?(?:is\b|:)|^[ \t#*>]*answer\b", re.IGNORECASE | re.MULTILINE)


def final_statement(text: str, start: int = 0) -> str | None:
    """The response's final-answer statement, from its anchor ("Final Answer: The final answer
    is $X$.", "the answer is X", "Answer: X") to the end of its paragraph, at most
    ``MAX_ANSWER_CHARS`` characters; None without one (at or after ``start``). Linear in ``len(text)``."""
    last = None
    for last in _FINAL_ANSWER.finditer(text, start):
        pass
    if last is None:
        for last in _ANSWER_IS.finditer(text, start):
            pass
    if last is None:
        return None
    window = text[last.start() : last.start() + MAX_ANSWER_CHARS]
    body = _ANSWER_LEAD.match(window, last.end() - last.start()).end()
    cut = window.find("\n\n", body)  # the end of the paragraph the answer starts in
    return window[:cut] if cut > 0 else window


# Number formatting: a number with thousands separators, a trailing backslash, spacing or full
# stop, a decimal comma.
_THOUSANDS = re.compile(r"(-?)([1-9]\d{0,2}(?:(?:\s*\{\s*,\s*\}\s*|,\\!|,|\\[,;! ]|~|\s)\d{3})+)(\.\d+)?")
_TRAILING = re.compile(r"(?:\\[,;:! ]|\\q?quad|\\\\|\\|\s)+\Z")
_DECIMAL_COMMA = re.compile(r"-?\d+,\d+")


def _tidy(content: str) -> str:
    """An answer's content with its number formatting undone (``1 000`` -> ``1000``, ``42\\`` -> ``42``)."""
    content = _TRAILING.sub("", content)
    if content.endswith(".") and (content[-2:-1].isdigit() or content[-2:-1] == "}"):
        content = content[:-1]
    m = _THOUSANDS.fullmatch(content)
    if m:
        content = m.group(1) + re.sub(r"\D", "", m.group(2)) + (m.group(3) or "")
    return content


def _readings(content: str) -> list[str]:
    """The ways to read an answer's content: as written, then (``a,b``) as the decimal ``a.b``."""
    content = _tidy(content)
    if _DECIMAL_COMMA.fullmatch(content):
        return [content, content.replace(",", ".")]
    return [content]


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


_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\(|\\\[")


def _gold_texts(answer: str) -> list[str]:
    """What math_verify parses for a gold answer, first as written then other readings: a bare
    answer as ``$answer$``; a worked solution's final box group, else its final-answer statement;
    a gold with its own math delimiters as it is. Empty if the answer is refused."""
    boxes = _boxes(answer) if ("\\boxed" in answer or "\\fbox" in answer) else []
    if boxes:
        content = _box_group(answer, boxes) or ""
    else:
        statement = final_statement(answer) if "answer" in answer.lower() else None
        if statement is not None or _MATH_DELIMITER.search(answer):
            text = statement if statement is not None else answer
            return [] if answer_problem(text) is not None else [text]
        content = answer
    if not content or answer_problem(content) is not None:
        return []
    return [f"${c}$" for c in _readings(content)]


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout: int | None) -> tuple[tuple, ...]:
    from math_verify import parse

    return tuple(tuple(parsed) for parsed in (parse(t, parsing_timeout=timeout) for t in _gold_texts(answer)) if parsed)


def _verify(gold: str, texts: list[str]) -> bool:
    """Whether any reading of the gold matches any of the prediction ``texts`` (parsed in order)."""
    from math_verify import parse, verify

    timeout = _timeout()
    golds = _parse_gold(gold, timeout)
    if not golds:
        return False
    for text in texts:
        pred = parse(text, parsing_timeout=timeout)
        if pred and any(verify(list(g), pred, timeout_seconds=timeout) for g in golds):
            return True
    return False


def is_equivalent(gold: str, predicted: str) -> bool:
    """math_verify's judgement of ``predicted`` (a boxed content) against ``gold``."""
    if answer_problem(predicted) is not None:
        return False
    return _verify(gold, [f"\\boxed{{{c}}}" for c in _readings(predicted)])


def _check_format(answer_format: str) -> None:
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format={answer_format!r}: expected one of {', '.join(ANSWER_FORMATS)}")


def _graded(response: str, answer: str, answer_format: str) -> tuple[bool, bool]:
    """(correct, an answer was found) for one response: its box group; with ``boxed_or_final``
    its final-answer statement where that comes after the last box (or there is no box); with
    ``any``, else the last ``MAX_ANSWER_CHARS`` characters, as math_verify reads them."""
    if answer_format != "boxed":
        _check_format(answer_format)
    boxes = _boxes(response)  # once: a long response is scanned a single time
    content = _box_group(response, boxes)
    if answer_format != "boxed":
        text = _statement_or_tail(response, boxes[-1][1] if boxes and content else 0, answer_format)
        if text is not None:
            return answer_problem(text) is None and _verify(answer, [text]), True
    if content:
        return is_equivalent(answer, content), True
    return False, False


def _statement_or_tail(response: str, after: int, answer_format: str) -> str | None:
    """The final-answer statement if it starts at or after ``after`` (the end of the box group);
    with ``any`` and no box, else the response's last ``MAX_ANSWER_CHARS`` characters (from a
    word's start)."""
    statement = final_statement(response, after)
    if statement is not None or after or answer_format != "any":
        return statement
    tail = response[-MAX_ANSWER_CHARS:]
    if len(response) > MAX_ANSWER_CHARS:
        space = re.search(r"\s", tail)
        tail = tail[space.end() :] if space else tail
    return tail if tail.strip() else None


def is_correct(response: str, answer: str, answer_format: str = "boxed") -> bool:
    return _graded(response, str(answer), answer_format)[0]


def format_ok(response: str, answer_format: str = "boxed") -> bool:
    """The response has a complete, non-empty ``\\boxed{...}`` (``boxed_or_final``: or a
    final-answer statement; ``any``: or any text)."""
    if boxed_answer(response):
        return True
    return answer_format != "boxed" and _statement_or_tail(response, 0, answer_format) is not None


def reward(prompt: str, response: str, extra_info: dict, *, format_weight: float = 0.0,
           answer_format: str = "boxed") -> dict[str, Any]:
    """1 if the response's answer (its box group; with ``answer_format`` "boxed_or_final" or
    "any", see the module docstring) is equivalent to ``extra_info["answer"]``, plus format bonus."""
    correct, found = _graded(response, str(extra_info["answer"]), answer_format)
    return combine(float(correct), float(found), format_weight)


def final_answer(response: str, extra_info: dict | None = None) -> str | None:
    """The content of the response's box group (None if it has no non-empty one), for voting."""
    return boxed_answer(response) or None


def _extracted(response: str, answer_format: str) -> str | None:
    boxes = _boxes(response)
    content = _box_group(response, boxes)
    text = _statement_or_tail(response, boxes[-1][1] if boxes and content else 0, answer_format)
    if text is None:
        return content or None
    if answer_problem(text) is not None:  # graded wrong: no answer to vote for
        return None
    from math_verify import parse

    found = [x for x in parse(text, parsing_timeout=_timeout()) if isinstance(x, str)]
    return found[0] if found and found[0] else None


def final_answer_or_statement(response: str, extra_info: dict | None = None) -> str | None:
    """The answer as ``answer_format="boxed_or_final"`` grades it (the box group, or what
    math_verify reads in a final-answer statement after it), for voting."""
    return _extracted(response, "boxed_or_final")


def final_answer_any(response: str, extra_info: dict | None = None) -> str | None:
    """The answer as ``answer_format="any"`` grades it, for voting."""
    return _extracted(response, "any")


def same_answer(a: str, b: str) -> bool:
    """Two boxed answers are equivalent: equal strings, else math_verify with ``a`` in the
    gold role (math_verify is not exactly symmetric; voting passes a cluster's first answer as ``a``)."""
    return a == b or is_equivalent(a, b)


def parse_row(raw: dict, source: str, row: int) -> tuple[dict, dict]:
    if not isinstance(raw.get("problem"), str):
        raise DataError(source, row, "problem", "missing" if raw.get("problem") is None else "expected a string")
    answer = raw.get("answer")
    if answer is None and isinstance(raw.get("solution"), str):
        answer = boxed_answer(raw["solution"])
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


def task(*, template: str = TEMPLATE, default_path: str = DEFAULT_PATH, answer_format: str = "boxed", **options: Any) -> Task:
    """The math task; ``options``: format_weight, chat, system_prompt, split (see ``builtin_task``).
    ``answer_format``: "boxed" (the default: only a box is an answer), "boxed_or_final" (eval:
    also a final-answer statement) or "any" (eval: also the response's end, as math_verify reads
    it); see the module docstring."""
    _check_format(answer_format)
    t = builtin_task(NAME, parse_row, "relign.envs.math:reward", template=template, default_path=default_path,
                     extract_spec="relign.envs.math:final_answer", answer_marker="\\boxed", step_delimiter="\n\n", equal_spec="relign.envs.math:same_answer", **options)
    if answer_format != "boxed":
        extract = "final_answer_or_statement" if answer_format == "boxed_or_final" else "final_answer_any"
        t = replace(t, reward_kwargs={**t.reward_kwargs, "answer_format": answer_format},
                    extract_spec=f"relign.envs.math:{extract}")
    return t
