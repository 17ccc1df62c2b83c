"""Bradley-Terry reward model: learn r(x, y) so that preferred responses score higher.

    for each step:
        pairs   <- next global batch (deterministic, resumable)
        for each micro-batch:
            r_w, r_l = r(x, y_w), r(x, y_l)           one forward over the interleaved rows
            L = -log sigma(r_w - r_l - m) + c (r_w + r_l)^2
            backward(sum L / pairs in the global batch)
        clip grad norm; AdamW step; lr schedule step
        every eval_every: pair accuracy and reward margin on held-out pairs

The model is ``AutoModelForSequenceClassification`` with one output, read at the last non-pad
token (``models.reward``). Checkpoints are plain HF folders; ``relign rl
reward.model=RUN/checkpoints/step_N`` uses one as a learned reward.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .. import banner, distributed
from ..algorithms.preference import bradley_terry_loss
from ..checkpoint import (
    gather_train_state,
    load_model_weights,
    resolve_resume,
    resume_training,
    save_checkpoint,
    save_final,
    seed_everything,
)
from ..config import (
    CheckpointConfig,
    ConfigError,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    PreferenceDataConfig,
    check_choice,
    check_common,
    check_divides,
    check_model_path,
    check_non_negative,
    check_positive,
    check_rows,
)
from ..data.collate import StepSampler, chunks, shard
from ..data.preference import TRUNCATION
from ..models.loading import apply_lora, load_model_tokenizer, resolve_device, trainable_parameters
from ..models.reward import load_reward_model, sequence_rewards
from ..optim import build_training, clip_gradients
from ..rundir import open_run
from ..tracking import Tracker, read_metrics
from . import RunResult
from .pairs import add_sums, average_sums, collate_pairs, load_examples


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, warmup_ratio=0.03))
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    use_margin: bool = False
    """Subtract each row's 'margin' field inside the sigmoid (Llama 2); rows without one use 0."""
    center_coef: float = 0.0
    """Weight c of the reward-centering term c (r_w + r_l)^2 (Eisenstein et al.; 1e-2 is typical)."""
    run_dir: str = ""
    """Where config.yaml, metrics.jsonl and checkpoints/ go (empty: runs/rm-<time>)."""
    resume: str = "none"
    """'auto' continues from the newest complete checkpoint in run_dir; or a checkpoint path; 'none' starts fresh."""
    seed: int = 0
    """Seed for initialisation and data order."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    max_steps: int = 0
    """Optimizer steps to run (0 = epochs x steps per epoch)."""
    epochs: float = 1.0
    """Passes over the training data when max_steps is 0."""
    batch_size: int = 16
    """Pairs per optimizer step, summed over all ranks."""
    micro_batch_size: int = 4
    """Pairs per forward/backward pass on one rank."""
    eval_every: int = 0
    """Evaluate on the held-out pairs every N steps (0 = only at the end, when there is eval data)."""
    eval_batch_size: int = 8
    """Pairs per eval forward pass."""


def _check(cfg: Config) -> None:
    """Every setting that cannot work, before any data or model is read."""
    check_positive(cfg, "batch_size", "micro_batch_size", "eval_batch_size", "epochs")
    check_non_negative(cfg, "max_steps", "eval_every", "center_coef")
    check_divides(cfg, "batch_size", "micro_batch_size", distributed.world_size())
    check_common(cfg)
    check_choice("data.truncation", cfg.data.truncation, TRUNCATION)
    if not cfg.data.path:
        raise ConfigError("missing value for 'data.path': give a preference file, a dataset folder or a hub id")
    check_model_path("model.path", cfg.model.path)


# Logged names of the loss's per-pair values, where they differ.
METRIC_NAMES = {"margins": "rewards/margins"}


def pair_rewards(model, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """r(x, y_w), r(x, y_l) [B] from the interleaved rows of ``collate_pairs``."""
    r = sequence_rewards(model, mb["input_ids"], mb["attention_mask"])  # [2B]
    return r[0::2], r[1::2]


def train(cfg: Config) -> RunResult:
    t_start = time.perf_counter()
    distributed.init()
    _check(cfg)
    device = resolve_device(cfg.device)
    rank, world = distributed.rank(), distributed.world_size()
    seed_everything(cfg.seed)
    run_dir = open_run(cfg, "rm")  # a fresh directory unless resuming the same run (relign.rundir)

    m = cfg.model
    tok = load_model_tokenizer(m)
    train_set, eval_set, data_metrics = load_examples(cfg.data, tok, seed=cfg.seed)
    if not train_set:
        raise ConfigError(f"data.path={cfg.data.path}: no usable rows ({data_metrics['data/rows']:.0f} read, "
                          f"{data_metrics['data/dropped_too_long']:.0f} longer than data.max_length={cfg.data.max_length}, "
                          f"{data_metrics['data/bad_rows']:.0f} bad)")
    check_rows(len(train_set), cfg.batch_size, what=f"data.path={cfg.data.path}")
    steps_per_epoch = len(train_set) // cfg.batch_size  # StepSampler drops an epoch's short tail
    total_steps = cfg.max_steps or max(1, int(math.ceil(cfg.epochs * steps_per_epoch)))
    run_facts = dict(  # for the start banner and --dry-run
        run_dir=run_dir, device=device, kind="seq_cls",
        data=banner.data_line(int(data_metrics["data/rows"] + data_metrics.get("data/eval_rows", 0)), len(train_set),
                              len(eval_set)),
        steps=banner.steps_line(total_steps, max_steps=cfg.max_steps, epochs=cfg.epochs, steps_per_epoch=steps_per_epoch,
                                batch=f"{cfg.batch_size} pairs"),
    )
    banner.dry_run("rm", cfg, **run_facts)  # --dry-run stops here, before any weights are read
    model = load_reward_model(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code,
                              gradient_checkpointing=m.gradient_checkpointing, lean_activations=m.lean_activations,
                              pad_token_id=tok.pad_token_id, device=device)
    if m.lora.enabled:  # the new score head trains in full next to the adapter
        model = apply_lora(model, r=m.lora.r, alpha=m.lora.alpha, dropout=m.lora.dropout, target_modules=m.lora.target_modules,
                           task_type="SEQ_CLS", modules_to_save=["score"])
    ckpt = resolve_resume(cfg.resume, run_dir)
    if ckpt is not None:
        load_model_weights(model, ckpt)
    banner.start("rm", cfg, model=model, **run_facts)  # parameters counted before FSDP shards them
    model = distributed.wrap_fsdp(model)

    sampler = StepSampler(len(train_set), cfg.batch_size, seed=cfg.seed)
    o = cfg.optim
    optimizer, scheduler = build_training(model, o, total_steps)
    start_step = resume_training(ckpt, model, optimizer, scheduler, sampler)

    def save(step: int) -> None:
        model_sd, optim_sd = gather_train_state(model, optimizer)
        if distributed.is_main():
            save_checkpoint(run_dir, step, model=model, tokenizer=tok, state_dict=model_sd,
                            tensors={"optimizer": optim_sd, "scheduler": scheduler.state_dict()},
                            state={"sampler": sampler.state_dict(), "recipe": "rm"}, keep_last=cfg.checkpoint.keep_last)
        distributed.barrier()

    def pair_losses(idx: list[int], exs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mb = collate_pairs([exs[i] for i in idx], tok.pad_token_id, device)
        r_w, r_l = pair_rewards(model, mb)
        return bradley_terry_loss(r_w, r_l, margin=mb["margins"] if cfg.use_margin else None, center_coef=cfg.center_coef)

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        model.eval()
        mine = shard(list(range(len(eval_set))), rank, world)
        sums: dict[str, torch.Tensor] = {}
        parts = distributed.lockstep(list(chunks(mine, cfg.eval_batch_size)), filler=[0])
        with banner.progress(len(parts), "rm eval", enabled=cfg.logging.progress, leave=False, delay=3.0) as bar:
            for part, real in parts:
                losses, met = pair_losses(part, eval_set)
                if real:  # else a forward only to keep the ranks in step
                    add_sums(sums, {"loss": losses, **met})
                bar.update()
        model.train()
        distributed.reshard(model)  # a forward with no backward (see distributed.reshard)
        return average_sums(sums, len(mine), "eval/", device=device, names=METRIC_NAMES)

    lg = cfg.logging
    tracker = Tracker(run_dir, total_steps=total_steps, start_step=start_step, desc="rm", progress=lg.progress,
                      bar_keys=("train/loss", "train/accuracy", "train/rewards/margins", "eval/accuracy"),
                      tensorboard=lg.tensorboard, wandb=lg.wandb, wandb_project=lg.wandb_project, run_name=lg.run_name)
    if start_step == 0:
        tracker.log(0, data_metrics, advance=False)
    else:
        tracker.write(f"resumed from {ckpt} at step {start_step}")

    params = trainable_parameters(model)
    metrics: dict[str, float] = {}
    for step in range(start_step + 1, total_steps + 1):
        t0 = time.perf_counter()
        mine = shard(sampler.next(), rank, world)
        sums: dict[str, torch.Tensor] = {}
        for part in chunks(mine, cfg.micro_batch_size):
            losses, met = pair_losses(part, train_set)
            (losses.sum() / cfg.batch_size * world).backward()  # mean over the global batch
            add_sums(sums, {"loss": losses, **met})
        grad_norm = clip_gradients(params, o.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        metrics = average_sums(sums, len(mine), "train/", device=device, names=METRIC_NAMES)
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr, "perf/pairs_per_s": cfg.batch_size / max(seconds, 1e-9),
                        "train/epoch": sampler.epoch + sampler.position / max(1, sampler.n)})
        if eval_set and ((cfg.eval_every and step % cfg.eval_every == 0) or step == total_steps):
            metrics.update(evaluate())
        tracker.log(step, metrics)
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
            save(step)

    last = save_final(run_dir, save, total_steps=total_steps, start_step=start_step, save_final=cfg.checkpoint.save_final)
    tracker.close()
    history = read_metrics(run_dir) if distributed.is_main() else []
    distributed.barrier()
    banner.end("rm", run_dir=run_dir, seconds=time.perf_counter() - t_start, metrics=metrics,
               keys=("train/loss", "train/accuracy", "eval/loss", "eval/accuracy"), checkpoint=last)
    return RunResult(run_dir=run_dir, steps=total_steps, metrics=metrics, checkpoint=last, history=history)
