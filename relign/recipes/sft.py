"""Supervised fine-tuning: maximise log p(response | prompt) on the trainable tokens.

    for each step:
        batch   <- next global batch of examples (deterministic, resumable)
        N       <- tokens (or sequences) in the whole batch, over all micro-batches and ranks
        for each micro-batch:   loss_mb = aggregate(-log p(y_t | y_<t), mask, mode, N); backward
        clip grad norm; AdamW step; lr schedule step
        every eval_every: held-out loss;  every save_every: atomic checkpoint

Because every micro-batch divides by the same global N, the summed gradient is exactly the
gradient of the full-batch loss: micro-batch size, gradient accumulation, packing and the
number of ranks do not change the result.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .. import banner, distributed
from ..algorithms.aggregation import MODES, aggregate, aggregate_count
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
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    check_choice,
    check_common,
    check_divides,
    check_model_path,
    check_non_negative,
    check_positive,
    check_rows,
)
from ..data.collate import StepSampler, chunks, pack_collate, pad_collate, shard, to_device
from ..data.sft import TRUNCATION, SFTExample, build_sft_examples
from ..data.stats import announce
from ..models.loading import apply_lora, load_causal_lm, load_model_tokenizer, resolve_device, trainable_parameters
from ..models.logprobs import token_logps
from ..models.varlen import packed_attention
from ..optim import build_training, clip_gradients
from ..rundir import open_run
from ..tracking import Tracker, read_metrics
from . import RunResult


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-5, warmup_ratio=0.03))
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run_dir: str = ""
    """Where config.yaml, metrics.jsonl and checkpoints/ go (empty: runs/sft-<time>)."""
    resume: str = "none"
    """'auto' continues from the newest complete checkpoint in run_dir; or a checkpoint path; 'none' starts fresh."""
    seed: int = 0
    """Seed for initialisation, data order and sampling."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    max_steps: int = 0
    """Optimizer steps to run (0 = epochs x steps per epoch)."""
    epochs: float = 1.0
    """Passes over the training data when max_steps is 0."""
    batch_size: int = 16
    """Examples per optimizer step, summed over all ranks."""
    micro_batch_size: int = 4
    """Examples per forward/backward pass on one rank; gradient accumulation covers the rest."""
    loss_agg: str = "token-mean"
    """Loss reduction: token-mean or seq-mean-token-mean, normalized over the whole step's batch."""
    packing: bool = True
    """Pack each micro-batch into one padding-free row with per-example position ids; attention runs example by
    example (flash-attention's varlen kernel, or SDPA per example: relign.models.varlen). false: length-sorted padded
    micro-batches."""
    eval_every: int = 0
    """Compute the held-out loss every N steps (0 = only at the end, when there is eval data)."""
    eval_batch_size: int = 16
    """Examples per eval forward pass."""


def _check(cfg: Config) -> None:
    """Every setting that cannot work, before any data or model is read."""
    check_positive(cfg, "batch_size", "micro_batch_size", "eval_batch_size", "epochs")
    check_non_negative(cfg, "max_steps", "eval_every")  # max_steps 0 = epochs x steps per epoch
    check_divides(cfg, "batch_size", "micro_batch_size", distributed.world_size())
    check_common(cfg)
    check_choice("loss_agg", cfg.loss_agg, [m for m in MODES if m in ("token-mean", "seq-mean-token-mean")])
    check_choice("data.truncation", cfg.data.truncation, TRUNCATION)
    if not cfg.data.path:
        raise ConfigError("missing value for 'data.path': give a data file, a dataset folder or a hub id")
    check_model_path("model.path", cfg.model.path)


def _collate(examples: list[SFTExample], packing: bool, pad_id: int, device) -> dict[str, torch.Tensor]:
    batch = pack_collate(examples) if packing else pad_collate(examples, pad_id)
    return to_device(batch, device)


