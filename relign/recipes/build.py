"""Configs become components here (torchtune's builder idea).

Every recipe builds its models, engine, task, tracker and evaluator with these, from its
config sections; everything below this module takes flat arguments. One function per
component, so a recipe's ``train`` reads as its algorithm and not as the unpacking of
``ModelConfig`` field by field. (The recipes' own small pieces, a ``SamplingParams`` or a
``StepSampler``, are built where they are used.)
"""

from __future__ import annotations

import copy
import sys
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import distributed
from ..config import ConfigError, TaskConfig, VllmConfig
from ..envs.base import load_function
from ..envs.env import make_env
from ..envs.rewards import RewardPool
from ..envs.reader_rules import RuleReader
from ..envs.tasks import build_task, render_prompt
from ..evaluate import PeriodicEval
from ..models.loading import (
    apply_lora, compile_enabled, compile_layers, load_causal_lm, load_tokenizer, resolve_model_path
)
from ..models.precision import compute_dtype
from ..models.reader import Forecaster, LMReader, ReaderScorer
from ..models.reward import load_reward_model, load_scorer
from ..models.value import ValueModel
from ..rollout.collect import RolloutCollector
from ..rollout.engine import ENGINES, SamplingParams, derive_seed, eos_token_ids
from ..rollout.hf_engine import HFEngine
from ..rollout.vllm_engine import VLLMEngine
from ..rollout.weights import checkpoint_weights
from ..tracking import Tracker

if TYPE_CHECKING:  # the config classes of the recipes that call these
    from ..config import LoggingConfig, ModelConfig
    from .rl_config import EvalDuringTrainingConfig, LearnedRewardConfig, RolloutConfig


def _lean(m: ModelConfig, device) -> bool:
    """``model.lean_activations``, off under ``model.compile`` (inductor's partitioner picks what to
    recompute for the backward itself, and the lean autograd functions would be opaque to it)."""
    return m.lean_activations and not compile_enabled(m.compile, device)


def _compile(model: torch.nn.Module, m: ModelConfig, device) -> torch.nn.Module:
    """``model.compile``: each decoder layer compiled (``models.loading.compile_layers``), after
    LoRA wrapping and before FSDP."""
    if compile_enabled(m.compile, device):
        compile_layers(model)
    return model


def load_policy(m: ModelConfig, device) -> torch.nn.Module:
    """The trainable policy: ``model.path`` (+ a LoRA adapter), in train mode, dropout off."""
    model = load_causal_lm(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                           trust_remote_code=m.trust_remote_code, gradient_checkpointing=m.gradient_checkpointing,
                           lean_activations=_lean(m, device), device=device)
    if m.lora.enabled:
        model = apply_lora(model, r=m.lora.r, alpha=m.lora.alpha, dropout=m.lora.dropout, target_modules=m.lora.target_modules)
    return _compile(model, m, device)


def load_reward(m: ModelConfig, device, pad_token_id: int) -> torch.nn.Module:
    """A trainable reward model r(x, y): ``model.path`` as ``AutoModelForSequenceClassification``
    with one output (+ a LoRA adapter, beside which the new score head trains in full)."""
    model = load_reward_model(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                              trust_remote_code=m.trust_remote_code, gradient_checkpointing=m.gradient_checkpointing,
                              lean_activations=_lean(m, device), pad_token_id=pad_token_id, device=device)
    if m.lora.enabled:
        model = apply_lora(model, r=m.lora.r, alpha=m.lora.alpha, dropout=m.lora.dropout, target_modules=m.lora.target_modules,
                           task_type="SEQ_CLS", modules_to_save=["score"])
    return _compile(model, m, device)


def load_frozen(path: str, m: ModelConfig, device, key: str = "model.path") -> torch.nn.Module:
    """A frozen copy of a causal LM (the reference policy): eval mode, no gradients."""
    model = load_causal_lm(path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                           trust_remote_code=m.trust_remote_code, device=device, key=key)
    return _compile(model.eval().requires_grad_(False), m, device)


def load_critic(path: str, m: ModelConfig, device, key: str = "model.path") -> ValueModel:
    """A value model V(s_t): the causal LM at ``path`` with a zero-initialized scalar head."""
    return _compile(ValueModel(load_causal_lm(path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                                              trust_remote_code=m.trust_remote_code,
                                              gradient_checkpointing=m.gradient_checkpointing,
                                              lean_activations=_lean(m, device), device=device, key=key)), m, device)


