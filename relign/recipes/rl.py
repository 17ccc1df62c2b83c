"""Reinforcement learning with verifiable (or learned) rewards: PPO, the GRPO family, RLOO, REINFORCE++.

    for each step:
        1. rollout      G completions for each of the step's prompts (single- or multi-turn)
        2. rewards      task reward functions in worker processes (errors and timeouts -> 0)
                        [DAPO dynamic sampling: drop zero-variance groups, sample more prompts]
        3. ref logps    only when a KL term is used
        4. values       only with a critic (GAE)
        5. old logps    only when the batch is used for more than one update (else reuse the
                        detached current log-probs: the ratio is 1 and its gradient is exact)
        6. advantages   group (GRPO / Dr. GRPO / RLOO), REINFORCE++, GAE or GDPO
        7. updates      ppo_epochs x mini_batches optimizer steps of the clipped policy loss
                        (+ KL, entropy), and of the clipped value loss for the critic
        8. weight sync  to the engine (nothing to copy when the engine shares the policy)

Presets in examples/ name the published algorithms; see docs/rl.md for the table.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import distributed
from ..algorithms import advantages as adv_fns
from ..algorithms import shaping
from ..algorithms.aggregation import MODES, aggregate, aggregate_count
from ..algorithms.kl import kl_estimate, kl_penalty_rewards
from ..algorithms.policy_losses import entropy_bonus_loss, gspo_loss, ppo_clip_loss, truncated_is_weights, value_loss
from ..checkpoint import load_checkpoint, load_model_weights, resolve_resume, save_checkpoint, seed_everything
from ..config import (
    CheckpointConfig,
    ConfigError,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    check_choice,
    make_run_dir,
    save_resolved_config,
)
from ..data.collate import StepSampler
from ..models.loading import apply_lora, load_causal_lm, load_tokenizer, resolve_device, trainable_parameters
from ..models.logprobs import shared_prefix_token_logps, token_logps
from ..models.value import ValueModel
from ..optim import build_optimizer, build_scheduler, clip_gradients, warmup_steps_of
from ..rollout.batch import RolloutBatch, build_batch, micro_slices
from ..rollout.engine import SamplingParams
from ..rollout.hf_engine import HFEngine
from ..rollout.collect import RolloutCollector
from ..evaluate import EvalDuringTrainingConfig, PeriodicEval, check_eval_during_training
from ..tracking import Tracker, read_metrics
from . import RunResult

ADVANTAGES = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "gdpo")


@dataclass
class RolloutConfig:
    n: int = 8
    """Completions per prompt (group size G)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer scores log-probs at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = 256
    """Longest completion (per turn in multi-turn rollouts)."""
    max_response_tokens: int = 0
    """Multi-turn: cap on model + environment tokens after the prompt (0 = max_new_tokens x max_turns)."""
    min_new_tokens: int = 0
    """Forbid EOS before this many tokens."""
    ignore_eos: bool = False
    """Generate exactly max_new_tokens (benchmarks)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings."""
    max_turns: int = 1
    """Model turns per episode with a multi-turn environment (task.env)."""
    max_batch_rows: int = 256
    """Most sequences the engine decodes at once."""