def _forward(model, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    logps, _ = token_logps(
        model, mb["input_ids"], attention_mask=mb.get("attention_mask"), position_ids=mb.get("position_ids"),
        target_mask=mb["loss_mask"],
    )
    return logps  # [B, T]


def _load_data(cfg: Config, tok) -> tuple[list[SFTExample], list[SFTExample], dict[str, float]]:
    d = cfg.data
    common = dict(
        max_length=d.max_length, truncation=d.truncation, skip_bad_rows=d.skip_bad_rows, prompt_key=d.prompt_key,
        response_key=d.response_key, messages_key=d.messages_key, chat_template=d.chat_template,
        system_prompt=d.system_prompt, max_rows=d.max_rows,
    )
    train_set, stats = build_sft_examples(d.path, tok, split=d.split, key="data.path", **common)
    announce(stats)
    metrics = stats.as_metrics()
    eval_set: list[SFTExample] = []
    if d.eval_path:
        eval_set, estats = build_sft_examples(d.eval_path, tok, split=d.eval_split or d.split, key="data.eval_path", **common)
        announce(estats)
        metrics.update(estats.as_metrics("data/eval_"))
    elif d.eval_fraction > 0:
        g = torch.Generator().manual_seed(cfg.seed)
        order = torch.randperm(len(train_set), generator=g).tolist()
        n_eval = max(1, int(len(train_set) * d.eval_fraction))
        eval_set = [train_set[i] for i in order[:n_eval]]
        train_set = [train_set[i] for i in sorted(order[n_eval:])]
    return train_set, eval_set, metrics


def accumulate_gradients(
    model, examples: list[SFTExample], *, micro_batch_size: int, packing: bool, loss_agg: str, pad_id: int, device
) -> torch.Tensor:
    """Forward/backward this rank's examples in micro-batches; returns the step's loss (detached).

    One normalizer N (tokens or sequences) is counted over the whole step, all micro-batches
    and all ranks, before any backward pass, so the accumulated gradient is that of the full
    batch loss: sum_mb aggregate(-logp_mb, mask_mb, mode, N) == aggregate(-logp, mask, mode).
    """
    if not packing:
        # Similar lengths in a micro-batch waste less compute on padding. The order within a
        # step does not change the step's loss (one global normalizer), only float rounding.
        examples = sorted(examples, key=len)
    micro = [_collate(group, packing, pad_id, device) for group in chunks(examples, micro_batch_size)]
    count = sum(aggregate_count(mb["loss_mask"], loss_agg, segment_ids=mb["segment_ids"]) for mb in micro)
    normalizer = distributed.all_reduce_sum(count)
    world = distributed.world_size()
    loss_sum = torch.zeros((), device=device)
    for mb in micro:
        logps = _forward(model, mb)  # [B, T]
        loss = aggregate(-logps, mb["loss_mask"], loss_agg, normalizer, segment_ids=mb["segment_ids"])
        # FSDP averages gradients over ranks; scale so that they sum instead (N is global).
        (loss * world).backward()
        loss_sum += loss.detach()
    return loss_sum


@torch.no_grad()
def evaluate_loss(model, examples: list[SFTExample], *, batch_size: int, pad_id: int, device, progress: bool = False,
                  desc: str = "sft") -> float:
    """Token-mean negative log-likelihood over this rank's share of ``examples``, summed over ranks."""
    was_training = model.training
    model.eval()
    mine = shard(examples, distributed.rank(), distributed.world_size())
    nll = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    groups = distributed.lockstep(list(chunks(mine, batch_size)), filler=examples[:1])
    with banner.progress(len(groups), f"{desc} eval", enabled=progress, leave=False, delay=3.0) as bar:
        for group, real in groups:
            mb = _collate(group, False, pad_id, device)
            logps = _forward(model, mb)
            if real:  # else a forward only to keep the ranks in step
                nll += -(logps * mb["loss_mask"]).sum()
                count += mb["loss_mask"].sum()
            bar.update()
    model.train(was_training)
    distributed.reshard(model)  # a forward with no backward (see distributed.reshard)
    nll, count = distributed.all_reduce_sum(nll), distributed.all_reduce_sum(count)
    return (nll / count.clamp_min(1)).item()


def train(cfg: Config, *, desc: str = "sft") -> RunResult:
    """``desc`` labels the progress bars (the verifier recipe trains through this loop)."""
    t_start = time.perf_counter()
    distributed.init()
    _check(cfg)
    device = resolve_device(cfg.device)
    rank, world = distributed.rank(), distributed.world_size()
    seed_everything(cfg.seed)
    run_dir = open_run(cfg, "sft")  # a fresh directory unless resuming the same run (relign.rundir)

    # ---- data and model
    m = cfg.model
    tok = load_model_tokenizer(m)
    train_set, eval_set, data_metrics = _load_data(cfg, tok)
    check_rows(len(train_set), cfg.batch_size, what=f"data.path={cfg.data.path}")
    steps_per_epoch = len(train_set) // cfg.batch_size  # StepSampler drops an epoch's short tail
    total_steps = cfg.max_steps or max(1, int(math.ceil(cfg.epochs * steps_per_epoch)))
    run_facts = dict(  # for the start banner and --dry-run
        run_dir=run_dir, device=device,
        data=banner.data_line(int(data_metrics["data/rows"] + data_metrics.get("data/eval_rows", 0)), len(train_set),
                              len(eval_set)),
        steps=banner.steps_line(total_steps, max_steps=cfg.max_steps, epochs=cfg.epochs, steps_per_epoch=steps_per_epoch,
                                batch=f"{cfg.batch_size} examples"),
    )
    banner.dry_run("sft", cfg, **run_facts)  # --dry-run stops here, before any weights are read
    model = load_causal_lm(
        m.path, dtype=m.dtype, attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code,
        gradient_checkpointing=m.gradient_checkpointing, lean_activations=m.lean_activations, device=device,
    )
    if cfg.packing:
        packed_attention(model, m.attn_implementation)
    if m.lora.enabled:
        model = apply_lora(model, r=m.lora.r, alpha=m.lora.alpha, dropout=m.lora.dropout, target_modules=m.lora.target_modules)
    ckpt = resolve_resume(cfg.resume, run_dir)
    if ckpt is not None:
        load_model_weights(model, ckpt)  # before sharding, so every rank starts from the same full weights
    banner.start("sft", cfg, model=model, **run_facts)  # parameters counted before FSDP shards them
    model = distributed.wrap_fsdp(model)

    sampler = StepSampler(len(train_set), cfg.batch_size, seed=cfg.seed)
    o = cfg.optim
    optimizer, scheduler = build_training(model, o, total_steps)
    start_step = resume_training(ckpt, model, optimizer, scheduler, sampler)

    def save(step: int) -> None:
        model_sd, optim_sd = gather_train_state(model, optimizer)  # collective under FSDP
        if distributed.is_main():
            save_checkpoint(
                run_dir, step, model=model, tokenizer=tok, state_dict=model_sd,
                tensors={"optimizer": optim_sd, "scheduler": scheduler.state_dict()},
                state={"sampler": sampler.state_dict(), "recipe": "sft"}, keep_last=cfg.checkpoint.keep_last,
            )
        distributed.barrier()

    lg = cfg.logging
    tracker = Tracker(
        run_dir, total_steps=total_steps, start_step=start_step, desc=desc,
        bar_keys=("train/loss", "train/lr", "perf/tokens_per_s", "eval/loss"), progress=lg.progress,
        tensorboard=lg.tensorboard, wandb=lg.wandb, wandb_project=lg.wandb_project, run_name=lg.run_name,
    )
    if start_step == 0:
        tracker.log(0, data_metrics, advance=False)
    else:
        tracker.write(f"resumed from {ckpt} at step {start_step}")

    params = trainable_parameters(model)
    pad_id = tok.pad_token_id
    metrics: dict[str, float] = {}
    for step in range(start_step + 1, total_steps + 1):
        t0 = time.perf_counter()
        # ---- this rank's share of the step's global batch, cut into micro-batches
        mine = [train_set[i] for i in shard(sampler.next(), rank, world)]
        loss_sum = accumulate_gradients(
            model, mine, micro_batch_size=cfg.micro_batch_size, packing=cfg.packing, loss_agg=cfg.loss_agg,
            pad_id=pad_id, device=device,
        )
        grad_norm = clip_gradients(params, o.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        tokens = distributed.all_reduce_sum(torch.tensor(float(sum(len(e) for e in mine)), device=device))
        seconds = time.perf_counter() - t0
        metrics = {
            "train/loss": distributed.all_reduce_sum(loss_sum).item(),
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/epoch": sampler.epoch + sampler.position / max(1, sampler.n),
            "perf/tokens": tokens.item(),
            "perf/tokens_per_s": tokens.item() / max(seconds, 1e-9),
            "perf/step_seconds": seconds,
        }
        if eval_set and ((cfg.eval_every and step % cfg.eval_every == 0) or step == total_steps):
            metrics["eval/loss"] = evaluate_loss(model, eval_set, batch_size=cfg.eval_batch_size, pad_id=pad_id, device=device,
                                                 progress=lg.progress, desc=desc)
        tracker.log(step, metrics)
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
            save(step)

    last = save_final(run_dir, save, total_steps=total_steps, start_step=start_step, save_final=cfg.checkpoint.save_final)
    tracker.close()
    history = read_metrics(run_dir) if distributed.is_main() else []
    distributed.barrier()
    banner.end("sft", run_dir=run_dir, seconds=time.perf_counter() - t_start, metrics=metrics,
               keys=("train/loss", "eval/loss", "train/epoch"), checkpoint=last)
    return RunResult(run_dir=run_dir, steps=total_steps, metrics=metrics, checkpoint=last, history=history)