def tracker_for(lg: LoggingConfig, run_dir, *, total_steps: int, start_step: int = 0, desc: str,
                bar_keys: tuple[str, ...] = (), progress: bool | None = None) -> Tracker:
    """metrics.jsonl, TensorBoard / W&B as ``logging.*`` says, and the progress bar (``progress``: override ``logging.progress``)."""
    return Tracker(run_dir, total_steps=total_steps, start_step=start_step, desc=desc, bar_keys=bar_keys,
                   progress=lg.progress if progress is None else progress, tensorboard=lg.tensorboard, wandb=lg.wandb,
                   wandb_project=lg.wandb_project, run_name=lg.run_name)


def engine_for(kind: str, policy: torch.nn.Module, tokenizer, *, max_batch_rows: int, seed: int, prefix_cache_bytes: int = 0,
               m: ModelConfig | None = None, vllm: VllmConfig | None = None, max_model_len: int = 0, rows: int = 0,
               key: str = "rollout.engine", fast_decode: bool = True, own_copy: bool = False):
    """The rollout engine, built before the policy is sharded (and, under torchrun, after the
    process group exists: vLLM joins it).

    hf, one process: the engine samples from the policy module itself (no second copy, and
    ``load_weights`` copies nothing). Under torchrun the policy is about to be sharded and
    each rank samples on its own, so the engine gets a full replica of it, in eval mode and
    without gradients, that ``load_weights`` refreshes after every update.
    ``prefix_cache_bytes`` > 0 keeps the keys/values of earlier prompts for prompts that extend
    them (tree search; cleared whenever the weights change).

    vllm: a colocated vLLM engine (one per rank) for ``m.path``'s architecture, started with
    dummy weights and given the policy's at once (a resumed or LoRA-merged policy included).
    ``max_model_len`` is the run's longest prompt + response when ``vllm.max_model_len`` is 0
    (0 too: the model's max_position_embeddings). ``rows``: the sequences one call decodes (RL:
    a step's share of completions), when fewer than ``max_batch_rows``: vLLM's ``max_num_seqs``,
    which sizes its KV cache on CPU.
    ``key`` names the setting in error messages. ``fast_decode``: the HF engine's own decode
    step for the architectures it covers (rollout/fast_decode.py). ``own_copy``: the HF engine
    gets a replica in one process too (rollout.overlap=thread samples while the policy trains).
    """
    if kind not in ENGINES:
        raise ConfigError(f"bad value for '{key}': {kind!r}; choose one of {', '.join(ENGINES)}")
    if kind == "vllm":
        vllm = vllm or VllmConfig()
        limit = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
        length = vllm.max_model_len or max_model_len or limit
        if not length:
            raise ConfigError(f"{key}=vllm: the model's config has no max_position_embeddings: set the vllm.max_model_len "
                              "setting")
        if limit and length > limit:
            if vllm.max_model_len:
                raise ConfigError(f"{key.rsplit('engine', 1)[0]}vllm.max_model_len={length} is longer than the model's "
                                  f"max_position_embeddings={limit}")
            length = limit
        engine = VLLMEngine(resolve_model_path(m.path), tokenizer, eos_token_ids=eos_token_ids(tokenizer, policy),
                            max_model_len=length, dtype=compute_dtype(policy),
                            max_num_seqs=min(max_batch_rows, rows) if rows > 0 else max_batch_rows,
                            seed=seed, settings=vllm, tokenizer_path=resolve_model_path(m.tokenizer or m.path),
                            trust_remote_code=m.trust_remote_code, key=key)
        engine.load_weights(checkpoint_weights(policy))
        return engine
    model = policy
    if distributed.world_size() > 1:
        model = copy.deepcopy(policy).eval().requires_grad_(False)
    elif own_copy:  # the same requires_grad flags as the policy: the forward then takes the same kernels, bit for bit
        model = copy.deepcopy(policy).eval()
    return HFEngine(model, tokenizer, max_batch_rows=max_batch_rows, seed=seed, prefix_cache_bytes=prefix_cache_bytes,
                    fast_decode=fast_decode)


