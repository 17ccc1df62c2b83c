"""The RL step's stages beside the loop (``recipes/rl.py``): the critic, the batch, the reference
and the values, the shaped rewards, and the step's metrics and MFU. Each reads the run's models and
collector (``RLRun``) and the config, and returns tensors or metrics; the loop decides when each runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..algorithms import shaping
from ..algorithms.kl import kl_estimate
from ..checkpoint import load_model_weights
from ..models.flops import ModelFlops, model_flops
from ..models.value import ValueModel
from ..optim import build_optimizer
from ..rollout.batch import RolloutBatch, build_batch
from ..rollout.vine import AdaptiveK, VineEpisode, mc_step_values
from ..rollout.weights import engine_weights
from ..tracking import StageClock
from . import build, frame
from .rl_advantages import Rewards, shaped_rewards
from .rl_config import AlgorithmConfig, Config
from .rl_update import Layout, Stats, behaviour_spread, score_logps, score_values

if TYPE_CHECKING:  # the run's parts, named in RLRun only
    from ..data.collate import StepSampler
    from ..evaluate import PeriodicEval
    from ..rollout.collect import RolloutCollector
    from ..rollout.engine import Engine
    from ..rollout.queue import RolloutAhead
    from ..tracking import Tracker
    from .rl_advantages import AdvantageOptions, Estimator
    from .rl_update import ActorLoss


@dataclass
class RLRun:
    """Everything ``rl.train`` drives; built once by ``rl._setup``."""

    tok: Any
    policy: torch.nn.Module
    ref: torch.nn.Module | None
    critic: ValueModel | None
    engine: Engine
    collector: RolloutCollector
    sampler: StepSampler
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    critic_opt: torch.optim.Optimizer | None
    layout: Layout
    loss_fn: ActorLoss
    estimator: Estimator
    options: AdvantageOptions
    tracker: Tracker
    evaluator: PeriodicEval | None
    start: int
    ahead: RolloutAhead
    """The batches sampled ahead of the update (rollout.max_staleness), restored on resume."""
    step_delimiter: str = ""
    """Where a response's steps end (VinePPO)."""
    probe: list[list[int]] | None = None
    """The sync check's fixed sequences (None: the engine holds the policy's own tensors, or the check is off)."""
    trainer: frame.Trainer | None = None
    """The policy's frame trainer: its steps (the rollout steps, not the updates) and its save tail."""


def critic_for(cfg: Config, ckpt, device) -> tuple[ValueModel, torch.optim.Optimizer]:
    """The value model V(s_t) (resumed from ``ckpt/critic``), sharded, with its AdamW."""
    m = cfg.model
    critic = build.load_critic(cfg.critic.path or m.path, m, device, key="critic.path" if cfg.critic.path else "model.path")
    if ckpt is not None:
        load_model_weights(critic.lm, ckpt / "critic")
        critic.load_head(ckpt / "critic")
    critic = frame.shard(critic)
    return critic, build_optimizer(critic, lr=cfg.critic.lr, weight_decay=cfg.optim.weight_decay,
                                   betas=(cfg.optim.beta1, cfg.optim.beta2))


def values_of(run: RLRun, cfg: Config, step: int, groups, batch, micro) -> tuple[object, dict[str, float]]:
    """The values the estimator reads: the critic's V(s_t) [N, L], VinePPO's step values (K
    continuations from every step boundary, sampled by the engine with the policy's settings
    and scored by the task), or None."""
    if run.critic is not None:
        return score_values(run.critic, batch, micro, run.layout), {}
    if run.estimator.values != "monte_carlo":
        return None, {}
    v, c = cfg.vine, run.collector
    episodes = [VineEpisode(e.prompt_ids, e.response_ids, g.prompt_text, g.extra_info) for g in groups for e in g.episodes]
    run.engine.wake()  # generation between the rollout and the update
    if run.engine.weights_stale:  # a vLLM engine that slept at level 2 dropped them
        run.engine.load_weights(engine_weights(run.engine, run.policy))
    values, stats = mc_step_values(
        run.engine, run.tok, episodes, params=c.sampling,
        score=lambda p, r, i, ids: [x.reward for x in c.pool.score(p, r, i, completion_ids=ids)],
        k=v.k, max_steps=v.max_steps, delimiter=run.step_delimiter, dedup=v.dedup,
        adaptive=AdaptiveK() if v.adaptive else None, seed=cfg.seed, step=step)
    run.engine.sleep()
    stats["vine/policy_tokens"] = float(sum(len(e.response_ids) for e in episodes))
    return values, stats


def reference_logps(run: RLRun, batch, micro, temperature: float) -> torch.Tensor:
    if run.ref is not None:
        return score_logps(run.ref, batch, micro, run.layout, temperature=temperature)
    with run.policy.disable_adapter():  # LoRA: the reference is the base model, no second copy
        return score_logps(run.policy, batch, micro, run.layout, temperature=temperature)


