"""A lean one-token decode step for Llama-family decoders (Llama, Qwen2, Qwen3), for the HF engine.

Why: on a small model the built-in engine's decode step is mostly overhead around the matrix
products. transformers' forward rebuilds a 4-D attention mask every token, runs each
projection as its own small matmul, and its CPU SDPA kernel spends ~0.6 ms per layer on a
single query row: in a profile of the GRPO bench's rollout (32 rows x 128 tokens, tiny
"small" Qwen2) SDPA was 32% and the matmuls 49% of the time. Here a decode step is

    h = embed(token)
    per layer:  x = RMSNorm(h);  q, k, v = x W_q^T, x W_k^T, x W_v^T (+ b);  RoPE(q, k) at each row's position
                K[:, :, col], V[:, :, col] <- k, v      (buffers allocated once, ``col`` a tensor on the device)
                h += softmax(q K^T * scale + mask) V  W_o^T
                x = RMSNorm(h);  h += (silu(x W_g^T) * x W_u^T) W_d^T
    logits = RMSNorm(h) W_lm^T

with the model's own modules for the norms and the rotary table, and a plain matmul attention
over the key/value buffers (grouped-query heads without repeating K/V). The prefill still runs
through the model's forward. The numbers equal the model's forward to float rounding (the
engine's log-probs are tested against the trainer's).

**Static shapes (issue 46, for CUDA graphs).** Nothing in ``step`` reads a value back to the
host: the column it writes, the positions and the mask come from tensors on the device, so the
same step can be captured once in a CUDA graph and replayed for every token (``DecodePlan``).
It attends over ``span`` columns of the buffers: on the CPU the filled part (``span`` grows by
one per token, as the cache did), under a graph the whole capacity, the unwritten columns masked.

**Weights** (``Weights``): the products run on copies of the projection weights,
[W_q; W_k; W_v]^T, W_o^T, [W_g; W_u]^T, W_d^T and W_lm^T, transposed to [in, out] and contiguous,
in the dtype the model computes in, written with ``copy_`` from the model's parameters at the
start of every ``generate`` call. On a 2-core CPU, at the GRPO bench's 32 rows, the fused and
transposed products made the rollout 4-5% faster with the same tokens (BENCHMARKS.md, HF engine).
They are refreshed at every call because an engine that shares the trainer's module must sample
from the weights of the last update, and an in-place fused AdamW step does not bump a
parameter's version counter, so no cache keyed on versions could tell they went stale. On the
CPU the copies live for one call (the linear weights' bytes again while it runs; the RL loop has
freed the gradients, the same bytes, by then). Where steps are captured in graphs (CUDA) the
buffers are kept across calls and only rewritten, so their addresses, and the graphs that read
them, survive the training steps between rollouts.

**LoRA** (peft's ``lora.Linear``): the copy of an adapted projection is its base weight plus
peft's ``get_delta_weight`` of each active adapter (s * B A), summed beside the model: the
engine decodes at the full model's speed, and the trainer's weights are never merged and
unmerged (W + dW - dW is not W in floating point, and would drift at every rollout). Variants
whose forward is not a plain sum (DoRA and others) are refused in one line (``lora_refusal``).

A model this does not cover (another architecture, quantized layers, sliding-window attention)
keeps the model's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.flops import device_peak
from ..models.precision import autocast_of, compute_dtype

ARCHITECTURES = ("llama", "qwen2", "qwen3")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def base_model(model):
    """The transformers model inside a peft wrapper (or ``model`` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _is_lora(x) -> bool:
    """A peft LoRA layer around a plain ``nn.Linear`` (checked by its attributes: no peft import needed)."""
    return hasattr(x, "lora_A") and hasattr(x, "get_delta_weight") and type(getattr(x, "base_layer", None)) is torch.nn.Linear


def _active(layer) -> list[str]:
    """The adapters whose delta the layer's forward adds now (none when disabled or already merged)."""
    if layer.disable_adapters or layer.merged:
        return []
    return [a for a in layer.active_adapters if a in layer.lora_A]


def lora_refusal(model) -> str | None:
    """One line naming the key to change, when a LoRA adapter's forward is not W + s·B·A (DoRA and
    the other peft variants): the decode step could only sample from a wrong merged copy."""
    for name, m in base_model(model).named_modules():
        if not hasattr(m, "lora_A"):
            continue
        for a in getattr(m, "active_adapters", []):
            variant = getattr(m, "lora_variant", {}).get(a)
            if variant is not None or getattr(m, "use_dora", {}).get(a):
                kind = "DoRA" if getattr(m, "use_dora", {}).get(a) else type(variant).__name__
                return (f"rollout.fast_decode: adapter {a!r} on {name} is a {kind} variant, which the decode step's merged "
                        "copies (W + s·B·A) cannot hold: set rollout.fast_decode=false (fast_decode=False) to sample "
                        "through peft's forward")
    return None


def unsupported_reason(model) -> str | None:
    """None if ``model`` (a transformers model, or peft's wrapper of one) can use this decode step,
    else why not (for a debug message)."""
    base = base_model(model)
    cfg = getattr(base, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in ARCHITECTURES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {ARCHITECTURES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window layers"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    inner = getattr(base, "model", None)
    head = getattr(base, "lm_head", None)
    if inner is None or type(head) is not torch.nn.Linear or not hasattr(inner, "rotary_emb"):
        return "not a <Model>ForCausalLM with model.layers and a plain lm_head"
    if type(inner.embed_tokens) is not torch.nn.Embedding:
        return "the input embedding is not a plain nn.Embedding"
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        if any(type(x) is not torch.nn.Linear and not _is_lora(x) for x in linears):
            return "a projection is neither a plain nn.Linear nor a LoRA layer around one (quantized?)"
        if any(_is_lora(x) and getattr(x, "fan_in_fan_out", False) for x in linears):
            return "a LoRA layer with fan_in_fan_out"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [a.q_norm, a.k_norm] if hasattr(a, "q_norm") else []
        if any(not type(x).__name__.endswith("RMSNorm") or not hasattr(x, "variance_epsilon") for x in norms):
            return "a norm that is not Llama's RMSNorm"
        if len({x.variance_epsilon for x in norms}) > 1:
            return "RMSNorms with different eps"
        if _bias(m.gate_proj) is not None or _bias(m.up_proj) is not None:
            return "MLP biases"
        if (_bias(a.q_proj) is None) != (_bias(a.k_proj) is None) or (_bias(a.q_proj) is None) != (_bias(a.v_proj) is None):
            return "mixed q/k/v biases"
    return None


def _bias(linear) -> torch.Tensor | None:
    return (linear.base_layer if _is_lora(linear) else linear).bias


def effective_weight(linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W [out, in], b or None) that ``linear``'s forward applies: a plain layer's parameters, or a
    LoRA layer's base weight + ``get_delta_weight`` of each active adapter (and s * the bias of
    lora_B under ``lora_bias``), computed beside the layer, which is left as it was."""
    if not _is_lora(linear):
        return linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    base = linear.base_layer
    w, b = base.weight.detach(), None if base.bias is None else base.bias.detach()
    for a in _active(linear):
        w = w + linear.get_delta_weight(a).to(w.dtype)
        if getattr(linear, "lora_bias", {}).get(a):
            b = b + linear.lora_B[a].bias.detach().to(b.dtype) * linear.scaling[a]
    return w, b


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Weights:
    """The decode step's copies of a model's projections (see the module docstring): per layer the
    (weight [in, out], bias or None) pairs of qkv, o, gate-up and down; and the head's. Allocated
    once; ``refresh`` rewrites them in place from the model's current parameters."""

    def __init__(self, model, *, refresh: bool = True):
        base = base_model(model)
        self.dtype = compute_dtype(model)
        self.groups: list[tuple[torch.Tensor, torch.Tensor | None, list]] = []  # (W^T buffer, b buffer, linears)

        def fused(*linears) -> tuple[torch.Tensor, torch.Tensor | None]:
            ref = (linears[0].base_layer if _is_lora(linears[0]) else linears[0]).weight
            out = sum((x.base_layer if _is_lora(x) else x).weight.shape[0] for x in linears)
            w = torch.empty(ref.shape[1], out, dtype=self.dtype, device=ref.device)
            b = None if _bias(linears[0]) is None else torch.empty(out, dtype=self.dtype, device=ref.device)
            self.groups.append((w, b, list(linears)))
            return w, b

        self.layers = []
        for layer in base.model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((fused(a.q_proj, a.k_proj, a.v_proj), fused(a.o_proj), fused(m.gate_proj, m.up_proj),
                                fused(m.down_proj)))
        self.lm = fused(base.lm_head)
        if refresh:
            self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Write the model's current weights (LoRA merged beside it) into the buffers, in place."""
        for w_buf, b_buf, linears in self.groups:
            col = 0
            for x in linears:
                w, b = effective_weight(x)
                w_buf[:, col : col + w.shape[0]].copy_(w.t())
                if b_buf is not None:
                    b_buf[col : col + w.shape[0]].copy_(b)
                col += w.shape[0]

    def nbytes(self) -> int:
        """Bytes one decode step reads from the copies (every weight once)."""
        return sum(t.numel() * t.element_size() for w, b, _ in self.groups for t in (w, b) if t is not None)

    def tensors(self) -> list[torch.Tensor]:
        return [t for w, b, _ in self.groups for t in (w, b) if t is not None]


def _linear(x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    w, b = wb
    return x @ w if b is None else torch.addmm(b, x, w)


class StaticKV:
    """Key/value buffers [R, Hkv, L, D] per layer, allocated once, written at the device column ``col``.

    ``prompt_ok`` [R, L] marks the columns a row may attend to apart from the generated ones (its
    prompt without the left padding; True from the first generated column on); a step attends to
    column c when ``prompt_ok[r, c]`` and ``c <= col``. ``col`` [1] is the column the next step
    writes (every row writes the same column: prompts are left-padded to a common length)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], prompt_ok: torch.Tensor, col: torch.Tensor):
        self.k, self.v, self.prompt_ok, self.col = k, v, prompt_ok, col
        self.cols = torch.arange(prompt_ok.shape[1], device=prompt_ok.device)  # [L]

    @classmethod
    def empty(cls, layers: int, R: int, Hkv: int, L: int, D: int, dtype, device) -> StaticKV:
        z = lambda: torch.zeros(R, Hkv, L, D, dtype=dtype, device=device)  # noqa: E731  (finite: masked columns read 0)
        return cls([z() for _ in range(layers)], [z() for _ in range(layers)],
                   torch.zeros(R, L, dtype=torch.bool, device=device), torch.zeros(1, dtype=torch.long, device=device))

    @property
    def rows(self) -> int:
        return self.prompt_ok.shape[0]

    @property
    def capacity(self) -> int:
        return self.prompt_ok.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.k, *self.v, self.prompt_ok, self.col, self.cols]

    def fill(self, keys: list[torch.Tensor], values: list[torch.Tensor], rows: torch.Tensor, prompt_ok: torch.Tensor) -> None:
        """Start a call in these (kept) buffers: row i takes the prefill's keys and values [P, Hkv, >= Lp, D]
        of prompt ``rows[i]``, ``prompt_ok`` [R, Lp] its mask; the columns after the prompt are zeroed
        (masked, but read: a NaN left in them by an earlier call would spread through 0 * NaN)."""
        Lp = prompt_ok.shape[1]
        for dst, src in zip([*self.k, *self.v], [*keys, *values]):
            dst[:, :, :Lp].copy_(src[:, :, :Lp].index_select(0, rows))
            dst[:, :, Lp:].zero_()
        self.prompt_ok[:, :Lp].copy_(prompt_ok)
        self.prompt_ok[:, Lp:] = True
        self.col.fill_(Lp)

    def select(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (new tensors: the eager path)."""
        self.k = [x.index_select(0, keep) for x in self.k]
        self.v = [x.index_select(0, keep) for x in self.v]
        self.prompt_ok = self.prompt_ok.index_select(0, keep)

    def copy_rows(self, src: StaticKV, keep: torch.Tensor) -> None:
        """Rows ``keep`` of ``src`` (of the same capacity) into this one's ``len(keep)`` rows, in place:
        the buffers a captured step reads keep their addresses."""
        for d, s in zip([*self.k, *self.v], [*src.k, *src.v]):
            torch.index_select(s, 0, keep, out=d)
        torch.index_select(src.prompt_ok, 0, keep, out=self.prompt_ok)
        self.col.copy_(src.col)


class FastDecoder:
    """``step(tokens, positions, kv, weights, span) -> logits`` for one new token per row."""

    def __init__(self, model):
        self.model = model
        base = base_model(model)
        self.inner = base.model
        cfg = base.config
        self.H = cfg.num_attention_heads
        self.Hkv = getattr(cfg, "num_key_value_heads", None) or self.H
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.layers = len(self.inner.layers)
        self.eps = self.inner.layers[0].input_layernorm.variance_epsilon
        # dynamic and long RoPE read the longest position back to the host and may swap their
        # frequency table for a new tensor: a captured graph can hold neither
        rope = str(getattr(self.inner.rotary_emb, "rope_type", "default"))
        self.capturable = "dynamic" not in rope and rope != "longrope"
        self.layer_fn = decoder_layer  # or torch.compile(decoder_layer): ``compile_layers``

    def compile_layers(self) -> None:
        """Compile the decoder layer once for every layer (``DecodePlan.capture='compile'``): shapes are
        fixed within a bucket, and the layers differ only in the tensors they are given."""
        self.layer_fn = torch.compile(decoder_layer, fullgraph=True, dynamic=False)

    def weights(self) -> Weights:
        """Fresh copies of the model's weights (made after the last update)."""
        return Weights(self.model)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, kv: StaticKV, weights: Weights, span: int, *,
             filled: bool = False) -> torch.Tensor:
        """tokens, positions [R]; ``kv``: the rows' key/value buffers, written at ``kv.col``, which
        then moves on by one; attention over columns [0, span) of them. Returns the next-token
        logits [R, V]. Reads nothing back to the host (a CUDA graph can hold it). ``filled``: the
        span ends at the written column (the eager path), so the host knows it is ``span - 1``."""
        with autocast_of(self.model):  # model.dtype=bf16-mixed: compute as the model's forward does
            logits = self._step(tokens, positions, kv, weights, span, span - 1 if filled else None)
        kv.col.add_(1)
        return logits

    def _step(self, tokens, positions, kv: StaticKV, weights: Weights, span: int, at: int | None) -> torch.Tensor:
        h = self.inner.embed_tokens(tokens)  # [R, hidden]
        cos, sin = self.inner.rotary_emb(h, positions[:, None])  # [R, 1, D]
        allowed = kv.prompt_ok[:, :span] & (kv.cols[:span] <= kv.col)  # [R, span]
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=h.device).masked_fill_(~allowed, float("-inf"))
        bias = bias[:, None, None, :].to(h.dtype)  # [R, 1, 1, span]
        for layer, K_buf, V_buf, (qkv, o_proj, gate_up, down) in zip(self.inner.layers, kv.k, kv.v, weights.layers):
            a = layer.self_attn
            qk_norm = (a.q_norm.weight, a.k_norm.weight) if hasattr(a, "q_norm") else (None, None)  # Qwen3
            h = self.layer_fn(h, cos, sin, bias, kv.col, K_buf, V_buf, layer.input_layernorm.weight,
                              layer.post_attention_layernorm.weight, *qk_norm, *qkv, *o_proj, *gate_up, down[0], down[1],
                              eps=self.eps, scaling=a.scaling, heads=(self.H, self.Hkv, self.D), span=span, at=at)
        return _linear(self.inner.norm(h), weights.lm)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps), the variance in fp32: Llama's, Qwen2's and Qwen3's RMSNorm, op for op."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def decoder_layer(h, cos, sin, bias, col, K_buf, V_buf, norm1, norm2, q_norm, k_norm, qkv_w, qkv_b, o_w, o_b, gu_w, gu_b,
                  d_w, d_b, *, eps: float, scaling: float, heads: tuple[int, int, int], span: int,
                  at: int | None = None) -> torch.Tensor:
    """One decoder layer of the decode step on one token per row (the module docstring's per-layer
    lines), a pure function of tensors: ``torch.compile`` traces it once and serves every layer.
    The key and value go to column ``col`` (a tensor), or ``at`` where the host knows it (eager)."""
    H, Hkv, D = heads
    R, g = h.shape[0], H // Hkv
    x = rms_norm(h, norm1, eps)
    q, k, v = _linear(x, (qkv_w, qkv_b)).split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.reshape(R, H, D), k.reshape(R, Hkv, D), v.reshape(R, Hkv, D)
    if q_norm is not None:  # Qwen3: RMSNorm per head before RoPE
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    # under bf16-mixed the buffers hold bf16 (attention casts to bf16 anyway), as the prefill's cache does
    if at is None:
        K_buf.index_copy_(2, col, k[:, :, None].to(K_buf.dtype))
        V_buf.index_copy_(2, col, v[:, :, None].to(V_buf.dtype))
    else:  # a slice write: on a CPU half index_copy_'s time into a cold buffer of 256 rows (38 against 70 us)
        K_buf[:, :, at : at + 1] = k[:, :, None].to(K_buf.dtype)
        V_buf[:, :, at : at + 1] = v[:, :, None].to(V_buf.dtype)
    K, V = K_buf[:, :, :span], V_buf[:, :, :span]  # [R, Hkv, span, D]
    scores = torch.matmul(q.view(R, Hkv, g, D), K.transpose(-1, -2)) * scaling + bias  # [R, Hkv, g, span]
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.matmul(p, V).reshape(R, H * D)
    h = h + _linear(o, (o_w, o_b))
    x = rms_norm(h, norm2, eps)
    gate, up = _linear(x, (gu_w, gu_b)).chunk(2, dim=-1)
    return h + _linear(F.silu(gate) * up, (d_w, d_b))


