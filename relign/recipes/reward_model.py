"""Bradley-Terry reward model: learn r(x, y) so that preferred responses score higher.

    for each step:
        pairs   <- next global batch (deterministic, resumable)
        for each micro-batch:
            r_w, r_l = r(x, y_w), r(x, y_l)           one forward over the interleaved rows
            L = -log sigma(r_w - r_l - m) + c (r_w + r_l)^2
            backward(sum L / pairs in the global batch)
        clip grad norm; AdamW step; lr schedule step
        every eval_every: pair accuracy and reward margin on held-out pairs

With ``loss=bce`` the rows are pointwise ``{prompt, response, label in [0, 1]}`` and the loss is
binary cross-entropy on the same head, L = -[t log sigma(r) + (1 - t) log(1 - sigma(r))]: the
forecaster of linguistic calibration (Band et al., arXiv 2404.00474, ForecastProbs), read as
sigma(r(x, y)) (``models.reader.Forecaster``).

The model is ``AutoModelForSequenceClassification`` with one output, read at the last non-pad
token (``models.reward``). Checkpoints are plain HF folders; ``relign rl
reward.model=RUN/checkpoints/step_N`` uses one as a learned reward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import banner, distributed
from ..algorithms.preference import bradley_terry_loss
from ..checks import (
    check_choice, check_common, check_divides, check_model_path, check_non_negative, check_positive, check_rows
)
from ..config import BatchFields, ConfigError, OptimConfig, PreferenceDataConfig
from ..data.collate import chunks, shard
from ..data.preference import TRUNCATION
from ..models.flops import ModelFlops, model_flops
from ..models.loading import load_model_tokenizer
from ..models.logprobs import right_pad
from ..models.reward import sequence_rewards
from . import RunResult, build, frame
from .pairs import add_sums, average_sums, collate_pairs, load_examples


@dataclass
class Config(BatchFields):
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, warmup_ratio=0.03))
    eval_batch_size: int = 8
    """Pairs per eval forward pass."""
    use_margin: bool = False
    """Subtract each row's 'margin' field inside the sigmoid (Llama 2); rows without one use 0."""
    center_coef: float = 0.0
    """Weight c of the reward-centering term c (r_w + r_l)^2 (Eisenstein et al.; 1e-2 is typical)."""
    loss: str = "bt"
    """bt (Bradley-Terry on preference pairs) or bce (pointwise rows {prompt, response, label in [0, 1]}: a forecaster)."""


def _check(cfg: Config) -> None:
    """Every setting that cannot work, before any data or model is read."""
    check_positive(cfg, "batch_size", "micro_batch_size", "eval_batch_size", "epochs")
    check_non_negative(cfg, "max_steps", "eval_every", "center_coef")
    check_divides(cfg, "batch_size", "micro_batch_size", distributed.data_size())
    check_common(cfg)
    check_choice("data.truncation", cfg.data.truncation, TRUNCATION)
    check_choice("loss", cfg.loss, ("bt", "bce"))
    if cfg.loss == "bce" and (cfg.use_margin or cfg.center_coef):
        raise ConfigError("use_margin and center_coef shape the Bradley-Terry loss of pairs: loss=bce has no pairs")
    if not cfg.data.path:
        raise ConfigError("missing value for 'data.path': give a preference file, a dataset folder or a hub id")
    check_model_path("model.path", cfg.model.path)


# Logged names of the loss's per-pair values, where they differ.
METRIC_NAMES = {"margins": "rewards/margins"}


def step_flops(shape: ModelFlops | None, examples: list) -> float:
    """Model FLOPs of training on ``examples`` (``models.flops``): forward and backward of each
    full row (a pair's two, a point's one); the scalar head is a few FLOPs, not counted."""
    if shape is None:
        return 0.0
    def rows(e) -> tuple[int, ...]:
        return (len(e.chosen_ids), len(e.rejected_ids)) if hasattr(e, "chosen_ids") else (len(e.input_ids),)

    return sum(3 * shape.sequence(n, 0) for e in examples for n in rows(e))