def task_for(t: TaskConfig):
    """The task of an RL run (a built-in task, a custom one, or a procedural multi-turn one)."""
    return build_task(t.name, path=t.path, reward_fn=t.reward_fn, chat=t.chat, system_prompt=t.system_prompt,
                      format_weight=t.format_weight, single_turn=False, reward_style=t.reward_style,
                      answer_format=t.answer_format, sections=t,
                      features=dict(t.features))


def env_turn_limit(task, env_spec: str) -> int:
    """``rollout.max_turns=0``: the multi-turn environment's own turn limit, ``task.env_max_turns``
    (a GEM game's ``max_turns``, read when the task built it) or the env class's ``max_turns``
    attribute; a one-line ``ConfigError`` naming ``rollout.max_turns`` when it has none."""
    if not env_spec:
        raise ConfigError(f"rollout.max_turns=0 takes the environment's own turn limit, but task '{task.name}' has no "
                          "multi-turn environment: set rollout.max_turns >= 1")
    limit = task.env_max_turns if env_spec == task.env else None
    if limit is None:
        try:
            limit = getattr(load_function(env_spec), "max_turns", None)
        except (ValueError, TypeError, FileNotFoundError) as e:
            raise ConfigError(f"task.env: {e}") from None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"rollout.max_turns=0 takes the environment's own max_turns, but task '{task.name}' ({env_spec}) "
                          "has no fixed one: set rollout.max_turns >= 1")
    return limit


def collector_for(task, t: TaskConfig, ro: RolloutConfig, rw: LearnedRewardConfig, tokenizer, engine, *,
                  m: ModelConfig, device, seed: int):
    """Prompts, reward workers (or the multi-turn environment) and the learned reward of a run."""
    env_spec = t.env or task.env or ""
    if rw.model and env_spec:
        raise ConfigError("reward.model scores single-turn completions; it cannot be combined with a multi-turn environment "
                          f"(task.env or task.name={t.name})")
    try:
        env = make_env(load_function(env_spec), tokenizer) if env_spec else None
        records = task.load(t.path or None, t.split or None, max_rows=t.max_rows, seed=seed)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise ConfigError(f"task: {e}") from None
    scorer = None
    if rw.kind == "reader":  # linguistic calibration: a reader's forecast through a proper scoring rule
        scorer = reader_scorer_for(rw, m, device, seed=seed)
    elif rw.model:  # a learned reward: a second model, scoring completions in batches
        try:
            scorer = load_scorer(rw.model, rw.kind, device=device, batch_size=rw.batch_size, max_length=rw.max_length,
                                 dtype=m.dtype, trust_remote_code=m.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"reward.model={rw.model}: {e}") from None
    sampling = SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                              max_new_tokens=ro.max_new_tokens, min_new_tokens=ro.min_new_tokens, stop=list(ro.stop),
                              ignore_eos=ro.ignore_eos)
    pool = None if env is not None else RewardPool.from_task(task, num_workers=t.reward_workers, timeout=t.reward_timeout)
    collector = RolloutCollector(
        tokenizer, engine, records, sampling=sampling, pool=pool, env=env, term_weights=task.term_weights,
        max_turns=ro.max_turns, max_response_tokens=ro.max_response_tokens, max_prompt_length=t.max_prompt_length,
        seed=seed, scorer=scorer, scorer_weight=rw.weight, rule_weight=rw.rule_weight,
    )
    source = t.path or getattr(task, "default_path", "") or t.name
    if not len(collector):
        collector.close()
        raise ConfigError(f"task '{t.name}' ({source}): no prompt of {len(records):,} fits task.max_prompt_length={t.max_prompt_length}")
    if distributed.is_main():
        skipped = len(records) - len(collector)  # the reason only where there is a skip: "0 skipped (longer ...)" misreads
        why = f" (longer than task.max_prompt_length={t.max_prompt_length})" if skipped else ""
        print(f"data: {source}: {len(records):,} rows read, {skipped:,} skipped{why}", file=sys.stderr, flush=True)
    return collector


