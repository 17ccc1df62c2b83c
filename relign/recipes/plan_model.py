"""A recipe's model in numbers, for its memory plan (``recipes/memory.py``): the shape read from
``config.json`` alone, the precision, the parameters (all, trainable, per rank), the options that
change what a pass keeps (lean activations, compile, checkpointing, LoRA, the LM head's stage), and
the helpers every planner shares (the mesh's ranks, the token budget, the step's seconds, the facts
line)."""

from __future__ import annotations

from typing import Any

from .. import plan as P
from .. import plan_table
from ..config import ConfigError
from ..devices import Device
from ..models import budget
from ..models.flops import ModelFlops
from ..models.loading import check_model_source, compile_enabled, from_pretrained_checked, resolve_model_path
from ..models.varlen import SUPPORTED


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


def head_fact(why: str) -> str:
    """The facts' line on the LM head of the loss's passes."""
    if not why:
        return f"LM head: fused (stage b), {P.CHUNK_TOKENS:,} positions at a time: no [tokens x vocabulary] logits"
    return f"LM head: the model's own (stage a: {why}), its logits kept for the backward"


def mesh_ranks(cfg: Any, world: int) -> tuple[int, int, int]:
    """(dp, cp, tp) of the run's mesh over ``world`` ranks."""
    par = getattr(cfg, "parallel", None)
    tp, cp = (par.tp_size, par.cp_size) if par is not None else (1, 1)
    return max(1, world // (tp * cp)), cp, tp


def device_type(device: Device) -> str:
    """The torch device type a plan's device is: cpu, or cuda (a local or a named GPU)."""
    return "cpu" if device.key == "cpu" else "cuda"


def step_seconds(flops: float, device: Device) -> float | None:
    return flops / (device.tflops * 1e12) if device.tflops else None


def token_budget(setting: int | None, model: Model, device: Device, *, cpu: int, held: int = 0) -> int:
    """``max_tokens_per_micro`` as the run will take it (``models/budget.device_tokens``): the setting
    when given; null: ``cpu`` on a CPU, on a GPU ``budget.CUDA_TOKENS`` or what 60% of the memory free
    once the weights are in (the device's available less ``held`` bytes), less the optimizer state to
    come, holds at ``budget.bytes_per_token``, in steps of 1,024 and at least ``budget.MIN_TOKENS``."""
    if setting is not None:
        return setting
    if device_type(device) == "cpu":
        return cpu
    from types import SimpleNamespace

    per = budget.bytes_per_token(SimpleNamespace(config=model.s.config()), checkpointing=model.ckpt)
    fit = int(0.6 * max(device.available - held - 12 * model.trainable, 0) / per)
    return max(budget.MIN_TOKENS, min(budget.CUDA_TOKENS, fit // 1024 * 1024))


def causal_pairs(n: int) -> float:
    return n * (n + 1) / 2


def model_facts(cfg: Any, model: Model, world: int) -> list[str]:
    m, s = cfg.model, model.s
    dp, cp, tp = mesh_ranks(cfg, world)
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