@dataclass
class TaskConfig:
    name: str = "gsm8k"
    """Built-in task (gsm8k, math, countdown) or 'custom' with data path + reward_fn."""
    path: str = ""
    """Training prompts: a file, dataset folder or hub id (empty: the task's default source)."""
    split: str = ""
    """Split to read (empty: the task's default)."""
    max_rows: int = 0
    """Read at most this many prompts (0 = all)."""
    chat: bool = True
    """Wrap prompts in the tokenizer's chat template."""
    system_prompt: str = ""
    """System message for chat prompts."""
    max_prompt_length: int = 512
    """Prompts longer than this (in tokens) are skipped and counted."""
    format_weight: float = 0.0
    """Weight of the task's format reward added to correctness."""
    reward_fn: str = ""
    """Custom reward function 'path/to/file.py:function' (replaces the task's own)."""
    reward_timeout: float = 10.0
    """Seconds per reward call; a call that raises or runs longer scores 0 and is counted."""
    reward_workers: int = 2
    """Reward worker processes (0 = in-process, no timeout enforcement)."""
    env: str = ""
    """Multi-turn environment class 'module:Class' or 'file.py:Class' (empty = single-turn)."""


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"
    """grpo (group baseline), rloo (leave-one-out), reinforce_pp, reinforce_pp_baseline, gae (critic), gdpo."""
    scale_rewards: str = "none"
    """Group advantages: 'std' divides by the group std (GRPO), 'none' does not (Dr. GRPO)."""
    policy_loss: str = "ppo_clip"
    """ppo_clip (token-level ratio) or gspo (sequence-level ratio)."""
    loss_agg: str = "seq-mean-token-sum-norm"
    """token-mean, seq-mean-token-mean, seq-mean-token-sum or seq-mean-token-sum-norm."""
    clip_low: float = 0.2
    """Lower clip range epsilon_low of the ratio."""
    clip_high: float = 0.2
    """Upper clip range epsilon_high (DAPO clip-higher uses 0.28)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 bounding the loss for negative advantages (0 = off)."""
    kl_coef: float = 0.0
    """beta of the KL(pi || pi_ref) term (0 = no reference model)."""
    kl_estimator: str = "k3"
    """k1, k2 or k3."""
    kl_in_reward: bool = False
    """Apply KL as a per-token reward penalty instead of a loss term."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per pass (the batch is split into this many mini-batches)."""
    gamma: float = 1.0
    """Discount (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    whiten_advantages: bool = True
    """GAE: whiten advantages over the batch."""
    tis_cap: float = 0.0
    """Truncated importance-sampling cap between sampling and trainer log-probs (0 = off)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts to refill."""
    max_sampling_rounds: int = 3
    """Dynamic sampling: most rollout rounds per step."""
    overlong: str = "none"
    """Overlong shaping: none, penalty (DAPO soft penalty) or mask (drop truncated completions from the loss)."""
    overlong_cache: int = 0
    """Soft-penalty window L_cache in tokens before max_new_tokens."""
    overlong_factor: float = 1.0
    """Largest overlong penalty."""
    gdpo_weights: list[float] = field(default_factory=list)
    """GDPO: weight per reward component (sorted by name; empty = all 1)."""


@dataclass
class LearnedRewardConfig:
    model: str = ""
    """A trained reward model (relign rm) or generative verifier (relign verifier) checkpoint; empty = rule reward only."""
    kind: str = "auto"
    """auto (sequence-classification checkpoint -> rm, causal LM -> verifier), rm or verifier."""
    weight: float = 1.0
    """Weight of the learned reward in reward = rule_weight * rule + weight * model."""
    rule_weight: float = 1.0
    """Weight of the task's rule-based reward (0: the learned reward alone)."""
    batch_size: int = 16
    """Completions per scoring forward pass."""
    max_length: int = 2048
    """Longest (problem + response) the scorer reads, in tokens (longer inputs keep their end)."""


@dataclass
class CriticConfig:
    path: str = ""
    """Critic backbone (empty: the policy's model.path)."""
    lr: float = 1e-5
    """Critic learning rate."""
    value_clip: float = 0.2
    """Clip range of the value update around the old values (0 = off)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: LearnedRewardConfig = field(default_factory=LearnedRewardConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, schedule="constant"))
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalDuringTrainingConfig = field(default_factory=EvalDuringTrainingConfig)
    run_dir: str = ""
    """Where config.yaml, metrics.jsonl, rollouts/ and checkpoints/ go (empty: runs/rl-<time>)."""
    resume: str = "none"
    """'auto' continues from the newest complete checkpoint in run_dir; or a checkpoint path."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    max_steps: int = 100
    """Rollout + update steps."""
    prompts_per_step: int = 8
    """Prompts per step; the batch holds prompts_per_step x rollout.n completions."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass."""
    traces_per_step: int = 64
    """Completions written to rollouts/step_N.jsonl each step (0 = none)."""
    nan_patience: int = 3
    """Stop (after saving the last good checkpoint) when this many updates in a row are non-finite."""
    share_prompt: bool = True
    """Run each group's prompt once in training forwards (needs micro_batch_size to be a multiple of rollout.n)."""


