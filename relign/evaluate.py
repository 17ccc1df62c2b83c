"""Evaluate a model on a task: accuracy, pass@k, maj@k, response lengths.

    for each batch of problems:
        sample     n completions per prompt (one prefill per prompt; seed + batch index)
        score      every completion with the task's reward (worker processes: raise/hang -> 0)
        extract    every completion's final answer (the task's extractor, for maj@k)
    per problem:   c = correct samples of n;  pass@k(n, c, k);  majority answer of the first k
    average over problems

``evaluate(...)`` is the loop on a model already in memory, which ``relign eval``
(``relign.recipes.eval``), RL (``eval.every``: ``PeriodicEval``, here) and the demo call.
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
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .config import ConfigError
from .envs.rewards import RewardPool
from .envs.tasks import build_task, encode_problems
from .rollout.engine import SamplingParams
from .strategies.base import Problem
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


def evaluate(model, tokenizer, task, records, *, n=1, ks=(1,), temperature=0.0, top_p=1.0, max_new_tokens=256,
             batch_prompts=32, seed=0, engine=None, reward_workers=0, reward_timeout=10.0, progress=True, desc="eval",
             top_k: int = 0, stop: Sequence[str] = (), max_prompt_length: int = 0, correct_threshold: float = 1.0,
             max_batch_rows: int = 256, pool=None) -> tuple[dict, list[dict]]:
    """Sample ``n`` completions per record, score them, and return (summary, sample rows).

    ``records`` are task records (``Task.load``). ``engine`` defaults to an ``HFEngine`` on
    ``model``; each batch is sampled with its own seed (``seed`` + batch index), so a shared
    engine's random stream (RL's, saved in its checkpoints) is left untouched. The model is put
    in eval mode while sampling and restored afterwards (the engine does it). ``pool`` reuses a
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

    if engine is None:
        from .recipes.build import engine_for

        engine = engine_for("hf", model, tokenizer, max_batch_rows=max_batch_rows, seed=seed)
    own_pool = pool is None
    pool = pool if pool is not None else RewardPool.from_task(task, num_workers=reward_workers, timeout=reward_timeout)
    stats0 = dict(pool.stats)
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
                scored = results[q * n : (q + 1) * n]
                problem_rows = [_sample_row(p, j, c, r, extract(c.text, p.extra_info) if voting else None, correct_threshold)
                                for j, (c, r) in enumerate(zip(completions, scored))]
                per_problem.append(_problem_metrics(problem_rows, ks, equal if voting else None))
                rows.extend(problem_rows)
            bar.update(len(chunk))
            bar.set_postfix(acc=f"{sum(r['score'] for r in rows) / len(rows):.3f}", refresh=False)
    finally:
        bar.close()
        stats = dict(pool.stats)
        if own_pool:
            pool.close()

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
        "num_problems": float(len(problems)),
        "num_samples": float(len(rows)),
        "reward_errors": float(stats.get("exceptions", 0) - stats0.get("exceptions", 0)),
        "reward_timeouts": float(stats.get("timeouts", 0) - stats0.get("timeouts", 0)),
        "skipped_long": float(skipped_long),
    })
    if errors["extract"] or errors["equal"]:
        summary["extract_errors"] = float(errors["extract"])
        summary["equal_errors"] = float(errors["equal"])
    return summary, rows


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


@dataclass
class EvalDuringTrainingConfig:
    every: int = 0
    """Evaluate the policy every N steps and at the last step (0 = off); logged as eval/accuracy, eval/pass@k, ..."""
    path: str = ""
    """Eval problems: a file, dataset folder or hub id (empty: the task's shipped test set; custom tasks must set it)."""
    split: str = ""
    """Split to read (empty: the task's default)."""
    max_rows: int = 64
    """Evaluate on the first N problems (0 = all)."""
    n: int = 1
    """Samples per problem."""
    ks: list[int] = field(default_factory=list)
    """k values of pass@k and maj@k (empty: 1 and n)."""
    temperature: float = 0.0
    """Sampling temperature (0 = greedy, needs n = 1)."""
    max_new_tokens: int = 0
    """Longest completion (0 = rollout.max_new_tokens)."""
    batch_prompts: int = 32
    """Problems sampled together."""
    samples: bool = True
    """Write every sample to eval/step_N.jsonl in the run directory."""


