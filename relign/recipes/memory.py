"""Each recipe's memory plan from its config (``relign plan``, ``--dry-run``, the refusal in ``frame.open``).

The terms are ``relign.plan``'s pure functions; this module reads a recipe's config to know which
stages the recipe runs and what each one holds at its peak, per rank:

    sft, rm   train (the largest micro-batch's forward and backward), optimizer, eval
    dpo       reference (the precompute, no gradients), train, optimizer, eval
    rl        rollout, reference, old_logps, values, update, critic update, optimizer

The plan is the worst case the config allows: every row at ``data.max_length``, every prompt at
``task.max_prompt_length`` and every response at its token budget, all its positions scored. A run
stops at ``frame.open`` (before any weights load) when the peak exceeds what the device has,
unless ``plan.check=false``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import distributed
from .. import plan as P
from .. import plan_table
from ..checks import get_key
from ..config import ConfigError
from ..data.balance import micro_batch_plan
from ..devices import Device, GiB, local_device
from ..models import budget
from ..rundir import dry_run_requested, is_nested, set_memory_plan
from .plan_model import (Model, causal_pairs, device_type, head_fact, mesh_ranks, model_facts, read_shape, step_seconds,
                         token_budget)
from .rl_advantages import ESTIMATORS

# --------------------------------------------------------------------------- sft, rm


def _eval_rows(cfg: Any) -> bool:
    d = cfg.data
    return bool(d.eval_path or d.eval_fraction > 0)


def plan_sft(cfg: Any, shape: P.Shape, device: Device, world: int = 1, *, pairs: bool = False) -> P.Plan:
    """SFT (``recipes/sft.py``): micro-batches of ``micro_batch_size`` rows of ``data.max_length``
    tokens (packed: one row; else padded), every position after each row's first scored; the
    held-out loss in padded batches of ``eval_batch_size`` rows. The reward model (``rm``) is the
    same with ``pairs`` (two rows each, padded) and a scalar head instead of the logits."""
    dp, cp, tp = mesh_ranks(cfg, world)
    model = Model(cfg.model, shape, tp=tp, dp=dp * cp, device=device_type(device))
    Lmax = cfg.data.max_length
    lm, per_row, packing = not pairs, 2 if pairs else 1, not pairs and cfg.packing  # the rm config has no packing
    # packed SFT cuts a rank's rows into balanced passes of at most max_tokens_per_micro tokens when it has a budget
    # (null: by device, none on a CPU); else micro_batch_size rows a pass
    max_tokens = token_budget(getattr(cfg, "max_tokens_per_micro", 0), model, device, cpu=0, held=model.weights) \
        if packing else 0
    rank_rows = max(1, cfg.batch_size // dp)
    if max_tokens:
        parts = micro_batch_plan([Lmax] * rank_rows, max_tokens=max_tokens)[0]
        rows, passes = max(len(part) for part in parts), len(parts)
    else:
        rows, passes = cfg.micro_batch_size * per_row, rank_rows // cfg.micro_batch_size
    tokens = rows * Lmax // cp
    positions = rows * (Lmax - 1) // cp if lm else 0
    packed = packing and model.packed_attention
    accum = passes > 1
    rope = tokens if packing else Lmax
    per_step = cfg.batch_size * per_row // dp
    step_flops = 3 * model.flops(per_step * Lmax, per_step * (Lmax - 1) if lm else 0, per_step * causal_pairs(Lmax))
    # the loss is a fixed weighted sum of log-probs: the fused head takes its gradients in the forward (sft._loss)
    fused = lm and model.fused()
    train = P.Stage("train", model.train_pass(tokens, positions, packed=packed, rope=rope, accum=accum, head=lm,
                                              fused=fused, weighted=True),
                    key="max_tokens_per_micro" if max_tokens else "micro_batch_size", seconds=step_seconds(step_flops, device))
    stages = [train, P.Stage("optimizer", model.optimizer_step(), key="optim")]
    if _eval_rows(cfg):
        ev = cfg.eval_batch_size * per_row
        stages.append(P.Stage("eval", {**model.states(grads=False),
                                       "forward (no grad)": model.nograd_pass(ev * Lmax, ev * (Lmax - 1) if lm else 0,
                                                                              fused=fused)},
                              key="eval_batch_size"))
    budget_text = f"; budget {max_tokens:,}{' by device' if cfg.max_tokens_per_micro is None else ''}" if max_tokens else ""
    facts = model_facts(cfg, model, world) + [
        f"largest micro-batch: {rows} rows x {Lmax} tokens = {tokens:,} tokens "
        f"({'packed' if packing else 'padded'}{budget_text}), logits at {positions:,} positions"
        + (f"; {passes} micro-batches per step" if accum else "")] + ([head_fact(model.head_why)] if lm else [])
    return P.Plan("rm" if pairs else "sft", device, stages, facts)


def plan_rm(cfg: Any, shape: P.Shape, device: Device, world: int = 1) -> P.Plan:
    return plan_sft(cfg, shape, device, world, pairs=True)


# --------------------------------------------------------------------------- dpo

REFERENCE_FREE = ("simpo", "orpo")
"""The losses of ``preference.PAIR_LOSSES`` that read no reference (that module imports the frame, which
imports this one; tests/test_plan.py keeps the two in step)."""



def plan_dpo(cfg: Any, shape: P.Shape, device: Device, world: int = 1) -> P.Plan:
    """DPO and its family (``recipes/preference.py``): each pair is prompt + chosen and prompt +
    rejected; with ``share_prompt`` on a model varlen covers, one packed row per micro-batch that
    runs the prompt once (a pair is then at most ``2 data.max_length`` tokens, its responses scored).
    The reference log-probs are precomputed before the first step (``reference=precompute``) in
    batches of ``eval_batch_size`` pairs, or a frozen copy scores every micro-batch (``online``)."""
    dp, cp, tp = mesh_ranks(cfg, world)
    model = Model(cfg.model, shape, tp=tp, dp=dp * cp, device=device_type(device))
    Lmax, kto = cfg.data.max_length, cfg.loss == "kto"
    per_pair = Lmax if kto else 2 * Lmax  # the worst case: prompt of 1 token, both responses of Lmax - 1
    share = cfg.share_prompt and not kto
    packed = (cfg.packing or share) and model.packed_attention
    # packed pairs are cut into balanced passes of at most max_tokens_per_micro tokens when there is a budget (null: by
    # device, none on a CPU; pairs.micro_batches); else micro_batch_size pairs a pass
    max_tokens = token_budget(getattr(cfg, "max_tokens_per_micro", 0), model, device, cpu=0, held=model.weights) \
        if cfg.packing or packed else 0
    rank_pairs = max(1, cfg.batch_size // dp)
    if max_tokens:
        parts = micro_batch_plan([per_pair] * rank_pairs, max_tokens=max_tokens)[0]
        pairs, passes = max(len(part) for part in parts), len(parts)
    else:
        pairs, passes = cfg.micro_batch_size, rank_pairs // cfg.micro_batch_size
    tokens = pairs * per_pair // cp
    positions = pairs * (per_pair - (1 if kto else 2)) // cp
    # a shared prompt without varlen runs against its KV cache, on the model's own logits (pairs.sequence_logps)
    layout_why = "the shared-prefix layout" if share and not packed else ""
    fused = model.fused(layout_why)
    accum = passes > 1
    ref = cfg.loss not in REFERENCE_FREE
    online = {}
    if ref and cfg.reference == "online" and not cfg.model.lora.enabled:
        online = {"reference": P.weight_bytes(model.local, model.prec.param)}
    # the precompute scores with the starting policy, or with a second model beside it (ref_model)
    precompute = {"reference": P.weight_bytes(model.local, model.prec.param)} if cfg.ref_model else {}
    per_step = cfg.batch_size // dp
    step_flops = 3 * model.flops(per_step * per_pair, per_step * per_pair, per_step * 2 * causal_pairs(Lmax))
    stages = []
    if ref and cfg.reference == "precompute":
        ev = cfg.eval_batch_size
        # before the first step: the policy scores the pairs, AdamW has no state yet
        stages.append(P.Stage("reference", {"weights": P.weight_bytes(model.weights, 1), **precompute,
                                            "forward (no grad)": model.nograd_pass(ev * per_pair, ev * per_pair, fused=fused)},
                              key="eval_batch_size"))
    stages.append(P.Stage("train", {**model.train_pass(tokens, positions, packed=packed, rope=tokens if packed else Lmax,
                                                       accum=accum, fused=fused), **online},
                          key="max_tokens_per_micro" if max_tokens else "micro_batch_size", seconds=step_seconds(step_flops, device)))
    stages.append(P.Stage("optimizer", {**model.optimizer_step(), **online}, key="optim"))
    if _eval_rows(cfg):
        ev = cfg.eval_batch_size
        stages.append(P.Stage("eval", {**model.states(grads=False), **online,
                                       "forward (no grad)": model.nograd_pass(ev * per_pair, ev * per_pair, fused=fused)},
                              key="eval_batch_size"))
    budget_text = f"; budget {max_tokens:,}{' by device' if cfg.max_tokens_per_micro is None else ''}" if max_tokens else ""
    facts = model_facts(cfg, model, world) + [
        f"largest micro-batch: {pairs} {'examples' if kto else 'pairs'} of up to {per_pair:,} tokens = {tokens:,} tokens "
        f"({'packed' if packed else 'padded'}{budget_text}), logits at {positions:,} positions"
        + (f"; {passes} micro-batches per step" if accum else ""),
        head_fact(model.head_why or layout_why)]
    return P.Plan("dpo", device, stages, facts)


# --------------------------------------------------------------------------- rl


class Micro:
    """The largest micro-batch ``rl_update.plan`` cuts from ``items`` items of ``size`` tokens (groups
    or sequences, all at the worst-case lengths), over ``dp`` ranks: its tokens, sequences, passes."""

    def __init__(self, items: int, size: int, seqs_per_item: int, *, dp: int, max_tokens: int, max_rows: int):
        max_items = max(1, max_rows // seqs_per_item) if max_rows else 0
        split = max_rows and seqs_per_item > max_rows  # a group larger than the row budget runs in parts
        plan = micro_batch_plan([size] * items, ranks=dp, max_tokens=max_tokens, max_items=max_items)[0]
        largest = max((len(part) for part in plan), default=0)
        self.parts = math.ceil(seqs_per_item / max_rows) if split else 1
        self.items, self.passes = largest, len(plan) * self.parts
        self.seqs = largest * seqs_per_item // self.parts
        self.tokens = largest * size // self.parts


@dataclass(frozen=True)
class _RLLayout:
    """An RL step's sequences as the passes lay them out (``rl_update.Layout``), at the worst case."""

    n: int
    """Samples per prompt (``rollout.n``)."""
    Pl: int
    """The longest prompt (``task.max_prompt_length``)."""
    R: int
    """The longest response (its token budget over every turn)."""
    G: int
    """Sequences per item: n where a group's prompt runs once (packed continuations, or the KV-cache prefix), else 1."""
    pack: bool
    size: int
    """Tokens of one item (a sequence, or a group of n sharing its prompt)."""
    items: int
    """Items of the step."""
    why: str
    """Why the layout keeps the model's own LM head ("" where the fused head may run)."""

    @property
    def name(self) -> str:
        return "packed" if self.pack else ("shared prompt, padded" if self.G > 1 else "padded")


