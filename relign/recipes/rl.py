"""Reinforcement learning with verifiable (or learned) rewards: PPO, the GRPO family, RLOO, REINFORCE++.

    for each step:
        1. rollout      G completions for each of the step's prompts (single- or multi-turn),
                        scored by the task's reward in worker processes (errors, timeouts -> 0)
                        [DAPO dynamic sampling: drop zero-variance groups, draw more prompts]
                        [rollout.max_staleness = s: batch k + s is sampled now, by the current
                        weights, and batch k, sampled s steps ago, is trained; overlap=thread
                        samples it in a background thread during steps 2-6, joined before 7]
        2. ref logps    only with a KL term
        3. old logps    only when the batch serves more than one update (else the detached
                        current log-probs: the ratio is 1 and its gradient exact)
        4. values       only for an estimator that needs V(s_t): the critic (GAE), or VinePPO's
                        Monte-Carlo values (K continuations from every step boundary)
        5. advantages   one estimator, looked up by name in ESTIMATORS
        6. updates      ppo_epochs x mini_batches optimizer steps of the clipped policy loss
                        (+ KL, entropy), and of the clipped value loss for the critic
        7. weight sync  to the engine (nothing to copy when the engine shares the policy), then the
                        sync check: the engine's weight fingerprint must equal the trainer's, and
                        both score a fixed probe alike, or the run stops

Under torchrun every rank samples its share of the prompts, the groups are gathered, and the
sequences are balanced over ranks and micro-batches by token count (``rl_update``). Presets in
examples/ name the published algorithms; see docs/rl.md for the table.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import banner, distributed, rundir, watchdog
from ..algorithms.policy_losses import behaviour_weights
from ..checkpoint import gather_train_state, load_checkpoint, load_model_weights, restore_optimizer
from ..models import varlen
from ..models.budget import CPU_TOKENS, device_tokens
from ..models.loading import load_model_tokenizer, trainable_parameters
from ..rollout.queue import RolloutAhead, Sampled
from ..rollout.sync_check import can_check, check_sync, probe_sequences
from ..rollout.traces import write_traces
from ..rollout.weights import engine_weights
from ..tracking import StageClock
from . import RunResult, build, frame
from .rl_advantages import ESTIMATORS, AdvantageOptions
# the recipe's config lives beside it (rl_config.py); rl.Config & co. stay its public names
from .rl_config import (  # noqa: F401
    AlgorithmConfig, Config, CriticConfig, EvalDuringTrainingConfig, LearnedRewardConfig, RolloutConfig, TaskConfig,
    TrpoConfig, VineConfig, check_eval_during_training
)
from .rl_config import check as _check
from .rl_config import check_budget
from .rl_stages import RLRun, batch_of, critic_for, reference_logps, rewards_of, step_metrics, trainer_mfu, values_of
from .rl_update import ActorLoss, Layout, Stats, behaviour_stats, plan, score_logps, trpo_update, update_critic, update_policy

if TYPE_CHECKING:  # named in RLState only
    from ..models.value import ValueModel
    from ..rollout.engine import Engine


@dataclass
class RLState:
    """What an RL checkpoint holds beyond the frame's (weights, optimizer, schedule, sampler): the
    engine's random stream, the batches in flight (rollout.max_staleness) and the critic with its
    optimizer. One object saves it (``save``, the frame saver's ``extra``) and loads it (``load``)."""

    engine: Engine
    ahead: RolloutAhead
    critic: ValueModel | None = None
    critic_opt: torch.optim.Optimizer | None = None

    def load(self, ckpt: Path) -> None:
        tensors, _ = load_checkpoint(ckpt, restore_rng=False)
        self.engine.load_state_dict(tensors["engine"])
        self.ahead.load(tensors.get("rollout_queue", []))  # the batches that were in flight
        if self.critic is not None:
            restore_optimizer(self.critic, self.critic_opt, tensors["critic_optimizer"])

    def save(self) -> tuple[dict, dict]:
        """(tensors, models) for ``frame.saver``: collectives under FSDP (the critic's gather)."""
        tensors, models = {"engine": self.engine.state_dict()}, {}
        if self.ahead.depth > 0:
            tensors["rollout_queue"] = self.ahead.state()
        if self.critic is not None:
            critic_sd, tensors["critic_optimizer"] = gather_train_state(self.critic, self.critic_opt)
            models["critic"] = (self.critic, critic_sd)
        return tensors, models


def _resolve(cfg: Config):
    """What the config leaves to the task, settled by ``frame.open`` before the memory plan and the
    run directory: the task itself, its environment, ``rollout.max_turns=0`` (the environment's own
    turn limit, a GEM game's), the advantage estimator (checked against the task) and the step
    delimiter (VinePPO)."""
    a, ro, t = cfg.algorithm, cfg.rollout, cfg.task
    task = build.task_for(t)
    env = t.env or task.env or ""
    check_eval_during_training(cfg.eval, task=t.name, env=env)
    if ro.max_turns == 0:  # the environment's own turn limit (a GEM game's max_turns)
        ro.max_turns = build.env_turn_limit(task, env)
        check_budget(cfg)
        if distributed.is_main():
            print(f"rollout.max_turns=0: the environment's own limit, {ro.max_turns} turns", file=sys.stderr, flush=True)
    estimator = ESTIMATORS[a.advantage]
    delimiter = cfg.vine.delimiter or task.step_delimiter or ""
    if estimator.check_task is not None:
        estimator.check_task(task.name, env, delimiter)
    return task, estimator, delimiter


def _layout(cfg: Config, model, device, *, pack: bool, share: bool) -> Layout:
    """The update's micro-batch layout: packed, shared or padded rows, in passes of a token budget
    sized for the device, each row at most the longest prompt and response (varlen's constant bound)."""
    ro, t = cfg.rollout, cfg.task
    budget = device_tokens(cfg.max_tokens_per_micro, model, device, cpu=CPU_TOKENS,
                           checkpointing=cfg.model.gradient_checkpointing)
    return Layout("packed" if pack else ("shared" if share else "padded"), group_size=ro.n if share else 1,
                  max_tokens=budget, max_rows=cfg.micro_batch_size,
                  max_length=t.max_prompt_length + (ro.max_response_tokens or ro.max_new_tokens * ro.max_turns))


def _setup(cfg: Config, run: frame.Run) -> tuple[RLRun, Callable[[int], None]]:
    a, ro, m, t = cfg.algorithm, cfg.rollout, cfg.model, cfg.task
    task, estimator, delimiter = run.resolved  # _resolve's, in frame.open
    # ---- models: weights (a resumed run's) are loaded before sharding and before the engine's replica
    tok = load_model_tokenizer(m)
    if rundir.dry_run_requested():  # count the prompts and the parameters without reading any weights, and stop
        _dry_run(cfg, task, tok, run)
    policy = build.load_policy(m, run.device)
    ckpt = frame.checkpoint_to_resume(run)
    ref = None
    if a.kl != "none" and not m.lora.enabled:  # with LoRA the reference is the base model, adapter disabled
        ref = frame.shard(build.load_frozen(m.path, m, run.device))
    critic, critic_opt = critic_for(cfg, ckpt, run.device) if estimator.values == "critic" else (None, None)
    # packed rows run sequence by sequence (relign.models.varlen); a group's prompt runs once,
    # its responses continuing it in the packed row where varlen applies, else in padded rows
    # against its KV cache
    pack, share = varlen.choose([policy, ref, critic], m.attn_implementation, packing=cfg.packing,
                                share=cfg.share_prompt and ro.n > 1)
    frame.context_parallel(cfg, policy, ref, critic)
    if ckpt is not None:
        load_model_weights(policy, ckpt)
    engine = build.engine_for(ro.engine, policy, tok, max_batch_rows=ro.max_batch_rows, seed=cfg.seed, m=m, vllm=ro.vllm,
                              fast_decode=ro.fast_decode, own_copy=ro.overlap == "thread",
                              max_model_len=t.max_prompt_length + (ro.max_response_tokens or ro.max_new_tokens * ro.max_turns),
                              rows=max(1, cfg.prompts_per_step // distributed.world_size()) * ro.n)
    collector = build.collector_for(task, t, ro, cfg.reward, tok, engine, m=m, device=run.device, seed=cfg.seed)
    banner.start("rl", cfg, model=policy, **_facts(cfg, collector, run))
    # ---- optimizer: the schedule counts every planned update, ppo_epochs x mini_batches per step
    tr = frame.trainable(run, policy, ckpt=ckpt, rows=len(collector), batch_size=cfg.prompts_per_step,
                         total_steps=cfg.max_steps * a.ppo_epochs * a.mini_batches, weights_loaded=True, steps=cfg.max_steps)
    def collect() -> tuple[list, dict[str, float]]:  # the next batch in draw order, and its collection statistics
        groups = collector.collect(tr.sampler, cfg.prompts_per_step, a.dynamic_sampling, a.max_sampling_rounds)
        return groups, dict(collector.last)

    ahead = RolloutAhead(collect, depth=ro.max_staleness, max_steps=cfg.max_steps, overlap=ro.overlap == "thread",
                         threads=ro.overlap_threads, engine=engine)
    state = RLState(engine, ahead, critic, critic_opt)
    if ckpt is not None:
        state.load(ckpt)
    evaluator = None
    if cfg.eval.every and distributed.is_main():  # held-out accuracy through the engine (rank 0)
        evaluator = build.evaluator_for(cfg.eval, t, ro, tok, run.run_dir, seed=cfg.seed)
    tracker = frame.tracker(run, tr, desc="rl",
                            bar_keys=("reward/mean", "reward/score", "actor/kl", "response/length_mean", "perf/tokens_per_s",
                                      "perf/mfu"))
    layout = _layout(cfg, tr.model, run.device, pack=pack, share=share)
    loss_fn = actor_loss(a, collector.max_response_tokens)
    options = AdvantageOptions(ro.n, a.scale_rewards, a.gamma, a.lam, a.whiten_advantages)
    probe = None
    if ro.sync_check_tol > 0 and can_check(engine, tr.model):
        probe = probe_sequences([ids for _, ids, _ in collector.records])
    r = RLRun(tok, tr.model, ref, critic, engine, collector, tr.sampler, tr.optimizer, tr.scheduler, critic_opt, layout,
             loss_fn, estimator, options, tracker, evaluator, tr.start, ahead, delimiter, probe, tr)
    _sync_check(r, cfg, tr.start)  # the weights the engine starts from (vLLM's first push): wrong ones cost no step
    return r, frame.saver(run, tr, tok, extra=state.save)


def actor_loss(a: AlgorithmConfig, max_len: int) -> ActorLoss:
    """The actor loss of ``algorithm.*``: the KL is a loss term only with algorithm.kl=loss."""
    return ActorLoss(a.policy_loss, a.clip_low, a.clip_high, a.dual_clip, a.kl_coef if a.kl == "loss" else 0.0,
                     a.kl_estimator, a.entropy_coef, a.loss_agg, max_len, a.kl_agg, a.kl_clamp)


def _facts(cfg: Config, collector, run: frame.Run) -> dict:
    """What the start banner and --dry-run say about the data and the length of the run."""
    return dict(run_dir=run.run_dir, device=run.device,
                data=banner.data_line(len(collector) + collector.skipped_long, len(collector), unit="prompts"),
                steps=f"{cfg.max_steps:,} x {cfg.prompts_per_step} prompts x {cfg.rollout.n} samples")


def _dry_run(cfg: Config, task, tok, run: frame.Run) -> None:
    """--dry-run: the prompts as the run would read them (no engine: nothing is sampled), then DryRunDone."""
    collector = build.collector_for(task, cfg.task, cfg.rollout, cfg.reward, tok, None, m=cfg.model, device=run.device,
                                    seed=cfg.seed)
    try:
        banner.dry_run("rl", cfg, **_facts(cfg, collector, run))
    finally:
        collector.close()


# --------------------------------------------------------------------------- the loop


def train(cfg: Config) -> RunResult:
    run = frame.open(cfg, "rl", check=_check, resolve=_resolve)
    watchdog.configure(cfg.rollout.wait_timeout, run.run_dir, key="rollout.wait_timeout")  # no blocking wait without a deadline
    if distributed.is_main():
        (run.run_dir / "rollouts").mkdir(exist_ok=True)
    r, save = _setup(cfg, run)
    a, ro, device, run_dir = cfg.algorithm, cfg.rollout, run.device, run.run_dir
    # old log-probs needed: several updates per batch, the behaviour correction (pi_prox), the KL in the reward
    reuse = a.ppo_epochs * a.mini_batches > 1 or a.tis_cap > 0 or a.kl == "reward" or ro.max_staleness > 0
    bad_in_a_row, skipped_steps, status, metrics = 0, 0, "completed", {}
    t_train = time.perf_counter()
    try:
        for step in frame.steps(r.trainer):
            clock = StageClock(STAGES + r.ahead.stages, device)
            version = step - 1  # the updates applied so far: the version of the weights that sample now
            with clock("rollout"):  # 1. batch `step`; batches up to step + s sampled now, or (overlap) from now on
                sampled = r.ahead.take(step, version)
            groups = sampled.groups
            _rollout_time(clock, r.ahead.sampled_now)
            if not groups:  # dynamic sampling kept nothing: no update, the schedule moves on
                r.ahead.join()
                skipped_steps += 1
                _skip_step(r, cfg, step, skipped_steps, clock)
                continue
            r.ahead.before_update()  # the engine sleeps until the sync, unless it samples the next batch
            batch = batch_of(r, a, groups, device)
            micro = plan(batch, torch.arange(batch.size, device=device), r.layout)
            with clock("reference"):  # 2.
                ref_logps = reference_logps(r, batch, micro, ro.temperature) if a.kl != "none" else None
            with clock("old_logps"):  # 3. pi_prox: the weights before this step's update
                old_logps = score_logps(r.policy, batch, micro, r.layout, temperature=ro.temperature) if reuse else None
            with clock("values"):  # 4. the critic's V(s_t), or VinePPO's Monte-Carlo step values
                values, value_stats = values_of(r, cfg, step, groups, batch, micro)
            rewards = rewards_of(r, a, groups, batch, old_logps, ref_logps)  # 5.
            advantages, returns = r.estimator.fn(rewards, batch.response_mask, values, r.options)
            with clock("update"):  # 6.
                stats, skipped = _update(r, cfg, step, batch, advantages, returns, old_logps, ref_logps, values)
            bad_in_a_row = bad_in_a_row + skipped if skipped else 0
            r.ahead.before_sync(clock)  # the next batch sampled by the old weights (overlap), or the engine awake
            with clock("sync"):  # 7. the HF engine in one process holds the policy's own tensors: nothing is copied
                r.engine.load_weights(engine_weights(r.engine, r.policy))
                sync_gap = _sync_check(r, cfg, step)
            metrics = {**step_metrics(r, groups, batch, rewards, stats, old_logps, clock), **value_stats, **sync_gap}
            metrics.update(trainer_mfu(run, cfg, r, batch, metrics, reference=ref_logps is not None, old=old_logps is not None))
            metrics.update(r.ahead.metrics(version, sampled))  # the trained batch's staleness, where sampled ahead
            if r.evaluator is not None and r.evaluator.due(step, cfg.max_steps):  # held-out accuracy, updated policy
                metrics.update(r.evaluator(r.engine, step, write=r.tracker.write))
            r.tracker.log(step, metrics)
            if cfg.traces_per_step and distributed.is_main():
                write_traces(run_dir / "rollouts" / f"step_{step}.jsonl", r.tok, groups, batch, advantages, cfg.traces_per_step)
            stop = _stop_or_save(r, cfg, step, save, bad_in_a_row=bad_in_a_row, t_train=t_train)
            if stop:
                status = stop
                break
        else:
            frame.save_last(run, r.trainer, save)
    finally:
        r.collector.close()
        if r.evaluator is not None:
            r.evaluator.close()
        r.tracker.close()
    # the engine closes after the last collective (a vLLM engine's shutdown ends the process group)
    return frame.close(run, metrics=metrics, status=status, steps=cfg.max_steps, after=r.engine.close,
                       keys=("reward/mean", "reward/score", "eval/accuracy", "response/length_mean", "actor/kl"),
                       result={**metrics, "status": status})


STAGES = ("rollout", "reward", "reference", "old_logps", "values", "update", "sync")
"""The step's timed stages (time/<stage>_s); rollout.overlap=thread adds rollout_wait, the wait for the next batch."""


# --------------------------------------------------------------------------- the stages


def _rollout_time(clock: StageClock, sampled: list[Sampled]) -> None:
    """The reward pool's share of the step's sampling time is its own stage."""
    clock.seconds["reward"] = sum(b.stats.get("reward_s", 0.0) for b in sampled)
    clock.seconds["rollout"] -= clock.seconds["reward"]


def _sync_check(run: RLRun, cfg: Config, step: int) -> dict[str, float]:
    """After the sync (rollout/sync_check.py): the weight fingerprints must agree and the probe's engine-vs-trainer
    log-prob gap stay under the tolerance, else SyncMismatch stops the run. Returns the gap as a metric."""
    if run.probe is None:
        return {}
    gap = check_sync(run.engine, run.policy, run.probe, pad_id=run.tok.pad_token_id, tol=cfg.rollout.sync_check_tol,
                     step=step)
    return {"rollout/sync_gap": gap}


def _stop_or_save(run: RLRun, cfg: Config, step: int, save: Callable[[int], None], *, bad_in_a_row: int,
                  t_train: float) -> str:
    """The step's end: the status to stop with ("" to go on), a checkpoint saved when stopping or due."""
    status = ""
    if bad_in_a_row >= cfg.nan_patience:
        status = "stopped: non-finite updates"
        run.tracker.write(f"{bad_in_a_row} non-finite updates in a row: saving the last good weights and stopping")
    elif cfg.max_seconds and _out_of_time(t_train, cfg.max_seconds):
        status = f"stopped: max_seconds={cfg.max_seconds:g} after step {step}"
        run.tracker.write(f"{status}: saving a checkpoint")
    if status or (cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0):
        save(step)
    return status


def _out_of_time(t0: float, max_seconds: float) -> bool:
    """Rank 0's clock decides, so every rank stops after the same step."""
    late = float(distributed.is_main() and time.perf_counter() - t0 >= max_seconds)
    return bool(distributed.all_reduce_sum(torch.tensor([late], dtype=torch.float64), group="world").item() > 0)


def _mini_batches(n_groups: int, G: int, mini_batches: int, generator: torch.Generator, device) -> list[torch.Tensor]:
    """Rows of exactly ``mini_batches`` mini-batches of whole groups (shuffled when more than
    one): the number of updates per step is fixed, so the schedule's count is exact."""
    order = torch.randperm(n_groups, generator=generator) if mini_batches > 1 else torch.arange(n_groups)
    rows = (order.unsqueeze(-1) * G + torch.arange(G)).to(device)  # [n_groups, G]
    return [part.flatten() for part in torch.tensor_split(rows, mini_batches)]


def _update(run: RLRun, cfg: Config, step: int, batch, advantages, returns, old_logps, ref_logps, values) -> tuple[Stats, int]:
    """ppo_epochs x mini_batches updates of the policy (and of the critic on the same mini-batches)."""
    a = cfg.algorithm
    tis = None
    if a.tis_cap > 0:  # decoupled PPO's behaviour weight w = pi_prox / pi_behav, truncated or masked at C
        tis, over = behaviour_weights(old_logps, batch.sampling_logps, cap=a.tis_cap, mode=a.tis_mode)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # the same shuffles on every rank and on resume
    epochs = [_mini_batches(batch.size // cfg.rollout.n, cfg.rollout.n, a.mini_batches, gen, batch.input_ids.device)
              for _ in range(a.ppo_epochs)]
    mini = [rows for epoch in epochs for rows in epoch]
    params = trainable_parameters(run.policy)
    if cfg.update == "trpo":  # one natural-gradient step on the whole batch (no optimizer)
        tr = cfg.trpo
        return trpo_update(run.policy, params, batch, advantages, old_logps, temperature=cfg.rollout.temperature,
                           max_kl=tr.max_kl, damping=tr.damping, cg_iters=tr.cg_iters, backtrack_ratio=tr.backtrack_ratio,
                           max_backtracks=tr.max_backtracks, fvp_subsample=tr.fvp_subsample), 0
    stats, skipped = update_policy(run.policy, run.optimizer, run.scheduler, params, batch, mini, run.layout, run.loss_fn,
                                   advantages=advantages, old_logps=old_logps, ref_logps=ref_logps, tis=tis,
                                   temperature=cfg.rollout.temperature, max_grad_norm=cfg.optim.max_grad_norm,
                                   skip_inert=a.skip_zero_adv)
    if tis is not None:
        behaviour_stats(stats, tis, over, old_logps, batch, mode=a.tis_mode)
    if run.critic is not None:
        cstats = update_critic(run.critic, run.critic_opt, list(run.critic.parameters()), batch, mini, run.layout,
                               old_values=values, returns=returns, value_clip=cfg.critic.value_clip,
                               max_grad_norm=cfg.optim.max_grad_norm)
        stats.values.update(cstats.values)
    if skipped:
        run.tracker.write(f"step {step}: {skipped} non-finite update(s) skipped, the weights stay the last good ones")
    return stats, skipped


def _skip_step(run: RLRun, cfg: Config, step: int, skipped_steps: int, clock: StageClock) -> None:
    with warnings.catch_warnings():  # torch warns of a schedule step before any optimizer step: intended here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches):
            run.scheduler.step()
    run.tracker.write(f"step {step}: dynamic sampling kept no group with reward variance in "
                      f"{cfg.algorithm.max_sampling_rounds} generation batches; step skipped ({skipped_steps} so far)")
    run.tracker.log(step, {"rollout/skipped_steps": float(skipped_steps), **run.collector.step_metrics([]), **clock.metrics()})