def _check(cfg: Config) -> None:
    a = cfg.algorithm
    check_choice("algorithm.advantage", a.advantage, ADVANTAGES)
    check_choice("algorithm.scale_rewards", a.scale_rewards, ("std", "none"))
    check_choice("algorithm.policy_loss", a.policy_loss, ("ppo_clip", "gspo"))
    check_choice("algorithm.loss_agg", a.loss_agg, MODES)
    check_choice("algorithm.kl_estimator", a.kl_estimator, ("k1", "k2", "k3"))
    check_choice("algorithm.overlong", a.overlong, ("none", "penalty", "mask"))
    check_choice("reward.kind", cfg.reward.kind, ("auto", "rm", "verifier"))
    if cfg.reward.model and (cfg.task.env or cfg.task.name == "calculator"):
        raise ConfigError("reward.model scores single-turn completions; it cannot be combined with a multi-turn task.env")
    if a.advantage in ("grpo", "rloo", "gdpo", "reinforce_pp_baseline") and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.advantage={a.advantage} compares samples of a prompt: set rollout.n >= 2")
    if a.overlong == "penalty" and not 0 <= a.overlong_cache <= cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"algorithm.overlong_cache={a.overlong_cache} must lie in [0, rollout.max_new_tokens={cfg.rollout.max_new_tokens}]"
        )
    if cfg.prompts_per_step < 1 or cfg.micro_batch_size < 1 or a.mini_batches < 1 or a.ppo_epochs < 1:
        raise ConfigError("prompts_per_step, micro_batch_size, algorithm.mini_batches and algorithm.ppo_epochs must be >= 1")
    check_eval_during_training(cfg.eval, task=cfg.task.name, env=cfg.task.env)


def _forward(model, mb: dict[str, torch.Tensor], temperature: float, *, group_size: int = 0, with_entropy=False,
             entropy_grad=False):
    """Log-probs (and entropy) [n, L] of a micro-batch; ``group_size`` > 0: its rows are whole
    groups sharing a prompt, and each prompt is computed once."""
    if group_size > 1:
        return shared_prefix_token_logps(
            model, mb["input_ids"], mb["attention_mask"], mb["prompt_lens"], group_size, temperature=temperature,
            with_entropy=with_entropy, entropy_grad=entropy_grad,
        )
    # Rows are right-padded: cut the micro-batch to its longest row, and let causal attention
    # ignore the trailing padding (no mask needed), then pad the results back to the batch width.
    L = mb["input_ids"].shape[1]
    width = int(mb["attention_mask"].sum(-1).max())
    logps, ent = token_logps(
        model, mb["input_ids"][:, :width], temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, target_mask=mb["response_mask"][:, :width],
    )
    pad = lambda x: torch.nn.functional.pad(x, (0, L - width)) if x is not None else None  # noqa: E731
    return pad(logps), pad(ent)


@torch.no_grad()
def _score_all(fn, batch: RolloutBatch, micro: int) -> torch.Tensor:
    """Run ``fn(rows) -> [n, L]`` over the batch in micro-batches (no grad)."""
    return torch.cat([fn(batch.rows(s)) for s in micro_slices(batch.size, micro)])


