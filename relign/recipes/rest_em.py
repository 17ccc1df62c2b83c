"""ReST-EM (Singh et al. 2023, "Beyond Human Data", arXiv 2312.06585): self-training by expectation-maximization.

    for iteration k = 1 .. iterations:
        sample      rollout.n completions per training prompt from the current model
                    (k = 1: the base model; later: the checkpoint chosen in iteration k-1)
        filter      E-step: keep completions with score >= threshold (the task's correctness, not its
                    shaped reward: a format bonus never makes a wrong answer a target), at most max_per_prompt per
                    prompt (the first ones in sample order); a truncated completion counts as failed
        fine-tune   M-step: the SFT recipe on the kept (prompt, response) pairs, from the base model
                    (from_base, as ReST-EM and treetune do) or from the current one, `epochs` epochs,
                    one checkpoint per epoch
        select      validation accuracy of every epoch's checkpoint; the rule `select` picks one
                    (first_non_improving: the last checkpoint before accuracy stops improving)
        the chosen checkpoint samples the next iteration

Sampling is the RL collector's (``RolloutCollector.rollout``: the task's prompts, the engine, the
reward in worker processes); fine-tuning is ``relign.recipes.sft.train`` on ``iter_k/samples.jsonl``;
validation is ``relign.evaluate.evaluate``. Run directory (docs/rest_em.md)::

    config.yaml  metrics.jsonl (step = iteration; step 0 = the base model)  rest.json  rest_state.json
    iter_k/samples.jsonl  iter_k/filter.json  iter_k/sft/ (an SFT run: checkpoints/step_N per epoch)  iter_k/val.json

Resume (``resume=auto``) restarts at the iteration after the last one recorded in ``rest_state.json``
(written atomically as an iteration's last act); every iteration seeds everything from (seed, k), so a
resumed run repeats the uninterrupted one. A kill inside an iteration redoes that iteration.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .. import banner, distributed, rundir
from ..checkpoint import atomic_write_text, list_checkpoints, load_model_weights, seed_everything
from ..checks import check_choice, check_common, check_fraction, check_model_path, check_non_negative, check_positive
from ..config import CheckpointConfig, ConfigError, DataConfig, OptimConfig, RunFields, SamplingConfig, TaskConfig
from ..envs.rewards import RewardPool
from ..envs.tasks import encode_problems
from ..evaluate import evaluate
from ..models.loading import load_model_tokenizer
from ..rollout.collect import RolloutCollector
from ..rollout.engine import SamplingParams, derive_seed
from . import RunResult, build, frame, sft

SELECT_RULES = ("first_non_improving", "best", "last")
_NOT_TEXT = re.compile("[\x00\ud800-\udfff]")  # what relign.data.readers rejects in a row
STATE_FILE = "rest_state.json"


@dataclass
class RolloutConfig(SamplingConfig):
    """rollout.n completions per training prompt each iteration (the spec's default 8; the paper, as recalled: 32);
    a truncated one counts as failed."""

    temperature: float = 0.6
    """Sampling temperature (> 0 when n > 1)."""


@dataclass
class ValConfig:
    path: str = ""
    """Validation problems (file, dataset folder, hub id); empty: val.size training prompts held out (seeded), never trained on."""
    split: str = ""
    """Split of val.path to read (empty: the task's default)."""
    size: int = 64
    """Validation problems: the first N of val.path (0 = all), or N held-out training prompts."""
    n: int = 1
    """Samples per validation problem; accuracy is their mean score."""
    temperature: float = 0.0
    """Validation sampling temperature (0 = greedy, needs val.n = 1)."""
    max_new_tokens: int = 0
    """Longest validation completion (0 = rollout.max_new_tokens)."""
    batch_prompts: int = 32
    """Validation problems sampled together."""


@dataclass
class Config(RunFields):
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    val: ValConfig = field(default_factory=ValConfig)
    iterations: int = 2
    """ReST-EM iterations (sample -> filter -> fine-tune -> select)."""
    prompts_per_iteration: int = 0
    """Training prompts sampled per iteration, a fresh seeded subset each time (0 = all of them)."""
    threshold: float = 1.0
    """Keep completions whose score (the task's correctness, without a format bonus) is at least this (1.0: correct)."""
    max_per_prompt: int = 10
    """Keep at most this many correct completions per prompt, the first in sample order (the spec's cap 10)."""
    from_base: bool = True
    """Fine-tune each iteration from the base model (ReST-EM, treetune); false: from the current chosen checkpoint."""
    epochs: int = 2
    """SFT epochs over the kept samples per iteration; one checkpoint per epoch, the candidates of `select`."""
    select: str = "first_non_improving"
    """Checkpoint rule on validation accuracy: first_non_improving (ReST-EM: last before it stops improving), best, last."""
    batch_size: int = 16
    """SFT examples per optimizer step (lowered to the number of kept samples when fewer are kept)."""
    micro_batch_size: int = 4
    """SFT examples per forward/backward pass."""
    max_length: int = 1024
    """Longest SFT example (prompt + response) in tokens; longer ones keep the prompt and cut the response."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-5, warmup_ratio=0.03))
    prune_checkpoints: bool = False
    """Delete the epoch checkpoints that were not chosen (later iterations and resume read only the chosen ones)."""
    resume: str = "none"
    """'auto' continues after the last completed iteration in run_dir (rest_state.json); 'none' starts fresh.
    Iteration k seeds everything from (seed, k), so a resumed run repeats the uninterrupted one."""


# --------------------------------------------------------------------------- the math (pure)


def filter_samples(groups: Sequence[Any], threshold: float, max_per_prompt: int) -> tuple[list[dict], dict[str, int]]:
    """The E-step of ReST-EM with a binary reward: keep the correct completions.

    ``groups``: one per prompt, with ``prompt_text``, ``episodes`` (``text``, ``reward``,
    ``score``, ``finish_reason``) and optionally ``draw`` (the prompt's index; default its
    position). A completion passes when ``score >= threshold`` (the task's correctness: the
    reward may add a format bonus, which must not make a wrong answer a training target) and it finished
    (``finish_reason == "stop"``: a truncated one counts as failed, as in the spec) and is
    trainable text: not blank (nothing to imitate) and free of NUL characters and lone
    surrogates (a small model samples them now and then; the SFT reader refuses such a row).
    Per prompt the first ``max_per_prompt`` passing ones in sample order are kept, so no
    prompt dominates the fine-tuning set.

    Returns the kept records ``{"problem", "sample", "prompt", "response", "reward", "score"}``
    and ``stats``: sampled, correct (passing, before the cap), kept, prompts, prompts_with_any
    (prompts with at least one kept completion), truncated.
    """
    if max_per_prompt < 1:
        raise ValueError(f"max_per_prompt must be >= 1, got {max_per_prompt}")
    records: list[dict] = []
    stats = {"sampled": 0, "correct": 0, "kept": 0, "prompts": len(groups), "prompts_with_any": 0, "truncated": 0}
    for i, g in enumerate(groups):
        kept_here = 0
        for j, e in enumerate(g.episodes):
            stats["sampled"] += 1
            finished = e.finish_reason == "stop"
            stats["truncated"] += not finished
            if not (e.score >= threshold and finished and e.text.strip() and not _NOT_TEXT.search(e.text)):
                continue
            stats["correct"] += 1
            if kept_here < max_per_prompt:
                kept_here += 1
                records.append({"problem": getattr(g, "draw", i), "sample": j, "prompt": g.prompt_text,
                                "response": e.text, "reward": float(e.reward), "score": float(e.score)})
        stats["kept"] += kept_here
        stats["prompts_with_any"] += kept_here > 0
    return records, stats


def select_checkpoint(accuracies: Sequence[float], rule: str) -> int:
    """Index of the checkpoint to keep, from validation accuracies in epoch order.

    * ``first_non_improving`` (the ReST-EM paper): the last checkpoint before the first one
      that does not improve on its predecessor: [0.3, 0.5, 0.4, 0.6] -> 1, [0.3, 0.5, 0.6] -> 2,
      [0.5, 0.5] -> 0 (equal is not an improvement).
    * ``best``: the highest accuracy, the earliest on ties.
    * ``last``: the last checkpoint.
    """
    if not accuracies:
        raise ValueError("select_checkpoint needs at least one accuracy")
    if rule == "first_non_improving":
        for i in range(1, len(accuracies)):
            if accuracies[i] <= accuracies[i - 1]:
                return i - 1
        return len(accuracies) - 1
    if rule == "best":
        return max(range(len(accuracies)), key=lambda i: (accuracies[i], -i))
    if rule == "last":
        return len(accuracies) - 1
    raise ValueError(f"unknown selection rule {rule!r}; choose one of {', '.join(SELECT_RULES)}")


def sft_batch(kept: int, batch_size: int, micro_batch_size: int) -> tuple[int, int]:
    """(batch, micro-batch) for SFT on ``kept`` examples: the batch shrinks to ``kept`` when fewer
    are kept (SFT needs one full batch per step), and the micro-batch to the largest divisor of the
    batch that is at most ``micro_batch_size``."""
    batch = max(1, min(batch_size, kept))
    micro = max(d for d in range(1, min(micro_batch_size, batch) + 1) if batch % d == 0)
    return batch, micro


def iteration_seed(seed: int, k: int) -> int:
    """The seed of iteration k (k = 0: the run's set-up), a function of (seed, k) only, so that a
    resumed run repeats the uninterrupted one; < 2**31 for NumPy."""
    return derive_seed(seed, k) % (2**31)


# --------------------------------------------------------------------------- checks and set-up


def _check(cfg: Config) -> None:
    ro, v = cfg.rollout, cfg.val
    check_choice("select", cfg.select, SELECT_RULES)
    check_choice("resume", cfg.resume or "none", ("none", "auto"))
    if min(cfg.iterations, ro.n, cfg.max_per_prompt, cfg.epochs, cfg.batch_size, cfg.micro_batch_size, v.n) < 1:
        raise ConfigError("iterations, rollout.n, max_per_prompt, epochs, batch_size, micro_batch_size and val.n must be >= 1")
    if ro.temperature <= 0 and ro.n > 1:
        raise ConfigError(f"rollout.temperature={ro.temperature} is greedy: all rollout.n={ro.n} samples of a prompt "
                          "would be the same; set rollout.temperature > 0 (the spec's default is 0.6)")
    if v.temperature <= 0 and v.n > 1:
        raise ConfigError(f"val.temperature={v.temperature} is greedy: set val.temperature > 0 or val.n=1")
    if v.size < 0 or cfg.prompts_per_iteration < 0:
        raise ConfigError("val.size and prompts_per_iteration must be >= 0")
    check_positive(cfg, "max_length", "rollout.max_new_tokens", "rollout.max_batch_rows", "rollout.top_p", "val.batch_prompts",
                   "task.max_prompt_length", "task.reward_timeout")
    check_non_negative(cfg, "rollout.top_k", "val.max_new_tokens", "task.max_rows", "task.reward_workers")
    check_fraction(cfg, "rollout.top_p", closed=True)
    check_common(cfg)
    if not v.path and v.size < 1:
        raise ConfigError("val.size=0 holds out no training prompts: set val.size > 0, or val.path to validation problems")
    if not cfg.from_base and cfg.model.lora.enabled:
        raise ConfigError("from_base=false with model.lora.enabled: a LoRA checkpoint holds only the adapter, so the "
                          "next fine-tune cannot start from it; use from_base=true (ReST-EM's default)")
    if cfg.task.env:
        raise ConfigError(f"task.env={cfg.task.env}: relign rest fine-tunes on single-turn (prompt, response) pairs")
    if distributed.world_size() > 1:
        raise ConfigError("relign rest runs on one process (its SFT stage can run under torchrun on its own: relign sft)")
    check_model_path("model.path", cfg.model.path)


def _records(cfg: Config, task, tok) -> tuple[list[dict], list[dict], str]:
    """(training records, validation records, where validation comes from); prompts longer than
    task.max_prompt_length are dropped from both, as the collector would skip them."""
    t, v = cfg.task, cfg.val
    try:
        train = task.load(t.path or None, t.split or None, max_rows=t.max_rows, seed=cfg.seed)
        val = task.load(v.path, v.split or None, max_rows=v.size) if v.path else []
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise ConfigError(f"task: {e}") from None

    def fitting(records: list[dict]) -> list[dict]:
        problems, _ = encode_problems(tok, records, max_prompt_length=t.max_prompt_length)
        return [records[p.id] for p in problems]

    train = fitting(train)
    if v.path:
        source = v.path
    else:  # a held-out slice of the training prompts: disjoint from what is sampled and trained on
        if len(train) <= v.size:
            raise ConfigError(f"val.size={v.size} held-out prompts leave none of the {len(train)} training prompts: "
                              "lower val.size or set val.path")
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        held = set(order[: v.size])
        val = [r for i, r in enumerate(train) if i in held]
        train = [r for i, r in enumerate(train) if i not in held]
        source = f"{v.size} training prompts held out (seed {cfg.seed})"
    val = fitting(val)
    if not train or not val:
        which = "training" if not train else "validation"
        raise ConfigError(f"task '{t.name}': no {which} prompt fits task.max_prompt_length={t.max_prompt_length}")
    return train, val, source


def _load(cfg: Config, ckpt: Path | None, device) -> torch.nn.Module:
    """The base model (ckpt None) or a checkpoint of it; LoRA checkpoints hold the adapter only,
    so the model is always built from model.path and the checkpoint's weights loaded into it."""
    model = build.load_policy(cfg.model, device)
    if ckpt is not None:
        load_model_weights(model, ckpt)
    return model


def _sft_record(rec: dict, task_record: dict) -> dict:
    """A kept completion as an SFT row. Chat prompts become a conversation ending with the
    response, so SFT renders it with the chat template (and its end-of-turn token) exactly as
    the prompt was rendered for sampling; raw prompts stay prompt/response. The response is
    the engine's text: SFT re-tokenizes it (ReST-EM fine-tunes on text)."""
    out = dict(rec)
    if "messages" in task_record:
        out["messages"] = [*task_record["messages"], {"role": "assistant", "content": rec["response"]}]
    else:
        out["prompt"] = task_record["prompt"]
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in rows))


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def _fault(k: int) -> None:
    """Test hook: ``RELIGN_FAULT=rest-iteration`` or ``rest-iteration:K`` kills the process right
    after iteration K is recorded (rest_state.json written), to test resume."""
    if os.environ.get("RELIGN_FAULT") in ("rest-iteration", f"rest-iteration:{k}"):
        os.kill(os.getpid(), 9)


# --------------------------------------------------------------------------- the loop


@dataclass
class _Rest:
    """What every iteration reads, built once by ``train``."""

    cfg: Config
    run_dir: Path
    device: Any
    tok: Any
    train_records: list[dict]
    pool: RewardPool
    tracker: Any
    validate: Callable[[Path | None], dict[str, float]]
    log: dict[str, Any]


def train(cfg: Config) -> RunResult:
    run = frame.open(cfg, "rest", check=_check, seed=iteration_seed(cfg.seed, 0))
    t, ro, m = cfg.task, cfg.rollout, cfg.model
    task = build.task_for(t)
    if task.env:
        raise ConfigError(f"task.name={t.name} runs in a multi-turn environment; relign rest fine-tunes on single-turn pairs")
    tok = load_model_tokenizer(m)
    train_records, val_records, val_source = _records(cfg, task, tok)
    per_iteration = min(cfg.prompts_per_iteration or len(train_records), len(train_records))
    # the parameters are counted from the model's config: each stage loads its own weights
    banner.start("rest", cfg, run_dir=run.run_dir, device=run.device,
                 data=f"{len(train_records):,} training prompts, {len(val_records):,} validation ({val_source})",
                 steps=f"{cfg.iterations} iterations x {per_iteration:,} prompts x {ro.n} samples, then "
                       f"{cfg.epochs} SFT epoch(s) on the kept ones")
    start, current, log = _resume(cfg, run.run_dir)
    pool = RewardPool.from_task(task, num_workers=t.reward_workers, timeout=t.reward_timeout)
    tracker = build.tracker_for(cfg.logging, run.run_dir, total_steps=cfg.iterations, start_step=start, desc="rest",
                                bar_keys=("rest/val_accuracy", "rest/kept", "rest/correct_frac"))

    def validate(ckpt: Path | None) -> dict[str, float]:  # the same problems and seeds for every model
        engine = build.engine_for("hf", _load(cfg, ckpt, run.device), tok, max_batch_rows=ro.max_batch_rows, seed=cfg.seed)
        summary, _ = evaluate(engine, tok, task, val_records, n=cfg.val.n, temperature=cfg.val.temperature,
                              max_new_tokens=cfg.val.max_new_tokens or ro.max_new_tokens, stop=ro.stop,
                              batch_prompts=cfg.val.batch_prompts, seed=cfg.seed, pool=pool, progress=False)
        return summary

    rest = _Rest(cfg, run.run_dir, run.device, tok, train_records, pool, tracker, validate, log)
    status, metrics = "completed", {}
    try:
        if start == 0:
            base = validate(None)["accuracy"]
            log.update(base=m.path, base_val_accuracy=base, val_source=val_source, iterations=[])
            tracker.log(0, {"rest/val_accuracy": base}, advance=False)
            tracker.write(f"base model: validation accuracy {base:.4f} on {len(val_records)} problems ({val_source})")
        else:
            tracker.write(f"resumed after iteration {start}: sampling from {current}")
        for k in range(start + 1, cfg.iterations + 1):
            current, metrics, stop = _iteration(rest, k, current)
            if stop:
                status = stop
                break
            _fault(k)
    finally:
        pool.close()
        tracker.close()
    done = [h["iteration"] for h in log.get("iterations", [])]
    chosen = run.run_dir / current if current else None
    return frame.close(run, metrics=metrics, status=status, steps=max(done, default=0), checkpoint=chosen,
                       keys=("rest/val_accuracy", "rest/kept", "rest/correct_frac", "rest/chosen_epoch"),
                       result={**metrics, "status": status, "checkpoint": str(chosen) if chosen else m.path})


def _iteration(rest: _Rest, k: int, current: str | None) -> tuple[str | None, dict[str, float], str]:
    """Iteration k: (the chosen checkpoint, relative to the run directory; its metrics; "" or why the run stops)."""
    cfg, run_dir, m = rest.cfg, rest.run_dir, rest.cfg.model
    seed = iteration_seed(cfg.seed, k)
    seed_everything(seed)
    it = run_dir / f"iter_{k}"
    shutil.rmtree(it, ignore_errors=True)  # a killed attempt at this iteration is redone from scratch
    it.mkdir()
    t0 = time.perf_counter()

    # ---- 1. sample n completions per prompt from the current model
    indices = _prompts(len(rest.train_records), cfg.prompts_per_iteration, seed)
    model = _load(cfg, run_dir / current if current else None, rest.device)
    groups = _sample(model, rest.tok, rest.train_records, indices, cfg, rest.pool, seed)
    del model
    t1 = time.perf_counter()

    # ---- 2. filter: score (correctness) >= threshold, finished, at most max_per_prompt per prompt
    kept, stats = filter_samples(groups, cfg.threshold, cfg.max_per_prompt)
    rows = [_sft_record(r, rest.train_records[r["problem"]]) for r in kept]
    _write_jsonl(it / "samples.jsonl", rows)
    _write_json(it / "filter.json", {"threshold": cfg.threshold, "max_per_prompt": cfg.max_per_prompt, **stats})
    metrics = _filter_metrics(stats, t1 - t0)
    if not rows:
        return current, metrics, _stop(rest, k, stats, current, metrics)

    # ---- 3. fine-tune (from the base model by default) with a checkpoint per epoch
    init = m.path if cfg.from_base or not current else str(run_dir / current)
    sft_cfg = _sft_config(cfg, init, it, len(rows), seed)
    with rundir.nested():  # the ReST-EM run's banner and summary describe it, not each fine-tune's
        result = sft.train(sft_cfg, desc=f"rest sft {k}")
    ckpts = [p for _, p in list_checkpoints(it / "sft")]
    t2 = time.perf_counter()

    # ---- 4. select a checkpoint on validation accuracy
    summaries = [rest.validate(p) for p in ckpts]
    accs = [s["accuracy"] for s in summaries]
    e = select_checkpoint(accs, cfg.select)
    current = str(ckpts[e].relative_to(run_dir))
    _write_json(it / "val.json", {"select": cfg.select, "accuracy": accs, "chosen_epoch": e + 1, "chosen": current,
                                  "checkpoints": [str(p.relative_to(run_dir)) for p in ckpts], "summaries": summaries})
    if cfg.prune_checkpoints:
        for p in ckpts[:e] + ckpts[e + 1:]:
            shutil.rmtree(p, ignore_errors=True)
    t3 = time.perf_counter()

    # ---- 5. record the iteration; the chosen checkpoint samples the next one
    metrics.update({"rest/val_accuracy": accs[e], "rest/chosen_epoch": e + 1,
                    "rest/sft_loss": result.metrics.get("train/loss", float("nan")),
                    "rest/sft_steps": result.steps, "time/sft_s": t2 - t1, "time/val_s": t3 - t2})
    rest.tracker.log(k, metrics)
    rest.tracker.write(f"iteration {k}: kept {stats['kept']} of {stats['sampled']} ({stats['prompts_with_any']} of "
                       f"{stats['prompts']} prompts), validation accuracy per epoch {[round(a, 4) for a in accs]}, "
                       f"chose epoch {e + 1}: {current}")
    rest.log["iterations"].append({"iteration": k, "seed": seed, **stats, "sft_init": init, "sft_run": f"iter_{k}/sft",
                                   "sft_batch_size": sft_cfg.batch_size, "sft_steps": result.steps,
                                   "val_accuracy": accs, "chosen_epoch": e + 1, "chosen": current,
                                   "seconds": {"sample": t1 - t0, "sft": t2 - t1, "val": t3 - t2}})
    rest.log["status"] = "running" if k < cfg.iterations else "completed"
    _write_json(run_dir / "rest.json", rest.log)
    _write_json(run_dir / STATE_FILE, {"iteration": k, "checkpoint": current})  # the commit point
    return current, metrics, ""


def _filter_metrics(stats: dict[str, int], sample_s: float) -> dict[str, float]:
    """The E-step's figures as rest/* metrics."""
    n = max(1, stats["sampled"])
    return {"rest/kept": stats["kept"], "rest/sampled": stats["sampled"], "rest/correct_frac": stats["correct"] / n,
            "rest/prompts_with_any": stats["prompts_with_any"] / max(1, stats["prompts"]),
            "rest/truncated_frac": stats["truncated"] / n, "time/sample_s": sample_s}


def _stop(rest: _Rest, k: int, stats: dict[str, int], current: str | None, metrics: dict[str, float]) -> str:
    """Iteration k kept nothing: say so, log it, record it in rest.json; the run's status."""
    last = str(rest.run_dir / current) if current else f"the base model {rest.cfg.model.path}"
    message = (f"iteration {k} kept 0 of {stats['sampled']} completions (threshold {rest.cfg.threshold}; truncated "
               f"completions count as failed): nothing to fine-tune on; the last good checkpoint is {last}")
    rest.tracker.write(message)
    rest.tracker.log(k, metrics)
    rest.log["status"] = f"stopped: {message}"
    _write_json(rest.run_dir / "rest.json", rest.log)
    return rest.log["status"]


# --------------------------------------------------------------------------- the stages


def _resume(cfg: Config, run_dir: Path) -> tuple[int, str | None, dict]:
    """(completed iterations, chosen checkpoint relative to run_dir, rest.json so far)."""
    state_path = run_dir / STATE_FILE
    if cfg.resume != "auto" or not state_path.is_file():
        for stale in (state_path, run_dir / "rest.json"):  # a fresh start must not look resumable
            stale.unlink(missing_ok=True)
        for old in run_dir.glob("iter_*"):  # nor keep a longer earlier run's iterations
            shutil.rmtree(old, ignore_errors=True)
        return 0, None, {}
    state = json.loads(state_path.read_text())
    k, current = int(state["iteration"]), state["checkpoint"]
    if not (run_dir / current).is_dir():
        raise ConfigError(f"resume=auto: {STATE_FILE} names {run_dir / current}, which is gone; start with resume=none")
    log = json.loads((run_dir / "rest.json").read_text())
    log["iterations"] = [h for h in log["iterations"] if h["iteration"] <= k]
    return k, current, log


def _prompts(total: int, per_iteration: int, seed: int) -> list[int]:
    """The iteration's training prompts: all, or a seeded subset in index order."""
    if not per_iteration or per_iteration >= total:
        return list(range(total))
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[:per_iteration])


