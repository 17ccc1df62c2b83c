"""Evaluate a search strategy on a task's problems: the answers, their grades, and what they cost.

    for each batch of problems (searched in lockstep):
        results = strategy.search(engine, task, batch, budget=..., scorer=...)
    grade      each chosen answer with the task's reward (gold answer used here, after the search)
    summarize  accuracy with its 95% Wilson interval, generated tokens per question, engine calls

The grading reads the gold answer; the search never does (the guard in ``scorers``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .base import Budget, Problem, SearchResult


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion k / n (95% for z = 1.96).

    Unlike the normal approximation it stays inside [0, 1] and is not empty at k = 0 or n:
    center (p + z²/2n) / (1 + z²/n), half-width z·sqrt(p(1−p)/n + z²/4n²) / (1 + z²/n).
    """
    if n <= 0:
        return 0.0, 0.0
    p = k / n
    d = 1 + z * z / n
    center = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, center - half), min(1.0, center + half)


class CountingEngine:
    """An engine wrapper that counts ``generate`` calls (the lockstep figure of a whole eval)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def generate(self, prompts, params, *, seeds=None):
        self.calls += 1
        return self.engine.generate(prompts, params, seeds=seeds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def search_eval(strategy, engine, task, problems: list[Problem], *, budget: Budget, scorer=None, seed: int = 0,
                pool, batch_problems: int = 64, correct_threshold: float = 1.0, progress: bool = True,
                desc: str = "search") -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Search every problem, grade the answers, and return (summary, one row per problem).

    ``pool`` (a ``RewardPool`` for ``task``) grades the chosen solutions: a reward that raises
    or hangs grades 0. A problem whose scorer raised is counted in ``failed`` and graded wrong.
    """
    from tqdm.auto import tqdm

    counter = CountingEngine(engine)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    bar = tqdm(total=len(problems), desc=desc, disable=not progress, dynamic_ncols=True, file=sys.stderr,
               mininterval=0.5 if sys.stderr.isatty() else 5.0)
    try:
        for start in range(0, len(problems), batch_problems):
            chunk = problems[start : start + batch_problems]
            results = strategy.search(counter, task, chunk, budget=budget, scorer=scorer, seed=seed)
            rows.extend(_grade(task, chunk, results, pool, correct_threshold, strategy.name))
            bar.update(len(chunk))
            bar.set_postfix(acc=f"{sum(r['correct'] for r in rows) / len(rows):.3f}",
                            tok=f"{sum(r['cost']['generated_tokens'] for r in rows) / len(rows):.0f}", refresh=False)
    finally:
        bar.close()
    wall = time.perf_counter() - t0
    return summarize(rows, engine_calls=counter.calls, wall_s=wall), rows


def _grade(task, problems: Sequence[Problem], results: Sequence[SearchResult], pool, threshold: float,
           name: str) -> list[dict[str, Any]]:
    graded = [(p, r) for p, r in zip(problems, results) if r.chosen is not None and r.error is None]
    scores = pool.score([p.prompt_text for p, _ in graded], [r.chosen.text for _, r in graded],
                        [p.extra_info for p, _ in graded]) if graded else []
    score_of = {id(r): s for (_, r), s in zip(graded, scores)}
    rows = []
    for p, r in zip(problems, results):
        s = score_of.get(id(r))
        rows.append({
            "problem": p.id, "question": p.question, "strategy": name, "answer": r.answer,
            "gold": p.extra_info.get("answer", p.extra_info.get("target")),
            "correct": bool(s is not None and s.score >= threshold),
            "score": None if s is None else s.score, "error": r.error,
            "cost": asdict(r.cost),
            "candidates": [{"text": c.text, "answer": c.answer, "score": c.score, "finish_reason": c.finish_reason,
                            "tokens": len(c.token_ids), "meta": c.meta} for c in r.candidates],
            "tree": r.tree,
        })
    return rows


def summarize(rows: list[dict[str, Any]], *, engine_calls: int, wall_s: float) -> dict[str, float]:
    """accuracy (+ 95% Wilson interval) and the mean cost per question."""
    n = len(rows)
    k = sum(r["correct"] for r in rows)
    lo, hi = wilson_interval(k, n)

    def mean(key: str) -> float:
        return sum(r["cost"][key] for r in rows) / n if n else 0.0

    return {
        "accuracy": k / n if n else 0.0, "ci_low": lo, "ci_high": hi,
        "tokens_per_question": mean("generated_tokens"), "prompt_tokens_per_question": mean("prompt_tokens"),
        "engine_calls": float(engine_calls), "engine_calls_per_question": mean("engine_calls"),
        "scorer_calls_per_question": mean("scorer_calls"),
        "answered_frac": sum(r["answer"] is not None for r in rows) / n if n else 0.0,
        "failed": float(sum(r["error"] is not None for r in rows)), "num_problems": float(n), "wall_s": wall_s,
    }


def sweep_markdown(rows: list[dict[str, Any]]) -> str:
    """The sweep's one table, as Markdown."""
    head = "| strategy | budget (tokens) | accuracy [95% CI] | tokens / question | engine calls | wall s | failed |\n"
    head += "|---|---|---|---|---|---|---|\n"
    lines = [f"| {r['strategy']} | {r['budget'] if r['budget'] is not None else '-'} | {r['accuracy']:.3f} "
             f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {r['tokens_per_question']:.0f} | {r['engine_calls']:.0f} | "
             f"{r['wall_s']:.1f} | {r['failed']:.0f} |" for r in rows]
    return head + "\n".join(lines) + "\n"
