"""Measure a model on a task's problems: by sampling (accuracy, pass@k, maj@k, lengths), or by a search strategy.

    for each batch of problems:
        sample     n completions per prompt (one prefill per prompt; seed + batch index)
        score      every completion with the task's reward (worker processes: raise/hang -> 0)
        extract    every completion's final answer (the task's extractor, for maj@k)
    per problem:   c = correct samples of n;  pass@k(n, c, k);  majority answer of the first k
    average over problems

``evaluate(...)`` is the loop on a model already in memory, through the engine the caller
built (the run's own in RL, so eval samples the weights being trained), which ``relign eval``
(``relign.recipes.eval``), RL (``eval.every``: ``PeriodicEval``, here), ReST-EM and the demo
call. ``search_eval(...)`` runs a search strategy (``relign.strategies``) on the same problems
and grades its answers (below).
Prompts are rendered by ``relign.envs.tasks.render_prompt``, the renderer RL's collector
uses; the votes are ``relign.strategies.voting``'s; tasks come from
``relign.envs.tasks.build_task``.

Metric definitions (docs/eval.md):

* ``accuracy``: mean score over all samples: the pass@1 estimate; with temperature 0 (one
  greedy sample per problem) it is greedy accuracy. Scores may be fractional here.
* ``pass@k``: the unbiased estimator of Chen et al. (2021), averaged over problems. A sample
  counts as correct when its score is at least ``correct_threshold`` (1.0: fully correct).
* ``maj@k``: self-consistency (Wang et al., 2023): the majority answer of the **first** k
  samples, compared by the task's own equivalence; 1 if it is a correct answer. Averaging over
  all k-subsets when n > k would be exact but needs the vote of every subset (no closed form
  with first-seen tie breaking), so we do not; with n == k nothing is lost.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .envs.rewards import RewardPool
from .envs.tasks import Problem, encode_problems
from .rollout.engine import SamplingParams
from .strategies.base import Budget, SearchResult
from .strategies.voting import maj_at_k, majority, vote

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- metrics (pure)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem (Chen et al. 2021, "Evaluating Large Language Models
    Trained on Code", eq. 1): the probability that k of the n samples, drawn without
    replacement, include at least one of the c correct ones::

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

    The product form never builds the binomials (C(200, 100) overflows a float).
    """
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass@k needs n >= 1 samples and 0 <= c <= n correct ones, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # fewer wrong samples than k: every k-subset holds a correct one
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


# --------------------------------------------------------------------------- the loop


def _guard(fn: Callable[..., Any], default: Any, counter: dict[str, int], key: str) -> Callable[..., Any]:
    """``fn`` that returns ``default`` (and counts) instead of raising: a buggy extractor must
    not end an hour of generation."""

    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - user code; counted and logged
            if counter[key] == 0:
                log.warning("%s raised %s: %s (counted as %r; further errors are only counted)",
                            key, type(e).__name__, e, default)
            counter[key] += 1
            return default

    return call