def compute_advantages(cfg: AlgorithmConfig, batch: RolloutBatch, rewards: torch.Tensor, components: torch.Tensor | None,
                       values: torch.Tensor | None, group_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages [N, L] (and returns for the critic).

    grpo / rloo / gdpo compare whole sequences: ``rewards`` [N] (minus beta * sum_t KL_t when
    the KL is in the reward) or the reward ``components`` [N, K]; the sequence's advantage is
    put on each of its tokens. reinforce_pp and gae work per token on ``batch.token_rewards``
    (outcome on the last model token, KL penalty on every token when in the reward)."""
    mask = batch.response_mask
    if cfg.advantage in ("grpo", "rloo", "gdpo"):
        if cfg.advantage == "gdpo" and components is not None:
            w = torch.tensor(cfg.gdpo_weights, dtype=torch.float32) if cfg.gdpo_weights else None
            a = adv_fns.gdpo_advantages(components, group_size, w)
        else:
            baseline = "leave_one_out" if cfg.advantage == "rloo" else "mean"
            a = adv_fns.group_advantages(rewards, group_size, baseline=baseline, scale=cfg.scale_rewards)
        return a.unsqueeze(-1) * mask, None  # the sequence's advantage on each of its tokens
    if cfg.advantage.startswith("reinforce_pp"):
        base = "group_mean" if cfg.advantage == "reinforce_pp_baseline" else "none"
        return adv_fns.reinforce_pp_advantages(batch.token_rewards, mask, gamma=cfg.gamma, group_size=group_size, baseline=base), None
    a, returns = adv_fns.gae(batch.token_rewards, values, mask, gamma=cfg.gamma, lam=cfg.lam)
    if cfg.whiten_advantages:
        a = adv_fns.masked_whiten(a, mask)
    return a * mask, returns


def actor_token_loss(a: AlgorithmConfig, logps, entropy, old_logps, advantages, mask, *, ref_logps=None, tis=None):
    """Per-token actor loss [B, T]: the policy surrogate (times the TIS weight), plus
    beta * KL when the KL is a loss term, minus the entropy bonus. Returns (loss, diagnostics)."""
    if a.policy_loss == "gspo":
        # GSPO uses one advantage per sequence: the (constant) per-token advantage of the row
        seq_a = (advantages * mask).sum(-1) / mask.sum(-1).clamp_min(1)
        loss, info = gspo_loss(logps, old_logps, seq_a, mask, clip_low=a.clip_low, clip_high=a.clip_high)
    else:
        loss, info = ppo_clip_loss(logps, old_logps, advantages, clip_low=a.clip_low, clip_high=a.clip_high,
                                   dual_clip=a.dual_clip if a.dual_clip > 0 else None)
    if tis is not None:
        loss = loss * tis
    if ref_logps is not None:
        kl = kl_estimate(logps, ref_logps, a.kl_estimator)
        if not a.kl_in_reward:
            loss = loss + a.kl_coef * kl
        info["kl"] = kl.detach()
    if a.entropy_coef > 0:
        loss = loss + a.entropy_coef * entropy_bonus_loss(entropy)
    return loss, info


def train(cfg: Config) -> RunResult:
    _check(cfg)
    distributed.init()
    if distributed.world_size() > 1:
        raise ConfigError("relign rl runs on one process for now (torchrun support is planned)")
    device = resolve_device(cfg.device)
    seed_everything(cfg.seed)
    run_dir = make_run_dir(cfg.run_dir, "rl")
    save_resolved_config(cfg, run_dir)
    a, ro, m = cfg.algorithm, cfg.rollout, cfg.model

    # ---- models: policy (+ engine on the same weights), reference, critic
    tok = load_tokenizer(m.tokenizer or m.path, trust_remote_code=m.trust_remote_code)
    policy = load_causal_lm(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                            trust_remote_code=m.trust_remote_code, gradient_checkpointing=m.gradient_checkpointing, device=device)
    if m.lora.enabled:
        policy = apply_lora(policy, r=m.lora.r, alpha=m.lora.alpha, dropout=m.lora.dropout, target_modules=m.lora.target_modules)
    ref = None
    if a.kl_coef > 0 and not m.lora.enabled:  # with LoRA the reference is the base model, adapter disabled
        ref = load_causal_lm(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                             trust_remote_code=m.trust_remote_code, device=device).eval().requires_grad_(False)
    critic = critic_opt = None
    if a.advantage == "gae":
        critic = ValueModel(load_causal_lm(cfg.critic.path or m.path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                                           trust_remote_code=m.trust_remote_code, device=device))
        critic_opt = build_optimizer(critic, lr=cfg.critic.lr, weight_decay=cfg.optim.weight_decay, betas=(cfg.optim.beta1, cfg.optim.beta2))
    engine = HFEngine(policy, tok, max_batch_rows=ro.max_batch_rows, seed=cfg.seed)

    # ---- task: prompts, reward workers, optional multi-turn environment
    t = cfg.task
    sampling = SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k, max_new_tokens=ro.max_new_tokens,
                              min_new_tokens=ro.min_new_tokens, stop=list(ro.stop), ignore_eos=ro.ignore_eos)
    scorer = None
    if cfg.reward.model:  # a learned reward: a second model, scoring completions in batches
        from ..models.reward import load_scorer

        rw = cfg.reward
        try:
            scorer = load_scorer(rw.model, rw.kind, device=device, batch_size=rw.batch_size, max_length=rw.max_length,
                                 dtype=m.dtype, trust_remote_code=m.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"reward.model={rw.model}: {e}") from None
    runner = RolloutCollector(
        tok, engine, task=t.name, path=t.path, split=t.split, max_rows=t.max_rows, chat=t.chat, system_prompt=t.system_prompt,
        max_prompt_length=t.max_prompt_length, format_weight=t.format_weight, reward_fn=t.reward_fn,
        reward_timeout=t.reward_timeout, reward_workers=t.reward_workers, env=t.env, sampling=sampling,
        max_turns=ro.max_turns, max_response_tokens=ro.max_response_tokens, seed=cfg.seed,
        scorer=scorer, scorer_weight=cfg.reward.weight, rule_weight=cfg.reward.rule_weight,
    )
    sampler = StepSampler(len(runner), cfg.prompts_per_step, seed=cfg.seed)
    # held-out accuracy every eval.every steps, on the task's test problems (relign/evaluate.py)
    evaluator = PeriodicEval(
        cfg.eval, tok, run_dir, task=t.name, chat=t.chat, system_prompt=t.system_prompt, format_weight=t.format_weight,
        reward_fn=t.reward_fn, reward_workers=t.reward_workers, reward_timeout=t.reward_timeout,
        max_prompt_length=t.max_prompt_length, max_new_tokens=ro.max_new_tokens, stop=ro.stop, seed=cfg.seed,
    ) if cfg.eval.every else None
    opt_steps = cfg.max_steps * a.ppo_epochs * a.mini_batches
    o = cfg.optim
    optimizer = build_optimizer(policy, lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps)
    scheduler = build_scheduler(optimizer, total_steps=opt_steps, warmup_steps=warmup_steps_of(opt_steps, o.warmup_steps, o.warmup_ratio),
                                schedule=o.schedule, min_lr_ratio=o.min_lr_ratio)
    start = 0
    ckpt = resolve_resume(cfg.resume, run_dir)
    if ckpt is not None:
        load_model_weights(policy, ckpt)
        tensors, state = load_checkpoint(ckpt)
        optimizer.load_state_dict(tensors["optimizer"])
        scheduler.load_state_dict(tensors["scheduler"])
        engine.load_state_dict(tensors["engine"])
        sampler.load_state_dict(state["sampler"])
        if critic is not None:
            load_model_weights(critic.lm, ckpt / "critic")
            critic.load_head(ckpt / "critic")
            critic_opt.load_state_dict(tensors["critic_optimizer"])
        start = state["step"]

    def save(step: int) -> None:
        tensors = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "engine": engine.state_dict()}
        extra = {}
        if critic is not None:
            tensors["critic_optimizer"] = critic_opt.state_dict()
            extra["critic"] = critic
        save_checkpoint(run_dir, step, model=policy, tokenizer=tok, tensors=tensors, extra_models=extra,
                        state={"sampler": sampler.state_dict(), "recipe": "rl"}, keep_last=cfg.checkpoint.keep_last)

    lg = cfg.logging
    tracker = Tracker(run_dir, total_steps=cfg.max_steps, start_step=start, desc="rl", progress=lg.progress,
                      bar_keys=("reward/mean", "reward/score", "actor/kl", "response/length_mean", "perf/tokens_per_s"),
                      tensorboard=lg.tensorboard, wandb=lg.wandb, wandb_project=lg.wandb_project, run_name=lg.run_name)
    if start:
        tracker.write(f"resumed from {ckpt} at step {start}")
    (run_dir / "rollouts").mkdir(exist_ok=True)
    G, T = ro.n, ro.temperature
    micro = cfg.micro_batch_size
    # shared-prompt forwards need micro-batches of whole groups
    share = G if cfg.share_prompt and G > 1 and micro % G == 0 else 0
    bad_in_a_row = 0
    status = "completed"
    metrics: dict[str, float] = {}
    try:
        for step in range(start + 1, cfg.max_steps + 1):
            t_step = time.perf_counter()
            # ---- 1-2. rollout and rewards (dynamic sampling may take several rounds)
            groups = runner.collect(sampler, cfg.prompts_per_step, a.dynamic_sampling, a.max_sampling_rounds)
            t_rollout = time.perf_counter() - t_step
            episodes = [e for g in groups for e in g.episodes]
            batch = build_batch(episodes, tok.pad_token_id, device)
            rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32, device=device)
            lengths = batch.response_mask.sum(-1)
            truncated = torch.tensor([e.finish_reason != "stop" for e in episodes], device=device)
            if a.overlong == "penalty":
                rewards = rewards + shaping.overlong_penalty(lengths, max_len=ro.max_new_tokens, cache_len=a.overlong_cache, factor=a.overlong_factor)
            if a.overlong == "mask":
                batch.response_mask = shaping.truncation_loss_mask(truncated, batch.response_mask)
            # outcome reward on the last model token (multi-turn turn rewards are already there)
            if runner.env is None:
                batch.token_rewards.zero_()
                batch.token_rewards[torch.arange(batch.size), batch.last_token] = rewards
            mask = batch.response_mask
            t_train = time.perf_counter()

            # ---- 3. reference log-probs (only with a KL term)
            stats: dict[str, list[float]] = {}
            ref_logps = None
            if a.kl_coef > 0:
                if ref is not None:
                    ref_logps = _score_all(lambda mb: _forward(ref, mb, T, group_size=share)[0], batch, micro)
                else:
                    with policy.disable_adapter():
                        ref_logps = _score_all(lambda mb: _forward(policy, mb, T, group_size=share)[0], batch, micro)
            # ---- 4. values (only with a critic)
            values = _score_all(lambda mb: critic(mb["input_ids"], mb["attention_mask"]), batch, micro) if critic is not None else None
            # ---- 5. old log-probs: only needed when the batch serves more than one update
            reuse = a.ppo_epochs * a.mini_batches > 1 or a.tis_cap > 0 or (a.kl_in_reward and a.kl_coef > 0)
            old_logps = _score_all(lambda mb: _forward(policy, mb, T, group_size=share)[0], batch, micro) if reuse else None
            adv_rewards = rewards  # what the sequence-level estimators (grpo, rloo) see
            if a.kl_in_reward and a.kl_coef > 0:
                kl_tok = kl_estimate(old_logps, ref_logps, a.kl_estimator)
                batch.token_rewards = kl_penalty_rewards(batch.token_rewards, kl_tok, a.kl_coef, mask)
                # sequence-level form (RLOO, InstructGPT): R_i - beta * sum_t KL_t
                kl_seq = (kl_tok * mask).sum(-1)
                adv_rewards = rewards - a.kl_coef * kl_seq
                stats["reward/kl_penalty"] = [float(a.kl_coef * kl_seq.mean())]
            if old_logps is not None:  # engine vs trainer on the same tokens and weights
                _acc(stats, "actor/logp_mismatch", (batch.sampling_logps - old_logps).abs(), mask)
            # ---- 6. advantages
            comps = None
            if a.advantage == "gdpo":
                names = sorted(episodes[0].components) if episodes[0].components else []
                comps = torch.tensor([[e.components.get(k, 0.0) for k in names] for e in episodes], device=device) if names else None
            advantages, returns = compute_advantages(a, batch, adv_rewards, comps, values, G)
            tis = truncated_is_weights(old_logps, batch.sampling_logps, cap=a.tis_cap) if a.tis_cap > 0 else None

            # ---- 7. updates: ppo_epochs x mini_batches optimizer steps
            n_rows = batch.size
            mb_rows = math.ceil(n_rows // G / a.mini_batches) * G  # whole groups per mini-batch
            for _epoch in range(a.ppo_epochs):
                perm = torch.arange(n_rows, device=device)
                if a.mini_batches > 1:  # shuffle whole groups, so micro-batches keep their shared prompts
                    n_groups = n_rows // G
                    perm = (torch.randperm(n_groups, device=device).unsqueeze(-1) * G + torch.arange(G, device=device)).flatten()
                for mb_start in range(0, n_rows, mb_rows):
                    idx = perm[mb_start : mb_start + mb_rows]
                    normalizer = aggregate_count(mask[idx], a.loss_agg, max_len=ro.max_new_tokens)
                    finite = True  # NaN guard: every micro-batch loss of this update must be finite
                    for s in micro_slices(len(idx), micro):
                        rows = idx[s]
                        mb = batch.rows(rows)
                        logps, ent = _forward(policy, mb, T, group_size=share, with_entropy=True, entropy_grad=a.entropy_coef > 0)
                        old = old_logps[rows] if old_logps is not None else logps.detach()
                        loss_tok, info = actor_token_loss(
                            a, logps, ent, old, advantages[rows], mb["response_mask"],
                            ref_logps=ref_logps[rows] if ref_logps is not None else None, tis=tis[rows] if tis is not None else None,
                        )
                        if "kl" in info:
                            _acc(stats, "actor/kl", info["kl"], mb["response_mask"])
                        loss = aggregate(loss_tok, mb["response_mask"], a.loss_agg, normalizer, max_len=ro.max_new_tokens)
                        loss.backward()
                        stats.setdefault("actor/loss", []).append(loss.item())
                        finite = finite and math.isfinite(stats["actor/loss"][-1])
                        _acc(stats, "actor/entropy", ent.detach(), mb["response_mask"])
                        _acc(stats, "actor/clip_frac", info["clipped"], mb["response_mask"])
                        if old_logps is None:  # one update: these are still the sampling policy's log-probs
                            _acc(stats, "actor/logp_mismatch", (batch.sampling_logps[rows] - logps.detach()).abs(), mb["response_mask"])
                        if critic is not None:
                            v = critic(mb["input_ids"], mb["attention_mask"])
                            vl = value_loss(v, values[rows], returns[rows], clip=cfg.critic.value_clip or None)
                            aggregate(vl, mb["response_mask"], "token-mean", aggregate_count(mask[idx], "token-mean")).backward()
                            _acc(stats, "critic/value_loss", vl.detach(), mb["response_mask"])
                    gn = clip_gradients(trainable_parameters(policy), o.max_grad_norm)
                    ok = finite and math.isfinite(gn)
                    if critic is not None:
                        cgn = clip_gradients(critic.parameters(), o.max_grad_norm)
                        ok = ok and math.isfinite(cgn)
                        stats.setdefault("critic/grad_norm", []).append(cgn)
                    if ok:
                        optimizer.step()
                        if critic_opt is not None:
                            critic_opt.step()
                        bad_in_a_row = 0
                    else:  # NaN guard: skip the update, keep the last good weights
                        bad_in_a_row += 1
                        stats.setdefault("train/skipped_updates", []).append(1.0)
                        tracker.write(f"step {step}: non-finite loss or gradient, update skipped ({bad_in_a_row} in a row)")
                    stats.setdefault("actor/grad_norm", []).append(gn)
                    stats.setdefault("actor/lr", []).append(scheduler.get_last_lr()[0])
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    if critic_opt is not None:
                        critic_opt.zero_grad(set_to_none=True)
            t_train = time.perf_counter() - t_train
            # ---- 8. weight sync: the HF engine shares the policy's parameters, nothing to copy
            t_sync = time.perf_counter()
            engine.load_weights([])
            t_sync = time.perf_counter() - t_sync

            seconds = time.perf_counter() - t_step
            n_tokens = float(batch.attention_mask.sum())
            metrics = {
                "reward/mean": rewards.mean().item(),
                "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
                "reward/score": float(np.mean([e.score for e in episodes])),
                "response/length_mean": lengths.mean().item(),
                "response/length_max": lengths.max().item(),
                "response/truncated_frac": truncated.float().mean().item(),
                "time/rollout_s": t_rollout, "time/train_s": t_train, "time/sync_s": t_sync,
                "perf/tokens_per_s": n_tokens / max(seconds, 1e-9),
                "perf/response_tokens_per_s_rollout": float(lengths.sum()) / max(t_rollout, 1e-9),
                **runner.step_metrics(groups),
                **{k: float(np.mean(v)) if not k.endswith("skipped_updates") else float(np.sum(v)) for k, v in stats.items()},
            }
            if "actor/kl" not in metrics:
                metrics["actor/kl"] = 0.0
            if evaluator is not None and evaluator.due(step, cfg.max_steps):  # held-out accuracy of the updated policy
                metrics.update(evaluator(policy, engine, step, write=tracker.write))
            tracker.log(step, metrics)
            if cfg.traces_per_step:
                _write_traces(run_dir / "rollouts" / f"step_{step}.jsonl", tok, groups, batch, advantages, cfg.traces_per_step)
            if bad_in_a_row >= cfg.nan_patience:
                status = "stopped: non-finite updates"
                tracker.write(f"{bad_in_a_row} non-finite updates in a row: saving the last good weights and stopping")
                save(step)
                break
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
                save(step)
        else:
            if cfg.checkpoint.save_final and cfg.max_steps > start:
                save(cfg.max_steps)
    finally:
        runner.close()
        if evaluator is not None:
            evaluator.close()
        tracker.close()
    return RunResult(run_dir=run_dir, steps=cfg.max_steps, metrics={**metrics, "status": status}, history=read_metrics(run_dir))


def _acc(stats: dict[str, list[float]], key: str, values: torch.Tensor, mask: torch.Tensor) -> None:
    n = float(mask.sum())
    if n > 0:
        stats.setdefault(key, []).append(float((values * mask).sum()) / n)


def _write_traces(path, tok, groups, batch: RolloutBatch, advantages: torch.Tensor, limit: int) -> None:
    rows = []
    i = 0
    for g in groups:
        for e in g.episodes:
            if len(rows) >= limit:
                break
            cols = batch.response_mask[i].nonzero().flatten().tolist()
            start = len(e.prompt_ids)
            rows.append({
                "prompt": g.prompt_text, "problem": g.problem, "response": e.text, "reward": e.reward, "score": e.score,
                "components": e.components, "advantage": float(advantages[i, cols].mean()) if cols else 0.0,
                "finish_reason": e.finish_reason, "length": len(e.response_ids), "extra_info": _jsonable(g.extra_info),
                "tokens": tok.batch_decode([[t] for t in e.response_ids]),  # one call, not one per token
                "token_mask": e.response_mask,
                "logps": [round(x, 4) for x in e.sampling_logps],
                "token_advantages": [round(float(advantages[i, start + j]), 4) for j in range(len(e.response_ids))],
            })
            i += 1
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        return str(x)
