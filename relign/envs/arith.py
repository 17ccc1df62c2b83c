"""Multi-step arithmetic: a synthetic task with a verifiable answer, generated from a seed.

A problem is a chain of small integers joined by ``+`` and ``-``, read left to right::

    prompt:    Compute 7 + 5 - 3.
    solution:  7+5=12, 12-3=9. #### 9

The worked solution does one operation per step, so a small model can learn the steps and
chain them. The answer is the integer after the last ``####`` and must be followed by nothing
but an optional period and whitespace: ``#### 9`` is right, ``#### 9 apples``, ``#### 9.5``
and a response without ``####`` are not (no fallback to the last number, because every step
of the chain ends in a number). Only ``+`` and ``-`` are used, so reading left to right and
the usual operator precedence give the same value; ``safe_arith`` (never ``eval``) computes
the answer when a row gives only the expression.

Generation is deterministic from the seed (``random.Random(seed)``), and ``make_splits``
keeps the held-out test problems disjoint from the training problems (no expression in
both). ``relign demo`` uses this task; it also works on its own, e.g.
``relign rl task.name=relign.envs.arith:task task.path=train.jsonl`` with files written by
``write_splits``.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

from relign.data.readers import DataError
from relign.envs.base import Task, builtin_task
from relign.envs.reward_fn import combine
from relign.envs.safe_arith import ArithError, evaluate

NAME = "arith"
TEMPLATE = "Compute {expression}."

# The answer: the last "####", then an integer, then at most a period and whitespace.
_ANSWER = re.compile(r"[ \t]*(-?\d+)\.?\s*")
_MARKER = "####"
# What may follow the last "####": an answer is a few digits. Longer text is refused before the
# regex and int() see it (int() of a 1 MB digit string raises, past Python's 4300-digit limit).
MAX_ANSWER_CHARS = 64


# --------------------------------------------------------------------------- problems


def make_problem(rng: random.Random, *, min_ops: int = 2, max_ops: int = 3, max_operand: int = 9) -> dict[str, Any]:
    """One problem ``{"expression": "7 + 5 - 3", "answer": 9}``: ``min_ops``..``max_ops``
    operations on operands 1..``max_operand``."""
    n_ops = rng.randint(min_ops, max_ops)
    nums = [rng.randint(1, max_operand) for _ in range(n_ops + 1)]
    ops = [rng.choice("+-") for _ in range(n_ops)]
    expression = str(nums[0]) + "".join(f" {op} {n}" for op, n in zip(ops, nums[1:]))
    total = nums[0]
    for op, n in zip(ops, nums[1:]):
        total = total + n if op == "+" else total - n
    return {"expression": expression, "answer": total}


def make_splits(
    n_train: int, n_test: int, *, seed: int = 0, min_ops: int = 2, max_ops: int = 3, max_operand: int = 9
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``n_train`` training and ``n_test`` held-out problems, all distinct expressions.

    The same arguments always give the same problems in the same order."""
    if min_ops < 1 or max_ops < min_ops or max_operand < 1:
        raise ValueError(f"need 1 <= min_ops <= max_ops and max_operand >= 1, got {min_ops}, {max_ops}, {max_operand}")
    space = sum(max_operand ** (k + 1) * 2**k for k in range(min_ops, max_ops + 1))
    wanted = n_train + n_test
    if wanted > space // 2:
        # rejection sampling of distinct problems slows down near the size of the space
        raise ValueError(f"{wanted} distinct problems requested but only {space} exist; allow more operations or operands")
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[dict[str, Any]] = []
    while len(problems) < wanted:
        p = make_problem(rng, min_ops=min_ops, max_ops=max_ops, max_operand=max_operand)
        if p["expression"] not in seen:
            seen.add(p["expression"])
            problems.append(p)
    # the test set is drawn first, so changing n_train does not change the test problems
    return problems[n_test:], problems[:n_test]


def solution(expression: str) -> str:
    """The worked solution the SFT warm start teaches: ``"7+5=12, 12-3=9. #### 9"``."""
    tokens = expression.split()
    total = int(tokens[0])
    steps = []
    for op, n in zip(tokens[1::2], tokens[2::2]):
        new = total + int(n) if op == "+" else total - int(n)
        steps.append(f"{total}{op}{n}={new}")
        total = new
    return ", ".join(steps) + f". {_MARKER} {total}"


