"""``relign eval CONFIG``: evaluate a model on a task (accuracy, pass@k, maj@k, lengths).

    load the task's problems and the model
    sample-based eval: n samples per problem, scored and voted (``relign.evaluate.evaluate``)
    write RUN/eval.json (settings + metrics + notes), RUN/samples.jsonl (one row per sample),
          RUN/metrics.jsonl (eval/<metric> at step 0, for the report), and print the summary

The loop itself (``evaluate``) lives in ``relign.evaluate``, shared with RL's ``eval.every``
and the demo; metrics and the samples' schema are in docs/eval.md.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint import atomic_write_text, seed_everything
from ..config import ConfigError, LoggingConfig, ModelConfig, make_run_dir, save_resolved_config
from ..envs.base import Task
from ..envs.tasks import build_task
from ..evaluate import evaluate, format_summary, write_samples
from ..models.loading import load_tokenizer, resolve_device
from ..tracking import Tracker
from . import RunResult, build


@dataclass
class TaskConfig:
    name: str = "gsm8k"
    """Built-in task (gsm8k, math, math500, countdown) or 'custom' with path + reward_fn."""
    path: str = ""
    """Problems: a file, dataset folder or hub id (empty: the task's shipped test set)."""
    split: str = ""
    """Split to read (empty: the task's default)."""
    max_rows: int = 0
    """Evaluate on the first N problems (0 = all)."""
    chat: bool = True
    """Wrap prompts in the tokenizer's chat template (as relign rl does by default)."""
    system_prompt: str = ""
    """System message for chat prompts."""
    max_prompt_length: int = 0
    """Skip (and count) prompts longer than this many tokens (0 = no limit)."""
    format_weight: float = 0.0
    """Weight of the task's format reward in reward_mean (accuracy counts correctness only)."""
    reward_fn: str = ""
    """Custom reward function 'path/to/file.py:function' (replaces the task's own)."""
    reward_timeout: float = 10.0
    """Seconds per reward call; a call that raises or runs longer scores 0 and is counted."""
    reward_workers: int = 2
    """Reward worker processes (0 = in-process, no timeout enforcement)."""
    extract_fn: str = ""
    """Final-answer extractor 'file.py:function' (response, extra_info) -> str | None for maj@k (built-in tasks have one)."""
    equal_fn: str = ""
    """Answer equivalence 'file.py:function' (a, b) -> bool for maj@k (empty: the task's own, else string equality)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    n: int = 1
    """Samples per problem."""
    k: int = 0
    """The k of pass@k and maj@k (0 = n)."""
    ks: list[int] = field(default_factory=list)
    """All k values to report pass@k and maj@k for (empty: 1 and k); each must be <= n."""
    temperature: float = 0.0
    """Sampling temperature (0 = greedy decoding, which needs n = 1)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = 512
    """Longest completion in tokens; longer ones count as truncated."""
    stop: list[str] = field(default_factory=list)
    """Stop strings."""
    correct_threshold: float = 1.0
    """A sample counts as correct for pass@k / maj@k when its score is at least this."""
    batch_prompts: int = 32
    """Problems sampled together (each brings n rows to the engine)."""
    max_batch_rows: int = 256
    """Most sequences the engine decodes at once."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run_dir: str = ""
    """Where config.yaml, eval.json, samples.jsonl and metrics.jsonl go (empty: runs/eval-<time>)."""
    seed: int = 0
    """Seed for sampling."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""


def _check(cfg: Config) -> list[int]:
    """Validate the sampling settings; returns the ks to report."""
    if cfg.n < 1 or cfg.batch_prompts < 1 or cfg.max_batch_rows < 1 or cfg.max_new_tokens < 1:
        raise ConfigError("n, batch_prompts, max_batch_rows and max_new_tokens must be >= 1")
    if cfg.temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {cfg.temperature}")
    if cfg.temperature == 0 and cfg.n > 1:
        raise ConfigError(f"temperature=0 is greedy decoding: all n={cfg.n} samples would be the same; "
                          "set a temperature (e.g. temperature=0.6) or n=1")
    k = cfg.k or cfg.n
    if not 1 <= k <= cfg.n:
        raise ConfigError(f"k={cfg.k} must lie in [1, n={cfg.n}] (pass@k and maj@k use k of the n samples)")
    ks = sorted(set(cfg.ks)) or sorted({1, k})
    bad = [x for x in ks if not 1 <= x <= cfg.n]
    if bad:
        raise ConfigError(f"ks={list(cfg.ks)}: every k must lie in [1, n={cfg.n}]")
    return ks


def train(cfg: Config) -> RunResult:
    """``relign eval``: evaluate ``model.path`` on ``task``; writes eval.json, samples.jsonl and metrics.jsonl."""
    ks = _check(cfg)
    t, m = cfg.task, cfg.model
    task = build_task(t.name, path=t.path, reward_fn=t.reward_fn, chat=t.chat, system_prompt=t.system_prompt,
                      format_weight=t.format_weight, extract_fn=t.extract_fn, equal_fn=t.equal_fn)
    device = resolve_device(cfg.device)
    seed_everything(cfg.seed)
    run_dir = make_run_dir(cfg.run_dir, "eval")
    save_resolved_config(cfg, run_dir)
    records = task.load(t.path or None, t.split or None, max_rows=t.max_rows)
    tok = load_tokenizer(m.tokenizer or m.path, trust_remote_code=m.trust_remote_code)
    model = build.load_frozen(m.path, m, device)

    t0 = time.perf_counter()
    summary, rows, notes = _sample_eval(cfg, ks, task, model, tok, records)
    seconds = time.perf_counter() - t0

    result = {
        "model": m.path, "task": task.name, "data": t.path or task.default_path, "split": t.split or task.split,
        "n": cfg.n, "k": cfg.k or cfg.n, "ks": ks, "temperature": cfg.temperature, "greedy": cfg.temperature == 0,
        "top_p": cfg.top_p, "top_k": cfg.top_k, "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
        "metrics": summary, "notes": notes, "seconds": seconds,
    }
    _save(run_dir, cfg.logging, result, rows)
    print(f"{task.name}: {format_summary(summary)}  ({summary['num_problems']:.0f} problems x {cfg.n} samples, {seconds:.1f}s)")
    for note in notes:
        print(f"note: {note}")
    return RunResult(run_dir=run_dir, steps=0, metrics=summary)


def _sample_eval(cfg: Config, ks: list[int], task: Task, model, tok, records: list[dict]) -> tuple[dict, list[dict], list[str]]:
    """Sample ``cfg.n`` completions per problem and score them: (summary, sample rows, notes)."""
    t = cfg.task
    try:
        summary, rows = evaluate(
            model, tok, task, records, n=cfg.n, ks=ks, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            max_new_tokens=cfg.max_new_tokens, stop=cfg.stop, batch_prompts=cfg.batch_prompts, seed=cfg.seed,
            reward_workers=t.reward_workers, reward_timeout=t.reward_timeout, progress=cfg.logging.progress,
            desc=f"eval {task.name}", max_prompt_length=t.max_prompt_length, correct_threshold=cfg.correct_threshold,
            max_batch_rows=cfg.max_batch_rows,
        )
    except ValueError as e:  # e.g. every prompt longer than task.max_prompt_length
        raise ConfigError(str(e)) from None

    notes = []
    if task.extract_spec is None:
        notes.append(f"maj@k omitted: task '{task.name}' has no answer extractor (set task.extract_fn to enable it)")
    if summary.get("reward_errors") or summary.get("reward_timeouts"):
        notes.append(f"{summary['reward_errors']:.0f} reward calls raised and {summary['reward_timeouts']:.0f} timed out "
                     "(scored 0); see reward_error in samples.jsonl")
    if summary["skipped_long"]:
        notes.append(f"{summary['skipped_long']:.0f} problems skipped: prompt longer than task.max_prompt_length")
    return summary, rows, notes


def _save(run_dir: Path, lg: LoggingConfig, result: dict[str, Any], rows: list[dict]) -> None:
    """eval.json, samples.jsonl, and the metrics as eval/<metric> at step 0 in metrics.jsonl (and TensorBoard / W&B)."""
    atomic_write_text(run_dir / "eval.json", json.dumps(result, indent=2) + "\n")
    write_samples(run_dir / "samples.jsonl", rows)
    tracker = Tracker(run_dir, total_steps=0, desc="eval", progress=False, tensorboard=lg.tensorboard, wandb=lg.wandb,
                      wandb_project=lg.wandb_project, run_name=lg.run_name)
    tracker.log(0, {f"eval/{k}": v for k, v in result["metrics"].items()}, advance=False)
    tracker.close()


__all__ = ["Config", "TaskConfig", "train"]