def evaluate(engine, tokenizer, task, records, *, n=1, ks=(1,), temperature=0.0, top_p=1.0, max_new_tokens=256,
             batch_prompts=32, seed=0, reward_workers=0, reward_timeout=10.0, progress=True, desc="eval",
             top_k: int = 0, stop: Sequence[str] = (), max_prompt_length: int = 0, correct_threshold: float = 1.0,
             pool=None) -> tuple[dict, list[dict]]:
    """Sample ``n`` completions per record through ``engine``, score them, and return (summary, sample rows).

    ``records`` are task records (``Task.load``). Each batch is sampled with its own seed
    (``seed`` + batch index), so a shared engine's random stream (RL's, saved in its
    checkpoints) is left untouched. The HF engine puts its model in eval mode while sampling
    and restores it afterwards. ``pool`` reuses a
    ``RewardPool`` for ``task``'s reward; else one is made from ``reward_workers`` (0: in this
    process, no timeout) and closed at the end. ``ks`` greater than ``n`` are skipped.
    ``max_prompt_length`` > 0 skips (and counts) longer prompts.

    Summary: ``accuracy``, ``pass@{k}`` and (if the task has an answer extractor) ``maj@{k}``
    for each k in ``ks``, ``reward_mean``, ``length_mean``, ``length_max``, ``truncated_frac``,
    ``num_problems``, ``num_samples``, plus ``answered_frac``, ``reward_errors``,
    ``reward_timeouts``, ``skipped_long``. Rows: one per sample, schema in docs/eval.md.
    """
    if n < 1 or batch_prompts < 1:
        raise ValueError(f"evaluate needs n >= 1 and batch_prompts >= 1, got n={n}, batch_prompts={batch_prompts}")
    if temperature <= 0 and n > 1:
        raise ValueError(f"temperature={temperature} is greedy decoding: all n={n} samples would be the same; "
                         "use n=1 or a temperature > 0")
    ks = sorted({int(k) for k in ks if 1 <= int(k) <= n})
    voting = task.extract_spec is not None
    errors = {"extract": 0, "equal": 0}
    extract = _guard(task.extract_answer, None, errors, "extract")
    equal = _guard(task.answers_equal, False, errors, "equal")

    # Render and tokenize every prompt once (as RL does); too-long prompts are skipped and counted.
    problems, skipped_long = encode_problems(tokenizer, records, max_prompt_length=max_prompt_length)
    if not problems:
        raise ValueError(f"nothing to evaluate: {len(records)} records, {skipped_long} longer than {max_prompt_length} tokens")

    own_pool = pool is None
    pool = pool if pool is not None else RewardPool.from_task(task, num_workers=reward_workers, timeout=reward_timeout)
    stats0 = dict(pool.stats)
    grade = partial(_grade_problem, ks=ks, extract=extract if voting else None, equal=equal if voting else None,
                    threshold=correct_threshold)
    try:
        rows, per_problem = _sample_and_score(engine, pool, problems, grade, n=n, temperature=temperature, top_p=top_p,
                                              top_k=top_k, max_new_tokens=max_new_tokens, stop=stop, seed=seed,
                                              batch_prompts=batch_prompts, progress=progress, desc=desc)
    finally:
        stats = dict(pool.stats)
        if own_pool:
            pool.close()

    summary = _eval_summary(rows, per_problem, ks, voting=voting, num_problems=len(problems), skipped_long=skipped_long,
                            stats0=stats0, stats=stats, errors=errors)
    return summary, rows


def _sample_and_score(engine, pool, problems: list[Problem], grade: Callable[..., tuple[list[dict], dict[str, float]]], *,
                      n: int, temperature: float, top_p: float, top_k: int, max_new_tokens: int, stop: Sequence[str],
                      seed: int, batch_prompts: int, progress: bool, desc: str) -> tuple[list[dict], list[dict[str, float]]]:
    """Sample, score and grade ``problems`` batch by batch (batch ``b`` seeded ``seed + b``): (rows, per-problem metrics)."""
    rows: list[dict] = []
    per_problem: list[dict[str, float]] = []
    bar = tqdm(total=len(problems), desc=desc, disable=not progress, dynamic_ncols=True, file=sys.stderr,
               mininterval=0.5 if sys.stderr.isatty() else 5.0)
    try:
        for b, start in enumerate(range(0, len(problems), batch_prompts)):
            chunk = problems[start : start + batch_prompts]
            params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                                    stop=list(stop), seed=seed + b)
            outs = engine.generate([p.prompt_ids for p in chunk], params)
            flat = [(p, c) for p, cs in zip(chunk, outs) for c in cs]
            results = pool.score([p.prompt_text for p, _ in flat], [c.text for _, c in flat], [p.extra_info for p, _ in flat],
                                  completion_ids=[c.token_ids for _, c in flat])
            for q, (p, completions) in enumerate(zip(chunk, outs)):
                problem_rows, metrics = grade(p, completions, results[q * n : (q + 1) * n])
                per_problem.append(metrics)
                rows.extend(problem_rows)
            bar.update(len(chunk))
            bar.set_postfix(acc=f"{sum(r['score'] for r in rows) / len(rows):.3f}", refresh=False)
    finally:
        bar.close()
    return rows, per_problem


