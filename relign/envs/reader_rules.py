"""The rule-based reader of linguistic calibration: what a paragraph claims, read without a model.

A reader (Band et al., arXiv 2404.00474) answers two questions about a paragraph z written for a
question x: which answers does z commit to (*extract*), and with what probability does it give
each one (*forecast*). ``RuleReader`` answers both by parsing explicit statements. It is exact on
text that follows these forms, and brittle on anything else: it is the reader of tests and of
the synthetic ``calibration`` task, not a substitute for the learned reader (``models.reader``).

Statements it reads (case-insensitive, anywhere in the paragraph):

* ``X with 60% likelihood`` (or probability / chance / confidence, or nothing: ``B with 40%``),
* ``I estimate 70% that the answer is X`` (``70% that ... is X``: the text after the last "is"),
  ``I estimate 50% X, 50% Y`` and ``X (50%)``,
* ``I am certain that X`` / ``I am sure X`` -> 1.0,
* ``conf: 7`` on a question that ends in two options (``..., A or B?``): the first option with
  7/10, the second with 3/10 (``conf: 70%`` also works; an integer 0..10 is in tenths),
* ``No Answer`` (the whole paragraph) -> no answer at all,
* anything else is an unhedged answer: the paragraph's first sentence (without a leading "the
  answer is" / "it is") with probability 1.0.

A confidence that is not a number or lies outside [0, 1] (``conf: 12``, ``140%``) is no
statement: it is counted (``RuleReader.bad``) and left out. Numbers are parsed by ``float`` on
a matched digit string; nothing in a paragraph is executed.

Answers are compared as TriviaQA's evaluation compares them (``normalize_answer``: lower case,
punctuation and articles removed, whitespace collapsed), against the gold answer and its aliases.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

NO_ANSWER = "no answer"
MAX_CHARS = 4000
"""Only a paragraph's first 4000 characters are read: the patterns scan each clause from every
start, so a hostile megabyte-long response must not cost quadratic time."""

_PUNCT = set(string.punctuation + "‘’´`")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUM = r"[-+]?\d+(?:\.\d+)?"
_ANS = r"[^,;.\n%]+?"  # an answer: no clause punctuation
_WITH = re.compile(rf"(?P<ans>{_ANS})\s+with\s+(?:an?\s+)?(?P<num>{_NUM}|\S+?)\s*%", re.I)
_THAT = re.compile(rf"(?P<num>{_NUM})\s*%\s+(?:(?:that|on|for)\s+)?(?P<ans>[^,;\n%]+?)"
                   rf"(?=[,;\n]|\.(?:\s|$)|$|\s+(?:and|or)\s+{_NUM}\s*%)", re.I)
_PAREN = re.compile(rf"(?P<ans>{_ANS})\s*\(\s*(?P<num>{_NUM}|[^)\s]+?)\s*%\s*\)", re.I)
_CERTAIN = re.compile(r"\bI\s+am\s+(?:certain|sure|confident)\s+(?:that\s+)?(?P<ans>[^,;\n]+?)(?=[,;\n]|\.(?:\s|$)|$)", re.I)
_CONF = re.compile(r"\bconf(?:idence)?\s*[:=]\s*(?P<num>\S+)", re.I)
_TWO_OPTIONS = re.compile(r"(?:^|[\s,:])(?P<a>[^\s,:?]+)\s+or\s+(?P<b>[^\s,:?]+)\s*\?\s*$", re.I)
_LEAD = re.compile(r"^(?:(?:and|or|but|so)\s+)?(?:i\s+(?:think|believe|estimate|guess)\s+(?:that\s+)?)?"
                   r"(?:(?:the\s+answer|it)\s+(?:is|was)\s+)?", re.I)


def normalize_answer(s: str) -> str:
    """TriviaQA's answer normalization: lower case, underscores and punctuation to spaces, the
    articles a/an/the removed, whitespace collapsed."""
    s = s.lower().replace("_", " ")
    s = "".join(" " if ch in _PUNCT else ch for ch in s)
    kept = " ".join(_ARTICLES.sub(" ", s).split())
    # an answer that is only an article ("A", an option's name) keeps it rather than vanish
    return kept or " ".join(s.split())


def _clean(answer: str, *, after_is: bool = False) -> str:
    a = answer.strip()
    if after_is and re.search(r"\s(?:is|was)\s", a, re.I):
        a = re.split(r"\s(?:is|was)\s", a, flags=re.I)[-1]
    return _LEAD.sub("", a).strip().rstrip(".!").strip()


def _prob(num: str, *, tenths: bool = False) -> float | None:
    """A stated confidence as a probability, or None when it is not a number in range."""
    pct = num.endswith("%")
    num = num.rstrip("%").rstrip(".")
    if not re.fullmatch(_NUM, num):
        return None
    v = float(num)
    if tenths and not pct:
        if not (v.is_integer() and 0 <= v <= 10):
            return None
        return v / 10
    v /= 100
    return v if 0.0 <= v <= 1.0 else None


def two_options(question: str) -> tuple[str, str] | None:
    """The two options of a question that ends in ``A or B?``, else None."""
    m = _TWO_OPTIONS.search(question.strip())
    return (m["a"], m["b"]) if m else None


def parse_statements(question: str, paragraph: str) -> tuple[list[tuple[str, float]], int]:
    """(the (answer, probability) statements of ``paragraph`` in order of appearance, first per
    answer; the number of confidences that were not a probability). See the module docstring."""
    text = paragraph[:MAX_CHARS].strip()
    if normalize_answer(text) == NO_ANSWER:
        return [], 0
    found: list[tuple[int, str, float]] = []
    bad = 0
    used: set[int] = set()  # where each "%" is: one percentage makes one statement, read by the first form that fits
    for pattern, after_is in ((_WITH, False), (_PAREN, False), (_THAT, True)):
        for m in pattern.finditer(text):
            pct = text.index("%", m.start("num"))
            if pct in used:
                continue
            used.add(pct)
            p = _prob(m["num"] + "%")
            if p is None:
                bad += 1
                continue
            found.append((m.start(), _clean(m["ans"], after_is=after_is), p))
    for m in _CERTAIN.finditer(text):
        found.append((m.start(), _clean(m["ans"], after_is=True), 1.0))
    options = two_options(question)
    bare = False
    for m in _CONF.finditer(text):
        p = _prob(m["num"], tenths=True)
        if p is None or options is None:  # a bare confidence states no answer of its own: no fallback below
            bad += p is None
            bare = True
            continue
        found += [(m.start(), options[0], p), (m.start() + 1, options[1], 1.0 - p)]
    if not found and not bad and not bare and text:
        first = re.split(r"\.(?:\s|$)|\n", text, maxsplit=1)[0]
        found.append((0, _clean(first), 1.0))
    out: list[tuple[str, float]] = []
    seen: set[str] = set()
    for _, ans, p in sorted(found, key=lambda t: t[0]):
        key = normalize_answer(ans)
        if key and key not in seen:
            seen.add(key)
            out.append((ans, p))
    return out, bad


def _names(answer: str | Sequence[str]) -> set[str]:
    return {normalize_answer(answer)} if isinstance(answer, str) else {normalize_answer(a) for a in answer}


class RuleReader:
    """The reader protocol (``extract``, ``forecast``) by ``parse_statements``; deterministic, no model.

    ``bad`` counts the confidences that were not a probability, over every call so far."""

    def __init__(self):
        self.bad = 0

    def _parse(self, question: str, paragraph: str) -> list[tuple[str, float]]:
        stmts, bad = parse_statements(question, paragraph)
        self.bad += bad
        return stmts

    def extract(self, questions: Sequence[str], paragraphs: Sequence[str]) -> list[list[str]]:
        """The answers each paragraph commits to, deduplicated (by normalized form), in order."""
        return [[a for a, _ in self._parse(q, z)] for q, z in zip(questions, paragraphs, strict=True)]

    def forecast(self, questions: Sequence[str], paragraphs: Sequence[str],
                 answers: Sequence[str | Sequence[str]]) -> list[float]:
        """The probability each paragraph gives each answer (a string, or the answer with its
        aliases: any of them matches); 0 where the paragraph does not state it."""
        out = []
        for q, z, a in zip(questions, paragraphs, answers, strict=True):
            names = _names(a)
            out.append(next((p for s, p in self._parse(q, z) if normalize_answer(s) in names), 0.0))
        return out


def answers_match(answer: str, gold: str | Sequence[str]) -> bool:
    """Whether ``answer`` is the gold answer (or one of its aliases) after normalization."""
    return normalize_answer(answer) in _names(gold)


__all__ = ["NO_ANSWER", "RuleReader", "answers_match", "normalize_answer", "parse_statements", "two_options"]