def write_splits(
    out_dir: str | os.PathLike, n_train: int, n_test: int, *, seed: int = 0, direct_frac: float = 0.0, **shape: int
) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` (rows ``{"expression", "answer"}``) and
    ``sft.jsonl``: the training problems as ``{"prompt", "response"}`` demonstrations, a
    ``direct_frac`` share of them giving the answer alone (``"#### 9"``), the rest the worked
    solution. Returns the three paths by name."""
    train, test = make_splits(n_train, n_test, seed=seed, **shape)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + 1_000_003)  # its own stream: direct_frac does not move the problems
    sft = [
        {
            "prompt": TEMPLATE.replace("{expression}", p["expression"]),
            "response": f"{_MARKER} {p['answer']}" if rng.random() < direct_frac else solution(p["expression"]),
        }
        for p in train
    ]
    paths = {"train": out / "train.jsonl", "test": out / "test.jsonl", "sft": out / "sft.jsonl"}
    for name, rows in (("train", train), ("test", test), ("sft", sft)):
        tmp = paths[name].with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, paths[name])  # a concurrent reader never sees half a file
    return paths


# --------------------------------------------------------------------------- reward


def extract_answer(response: str) -> int | None:
    """The integer after the last ``####`` (only a period and whitespace may follow); else None."""
    if _MARKER not in response:
        return None
    after = response.rsplit(_MARKER, 1)[1]
    if len(after.strip()) > MAX_ANSWER_CHARS:
        return None
    m = _ANSWER.fullmatch(after)
    return int(m.group(1)) if m else None


def final_answer(response: str, extra_info: dict | None = None) -> str | None:
    """The answer as a canonical integer string, for majority voting (maj@k); None if there is none."""
    value = extract_answer(response)
    return None if value is None else str(value)


def format_ok(response: str) -> bool:
    """Exactly one ``####``, followed by an integer and nothing else."""
    return response.count(_MARKER) == 1 and extract_answer(response) is not None


def reward(prompt: str, response: str, extra_info: dict, *, format_weight: float = 0.0) -> dict[str, Any]:
    """1 if the response's answer equals ``extra_info["answer"]``; plus ``format_weight`` x format."""
    pred = extract_answer(response)
    correct = pred is not None and pred == int(extra_info["answer"])
    return combine(float(correct), float(format_ok(response)), format_weight)


# --------------------------------------------------------------------------- task


def parse_row(raw: dict, source: str, row: int) -> tuple[dict, dict]:
    """``{"expression": "7 + 5 - 3", "answer": 9}``; without "answer" it is computed."""
    expr = raw.get("expression")
    if not isinstance(expr, str) or not expr.strip():
        raise DataError(source, row, "expression", f"expected a non-empty string, got {expr!r:.80}")
    try:
        value = evaluate(expr)
    except ArithError as e:
        raise DataError(source, row, "expression", f"not + - * / arithmetic on integers: {e}") from None
    if "answer" in raw:
        try:
            answer = int(raw["answer"])
        except (TypeError, ValueError):
            raise DataError(source, row, "answer", f"expected an integer, got {raw['answer']!r:.80}") from None
        if answer != value:
            raise DataError(source, row, "answer", f"{answer} is not the value of {expr!r} ({value})")
    elif value.denominator != 1:
        raise DataError(source, row, "expression", f"value {value} is not an integer")
    return {"expression": expr.strip()}, {"answer": int(value), "expression": expr.strip()}


def task(*, template: str = TEMPLATE, default_path: str | None = None, **options: Any) -> Task:
    """The arithmetic task; ``options``: format_weight, chat, system_prompt (see ``builtin_task``).

    Usable by spec (``task.name=relign.envs.arith:task``). It ships no data: give a path to a
    file written by ``write_splits`` (``relign demo`` writes them into its run directory)."""
    return builtin_task(NAME, parse_row, "relign.envs.arith:reward", template=template, default_path=default_path,
                        extract_spec="relign.envs.arith:final_answer", answer_marker="####", reward_needs_reference=True, step_delimiter=",", **options)
