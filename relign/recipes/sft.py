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

import time
from dataclasses import dataclass, field

import torch

from .. import banner, distributed
from ..algorithms.aggregation import MODES, aggregate, aggregate_count
from ..checks import (
    check_choice, check_common, check_divides, check_model_path, check_non_negative, check_positive, check_rows
)
from ..config import BatchFields, ConfigError, DataConfig, OptimConfig
from ..data.balance import micro_batch_plan
from ..data.collate import chunks, pack_collate, pad_collate, shard, to_device
from ..data.sft import TRUNCATION, SFTExample, build_sft_examples
from ..data.stats import announce
from ..models.budget import device_tokens
from ..models.cp import packed_token_logps, packed_weighted_logps
from ..models.flops import ModelFlops, model_flops
from ..models.loading import load_model_tokenizer
from ..models.logprobs import token_logps, weighted_token_logps
from ..models.varlen import packed_attention
from . import RunResult, build, frame


@dataclass
class Config(BatchFields):
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-5, warmup_ratio=0.03))
    loss_agg: str = "token-mean"
    """Loss reduction: token-mean or seq-mean-token-mean, normalized over the whole step's batch."""
    packing: bool = True
    """Pack each micro-batch into one padding-free row with per-example position ids; attention runs example by
    example (flash-attention's varlen kernel, or SDPA per example: relign.models.varlen). false: length-sorted padded
    micro-batches."""
    max_tokens_per_micro: int | None = None
    """Token budget of one packed forward/backward pass on one rank (packing=true): this rank's examples are cut into
    balanced passes of at most this many tokens and micro_batch_size no longer counts; 0 = off (micro_batch_size
    examples per pass); null = by device: off on the CPU, on CUDA 32768 or what free memory holds if less."""


def _check(cfg: Config) -> None:
    """Every setting that cannot work, before any data or model is read."""
    check_positive(cfg, "batch_size", "micro_batch_size", "eval_batch_size", "epochs")
    check_non_negative(cfg, "max_steps", "eval_every")  # max_steps 0 = epochs x steps per epoch
    if cfg.max_tokens_per_micro is not None:
        check_non_negative(cfg, "max_tokens_per_micro")
    check_divides(cfg, "batch_size", "micro_batch_size", distributed.data_size())
    check_common(cfg)
    check_choice("loss_agg", cfg.loss_agg, [m for m in MODES if m in ("token-mean", "seq-mean-token-mean")])
    check_choice("data.truncation", cfg.data.truncation, TRUNCATION)
    if not cfg.data.path:
        raise ConfigError("missing value for 'data.path': give a data file, a dataset folder or a hub id")
    check_model_path("model.path", cfg.model.path)


def _collate(examples: list[SFTExample], packing: bool, pad_id: int, device, max_length: int = 0) -> dict:
    batch = pack_collate(examples, max_length=max_length) if packing else pad_collate(examples, pad_id)
    return to_device(batch, device)


def _forward(model, mb: dict) -> torch.Tensor:
    if "packing" in mb:  # the collator's layout and LM-head positions: the forward reads nothing back (models.varlen)
        # under context parallel, this rank's chunk of the row: the ranks' chunk losses sum to the row's (models.cp)
        logps, _ = packed_token_logps(model, mb["input_ids"], mb["position_ids"], mb["packing"],
                                      target_mask=mb["loss_mask"], keep=mb["keep"], whole=False)
        return logps
    logps, _ = token_logps(model, mb["input_ids"], attention_mask=mb["attention_mask"], target_mask=mb["loss_mask"])
    return logps  # [B, T]


def _loss(model, mb: dict[str, torch.Tensor], loss_agg: str, normalizer: torch.Tensor) -> torch.Tensor:
    """The micro-batch's share of the step's loss, aggregate(-log p, loss_mask, loss_agg, N)."""
    mask, seg = mb["loss_mask"], mb["segment_ids"]
    # the loss is linear in log p: -sum_t c_t log p_t, c each token's weight in the reduction. With
    # c known before the forward the fused LM head takes its gradients there, and no logits exist
    v = torch.zeros(mask.shape, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        (c,) = torch.autograd.grad(aggregate(v, mask, loss_agg, normalizer, segment_ids=seg), v)
    if "packing" in mb:  # the collator's layout and LM-head positions, as in _forward
        s = packed_weighted_logps(model, mb["input_ids"], c, mb["position_ids"], mb["packing"], keep=mb["keep"])
    else:
        s = weighted_token_logps(model, mb["input_ids"], c, attention_mask=mb["attention_mask"])
    if s is not None:
        return -s
    # under context parallel, this rank's chunk's targets: the ranks' losses sum to the row's
    return aggregate(-_forward(model, mb), mask, loss_agg, normalizer, segment_ids=seg)


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
    model, examples: list[SFTExample], *, micro_batch_size: int, packing: bool, loss_agg: str, pad_id: int, device,
    max_length: int = 0, max_tokens: int = 0,
) -> torch.Tensor:
    """Forward/backward this rank's examples in micro-batches; returns the step's loss (detached).

    One normalizer N (tokens or sequences) is counted over the whole step, all micro-batches
    and all ranks, before any backward pass, so the accumulated gradient is that of the full
    batch loss: sum_mb aggregate(-logp_mb, mask_mb, mode, N) == aggregate(-logp, mask, mode).

    ``max_tokens`` (with packing): micro-batches of at most that many tokens, balanced
    (``data.balance.micro_batch_plan``; a longer example runs alone), instead of
    ``micro_batch_size`` examples; every rank runs as many passes as the one with the most, a
    rank with fewer adding passes that count zero (FSDP needs each rank's forwards).
    """
    if not packing:
        # Similar lengths in a micro-batch waste less compute on padding. The order within a
        # step does not change the step's loss (one global normalizer), only float rounding.
        examples = sorted(examples, key=len)
    if packing and max_tokens > 0:
        plan = micro_batch_plan([len(e) for e in examples], max_tokens=max_tokens)[0]
        groups = distributed.lockstep([[examples[i] for i in part] for part in plan],
                                      filler=[min(examples, key=len)])
    else:
        groups = [(group, True) for group in chunks(examples, micro_batch_size)]
    micro = [(_collate(group, packing, pad_id, device, max_length), real) for group, real in groups]
    count = sum(aggregate_count(mb["loss_mask"], loss_agg, segment_ids=mb["segment_ids"]) for mb, real in micro if real)
    normalizer = distributed.all_reduce_sum(count)
    scale = distributed.grad_scale()
    loss_sum = torch.zeros((), device=device)
    for mb, real in micro:  # a filler pass (real False) keeps the ranks in lockstep and adds nothing
        loss = _loss(model, mb, loss_agg, normalizer) * float(real)
        # FSDP averages gradients over ranks; scale so that they sum instead (N is global).
        (loss * scale).backward()
        loss_sum += loss.detach()
    return loss_sum