def batch_of(run: RLRun, a: AlgorithmConfig, groups, device) -> RolloutBatch:
    batch = build_batch([e for g in groups for e in g.episodes], run.tok.pad_token_id, device, run.options.group_size)
    if a.overlong == "mask":  # DAPO's overlong filtering: truncated completions leave the loss
        truncated = torch.tensor([e.finish_reason != "stop" for g in groups for e in g.episodes], device=device)
        batch.response_mask = shaping.truncation_loss_mask(truncated, batch.response_mask)
    return batch


def rewards_of(run: RLRun, a: AlgorithmConfig, groups, batch, old_logps, ref_logps) -> Rewards:
    """The step's rewards with their shaping: overlong penalty, and the KL when it is in the reward."""
    def term_weight(k: str) -> float:
        return a.gdpo_weights.get(k, run.collector.term_weight(k))

    if run.estimator.check_groups is not None:
        run.estimator.check_groups(groups, term_weight)
    kl_tok = kl_estimate(old_logps, ref_logps, a.kl_estimator) if a.kl == "reward" else None
    return shaped_rewards(groups, batch, term_weight=term_weight, overlong=a.overlong,
                          max_len=run.collector.max_response_tokens, overlong_cache=a.overlong_cache,
                          overlong_factor=a.overlong_factor, kl_tok=kl_tok, kl_coef=a.kl_coef)


def batch_flops(shape: ModelFlops, batch: RolloutBatch, layout: Layout, *, head: bool = True) -> float:
    """Forward FLOPs of one pass over every row of ``batch`` (``models.flops``): a group's prompt
    once where the layout shares it (shared, or packed with G > 1), the LM head (``head``) at the
    response tokens."""
    G = layout.group_size if layout.kind != "padded" and layout.group_size > 1 else 1
    P, S = batch.prompt_lens.tolist(), batch.seq_lens.tolist()
    return sum(shape.group(P[i], [S[j] - P[j] for j in range(i, i + G)], shared=G > 1, head=head)
               for i in range(0, len(P), G))


def trainer_mfu(run: frame.Run, cfg: Config, r: RLRun, batch: RolloutBatch, metrics: dict[str, float], *, reference: bool,
                old: bool) -> dict[str, float]:
    """``perf/mfu`` of the step's trainer passes (the reference and old log-probs forwards, the
    update's forwards and backwards: policy, and critic if any) over their stages' seconds; the
    rollout and the values stage (generation for VinePPO) are not in it, as veRL's
    ``perf/mfu/actor`` leaves them out. Groups skipped for zero advantage did not run. TRPO's
    conjugate-gradient products are not counted: no MFU for it."""
    shape = model_flops(r.policy)
    if shape is None or run.peak is None or cfg.update == "trpo":
        return {}
    a, fwd = cfg.algorithm, batch_flops(shape, batch, r.layout)
    flops = (reference + old) * fwd + 3 * a.ppo_epochs * fwd * (1.0 - metrics.get("actor/skipped_rows_frac", 0.0))
    if r.critic is not None:
        flops += 3 * a.ppo_epochs * batch_flops(shape, batch, r.layout, head=False)
    seconds = sum(metrics.get(f"time/{k}_s", 0.0) for k in ("reference", "old_logps", "update"))
    return frame.mfu(run, flops, seconds)


def step_metrics(run: RLRun, groups, batch: RolloutBatch, rewards: Rewards, stats: Stats, old_logps, clock: StageClock
                  ) -> dict[str, float]:
    eps = [e for g in groups for e in g.episodes]
    lengths = batch.response_mask.sum(-1)
    out = {
        "reward/mean": float(rewards.outcome.mean()),
        "reward/std": float(rewards.outcome.std()) if len(eps) > 1 else 0.0,
        "reward/score": float(np.mean([e.score for e in eps])),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(np.mean([e.finish_reason != "stop" for e in eps])),
        **run.collector.step_metrics(groups),
        **stats.reduce(),
        **clock.metrics(),
    }
    behaviour_spread(out)
    if rewards.penalties is not None:
        out["reward/kl_penalty"] = float(-rewards.penalties.sum(-1).mean())
    if old_logps is not None:  # engine vs trainer on the same tokens and weights
        m, gap = batch.response_mask, (batch.sampling_logps - old_logps).abs()
        out["actor/logp_mismatch"] = float((gap * m).sum() / m.sum().clamp_min(1))
        out["actor/logp_mismatch_max"] = float(gap[m.bool()].max()) if m.any() else 0.0
    out["perf/tokens_per_s"] = float(batch.seq_lens.sum()) / max(out["time/step_s"], 1e-9)
    out.update(run.engine.perf_metrics())  # the engine's own (the HF engine on a GPU: perf/decode_bw_frac)
    return out