def _grade_problem(problem: Problem, completions, scored, *, ks: list[int], extract: Callable[..., str | None] | None,
                   equal: Callable[[str, str], bool] | None, threshold: float) -> tuple[list[dict], dict[str, float]]:
    """One problem's sample rows and its pass@k / maj@k; ``extract`` and ``equal`` are None for a task without votes."""
    rows = [_sample_row(problem, j, c, r, extract(c.text, problem.extra_info) if extract is not None else None, threshold)
            for j, (c, r) in enumerate(zip(completions, scored))]
    return rows, _problem_metrics(rows, ks, equal)


def _eval_summary(rows: list[dict], per_problem: list[dict[str, float]], ks: list[int], *, voting: bool, num_problems: int,
                  skipped_long: int, stats0: dict, stats: dict, errors: dict[str, int]) -> dict[str, float]:
    """``evaluate``'s summary; the pool's error counts are ``stats`` less ``stats0``: a shared pool counted earlier calls."""
    summary: dict[str, float] = {"accuracy": _mean([r["score"] for r in rows])}
    for k in ks:
        summary[f"pass@{k}"] = _mean([m[f"pass@{k}"] for m in per_problem])
    if voting:
        for k in ks:
            summary[f"maj@{k}"] = _mean([m[f"maj@{k}"] for m in per_problem])
        summary["answered_frac"] = _mean([r["extracted"] is not None for r in rows])
    lengths = [r["length"] for r in rows]
    summary.update({
        "reward_mean": _mean([r["reward"] for r in rows]),
        "length_mean": _mean(lengths),
        "length_max": float(max(lengths)),
        "truncated_frac": _mean([r["finish_reason"] == "length" for r in rows]),
        "num_problems": float(num_problems),
        "num_samples": float(len(rows)),
        "reward_errors": float(stats.get("exceptions", 0) - stats0.get("exceptions", 0)),
        "reward_timeouts": float(stats.get("timeouts", 0) - stats0.get("timeouts", 0)),
        "skipped_long": float(skipped_long),
    })
    if errors["extract"] or errors["equal"]:
        summary["extract_errors"] = float(errors["extract"])
        summary["equal_errors"] = float(errors["equal"])
    return summary


def _mean(values: Sequence[float]) -> float:
    return float(sum(values)) / len(values) if values else 0.0


def _sample_row(problem: Problem, j: int, completion, result, answer: str | None, threshold: float) -> dict[str, Any]:
    return {
        "problem": problem.id, "sample": j, "prompt": problem.prompt_text, "question": problem.question,
        "response": completion.text, "extracted": answer,
        "reward": result.reward, "score": result.score, "correct": result.score >= threshold,
        "components": dict(result.components), "reward_error": result.error,
        "finish_reason": completion.finish_reason, "length": len(completion.token_ids), "extra_info": problem.extra_info,
        # the problem's vote (filled in by _problem_metrics when the task has an answer extractor)
        "vote": None, "votes": None, "majority": None, "majority_correct": None,
    }


def _problem_metrics(rows: list[dict], ks: list[int], equal: Callable[[str, str], bool] | None) -> dict[str, float]:
    """pass@k and maj@k of one problem; adds the vote fields (of the largest k) to its rows."""
    n = len(rows)
    c = sum(r["correct"] for r in rows)
    out = {f"pass@{k}": pass_at_k(n, c, k) for k in ks}
    if equal is None:
        return out
    answers = [r["extracted"] for r in rows]
    correct = [r["correct"] for r in rows]
    for k in ks:
        out[f"maj@{k}"] = maj_at_k(answers, correct, k, equal)
    clusters = vote(answers[: max(ks) if ks else n], equal)
    winner = majority(clusters)
    votes: dict[str, int] = {}
    for cluster in clusters:  # keyed by each cluster's first answer, in first-seen order
        votes[answers[cluster[0]]] = votes.get(answers[cluster[0]], 0) + len(cluster)
    voted_for = {i: answers[cluster[0]] for cluster in clusters for i in cluster}
    for i, r in enumerate(rows):
        r["vote"] = voted_for.get(i)
        r["votes"] = votes
        r["majority"] = answers[winner[0]] if winner else None
        r["majority_correct"] = bool(correct[winner[0]]) if winner else None
    return out