def heldout_records(task, path: str, split: str, *, max_rows: int, seed: int, train_rows: int = 0,
                    train_seed: int | None = None, trained_on: str = "") -> list[dict]:
    """Evaluation records (``Task.load_heldout``): a procedural task's come from a seed derived
    apart from the training ``seed``, and those whose question a training problem (of
    ``train_seed``, default ``seed``) holds are dropped; the count is printed, with
    ``trained_on``: which training set that was."""
    try:
        records, dropped = task.load_heldout(path or None, split or None, max_rows=max_rows, seed=seed,
                                             train_rows=train_rows, train_seed=train_seed)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise ConfigError(f"task: {e}") from None
    if task.generate_spec is not None and not path and distributed.is_main():
        rows = train_rows or task.generate_sizes[0]
        against = trained_on or f"seed {seed if train_seed is None else train_seed}"
        print(f"eval data: {task.name}: {len(records) + dropped:,} held-out problems generated, {dropped:,} dropped "
              f"(their question is one of the {rows:,} training problems of {against})", file=sys.stderr, flush=True)
    return records


def reader_scorer_for(rw: LearnedRewardConfig, m: ModelConfig, device, *, seed: int) -> ReaderScorer:
    """reward.kind=reader: the rule reader, or the forecaster ``reward.model`` (sigma(logit)) with
    the extractor ``reward.reader.extractor`` sampled through an HF engine (or rule extraction)."""
    rd = rw.reader
    if rd.rule:
        reader = RuleReader()
    else:
        try:
            forecaster = Forecaster(rw.model, device=device, batch_size=rw.batch_size, max_length=rw.max_length,
                                    dtype=m.dtype, trust_remote_code=m.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"reward.model={rw.model}: {e}") from None
        generate = None
        if rd.extractor:
            tok = load_tokenizer(rd.extractor, trust_remote_code=m.trust_remote_code, key="reward.reader.extractor")
            engine = HFEngine(load_frozen(rd.extractor, m, device, key="reward.reader.extractor"), tok, seed=seed)
            generate = extractor_generate(engine, tok, SamplingParams(temperature=rd.extractor_temperature,
                                                                      max_new_tokens=rd.extractor_max_tokens), seed=seed)
        reader = LMReader(generate, forecaster)
    return ReaderScorer(reader, rule=rd.scoring, eps=rd.eps, lam=rd.normalization_lambda, offset=rd.offset,
                        unfinished_reward=rd.unfinished_reward)


def extractor_generate(engine, tok, params: SamplingParams, *, seed: int):
    """Prompt texts -> the extractor's completions: each prompt a user turn (the chat template, as
    relign sft trained it; raw text for a tokenizer without one), seeded by the prompt's own text,
    so an extraction does not depend on the batch it is in."""
    def generate(texts: list[str]) -> list[str]:
        ids = [render_prompt(tok, {"messages": [{"role": "user", "content": t}]} if tok.chat_template else {"prompt": t})[1]
               for t in texts]
        seeds = [derive_seed(seed, zlib.crc32(t.encode())) for t in texts]
        return [cs[0].text for cs in engine.generate(ids, params, seeds=seeds)]

    return generate


def evaluator_for(e: EvalDuringTrainingConfig, t: TaskConfig, ro: RolloutConfig, tokenizer, run_dir: Path, *,
                  seed: int) -> PeriodicEval:
    """RL's held-out eval (``eval.*``): the task as the run's (its reward, chat template, format
    weight), on ``eval.path`` (custom tasks) or the task's shipped test set, sampled with the
    rollouts' stop strings and, by default, their token budget."""
    task = build_task(t.name, path=e.path, reward_fn=t.reward_fn, chat=t.chat, system_prompt=t.system_prompt,
                      format_weight=t.format_weight, extract_fn=t.extract_fn, equal_fn=t.equal_fn,
                      reward_style=t.reward_style, answer_format=t.answer_format, sections=t,
                      features=dict(t.features))
    records = heldout_records(task, e.path, e.split, max_rows=e.max_rows, seed=seed, train_rows=t.max_rows)
    return PeriodicEval(task, records, tokenizer, run_dir, every=e.every, n=e.n, ks=e.ks, temperature=e.temperature,
                        max_new_tokens=e.max_new_tokens or ro.max_new_tokens, batch_prompts=e.batch_prompts,
                        samples=e.samples, stop=ro.stop, max_prompt_length=t.max_prompt_length, seed=seed,
                        reward_workers=t.reward_workers, reward_timeout=t.reward_timeout)
