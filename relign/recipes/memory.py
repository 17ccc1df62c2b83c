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
from ..models.flops import ModelFlops
from ..models.loading import check_model_source, compile_enabled, from_pretrained_checked, resolve_model_path
from ..models.varlen import SUPPORTED
from ..rundir import dry_run_requested, is_nested, set_memory_plan
from .rl_advantages import ESTIMATORS

# --------------------------------------------------------------------------- the model


def read_shape(path: str, *, trust_remote_code: bool = False, key: str = "model.path") -> P.Shape:
    """The model's shape from its config.json alone (``tiny:SIZE`` builds the tiny model first; a hub id
    whose hub is unreachable reads the cached file, as the loading does, without its retries)."""
    from transformers import AutoConfig

    folder = resolve_model_path(path)
    try:
        local_only = check_model_source(folder, key)
        config = from_pretrained_checked(AutoConfig, folder, key, local_only=local_only, trust_remote_code=trust_remote_code)
    except ValueError as e:  # a model type this transformers does not know
        raise ConfigError(f"{key}={path}: cannot read the model's config: {str(e).splitlines()[0]}") from None
    config = getattr(config, "text_config", None) or config
    return P.Shape.of(config)


class Model:
    """A recipe's model in numbers: shape, precision, parameters (all, trainable) and its options."""

    def __init__(self, m: Any, shape: P.Shape, *, tp: int = 1, dp: int = 1, device: str = "cpu"):
        """``tp``: the tensor-parallel degree; ``dp``: the ranks FSDP shards over (dp x cp of the mesh);
        ``device``: its type (``model.compile=auto`` decides by it)."""
        self.s, self.prec = shape, P.Precision.of(m.dtype)
        # regional compile turns lean activations off (the compiler picks what to recompute; counted as without)
        self.compiled = compile_enabled(getattr(m, "compile", "false"), device)
        self.lean, self.ckpt = m.lean_activations and not self.compiled, m.gradient_checkpointing
        self.lora = m.lora.r if m.lora.enabled else 0
        adapter = shape.lora_params(m.lora.r, m.lora.target_modules) if self.lora else 0
        # tensor parallel splits the layers' projections; FSDP shards what a rank keeps over dp
        local = shape.params - shape.layers * (shape.attention_linear + shape.mlp_linear) * (1 - 1 / tp)
        self.local = int(local / dp)
        """This rank's share of the model's parameters (a frozen copy of it holds as many: the reference)."""
        self.weights = self.local * self.prec.param + int(adapter / dp) * 4  # peft keeps adapters fp32
        self.trainable = int(adapter / dp) if self.lora else int(local / dp)
        self.grad_p = 4 if self.lora else self.prec.param
        self.tp, self.dp = tp, dp
        # the largest trainable tensor, of which the gradient norm takes a float64 copy: the embedding (or an
        # MLP projection), a LoRA factor of the MLP's width (r x I)
        if self.lora:
            self.largest = self.lora * max(shape.d, shape.intermediate) // dp
        else:
            self.largest = max(shape.embedding, shape.d * shape.intermediate // tp) // dp
        self.packed_attention = shape.model_type in SUPPORTED and m.attn_implementation == "sdpa"
        targets = [m.lora.target_modules] if isinstance(m.lora.target_modules, str) else list(m.lora.target_modules)
        self.lora_head = bool(self.lora) and "lm_head" in targets
        """LoRA adapts the LM head (peft's lora.Linear in its place)."""
        self.head_why = head_stage_a(shape.model_type, lora_head=self.lora_head, ranks=tp * dp)
        """Why this model's LM head keeps its logits (stage a), "" where the fused head applies (stage b)."""
        # peft's projections send the lean SwiGLU to the module's own forward where it adapts the MLP's
        self.mlp_adapted = bool(self.lora) and ("all-linear" in targets or bool({"gate_proj", "up_proj", "down_proj"} & set(targets)))

    def states(self, *, grads: bool) -> dict[str, int]:
        """Weights, AdamW's state and (``grads``) the gradients, this rank's share."""
        out = {"weights": P.weight_bytes(self.weights, 1), "AdamW state": P.adamw_bytes(self.trainable, self.grad_p)}
        if grads:
            out["gradients"] = P.grad_bytes(self.trainable, self.grad_p)
        return out

    def fused(self, layout_why: str = "") -> bool:
        """Whether a pass runs the fused LM head (stage b): the model allows it and so does the
        layout (``layout_why``: why it does not, "" when it does)."""
        return not (self.head_why or layout_why)

    def head_terms(self, positions: int, *, fused: bool, weighted: bool = False, entropy: bool = False,
                   entropy_grad: bool = False, temperature: float = 1.0) -> dict[str, int]:
        """The loss's LM head in a training pass: the logits (stage a) or the fused head's chunks (stage b)."""
        if fused:
            return {"LM head (fused)": P.fused_head_bytes(self.s, positions, self.prec, weighted=weighted,
                                                          head_grad=not self.lora, entropy=entropy,
                                                          entropy_grad=entropy_grad, temperature=temperature)}
        return {"logits": P.logits_bytes(positions, self.s.vocab, prec=self.prec, entropy=entropy,
                                         entropy_grad=entropy_grad, temperature=temperature, adapted=self.lora_head)}

    def train_pass(self, tokens: int, positions: int, *, packed: bool, rope: int, accum: bool,
                   head: bool = True, fused: bool = False, weighted: bool = False, entropy: bool = False,
                   entropy_grad: bool = False, temperature: float = 1.0) -> dict[str, int]:
        """The forward/backward of one micro-batch at the heavier of its two peaks, states included:
        the start of the loss's backward (saved activations, the bf16 weight copies, the loss's
        logits or, ``fused``, the fused head's chunks; the gradients only when an earlier
        micro-batch of the step left them: ``accum``), or the end of the backward (every gradient,
        and the embedding's being summed). FSDP's gathered layers at both. ``weighted``: the fused
        head takes its gradients in the forward (SFT); ``entropy``: the entropy is computed beside
        the log-probs (RL's update logs it), ``entropy_grad``: and differentiated (an entropy bonus)."""
        s, prec = self.s, self.prec
        lean = self.lean and not self.mlp_adapted
        fused = fused and head
        fsdp = {"FSDP gathered": P.fsdp_gather_bytes(s, prec, self.dp)}
        logits = self.head_terms(positions, fused=fused, weighted=weighted, entropy=entropy, entropy_grad=entropy_grad,
                                 temperature=temperature) if head else {}
        loss = {**self.states(grads=accum),
                "activations": P.activation_bytes(s, tokens, positions if head else 0, prec, lean=lean,
                                                  checkpointing=self.ckpt, packed=packed, rope_positions=rope, tp=self.tp,
                                                  fused=fused),
                "bf16 weight copies": P.weight_copy_bytes(s, prec, lean=lean, layers=1 if self.ckpt else None, tp=self.tp,
                                                          head=head and not fused),
                **logits, **fsdp}
        end = {**self.states(grads=True), **fsdp,
               "embedding gradients": 0 if self.lora else P.embedding_grad_bytes(
                   s, self.grad_p, accumulating=accum, head=head, in_place=fused or prec.mixed or prec.cast,
                   upcast=fused and prec.cast) // self.dp}
        return loss if sum(loss.values()) >= sum(end.values()) else end

    def optimizer_step(self) -> dict[str, int]:
        """The optimizer step: the states and the gradient norm's float64 copy of the largest gradient."""
        return {**self.states(grads=True), "optimizer step": P.grad_norm_bytes(self.largest)}

    def nograd_pass(self, tokens: int, positions: int, *, fused: bool = False, temperature: float = 1.0) -> int:
        """A forward without gradients: its transients (the LM head fused or not), FSDP's gathered layers,
        and under bf16-compute the cast copy of every weight, made at the forward's start
        (``precision.enable_compute_weights``)."""
        copies = P.weight_copy_bytes(self.s, self.prec, lean=self.lean, tp=self.tp) if self.prec.cast else 0
        return P.nograd_forward_bytes(self.s, tokens, positions, self.prec, fused=fused, copies=copies,
                                      temperature=temperature, adapted=self.lora_head) + \
            P.fsdp_gather_bytes(self.s, self.prec, self.dp, trainable=False)

    def flops(self, tokens: int, positions: int, pairs: float) -> float:
        """A forward's FLOPs (``models/flops.ModelFlops``, perf/mfu's count): tokens through the decoder,
        logits at the kept positions, attention pairs."""
        f = ModelFlops(self.s.config())
        return tokens * f.token + positions * f.head + pairs * f.pair


FUSED_TYPES = ("qwen2", "qwen3", "llama", "mistral")
"""The model types whose causal LM ``fused_ce.head_of`` takes (its ``PLAIN_CAUSAL_LMS``; tests/test_plan.py keeps the two in step)."""


def head_stage_a(model_type: str, *, lora_head: bool, ranks: int) -> str:
    """Why a model's LM head runs as the model's own (stage a: its logits kept, ``fused_ce.LogSoftmaxGather``)
    rather than fused (stage b, ``fused_ce.head_of``), from the config alone; "" where stage b applies. Stage a:
    another architecture (one that scales or caps its logits), a LoRA adapter on ``lm_head``, and more than one
    rank (FSDP2's DTensors, whose hooks the fused head would skip; context parallel's ``cp_token_logps`` too)."""
    if model_type not in FUSED_TYPES:
        return f"{model_type or 'this architecture'} is not a plain causal LM"
    if lora_head:
        return "LoRA adapts lm_head"
    if ranks > 1:
        return "FSDP2 over the ranks"
    return ""


def _head_fact(why: str) -> str:
    """The facts' line on the LM head of the loss's passes."""
    if not why:
        return f"LM head: fused (stage b), {P.CHUNK_TOKENS:,} positions at a time: no [tokens x vocabulary] logits"
    return f"LM head: the model's own (stage a: {why}), its logits kept for the backward"


def _ranks(cfg: Any, world: int) -> tuple[int, int, int]:
    """(dp, cp, tp) of the run's mesh over ``world`` ranks."""
    par = getattr(cfg, "parallel", None)
    tp, cp = (par.tp_size, par.cp_size) if par is not None else (1, 1)
    return max(1, world // (tp * cp)), cp, tp


def _type(device: Device) -> str:
    """The torch device type a plan's device is: cpu, or cuda (a local or a named GPU)."""
    return "cpu" if device.key == "cpu" else "cuda"


def _seconds(flops: float, device: Device) -> float | None:
    return flops / (device.tflops * 1e12) if device.tflops else None


def token_budget(setting: int | None, model: Model, device: Device, *, cpu: int, held: int = 0) -> int:
    """``max_tokens_per_micro`` as the run will take it (``models/budget.device_tokens``): the setting
    when given; null: ``cpu`` on a CPU, on a GPU ``budget.CUDA_TOKENS`` or what 60% of the memory free
    once the weights are in (the device's available less ``held`` bytes), less the optimizer state to
    come, holds at ``budget.bytes_per_token``, in steps of 1,024 and at least ``budget.MIN_TOKENS``."""
    if setting is not None:
        return setting
    if _type(device) == "cpu":
        return cpu
    from types import SimpleNamespace

    per = budget.bytes_per_token(SimpleNamespace(config=model.s.config()), checkpointing=model.ckpt)
    fit = int(0.6 * max(device.available - held - 12 * model.trainable, 0) / per)
    return max(budget.MIN_TOKENS, min(budget.CUDA_TOKENS, fit // 1024 * 1024))


def _causal(n: int) -> float:
    return n * (n + 1) / 2


def _facts(cfg: Any, model: Model, world: int) -> list[str]:
    m, s = cfg.model, model.s
    dp, cp, tp = _ranks(cfg, world)
    opts = [m.dtype, "lean activations" if model.lean else "no lean activations"]
    if model.compiled:
        opts.append("compiled layers (counted as without lean activations)")
    if m.gradient_checkpointing:
        opts.append("gradient checkpointing")
    if m.lora.enabled:
        opts.append(f"LoRA r {m.lora.r}")
    mesh = f", {world} ranks (dp {dp}, cp {cp}, tp {tp})" if world > 1 else ", 1 rank"
    return [f"model {m.path}: {s.model_type or 'decoder'}, {plan_table.count(s.params)} parameters "
            f"(d {s.d}, {s.layers} layers, {s.heads}/{s.kv_heads} heads, I {s.intermediate}, V {s.vocab:,}); "
            + ", ".join(opts) + mesh]


# --------------------------------------------------------------------------- sft, rm


def _eval_rows(cfg: Any) -> bool:
    d = cfg.data
    return bool(d.eval_path or d.eval_fraction > 0)


def plan_sft(cfg: Any, shape: P.Shape, device: Device, world: int = 1, *, pairs: bool = False) -> P.Plan:
    """SFT (``recipes/sft.py``): micro-batches of ``micro_batch_size`` rows of ``data.max_length``
    tokens (packed: one row; else padded), every position after each row's first scored; the
    held-out loss in padded batches of ``eval_batch_size`` rows. The reward model (``rm``) is the
    same with ``pairs`` (two rows each, padded) and a scalar head instead of the logits."""
    dp, cp, tp = _ranks(cfg, world)
    model = Model(cfg.model, shape, tp=tp, dp=dp * cp, device=_type(device))
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
    step_flops = 3 * model.flops(per_step * Lmax, per_step * (Lmax - 1) if lm else 0, per_step * _causal(Lmax))
    # the loss is a fixed weighted sum of log-probs: the fused head takes its gradients in the forward (sft._loss)
    fused = lm and model.fused()
    train = P.Stage("train", model.train_pass(tokens, positions, packed=packed, rope=rope, accum=accum, head=lm,
                                              fused=fused, weighted=True),
                    key="max_tokens_per_micro" if max_tokens else "micro_batch_size", seconds=_seconds(step_flops, device))
    stages = [train, P.Stage("optimizer", model.optimizer_step(), key="optim")]
    if _eval_rows(cfg):
        ev = cfg.eval_batch_size * per_row
        stages.append(P.Stage("eval", {**model.states(grads=False),
                                       "forward (no grad)": model.nograd_pass(ev * Lmax, ev * (Lmax - 1) if lm else 0,
                                                                              fused=fused)},
                              key="eval_batch_size"))
    budget_text = f"; budget {max_tokens:,}{' by device' if cfg.max_tokens_per_micro is None else ''}" if max_tokens else ""
    facts = _facts(cfg, model, world) + [
        f"largest micro-batch: {rows} rows x {Lmax} tokens = {tokens:,} tokens "
        f"({'packed' if packing else 'padded'}{budget_text}), logits at {positions:,} positions"
        + (f"; {passes} micro-batches per step" if accum else "")] + ([_head_fact(model.head_why)] if lm else [])
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
    dp, cp, tp = _ranks(cfg, world)
    model = Model(cfg.model, shape, tp=tp, dp=dp * cp, device=_type(device))
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
    step_flops = 3 * model.flops(per_step * per_pair, per_step * per_pair, per_step * 2 * _causal(Lmax))
    stages = []
    if ref and cfg.reference == "precompute":
        ev = cfg.eval_batch_size
        # before the first step: the policy scores the pairs, AdamW has no state yet
        stages.append(P.Stage("reference", {"weights": P.weight_bytes(model.weights, 1), **precompute,
                                            "forward (no grad)": model.nograd_pass(ev * per_pair, ev * per_pair, fused=fused)},
                              key="eval_batch_size"))
    stages.append(P.Stage("train", {**model.train_pass(tokens, positions, packed=packed, rope=tokens if packed else Lmax,
                                                       accum=accum, fused=fused), **online},
                          key="max_tokens_per_micro" if max_tokens else "micro_batch_size", seconds=_seconds(step_flops, device)))
    stages.append(P.Stage("optimizer", {**model.optimizer_step(), **online}, key="optim"))
    if _eval_rows(cfg):
        ev = cfg.eval_batch_size
        stages.append(P.Stage("eval", {**model.states(grads=False), **online,
                                       "forward (no grad)": model.nograd_pass(ev * per_pair, ev * per_pair, fused=fused)},
                              key="eval_batch_size"))
    budget_text = f"; budget {max_tokens:,}{' by device' if cfg.max_tokens_per_micro is None else ''}" if max_tokens else ""
    facts = _facts(cfg, model, world) + [
        f"largest micro-batch: {pairs} {'examples' if kto else 'pairs'} of up to {per_pair:,} tokens = {tokens:,} tokens "
        f"({'packed' if packed else 'padded'}{budget_text}), logits at {positions:,} positions"
        + (f"; {passes} micro-batches per step" if accum else ""),
        _head_fact(model.head_why or layout_why)]
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
                    seconds=_seconds(3 * updates * model.flops(mini.tokens * mini.passes, 0, 0), device)),
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
    dp, cp, tp = _ranks(cfg, world)
    model = Model(m, shape, tp=tp, dp=dp * cp, device=_type(device))
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
    pass_s = _seconds(model.flops(whole.tokens * whole.passes, whole.seqs * whole.passes * lay.R, 0), device)
    stages = [rollout] + [P.Stage(name, dict(nograd), key="max_tokens_per_micro", seconds=pass_s)
               for name, runs in (("reference", kl), ("old_logps", reuse)) if runs]
    if estimator_values:
        stages.append(P.Stage("values", {**keep, **asleep,
                                         "forward (no grad)": P.nograd_forward_bytes(shape, whole.tokens, 0, model.prec)},
                              key="max_tokens_per_micro",
                              seconds=_seconds(model.flops(whole.tokens * whole.passes, 0, 0), device)))
    updates = a.ppo_epochs * a.mini_batches
    upd_flops = 3 * updates * model.flops(mini.tokens * mini.passes, positions * mini.passes, 0)
    stages.append(P.Stage("update", {**model.train_pass(mini.tokens // cp, positions, packed=lay.pack,
                                                        rope=mini.tokens // cp if lay.pack else lay.size,
                                                        accum=mini.passes > 1, fused=fused, entropy=True,
                                                        entropy_grad=a.entropy_coef > 0, temperature=ro.temperature),
                                     **ref, **critic, **asleep},
                          key="max_tokens_per_micro" if not cfg.micro_batch_size else "micro_batch_size",
                          seconds=_seconds(upd_flops, device)))
    if estimator_values:
        stages += _critic_stages(model, {**keep, **asleep}, mini, lay, cp=cp, updates=updates, device=device)
    stages.append(P.Stage("optimizer", {**model.optimizer_step(), **ref, **critic, **asleep}, key="optim"))
    budget_text = f"{max_tokens:,}" if max_tokens else "none"
    facts = _facts(cfg, model, world) + [
        f"rollout: {cfg.prompts_per_step} prompts x {lay.n} samples, {rows} rows per engine call "
        f"({ro.engine}), prompts up to {lay.Pl} tokens, responses up to {lay.R}",
        f"largest update micro-batch: {mini.tokens:,} tokens ({mini.seqs} sequences, {lay.name}; budget "
        f"{budget_text}{' by device' if cfg.max_tokens_per_micro is None else ''}), logits at {positions:,} positions; "
        f"{mini.passes} pass{'es' if mini.passes > 1 else ''} per update, {updates} update{'s' if updates > 1 else ''} per step",
        _head_fact(model.head_why or lay.why)]
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
    return max(1, cfg.batch_size // _ranks(cfg, world)[0])


def _rl_tokens(cfg: Any, world: int) -> int:
    """The most tokens one rank's micro-batch can hold: its share of a mini-batch, every sequence at its budget."""
    ro = cfg.rollout
    seq = cfg.task.max_prompt_length + (ro.max_response_tokens or ro.max_new_tokens * max(1, ro.max_turns))
    return max(1, cfg.prompts_per_step * ro.n // cfg.algorithm.mini_batches // _ranks(cfg, world)[0]) * seq


def _rl_rows(cfg: Any, world: int) -> int:
    """The most sequences one rank's micro-batch can hold: its share of a mini-batch."""
    return max(1, cfg.prompts_per_step * cfg.rollout.n // cfg.algorithm.mini_batches // _ranks(cfg, world)[0])


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