def _rl_layout(cfg: Any, model: Model) -> _RLLayout:
    ro, Pl = cfg.rollout, cfg.task.max_prompt_length
    n, R = ro.n, ro.max_response_tokens or ro.max_new_tokens * max(1, ro.max_turns)
    share = cfg.share_prompt and n > 1
    pack = cfg.packing or (share and model.packed_attention)
    continued = share and model.packed_attention
    G = n if (share and (continued or not pack)) else 1
    if G == 1:
        size = Pl + R
    elif pack:
        size = Pl + n * R + n - 1  # [prompt, y_1][prompt[-1], y_2]...: the prompt once, its last token again
    else:
        size = Pl + n * R  # the prompt once against its KV cache, the responses padded
    # the shared-prefix layout hands the logits of each prompt's last position across micro-batches (stage a)
    why = "the shared-prefix layout" if share and not pack else ""
    return _RLLayout(n, Pl, R, G, pack, size, cfg.prompts_per_step * (1 if G > 1 else n), why)


def _rl_rollout(cfg: Any, model: Model, device: Device, world: int, keep: dict[str, int]
                ) -> tuple[P.Stage, dict[str, int], int]:
    """The rollout stage (the engine's cache and weight copies; one process: the HF engine shares the
    policy), what the engine holds asleep during the other stages, and the rows of an engine call."""
    ro, m, s, prec = cfg.rollout, cfg.model, model.s, model.prec
    n, Pl = ro.n, cfg.task.max_prompt_length
    R = ro.max_response_tokens or ro.max_new_tokens * max(1, ro.max_turns)
    prompts_rank = max(1, cfg.prompts_per_step // world)
    rows = min(max(1, ro.max_batch_rows // n), prompts_rank) * n
    # the HF engine's own full replica of the policy: under torchrun (the policy is sharded), rollout.overlap=thread
    replica = ro.engine != "vllm" and (world > 1 or ro.overlap == "thread")
    if ro.engine == "vllm":
        engine = _vllm_terms(cfg, s, prec, device, rows, Pl + R)
        asleep = _vllm_terms(cfg, s, prec, device, rows, Pl + R, awake=False)
    else:
        b = prec.compute
        fast = ro.fast_decode and s.model_type in ("llama", "qwen2", "qwen3") and not m.lora.enabled
        # a call's cache: its longest prompt + max_new_tokens (a multi-turn episode's later turns prompt with its history)
        cache = Pl + ro.max_new_tokens + (R if ro.max_turns != 1 else 0)
        engine = {"engine KV cache": P.kv_cache_bytes(s, rows, cache, b),
                  "engine weights": (P.decode_copy_bytes(s, b) if fast else 0)
                  + (P.weight_bytes(s.params, prec.param) if replica else 0),
                  "decode": max(P.decode_step_bytes(s, rows), P.nograd_forward_bytes(s, rows // n * Pl, 0, prec))}
        asleep = {"engine weights": P.weight_bytes(s.params, prec.param)} if replica else {}
    seconds = None
    if device.tbs:  # every decode step reads the weights and the cache once: a bandwidth bound
        steps = R * math.ceil(prompts_rank * n / rows)
        per_step = s.linear_params * prec.compute + rows * (Pl + R / 2) * P.kv_bytes_per_token(s, prec.compute)
        seconds = steps * per_step / (device.tbs * 1e12)
    return P.Stage("rollout", {**keep, **engine}, key="rollout.max_batch_rows", seconds=seconds), asleep, rows


def _critic_stages(model: Model, held: dict[str, int], mini: "Micro", lay: _RLLayout, *, cp: int, updates: int,
                   device: Device) -> list[P.Stage]:
    """A critic's update (its backward beside everything the step holds) and its optimizer step."""
    s, prec = model.s, model.prec
    c_params = model.local + s.d + 1  # the backbone (with its unused head) and the value head
    crit = model.train_pass(mini.tokens // cp, 0, packed=lay.pack, rope=mini.tokens // cp if lay.pack else lay.size,
                            accum=mini.passes > 1, head=False)
    crit = {k: v for k, v in crit.items() if k not in ("weights", "AdamW state", "gradients")}
    grads = {"critic gradients": P.grad_bytes(c_params, prec.param)}
    return [P.Stage("critic update", {**held, **grads, **{f"critic {k}": v for k, v in crit.items() if v}},
                    key="max_tokens_per_micro",
                    seconds=step_seconds(3 * updates * model.flops(mini.tokens * mini.passes, 0, 0), device)),
            # the critic's own clip_gradients, after its backward: a float64 copy of its largest gradient (the embedding's)
            P.Stage("critic optimizer", {**held, **grads, "optimizer step": P.grad_norm_bytes(s.embedding // model.dp)},
                    key="optim")]


def plan_rl(cfg: Any, shape: P.Shape, device: Device, world: int = 1) -> P.Plan:
    """RL (``recipes/rl.py``): the HF or vLLM engine samples ``prompts_per_step`` x ``rollout.n``
    completions; the reference, old log-probs, values and updates run micro-batches that
    ``rl_update.plan`` cuts by ``max_tokens_per_micro`` and ``micro_batch_size`` (groups whole where
    a prompt runs once); every prompt at ``task.max_prompt_length`` and every response at its
    budget."""
    ro, a, m = cfg.rollout, cfg.algorithm, cfg.model
    dp, cp, tp = mesh_ranks(cfg, world)
    model = Model(m, shape, tp=tp, dp=dp * cp, device=device_type(device))
    lay = _rl_layout(cfg, model)
    fused = model.fused(lay.why)
    kl = a.kl != "none"
    held = model.weights * (2 if kl and not m.lora.enabled else 1)  # in memory when the budget is taken
    max_tokens = token_budget(cfg.max_tokens_per_micro, model, device, cpu=budget.CPU_TOKENS, held=held)
    whole = Micro(lay.items, lay.size, lay.G, dp=dp, max_tokens=max_tokens, max_rows=cfg.micro_batch_size)
    mini = Micro(max(1, lay.items // a.mini_batches), lay.size, lay.G, dp=dp, max_tokens=max_tokens,
                 max_rows=cfg.micro_batch_size)
    positions = mini.seqs * lay.R // cp  # context parallel: each cp rank runs its chunk of the row
    estimator_values = ESTIMATORS[a.advantage].values == "critic"
    reuse = a.ppo_epochs * a.mini_batches > 1 or a.tis_cap > 0 or a.kl == "reward" or ro.max_staleness > 0
    # ---- what stays in memory the whole step
    ref = {"reference": P.weight_bytes(model.local, model.prec.param)} if kl and not m.lora.enabled else {}
    critic = {}
    if estimator_values:
        c_params = model.local + shape.d + 1  # the backbone (with its unused head) and the value head
        critic = {"critic": P.weight_bytes(c_params, model.prec.param) + P.adamw_bytes(c_params, model.prec.param)}
    keep = {**model.states(grads=False), **ref, **critic}
    rollout, asleep, rows = _rl_rollout(cfg, model, device, world, keep)
    # ---- the passes without gradients, then the update's
    nograd = {**keep, **asleep, "forward (no grad)": model.nograd_pass(whole.tokens, whole.seqs * lay.R, fused=fused,
                                                                        temperature=ro.temperature)}
    pass_s = step_seconds(model.flops(whole.tokens * whole.passes, whole.seqs * whole.passes * lay.R, 0), device)
    stages = [rollout] + [P.Stage(name, dict(nograd), key="max_tokens_per_micro", seconds=pass_s)
               for name, runs in (("reference", kl), ("old_logps", reuse)) if runs]
    if estimator_values:
        stages.append(P.Stage("values", {**keep, **asleep,
                                         "forward (no grad)": P.nograd_forward_bytes(shape, whole.tokens, 0, model.prec)},
                              key="max_tokens_per_micro",
                              seconds=step_seconds(model.flops(whole.tokens * whole.passes, 0, 0), device)))
    updates = a.ppo_epochs * a.mini_batches
    upd_flops = 3 * updates * model.flops(mini.tokens * mini.passes, positions * mini.passes, 0)
    stages.append(P.Stage("update", {**model.train_pass(mini.tokens // cp, positions, packed=lay.pack,
                                                        rope=mini.tokens // cp if lay.pack else lay.size,
                                                        accum=mini.passes > 1, fused=fused, entropy=True,
                                                        entropy_grad=a.entropy_coef > 0, temperature=ro.temperature),
                                     **ref, **critic, **asleep},
                          key="max_tokens_per_micro" if not cfg.micro_batch_size else "micro_batch_size",
                          seconds=step_seconds(upd_flops, device)))
    if estimator_values:
        stages += _critic_stages(model, {**keep, **asleep}, mini, lay, cp=cp, updates=updates, device=device)
    stages.append(P.Stage("optimizer", {**model.optimizer_step(), **ref, **critic, **asleep}, key="optim"))
    budget_text = f"{max_tokens:,}" if max_tokens else "none"
    facts = model_facts(cfg, model, world) + [
        f"rollout: {cfg.prompts_per_step} prompts x {lay.n} samples, {rows} rows per engine call "
        f"({ro.engine}), prompts up to {lay.Pl} tokens, responses up to {lay.R}",
        f"largest update micro-batch: {mini.tokens:,} tokens ({mini.seqs} sequences, {lay.name}; budget "
        f"{budget_text}{' by device' if cfg.max_tokens_per_micro is None else ''}), logits at {positions:,} positions; "
        f"{mini.passes} pass{'es' if mini.passes > 1 else ''} per update, {updates} update{'s' if updates > 1 else ''} per step",
        head_fact(model.head_why or lay.why)]
    return P.Plan("rl", device, stages, facts)


def _vllm_terms(cfg: Any, s: P.Shape, prec: P.Precision, device: Device, rows: int, length: int, *,
                awake: bool = True) -> dict[str, int]:
    """The vLLM engine (``rollout/vllm_engine.py``) colocated with the trainer. On a GPU it takes
    ``rollout.vllm.gpu_memory_utilization`` of the device's memory (weights and KV cache; or its
    weights plus ``kv_cache_gb``); asleep at level 1 its KV cache is freed and its weights moved to
    CPU memory, at level 2 both freed. On a CPU its KV cache is sized from the need (a step's rows x
    max_model_len, 64 MiB - 4 GiB) and vLLM has no sleep mode."""
    v = cfg.rollout.vllm
    weights = s.params * prec.compute
    on_gpu = device.key != "cpu"
    if on_gpu:
        if not awake:
            return {"engine KV cache": 0, "engine weights": 0}
        if v.kv_cache_gb > 0:
            return {"engine KV cache": int(v.kv_cache_gb * GiB), "engine weights": weights}
        total = int(v.gpu_memory_utilization * device.memory)
        return {"engine KV cache": max(0, total - weights), "engine weights": weights}
    kv = int(v.kv_cache_gb * GiB) if v.kv_cache_gb > 0 else \
        int(min(max(P.kv_bytes_per_token(s, prec.compute) * rows * (v.max_model_len or length), 64 * 2**20), 4 * GiB))
    return {"engine KV cache": kv, "engine weights": weights}


# --------------------------------------------------------------------------- the table, the search, the check


PLANNERS: dict[str, Callable[..., P.Plan]] = {"sft": plan_sft, "rm": plan_rm, "dpo": plan_dpo, "rl": plan_rl}
"""recipe -> its planner. The other recipes (rest, eval, demo, verifier's own stage) are not planned."""

def _per_rank(cfg: Any, world: int) -> int:
    return max(1, cfg.batch_size // mesh_ranks(cfg, world)[0])


def _rl_tokens(cfg: Any, world: int) -> int:
    """The most tokens one rank's micro-batch can hold: its share of a mini-batch, every sequence at its budget."""
    ro = cfg.rollout
    seq = cfg.task.max_prompt_length + (ro.max_response_tokens or ro.max_new_tokens * max(1, ro.max_turns))
    return max(1, cfg.prompts_per_step * ro.n // cfg.algorithm.mini_batches // mesh_ranks(cfg, world)[0]) * seq


def _rl_rows(cfg: Any, world: int) -> int:
    """The most sequences one rank's micro-batch can hold: its share of a mini-batch."""
    return max(1, cfg.prompts_per_step * cfg.rollout.n // cfg.algorithm.mini_batches // mesh_ranks(cfg, world)[0])


_PASSES = ("reference", "old_logps", "values", "update", "critic update")


def _budgeted(plan: P.Plan) -> bool:
    """Whether a token budget cuts the plan's passes (then micro_batch_size does not)."""
    return any(st.key == "max_tokens_per_micro" for st in plan.stages)


@dataclass(frozen=True)
class Search:
    """A key whose largest fitting value a plan names: the stages it sizes, and the value past which
    nothing changes (with what that value is; "" when the search only stops there). ``when``: whether
    the plan's stages depend on the key at this config."""

    key: str
    stages: tuple[str, ...]
    top: Callable[[Any, int], int]
    whole: str = ""
    when: Callable[[Any, P.Plan], bool] = lambda cfg, plan: True


def _sft_tokens(cfg: Any, world: int) -> int:
    """The tokens of a rank's whole batch of packed SFT rows at data.max_length."""
    return _per_rank(cfg, world) * cfg.data.max_length


SEARCH: dict[str, list[Search]] = {
    "sft": [Search("micro_batch_size", ("train",), _per_rank, "the rank's whole batch",
                   when=lambda c, p: not _budgeted(p)),
            Search("max_tokens_per_micro", ("train",), _sft_tokens, "the rank's whole batch in one pass",
                   when=lambda c, p: c.packing),  # SFT's budget cuts packed rows only
            Search("eval_batch_size", ("eval",), lambda c, w: 4096)],
    "dpo": [Search("micro_batch_size", ("train",), _per_rank, "the rank's whole batch",
                   when=lambda c, p: not _budgeted(p)),
            Search("max_tokens_per_micro", ("train",), lambda c, w: _per_rank(c, w) * 2 * c.data.max_length,
                   "the rank's whole batch in one pass", when=lambda c, p: c.packing or _budgeted(p)),
            Search("eval_batch_size", ("reference", "eval"), lambda c, w: 4096)],
    "rl": [Search("max_tokens_per_micro", _PASSES, _rl_tokens, "a rank's whole mini-batch in one pass"),
           Search("micro_batch_size", _PASSES, _rl_rows, "a rank's whole mini-batch in one pass"),
           Search("rollout.max_batch_rows", ("rollout",), lambda c, w: max(1, c.prompts_per_step // w) * c.rollout.n,
                  "a rank's whole rollout in one call")],
}
SEARCH["rm"] = [sr for sr in SEARCH["sft"] if sr.key != "max_tokens_per_micro"]


def _set_key(cfg: Any, key: str, value: Any) -> Any:
    out = copy.deepcopy(cfg)
    *head, last = key.split(".")
    setattr(get_key(out, ".".join(head)) if head else out, last, value)
    return out


def plan_for(cfg: Any, recipe: str, device: Device, *, world: int = 1, shape: P.Shape | None = None,
             search: bool = True) -> P.Plan:
    """The plan of ``recipe`` with ``cfg`` on ``device`` over ``world`` ranks; ``search``: also the
    largest value of each key in ``SEARCH`` whose stages fit (``Plan.fits``)."""
    if recipe not in PLANNERS:
        raise ConfigError(f"relign plan covers {', '.join(PLANNERS)}; {recipe} has no plan")
    if shape is None:
        shape = read_shape(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    planner = PLANNERS[recipe]
    out = planner(cfg, shape, device, world)
    out.ranks = P.env_local_ranks() if device.key == "cpu" else 1
    if not search:
        return out
    for sr in SEARCH[recipe]:
        stages = {st.name for st in out.stages} & set(sr.stages)
        if not stages or not sr.when(cfg, out):
            continue
        top = sr.top(cfg, world)

        def fits(v: int) -> bool:
            p = planner(_set_key(cfg, sr.key, v), shape, device, world)
            return all(st.total * out.ranks <= device.available for st in p.stages if st.name in stages)

        best = P.largest_fitting(fits, 1, top)
        out.fits.append(P.Fit(sr.key, best, get_key(cfg, sr.key), sr.whole, top=best == top, stages=tuple(stages)))
    return out


def check(cfg: Any, recipe: str, device: Any) -> P.Plan | None:
    """At the start of a run (``frame.open``), before any weights load: the plan on the run's device
    (``plan.device`` names another one), which ``--dry-run`` prints (``banner.dry_run``); a ConfigError of one line when its
    peak exceeds the device's memory, unless ``plan.check=false``. None for a recipe without a plan,
    or a model whose config cannot be read here (its loading will say why)."""
    dry = dry_run_requested() and not is_nested()
    if dry:
        set_memory_plan("")  # an earlier run's in this process (a notebook) is not this one's
    settings = getattr(cfg, "plan", None)
    if settings is None or recipe not in PLANNERS:
        return None
    if not (settings.check or dry):
        return None
    try:
        shape = read_shape(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    except ConfigError:
        return None
    target = local_device(settings.device or str(device))
    world = distributed.world_size()
    plan = plan_for(cfg, recipe, target, world=world, shape=shape, search=False)
    if dry or not plan.fits_device:  # what fits: for the table, or for the refusal to name
        plan = plan_for(cfg, recipe, target, world=world, shape=shape)
    why = plan_table.refusal(plan) if settings.check else None
    if dry and why and distributed.is_main():
        print(plan_table.format_plan(plan), flush=True)  # the table, then the refusal's one line
    elif dry:
        set_memory_plan(plan_table.format_plan(plan))  # banner.dry_run prints it with the run's summary
    if why:
        raise ConfigError(why)
    return plan