def pair_rewards(model, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """r(x, y_w), r(x, y_l) [B] from the interleaved rows of ``collate_pairs``."""
    r = sequence_rewards(model, mb["input_ids"], mb["attention_mask"])  # [2B]
    return r[0::2], r[1::2]


class PairLosses:
    """The Bradley-Terry loss of the reward model on rows of a pair set, and its held-out metrics."""

    def __init__(self, cfg: Config, model, pad_id: int, device):
        self.cfg, self.model, self.pad_id, self.device = cfg, model, pad_id, device

    def of(self, idx: list[int], exs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mb = collate_pairs([exs[i] for i in idx], self.pad_id, self.device)
        r_w, r_l = pair_rewards(self.model, mb)
        return bradley_terry_loss(r_w, r_l, margin=mb["margins"] if self.cfg.use_margin else None,
                                  center_coef=self.cfg.center_coef)

    @torch.no_grad()
    def evaluate(self, eval_set) -> dict[str, float]:
        """eval/* over this rank's share of the held-out pairs, averaged over all ranks."""
        self.model.eval()
        mine = shard(list(range(len(eval_set))), distributed.data_rank(), distributed.data_size())
        sums: dict[str, torch.Tensor] = {}
        parts = distributed.lockstep(list(chunks(mine, self.cfg.eval_batch_size)), filler=[0])
        with banner.progress(len(parts), "rm eval", enabled=self.cfg.logging.progress, leave=False, delay=3.0) as bar:
            for part, real in parts:
                losses, met = self.of(part, eval_set)
                if real:  # else a forward only to keep the ranks in step
                    add_sums(sums, {"loss": losses, **met})
                bar.update()
        self.model.train()
        distributed.reshard(self.model)  # a forward with no backward (see distributed.reshard)
        return average_sums(sums, len(mine), "eval/", device=self.device, names=METRIC_NAMES)


class PointLosses(PairLosses):
    """loss=bce: binary cross-entropy of sigma(r(x, y)) against each row's label t in [0, 1]."""

    def of(self, idx: list[int], exs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = [exs[i] for i in idx]
        ids, mask = right_pad([e.input_ids for e in rows], self.pad_id, self.device)
        t = torch.tensor([e.label for e in rows], dtype=torch.float32, device=self.device)  # [B]
        r = sequence_rewards(self.model, ids, mask)  # [B] logits
        losses = F.binary_cross_entropy_with_logits(r, t, reduction="none")
        p = torch.sigmoid(r.detach())
        # accuracy: the forecast on the label's side of 1/2; abs_error: |sigma(r) - t|
        return losses, {"accuracy": ((p > 0.5) == (t > 0.5)).float(), "abs_error": (p - t).abs()}


def train(cfg: Config) -> RunResult:
    run = frame.open(cfg, "rm", check=_check)
    tok = load_model_tokenizer(cfg.model)
    bce = cfg.loss == "bce"
    train_set, eval_set, data_metrics = load_examples(cfg.data, tok, points=bce, seed=cfg.seed)
    check_rows(len(train_set), cfg.batch_size, what=f"data.path={cfg.data.path}")
    total_steps, per_epoch = frame.schedule(cfg, len(train_set))
    facts = frame.offline_facts(run, total_steps, per_epoch, data_metrics, train=len(train_set), eval_rows=len(eval_set),
                                unit="rows" if bce else "pairs", kind="seq_cls")
    banner.dry_run("rm", cfg, **facts)  # --dry-run stops here, before any weights are read
    model = build.load_reward(cfg.model, run.device, tok.pad_token_id)
    banner.start("rm", cfg, model=model, **facts)  # parameters counted before FSDP shards them
    t = frame.trainable(run, model, ckpt=frame.checkpoint_to_resume(run), rows=len(train_set), batch_size=cfg.batch_size,
                        total_steps=total_steps)
    save = frame.saver(run, t, tok)
    losses = (PointLosses if bce else PairLosses)(cfg, t.model, tok.pad_token_id, run.device)
    tracker = frame.tracker(run, t, desc="rm", first=data_metrics,
                            bar_keys=("train/loss", "train/accuracy", "train/rewards/margins", "eval/accuracy", "perf/mfu"))
    metrics: dict[str, float] = {}
    shape = model_flops(model)
    for step in frame.steps(t):
        t0 = time.perf_counter()
        mine = shard(t.sampler.next(), run.rank, run.world)
        sums: dict[str, torch.Tensor] = {}
        for part in chunks(mine, cfg.micro_batch_size):
            per_pair, met = losses.of(part, train_set)
            (per_pair.sum() / cfg.batch_size * distributed.grad_scale()).backward()  # mean over the global batch
            add_sums(sums, {"loss": per_pair, **met})
        step_metrics = frame.optimizer_step(t, cfg.optim.max_grad_norm)
        seconds = time.perf_counter() - t0
        metrics = average_sums(sums, len(mine), "train/", device=run.device, names=METRIC_NAMES)
        flops = distributed.all_reduce_sum(torch.tensor(step_flops(shape, [train_set[i] for i in mine]), dtype=torch.float64,
                                                        device=run.device)).item()
        metrics.update({**step_metrics, "perf/pairs_per_s": cfg.batch_size / max(seconds, 1e-9), "train/epoch": frame.epoch(t),
                        **frame.mfu(run, flops, seconds)})
        if eval_set and frame.eval_due(step, cfg.eval_every, total_steps):
            metrics.update(losses.evaluate(eval_set))
        frame.log(run, tracker, save, step, metrics)
    last = frame.save_last(run, t, save)
    tracker.close()
    return frame.close(run, metrics=metrics, keys=("train/loss", "train/accuracy", "eval/loss", "eval/accuracy"),
                       steps=total_steps, checkpoint=last)