def _sample(model, tok, records: list[dict], indices: list[int], cfg: Config, pool, seed: int) -> list:
    """Groups of rollout.n scored completions, one per prompt in ``indices``. A prompt's
    completions are seeded by (iteration seed, prompt index), whatever the batching."""
    ro = cfg.rollout
    engine = build.engine_for("hf", model, tok, max_batch_rows=ro.max_batch_rows, seed=seed)
    sampling = SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                              max_new_tokens=ro.max_new_tokens, stop=list(ro.stop))
    collector = RolloutCollector(tok, engine, records, sampling=sampling, pool=pool,
                                 max_prompt_length=cfg.task.max_prompt_length, seed=seed)
    per_call = max(1, ro.max_batch_rows // ro.n)
    groups = []
    for i in range(0, len(indices), per_call):
        chunk = indices[i : i + per_call]
        groups.extend(collector.rollout(chunk, chunk))  # draw = the prompt's index: its seed and its id
    return groups


def _sft_config(cfg: Config, init: str, it: Path, kept: int, seed: int) -> sft.Config:
    """The SFT run of one iteration: ``epochs`` passes over the kept samples, a checkpoint at the
    end of every epoch (save_every = steps per epoch), a fresh optimizer and schedule."""
    batch, micro = sft_batch(kept, cfg.batch_size, cfg.micro_batch_size)
    steps_per_epoch = kept // batch  # SFT drops the short tail of an epoch
    m = cfg.model
    return sft.Config(
        model=replace(m, path=init, tokenizer=m.tokenizer or m.path),
        data=DataConfig(path=str(it / "samples.jsonl"), max_length=cfg.max_length),
        optim=cfg.optim,
        logging=replace(cfg.logging, wandb=False),  # the ReST-EM run logs to W&B, not each fine-tune
        checkpoint=CheckpointConfig(save_every=steps_per_epoch, keep_last=0, save_final=True),
        run_dir=str(it / "sft"), resume="none", seed=seed, device=cfg.device,
        epochs=float(cfg.epochs), batch_size=batch, micro_batch_size=micro,
    )