def check_eval_during_training(cfg: EvalDuringTrainingConfig, *, task: str = "", env: str = "") -> None:
    """ConfigError for settings that cannot work, before any model is loaded."""
    if not cfg.every:
        return
    if env:
        raise ConfigError(f"eval.every works with single-turn tasks, not with a multi-turn environment ({env})")
    if task == "custom" and not cfg.path:
        raise ConfigError("eval.every with task.name=custom: set eval.path to held-out problems (it may be the training file)")
    if cfg.every < 0 or cfg.n < 1 or cfg.batch_prompts < 1:
        raise ConfigError("eval.every must be >= 0, eval.n and eval.batch_prompts >= 1")
    if cfg.temperature <= 0 and cfg.n > 1:
        raise ConfigError(f"eval.temperature={cfg.temperature} is greedy: all eval.n={cfg.n} samples would be the same; "
                          "set eval.temperature > 0 or eval.n=1")
    bad = [k for k in cfg.ks if not 1 <= k <= cfg.n]
    if bad:
        raise ConfigError(f"eval.ks={list(cfg.ks)}: every k must lie in [1, eval.n={cfg.n}]")


def is_eval_step(step: int, every: int, last_step: int) -> bool:
    """Every ``every`` steps and at the last one (so a run always ends with an eval); never when 0."""
    return every > 0 and (step % every == 0 or step == last_step)


class PeriodicEval:
    """``eval.every`` in a training loop: the problems and the reward pool are set up once, and
    each call evaluates the current policy through the run's engine (which shares its weights)."""

    def __init__(self, cfg: EvalDuringTrainingConfig, tokenizer, run_dir: str | Path, *, task: str, chat: bool,
                 system_prompt: str, format_weight: float, reward_fn: str, reward_workers: int, reward_timeout: float,
                 max_prompt_length: int, max_new_tokens: int, stop: Sequence[str] = (), env: str = "", seed: int = 0):
        check_eval_during_training(cfg, task=task, env=env)
        self.cfg, self.tok, self.run_dir, self.seed = cfg, tokenizer, Path(run_dir), seed
        self.task = build_task(task, path=cfg.path, reward_fn=reward_fn, chat=chat, system_prompt=system_prompt,
                               format_weight=format_weight)
        # custom tasks read cfg.path as their default; built-in ones their shipped test set
        self.records = self.task.load(cfg.path or None, cfg.split or None, max_rows=cfg.max_rows)
        self.ks = sorted(set(cfg.ks)) or sorted({1, cfg.n})
        # plain temperature sampling (no top-p/top-k), with the rollouts' stop strings
        self.sampling = dict(temperature=cfg.temperature, stop=tuple(stop), max_new_tokens=cfg.max_new_tokens or max_new_tokens)
        self.max_prompt_length = max_prompt_length
        self.pool = RewardPool.from_task(self.task, num_workers=reward_workers, timeout=reward_timeout)

    def due(self, step: int, last_step: int) -> bool:
        return is_eval_step(step, self.cfg.every, last_step)

    def __call__(self, model, engine, step: int, write: Callable[[str], None] | None = None) -> dict[str, float]:
        """Evaluate now; returns the summary as ``eval/<metric>`` plus ``time/eval_s``. Every call
        uses the same seeds, so successive evals differ by the weights, not by sampling luck."""
        t0 = time.perf_counter()
        summary, rows = evaluate(
            model, self.tok, self.task, self.records, n=self.cfg.n, ks=self.ks, batch_prompts=self.cfg.batch_prompts,
            seed=self.seed, engine=engine, pool=self.pool, progress=False,
            max_prompt_length=self.max_prompt_length, **self.sampling,
        )
        if self.cfg.samples:
            write_samples(self.run_dir / "eval" / f"step_{step}.jsonl", rows)
        if write is not None:
            write(f"step {step} eval: {format_summary(summary)}")
        return {**{f"eval/{k}": v for k, v in summary.items()}, "time/eval_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.pool.close()


__all__ = [
    "EvalDuringTrainingConfig", "PeriodicEval", "check_eval_during_training", "evaluate", "format_summary", "is_eval_step",
    "pass_at_k", "write_samples",
]