# --------------------------------------------------------------------------- writing results


def write_samples(path: str | Path, rows: list[dict]) -> None:
    """One JSON object per line; values JSON cannot hold (from a custom extra_info) become strings."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")


def format_summary(summary: dict[str, float]) -> str:
    keys = [k for k in summary if k in ("accuracy", "reward_mean", "length_mean", "truncated_frac") or "@" in k]
    return "  ".join(f"{k} {summary[k]:.4g}" for k in keys)


# --------------------------------------------------------------------------- inside training (eval.every)


class PeriodicEval:
    """Held-out evaluation inside a training loop (RL's ``eval.every``): the problems and the reward
    pool are set up once, and each call evaluates the current policy through the run's engine
    (which shares its weights), with the same seeds every time, so successive evals differ by the
    weights and not by sampling luck. Plain temperature sampling (no top-p / top-k)."""

    def __init__(self, task, records: list[dict], tokenizer, run_dir: str | Path, *, every: int, n: int = 1,
                 ks: Sequence[int] = (), temperature: float = 0.0, max_new_tokens: int = 256, batch_prompts: int = 32,
                 samples: bool = True, stop: Sequence[str] = (), max_prompt_length: int = 0, seed: int = 0,
                 reward_workers: int = 0, reward_timeout: float = 10.0):
        self.task, self.records, self.tok, self.run_dir = task, records, tokenizer, Path(run_dir)
        self.every, self.samples, self.seed = every, samples, seed
        self.options = dict(n=n, ks=sorted(set(ks)) or sorted({1, n}), temperature=temperature, stop=tuple(stop),
                            max_new_tokens=max_new_tokens, batch_prompts=batch_prompts, max_prompt_length=max_prompt_length)
        self.pool = RewardPool.from_task(task, num_workers=reward_workers, timeout=reward_timeout)

    def due(self, step: int, last_step: int) -> bool:
        """Every ``every`` steps and at the last one (so a run always ends with an eval); never when 0."""
        return self.every > 0 and (step % self.every == 0 or step == last_step)

    def __call__(self, engine, step: int, write: Callable[[str], None] | None = None) -> dict[str, float]:
        """Evaluate now; returns the summary as ``eval/<metric>`` plus ``time/eval_s``."""
        t0 = time.perf_counter()
        summary, rows = evaluate(engine, self.tok, self.task, self.records, seed=self.seed, pool=self.pool, progress=False,
                                 **self.options)
        if self.samples:
            write_samples(self.run_dir / "eval" / f"step_{step}.jsonl", rows)
        if write is not None:
            write(f"step {step} eval: {format_summary(summary)}")
        return {**{f"eval/{k}": v for k, v in summary.items()}, "time/eval_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.pool.close()


# --------------------------------------------------------------------------- by a search strategy
#
#     for each batch of problems (searched in lockstep):
#         results = strategy.search(engine, task, batch, budget=..., scorer=...)
#     grade      each chosen answer with the task's reward (gold answer used here, after the search)
#     summarize  accuracy with its 95% Wilson interval, generated tokens per question, engine calls
#
# The grading reads the gold answer; the search never does (the guard in ``strategies.scorers``).


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


__all__ = [
    "CountingEngine", "PeriodicEval", "evaluate", "format_summary", "pass_at_k", "search_eval", "summarize",
    "sweep_markdown", "wilson_interval", "write_samples",
]