# --------------------------------------------------------------------------- the plan of a decode


@dataclass(frozen=True)
class DecodePlan:
    """How the HF engine runs its decode loop (``DecodePlan.for_device``).

    ``static``: rows in buckets and attention over the buffers' whole capacity, so every step of
    a bucket has the same shapes (what a graph needs); the buffers and weight copies are kept
    across calls. ``capture``: ``none`` (eager), ``graph`` (a ``torch.cuda.CUDAGraph`` of the eager
    step), ``compile`` (the decoder layer compiled once for all layers, fullgraph, the step captured
    in such a graph) or ``reduce-overhead`` (the whole step under ``torch.compile``'s own CUDA
    graphs). ``read_every``: the host reads the
    sampled tokens (and checks stops, compacts, stops early) every k steps, its only reads.
    ``row_buckets``: the row counts a chunk runs at (None: exactly its live rows).
    ``length_bucket``: the buffers' capacity is rounded up to a multiple of it."""

    static: bool = False
    capture: str = "none"
    read_every: int = 1
    row_buckets: tuple[int, ...] | None = None
    length_bucket: int = 1

    CAPTURES = ("none", "graph", "compile", "reduce-overhead")

    def __post_init__(self):
        if self.capture not in self.CAPTURES:
            raise ValueError(f"DecodePlan.capture: {self.capture!r}; choose one of {', '.join(self.CAPTURES)}")
        if self.capture != "none" and not self.static:
            raise ValueError("DecodePlan: a captured step needs static=True (fixed shapes)")
        if self.read_every < 1 or self.length_bucket < 1:
            raise ValueError("DecodePlan: read_every and length_bucket must be >= 1")

    @staticmethod
    def for_device(device: torch.device | str) -> DecodePlan:
        """CUDA: static shapes in a CUDA graph of the eager step, a host read every 16 steps. CPU:
        the eager step over the filled part of the buffers, exactly the live rows, the host reading
        every step (a read costs nothing there, and finished rows leave at once)."""
        if torch.device(device).type == "cuda":
            return DecodePlan(static=True, capture="graph", read_every=16, row_buckets=(8, 16, 32, 64, 128, 256),
                              length_bucket=256)
        return DecodePlan()

    def bucket(self, rows: int) -> int:
        """The row count a chunk of ``rows`` live rows runs at."""
        if self.row_buckets is None:
            return rows
        for b in self.row_buckets:
            if b >= rows:
                return b
        top = self.row_buckets[-1]
        return -(-rows // top) * top

    def capacity(self, length: int) -> int:
        return -(-length // self.length_bucket) * self.length_bucket


# --------------------------------------------------------------------------- the roofline

def device_peaks(name: str) -> tuple[float, float] | None:
    """(FLOP/s, bytes/s) of a GPU by its name (``models.flops.PEAKS``: dense bf16, HBM), None when unknown."""
    tflops, tbs = device_peak(name)
    return (tflops * 1e12, tbs * 1e12) if tflops and tbs else None


def roofline_seconds(*, rows: int, context: int, weight_bytes: int, weight_params: int, kv_bytes_per_token: int,
                     attn_flops_per_token: int, flops_per_s: float, bytes_per_s: float) -> float:
    """The least time one decode step can take: max(bytes / bandwidth, FLOPs / peak). It reads every
    weight once and the ``context`` cached tokens of all rows (their sum); it computes 2 FLOPs per
    weight per row and the attention's 4 * heads * head_dim per cached token per layer (``attn_flops_per_token``)."""
    bytes_ = weight_bytes + context * kv_bytes_per_token
    flops = 2 * weight_params * rows + context * attn_flops_per_token
    return max(bytes_ / bytes_per_s, flops / flops_per_s)