@torch.no_grad()
def evaluate_loss(model, examples: list[SFTExample], *, batch_size: int, pad_id: int, device, progress: bool = False,
                  desc: str = "sft") -> float:
    """Token-mean negative log-likelihood over this rank's share of ``examples``, summed over ranks."""
    was_training = model.training
    model.eval()
    mine = shard(examples, distributed.data_rank(), distributed.data_size())
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


def train_flops(shape: ModelFlops | None, examples: list[SFTExample]) -> float:
    """Model FLOPs of training on ``examples`` (``models.flops``): forward and backward, each
    example causal on its own, the LM head only where a target is scored (not on the prompt)."""
    if shape is None:
        return 0.0
    return sum(3 * shape.sequence(len(e), sum(e.loss_mask[1:])) for e in examples)


def train(cfg: Config, *, desc: str = "sft") -> RunResult:
    """``desc`` labels the progress bars (the verifier recipe trains through this loop)."""
    run = frame.open(cfg, "sft", check=_check)
    m, o = cfg.model, cfg.optim
    tok = load_model_tokenizer(m)
    train_set, eval_set, data_metrics = _load_data(cfg, tok)
    check_rows(len(train_set), cfg.batch_size, what=f"data.path={cfg.data.path}")
    total_steps, per_epoch = frame.schedule(cfg, len(train_set))
    facts = frame.offline_facts(run, total_steps, per_epoch, data_metrics, train=len(train_set), eval_rows=len(eval_set),
                                unit="examples")
    banner.dry_run("sft", cfg, **facts)  # --dry-run stops here, before any weights are read
    model = build.load_policy(m, run.device)
    if cfg.packing:
        packed_attention(model, m.attn_implementation)
    frame.context_parallel(cfg, model)
    banner.start("sft", cfg, model=model, **facts)  # parameters counted before FSDP shards them
    t = frame.trainable(run, model, ckpt=frame.checkpoint_to_resume(run), rows=len(train_set), batch_size=cfg.batch_size,
                        total_steps=total_steps)
    # packed passes of a token budget sized for the device (off on the CPU: micro_batch_size examples per pass)
    max_tokens = device_tokens(cfg.max_tokens_per_micro, t.model, run.device, cpu=0,
                               checkpointing=m.gradient_checkpointing) if cfg.packing else 0
    save = frame.saver(run, t, tok)
    tracker = frame.tracker(run, t, desc=desc, bar_keys=("train/loss", "train/lr", "perf/tokens_per_s", "perf/mfu",
                                                        "eval/loss"), first=data_metrics)
    shape = model_flops(model)
    metrics: dict[str, float] = {}
    for step in frame.steps(t):
        t0 = time.perf_counter()
        # ---- this rank's share of the step's global batch, cut into micro-batches
        mine = [train_set[i] for i in shard(t.sampler.next(), run.rank, run.world)]
        loss_sum = accumulate_gradients(t.model, mine, micro_batch_size=cfg.micro_batch_size, packing=cfg.packing,
                                        loss_agg=cfg.loss_agg, pad_id=tok.pad_token_id, device=run.device,
                                        max_length=cfg.data.max_length, max_tokens=max_tokens)
        # each cp rank's loss covers its chunks' tokens: the step's loss sums over dp and cp
        metrics = {"train/loss": distributed.all_reduce_sum(loss_sum, group="dp_cp").item(),
                   **frame.optimizer_step(t, o.max_grad_norm)}
        work = torch.tensor([float(sum(len(e) for e in mine)), train_flops(shape, mine)], dtype=torch.float64,
                            device=run.device)
        tokens, flops = distributed.all_reduce_sum(work).tolist()
        seconds = time.perf_counter() - t0
        metrics.update({"train/epoch": frame.epoch(t), "perf/tokens": tokens, "perf/tokens_per_s": tokens / max(seconds, 1e-9),
                        "perf/step_seconds": seconds, **frame.mfu(run, flops, seconds)})
        if eval_set and frame.eval_due(step, cfg.eval_every, total_steps):
            metrics["eval/loss"] = evaluate_loss(t.model, eval_set, batch_size=cfg.eval_batch_size, pad_id=tok.pad_token_id,
                                                 device=run.device, progress=cfg.logging.progress, desc=desc)
        frame.log(run, tracker, save, step, metrics)
    last = frame.save_last(run, t, save)
    tracker.close()
    return frame.close(run, metrics=metrics, keys=("train/loss", "eval/loss", "train/epoch"), steps=total_steps,
                       checkpoint=last)
