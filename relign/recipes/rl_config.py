"""The configuration of ``relign rl`` and the checks that run before anything is loaded.

One dataclass per part (rollout, algorithm, learned reward, VinePPO, TRPO, critic, eval during
training; the task is ``relign.config.TaskConfig``, shared with eval and rest) and ``Config``
that holds them with the fields every training run has (``TrainFields``); every field has its one-line doc (``relign rl --help``). ``check``
refuses settings that cannot work, with a message that names the key.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from .. import distributed
from ..algorithms.aggregation import MODES
from ..algorithms.policy_losses import BEHAVIOUR_MODES
from ..checks import check_choice, check_common, check_fraction, check_model_path, check_non_negative, check_positive
from ..config import ConfigError, OptimConfig, SamplingConfig, TaskConfig, TrainFields, VllmConfig
from ..envs.tasks import from_file
from ..rollout.engine import ENGINES
from ..rollout.vllm_engine import check_vllm
from .rl_advantages import ESTIMATORS
from .rl_update import POLICY_LOSSES


@dataclass
class RolloutConfig(SamplingConfig):
    engine: str = "hf"
    """Inference engine: hf (built in, shares the policy's weights in one process) or vllm
    (colocated vLLM, weights synced in place after every update; pip install "relign[vllm]")."""
    max_response_tokens: int = 0
    """Multi-turn: cap on model + environment tokens after the prompt (0 = max_new_tokens x max_turns)."""
    min_new_tokens: int = 0
    """Forbid EOS before this many tokens."""
    ignore_eos: bool = False
    """Generate exactly max_new_tokens (benchmarks)."""
    max_turns: int = 1
    """Model turns per episode with a multi-turn environment (task.env, or a task that has one); 0 = the environment's
    own max_turns (a GEM game's turn limit; an error if it has none)."""
    fast_decode: bool = True
    """HF engine: decode Llama/Qwen2/Qwen3 models with relign's own one-token step (matmul attention over the preallocated cache, no per-token mask rebuild); false = the model's forward."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """Settings of the vLLM engine (rollout.engine=vllm)."""
    max_staleness: int = 0
    """s: the batch of step k is sampled by the weights of step k - s (at most s updates old); step k samples the
    batch of step k + s before (or, with overlap=thread, while) it trains on batch k. 0 = synchronous (on-policy).
    s > 0 needs the behaviour correction algorithm.tis_cap (docs/rl.md, "Off-policy and overlap")."""
    overlap: str = "none"
    """none: the next batch is sampled before the update, in turn; thread: in a background thread on the engine's own
    weight copy while the main thread trains (needs max_staleness >= 1; one process only). Same results either way."""
    overlap_threads: int = 1
    """overlap=thread: intra-op threads of the sampling thread (0 = torch's default, as the trainer's). Decoding
    gains little from a second thread, and two full OpenMP teams on the same cores stall each other (on 2 CPU cores
    with 0 an overlapped step took 3x longer than with 1; BENCHMARKS.md, "Off-policy overlap")."""
    sync_check_tol: float = 0.1
    """The sync check after every weight sync to an engine that holds its own copy (torchrun replica, vLLM,
    overlap=thread): the engine's weight fingerprint must equal the trainer's (exact: a skipped sync at any lr), and
    both score a fixed probe; a mean |log-prob gap| above this many nats stops the run too (0 = no check at all)."""
    wait_timeout: float = 1800.0
    """Seconds any blocking wait (a collective, the reward pool, the engine, the overlap thread) may take before the
    run writes every thread's stack to the run directory and exits with an error naming the wait (0 = no limit)."""


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"
    """grpo (group baseline), rloo (leave-one-out), reinforce_pp, reinforce_pp_baseline, gae (critic), gdpo, vine (VinePPO: Monte-Carlo step values)."""
    scale_rewards: str = "none"
    """Group advantages: 'std' divides by the group std (GRPO), 'none' does not (Dr. GRPO)."""
    policy_loss: str = "ppo_clip"
    """ppo_clip (token-level ratio) or gspo (sequence-level ratio; needs loss_agg=seq-mean-token-mean)."""
    loss_agg: str = "seq-mean-token-sum-norm"
    """token-mean, seq-mean-token-mean, seq-mean-token-sum or seq-mean-token-sum-norm."""
    clip_low: float = 0.2
    """Lower clip range epsilon_low of the ratio."""
    clip_high: float = 0.2
    """Upper clip range epsilon_high (DAPO clip-higher uses 0.28)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 bounding the loss for negative advantages (0 = off)."""
    kl: str = "none"
    """KL to the reference policy: none, loss (beta * KL added to the loss, GRPO) or reward (-beta * KL per token in the reward, PPO-RLHF)."""
    kl_coef: float = 0.0
    """beta of the KL term (> 0 when algorithm.kl is loss or reward)."""
    kl_estimator: str = "k3"
    """k1, k2 or k3."""
    kl_agg: str = ""
    """The KL loss term's own reduction (algorithm.kl=loss): empty = loss_agg's, per token with the policy term;
    seq-mean-token-sum = VinePPO's reference (each sequence's KL summed over its tokens, averaged over sequences)."""
    kl_clamp: float = 0.0
    """Clamp each token's KL estimate to [0, kl_clamp] in the loss (0 = off; VinePPO's reference: 10)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per pass: the step's groups are split into exactly this many mini-batches."""
    gamma: float = 1.0
    """Discount (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    whiten_advantages: bool = True
    """GAE: whiten advantages over the batch."""
    tis_cap: float = 0.0
    """C: the cap of the behaviour weight w = pi_prox / pi_behav between the trainer's and the engine's log-probs
    (0 = off; required when rollout.max_staleness > 0)."""
    tis_mode: str = "truncate"
    """What a behaviour weight above tis_cap becomes: truncate (min(w, C), TIS) or mask (0: the token leaves the loss,
    counted; AReaL's decoupled PPO)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and draw more prompts to refill the batch."""
    skip_zero_adv: bool = True
    """Skip the forward and backward of groups whose advantage is 0 on every token (all rewards
    equal under a group baseline) when the loss has no KL or entropy term: they add exactly
    nothing to the gradient. The update is the same; actor/entropy, clip_frac and
    logp_mismatch are then over the rows that trained. actor/zero_adv_frac logs their share."""
    max_sampling_rounds: int = 3
    """Dynamic sampling: most generation batches per step (a step that keeps no group is skipped)."""
    overlong: str = "none"
    """Overlong shaping: none, penalty (DAPO soft penalty) or mask (drop truncated completions from the loss)."""
    overlong_cache: int = 0
    """Soft-penalty window L_cache in tokens before the episode's token budget."""
    overlong_factor: float = 1.0
    """Largest overlong penalty."""
    gdpo_weights: dict[str, float] = field(default_factory=dict)
    """GDPO: weights of named reward terms, overriding the reward's own (correct 1, format task.format_weight, ...)."""


@dataclass
class ReaderConfig:
    """The reader of linguistic calibration (reward.kind=reader; docs/calibration.md)."""

    extractor: str = ""
    """ExtractAnswers: a causal LM checkpoint (relign sft on the extractor template); empty: the rule reader extracts."""
    rule: bool = False
    """True: the rule reader (explicit confidence statements) extracts and forecasts; no models (tests, task calibration)."""
    scoring: str = "log"
    """The proper scoring rule of the forecast of the true answer: log or brier."""
    eps: float = 1.0e-4
    """The log score's clip: log max(f_y, eps) (reference: cross_entropy_epsilon)."""
    normalization_lambda: float = 5.0
    """lambda of the penalty lambda * |sum of the extracted answers' forecasts - 1| (reference: 5)."""
    offset: float = 5.0
    """Added to every finished response's reward (reference: reward_offset; GRPO is offset-invariant)."""
    extractor_temperature: float = 0.3
    """Sampling temperature of the extractor (reference: 0.3)."""
    extractor_max_tokens: int = 300
    """Longest extraction, in tokens."""
    unfinished_reward: float = -1.0
    """The reward of a response that hit the length limit (reference: penalty_reward_value)."""


@dataclass
class LearnedRewardConfig:
    model: str = ""
    """A trained reward model (relign rm), generative verifier (relign verifier) or, for kind=reader, forecaster checkpoint; empty = rule reward only."""
    kind: str = "auto"
    """auto (sequence-classification checkpoint -> rm, causal LM -> verifier), rm, verifier or reader (linguistic calibration)."""
    weight: float = 1.0
    """Weight of the learned reward in reward = rule_weight * rule + weight * model."""
    rule_weight: float = 1.0
    """Weight of the task's rule-based reward (0: the learned reward alone)."""
    batch_size: int = 16
    """Completions per scoring forward pass."""
    max_length: int = 2048
    """Longest (problem + response) the scorer reads, in tokens (longer inputs keep their end)."""
    reader: ReaderConfig = field(default_factory=ReaderConfig)
    """kind=reader: the reader and its reward's options."""


@dataclass
class VineConfig:
    k: int = 9
    """VinePPO: continuations sampled from every step boundary; their mean reward is V (the paper's K = 9)."""
    max_steps: int | None = None
    """Estimate V for the first max_steps + 1 states only; later ones are backfilled (VinePPO GSM8K: 25; null = all)."""
    dedup: bool = True
    """Send identical states (every sample's prompt, shared steps) to the engine once."""
    adaptive: bool = False
    """Adaptive K: 10 continuations, +4 while the 95% interval is wider than 0.05, at most 30 (then vine.k is unused)."""
    delimiter: str = ""
    """Where a step ends (empty: the task's own, e.g. newline for gsm8k)."""


@dataclass
class TrpoConfig:
    max_kl: float = 0.01
    """delta: the trust region, KL(pi_old || pi_new) per response token (sb3-contrib's target_kl)."""
    damping: float = 0.1
    """Added to the Fisher-vector product (F + damping I)."""
    cg_iters: int = 15
    """Conjugate-gradient iterations solving F s = g."""
    backtrack_ratio: float = 0.8
    """Line search: the step shrinks by this factor after each rejected try."""
    max_backtracks: int = 10
    """Line search: tries before the step is rejected and the parameters restored."""
    fvp_subsample: int = 5
    """The Fisher-vector product uses every N-th sequence (openai/baselines: 5); the surrogate and the line search's KL use every one."""


@dataclass
class CriticConfig:
    path: str = ""
    """Critic backbone (empty: the policy's model.path)."""
    lr: float = 1e-5
    """Critic learning rate."""
    value_clip: float = 0.2
    """Clip range of the value update around the old values (0 = off)."""


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


@dataclass
class Config(TrainFields):
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    vine: VineConfig = field(default_factory=VineConfig)
    update: str = "ppo"
    """The policy update: ppo (the clipped loss with the optimizer) or trpo (a natural-gradient step in a KL trust region)."""
    trpo: TrpoConfig = field(default_factory=TrpoConfig)
    reward: LearnedRewardConfig = field(default_factory=LearnedRewardConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, schedule="constant"))
    eval: EvalDuringTrainingConfig = field(default_factory=EvalDuringTrainingConfig)
    max_steps: int = 100
    """Rollout + update steps."""
    max_seconds: float = 0.0
    """Also stop after this much wall-clock training (checked after each step, which is then saved; 0 = no limit)."""
    prompts_per_step: int = 8
    """Prompts per step over all ranks; the batch holds prompts_per_step x rollout.n completions."""
    max_tokens_per_micro: int | None = None
    """Token budget of one forward/backward pass on one rank: prompt + response tokens as computed (a shared prompt once;
    0 = no limit; null = by device: 4096 on the CPU, on CUDA 32768 or what free memory holds if less)."""
    micro_batch_size: int = 0
    """Most sequences in one forward/backward pass (0 = no limit: max_tokens_per_micro decides)."""
    share_prompt: bool = True
    """Run each group's prompt once: its G responses follow it in one packed row where relign's varlen attention
    applies (sdpa; Qwen2/3, Llama, Mistral), else they run padded against its KV cache."""
    packing: bool = False
    """Pack each micro-batch's sequences into one row with per-sequence position ids, also where share_prompt cannot
    (flash-attention's varlen kernel on GPU: every sequence then runs whole)."""
    traces_per_step: int = 64
    """Completions written to rollouts/step_N.jsonl each step (0 = none)."""
    nan_patience: int = 3
    """Stop (after saving the last good checkpoint) when this many updates in a row are non-finite."""


def check_counts(cfg: Config) -> None:
    """Every count, size and rate: one line naming the key and its value (0 means off or all
    where the field's doc says so, and only there)."""
    check_positive(cfg, "max_steps", "prompts_per_step", "nan_patience", "rollout.n", "rollout.max_new_tokens",
                   "rollout.max_batch_rows", "rollout.top_p", "task.max_prompt_length",
                   "task.reward_timeout", "algorithm.ppo_epochs", "algorithm.mini_batches", "algorithm.max_sampling_rounds",
                   "reward.batch_size", "reward.max_length", "critic.lr")
    check_non_negative(cfg, "max_seconds", *(["max_tokens_per_micro"] if cfg.max_tokens_per_micro is not None else []),
                       "micro_batch_size", "traces_per_step", "rollout.top_k", "rollout.overlap_threads",
                       "rollout.max_turns", "rollout.max_response_tokens", "rollout.min_new_tokens", "task.max_rows", "task.reward_workers",
                       "task.format_weight", "algorithm.clip_low", "algorithm.clip_high", "algorithm.kl_coef",
                       "algorithm.entropy_coef", "algorithm.kl_clamp", "algorithm.tis_cap", "algorithm.overlong_cache",
                       "algorithm.overlong_factor", "critic.value_clip", "eval.every", "eval.max_rows",
                       "eval.max_new_tokens")
    check_fraction(cfg, "rollout.top_p", "algorithm.gamma", "algorithm.lam", closed=True)
    a, ro = cfg.algorithm, cfg.rollout
    if a.dual_clip and a.dual_clip <= 1:
        raise ConfigError(f"bad value for 'algorithm.dual_clip': {a.dual_clip}; it must be > 1 (or 0 = off)")
    if ro.min_new_tokens > ro.max_new_tokens:
        raise ConfigError(f"bad value for 'rollout.min_new_tokens': {ro.min_new_tokens}; it must be <= "
                          f"rollout.max_new_tokens={ro.max_new_tokens}")


def check_eval_during_training(cfg: EvalDuringTrainingConfig, *, task: str = "", env: str = "") -> None:
    """ConfigError for ``eval.*`` settings that cannot work, before any model is loaded."""
    if not cfg.every:
        return
    if env:
        raise ConfigError(f"eval.every works with single-turn tasks, not with a multi-turn environment ({env})")
    if from_file(task) and not cfg.path:
        raise ConfigError("eval.every with task.name=custom: set eval.path to held-out problems (it may be the training file)")
    if cfg.every < 0 or cfg.n < 1 or cfg.batch_prompts < 1:
        raise ConfigError("eval.every must be >= 0, eval.n and eval.batch_prompts >= 1")
    if cfg.temperature <= 0 and cfg.n > 1:
        raise ConfigError(f"eval.temperature={cfg.temperature} is greedy: all eval.n={cfg.n} samples would be the same; "
                          "set eval.temperature > 0 or eval.n=1")
    bad = [k for k in cfg.ks if not 1 <= k <= cfg.n]
    if bad:
        raise ConfigError(f"eval.ks={list(cfg.ks)}: every k must lie in [1, eval.n={cfg.n}]")


def check(cfg: Config) -> None:
    check_counts(cfg)
    check_common(cfg)
    a, ro = cfg.algorithm, cfg.rollout
    check_choice("rollout.engine", ro.engine, ENGINES)
    if ro.engine == "vllm":
        check_vllm(cfg, "rollout", top_p=ro.top_p, top_k=ro.top_k)
    check_choice("algorithm.advantage", a.advantage, tuple(ESTIMATORS))
    check_choice("algorithm.scale_rewards", a.scale_rewards, ("std", "none"))
    check_choice("algorithm.policy_loss", a.policy_loss, tuple(POLICY_LOSSES))
    check_choice("algorithm.loss_agg", a.loss_agg, MODES)
    check_choice("algorithm.kl", a.kl, ("none", "loss", "reward"))
    check_choice("algorithm.kl_estimator", a.kl_estimator, ("k1", "k2", "k3"))
    check_choice("algorithm.kl_agg", a.kl_agg, ("", *MODES))
    if (a.kl_agg or a.kl_clamp) and a.kl != "loss":
        raise ConfigError(f"algorithm.kl_agg / algorithm.kl_clamp shape the KL term of the loss: they need algorithm.kl=loss "
                          f"(got algorithm.kl={a.kl})")
    check_choice("algorithm.overlong", a.overlong, ("none", "penalty", "mask"))
    check_choice("reward.kind", cfg.reward.kind, ("auto", "rm", "verifier", "reader"))
    if cfg.reward.kind == "reader":
        check_reader(cfg.reward)
    if cfg.task.answer_format == "any":
        raise ConfigError("task.answer_format=any reads an answer the response never stated (its last number or formula): "
                          "it is for eval only; train with boxed (the default) or boxed_or_final")
    if a.kl != "none" and a.kl_coef <= 0:
        raise ConfigError(f"algorithm.kl={a.kl} needs algorithm.kl_coef > 0 (the beta of the KL term)")
    if a.kl == "none" and a.kl_coef > 0:
        raise ConfigError(f"algorithm.kl_coef={a.kl_coef} has no effect with algorithm.kl=none: set algorithm.kl=loss "
                          "(beta * KL in the loss, GRPO) or algorithm.kl=reward (-beta * KL per token in the reward, PPO)")
    if ro.temperature <= 0:
        raise ConfigError(f"rollout.temperature={ro.temperature}: RL needs sampling (temperature > 0); greedy decoding "
                          "gives G identical samples, and log-probs at temperature 0 are not defined")
    loss = POLICY_LOSSES[a.policy_loss]
    if loss.agg and a.loss_agg != loss.agg:
        raise ConfigError(f"algorithm.policy_loss={a.policy_loss} needs algorithm.loss_agg={loss.agg} (got {a.loss_agg}): "
                          f"{loss.why}")
    estimator = ESTIMATORS[a.advantage]
    if estimator.compares_samples and ro.n < 2:
        raise ConfigError(f"algorithm.advantage={a.advantage} compares samples of a prompt: set rollout.n >= 2")
    if ro.max_turns or ro.max_response_tokens:  # else the budget is known once the env's own max_turns is (rl._setup)
        check_budget(cfg)
    if a.mini_batches > cfg.prompts_per_step:
        raise ConfigError(f"algorithm.mini_batches={a.mini_batches} > prompts_per_step={cfg.prompts_per_step}: mini-batches "
                          "are made of whole groups (a group's samples are never split)")
    if estimator.check is not None:
        estimator.check(cfg)
    check_off_policy(cfg)
    check_choice("update", cfg.update, ("ppo", "trpo"))
    if cfg.update == "trpo":
        check_trpo(cfg)
    world = distributed.world_size()  # every rank samples its share with its own engine, whatever the mesh
    if cfg.prompts_per_step % world:
        raise ConfigError(f"prompts_per_step={cfg.prompts_per_step} does not divide across {world} ranks "
                          f"(torchrun --nproc_per_node): each rank samples prompts_per_step / {world} prompts")
    check_model_path("model.path", cfg.model.path)
    check_model_path("critic.path", cfg.critic.path, required=False)
    check_model_path("reward.model", cfg.reward.model, required=False)


def check_budget(cfg: Config) -> None:
    """algorithm.overlong_cache against the episode's token budget (max_response_tokens, else max_new_tokens x max_turns)."""
    a, ro = cfg.algorithm, cfg.rollout
    budget = ro.max_response_tokens or ro.max_new_tokens * ro.max_turns
    if a.overlong == "penalty" and not 0 <= a.overlong_cache <= budget:
        raise ConfigError(f"algorithm.overlong_cache={a.overlong_cache} must lie in [0, {budget}] (the episode's token budget)")


def check_off_policy(cfg: Config) -> None:
    """rollout.max_staleness / overlap and the behaviour correction they need."""
    a, ro = cfg.algorithm, cfg.rollout
    check_choice("algorithm.tis_mode", a.tis_mode, BEHAVIOUR_MODES)
    check_choice("rollout.overlap", ro.overlap, ("none", "thread"))
    if ro.max_staleness < 0:
        raise ConfigError(f"bad value for 'rollout.max_staleness': {ro.max_staleness}; it must be >= 0")
    if ro.sync_check_tol < 0 or ro.wait_timeout < 0:
        raise ConfigError("rollout.sync_check_tol and rollout.wait_timeout must be >= 0 (0 = off)")
    s = ro.max_staleness
    if ro.overlap == "thread" and s == 0:
        raise ConfigError("rollout.overlap=thread samples the next batch while this one trains: it needs "
                          "rollout.max_staleness >= 1 (with 0 the batch a step trains on must be sampled first)")
    if ro.overlap == "thread" and distributed.world_size() > 1:
        raise ConfigError("rollout.overlap=thread runs on one process for now: under torchrun the rollout's gathers in "
                          "a thread would race the trainer's FSDP collectives on one process group (a deadlock); use "
                          "rollout.overlap=none")
    if s == 0:
        return
    if a.tis_cap <= 0:
        raise ConfigError(f"rollout.max_staleness={s} trains on batches sampled by older weights: set the behaviour "
                          "correction algorithm.tis_cap (e.g. algorithm.tis_cap=2 algorithm.tis_mode=mask)")
    if cfg.update == "trpo":
        raise ConfigError(f"update=trpo with rollout.max_staleness={s}: TRPO's trust region is measured around the "
                          "policy that sampled the batch (on-policy data); use rollout.max_staleness=0")
    if ESTIMATORS[a.advantage].values == "monte_carlo":
        raise ConfigError(f"algorithm.advantage={a.advantage} with rollout.max_staleness={s}: its Monte-Carlo values "
                          "(VinePPO's) are sampled by the current policy for the current batch (on-policy); use "
                          "rollout.max_staleness=0")


def check_reader(rw: LearnedRewardConfig) -> None:
    """reward.kind=reader: the rule reader, or a forecaster (and optionally an extractor) checkpoint."""
    rd = rw.reader
    check_choice("reward.reader.scoring", rd.scoring, ("log", "brier"))
    if not 0 < rd.eps < 1:
        raise ConfigError(f"reward.reader.eps={rd.eps}: the log score's clip must lie in (0, 1)")
    if rd.normalization_lambda < 0 or rd.extractor_temperature < 0 or rd.extractor_max_tokens < 1:
        raise ConfigError("reward.reader.normalization_lambda and reward.reader.extractor_temperature must be >= 0, "
                          "reward.reader.extractor_max_tokens >= 1")
    if rd.rule and (rw.model or rd.extractor):
        raise ConfigError("reward.reader.rule=true reads with rules: leave reward.model and reward.reader.extractor empty")
    if not rd.rule and not rw.model:
        raise ConfigError("reward.kind=reader needs reward.model (the forecaster: relign rm loss=bce), or "
                          "reward.reader.rule=true for the rule reader")
    check_model_path("reward.reader.extractor", rd.extractor, required=False)


def check_trpo(cfg: Config) -> None:
    """update=trpo: what cannot work is an error; what it does not use is a warning."""
    a, o, tr = cfg.algorithm, cfg.optim, cfg.trpo
    if distributed.world_size() > 1:
        raise ConfigError("update=trpo runs on one process: its flat parameter vectors and double backward are not "
                          "supported under FSDP / torchrun yet")
    if a.kl == "loss":
        raise ConfigError("update=trpo has no loss to add the KL to: use algorithm.kl=reward (or none)")
    if min(tr.max_kl, tr.damping, tr.backtrack_ratio) <= 0 or tr.backtrack_ratio >= 1 or min(tr.cg_iters, tr.max_backtracks,
                                                                                                  tr.fvp_subsample) < 1:
        raise ConfigError("trpo.max_kl and trpo.damping must be > 0, trpo.backtrack_ratio in (0, 1), and trpo.cg_iters, "
                          "trpo.max_backtracks, trpo.fvp_subsample >= 1")
    if a.ppo_epochs > 1 or a.mini_batches > 1:
        raise ConfigError("update=trpo takes one natural-gradient step per rollout batch: set algorithm.ppo_epochs=1 and "
                          "algorithm.mini_batches=1")
    default = Config().optim
    unused = [f"optim.{k}" for k in ("lr", "schedule", "warmup_steps", "warmup_ratio", "weight_decay")
              if getattr(o, k) != getattr(default, k)]
    unused += ["algorithm.clip_low/clip_high"] if (a.clip_low, a.clip_high) != (0.2, 0.2) else []
    unused += ["algorithm.entropy_coef"] if a.entropy_coef else []
    if unused:
        warnings.warn(f"update=trpo: {', '.join(unused)} unused: the step size comes from trpo.max_kl (the trust "
                      "region), and there is no optimizer, schedule or clipped loss", stacklevel=2)
