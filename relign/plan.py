"""What a training step needs, in bytes and seconds, before anything loads (``relign plan``, ``--dry-run``,
the refusal at the start of a run; docs/plan.md).

Pure arithmetic on a model's shape (``Shape``, read from its config) and the run's numbers. Each term
is a small function whose docstring gives its formula and the code it models; ``recipes/memory.py``
adds them up stage by stage for each recipe, ``Plan`` holds the result and ``format_plan`` prints it.
Symbols: d hidden, L layers, H query heads, H_kv key/value heads, D head dim, I MLP width, V
vocabulary, T tokens of a forward pass (as computed: a shared prompt once), K positions whose logits
the loss keeps, N parameters, N_t trainable parameters, b bytes per element (p: of the weights, c: of
the compute dtype).

The terms model the code as it is. When that code changes (the log-prob path, the micro-batch
sizes, the decode buffers), the term changes with it; docs/plan.md names the code behind each.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .devices import Device
from .dtypes import DTYPES
from .errors import ConfigError

_BYTES = {"float32": 4, "bfloat16": 2}  # a torch dtype's name -> its bytes

CHUNK_TOKENS = 4096  # models/logprobs.DEFAULT_CHUNK_TOKENS: the log-softmax runs this many positions at a time

# --------------------------------------------------------------------------- the model's shape


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes, read from its Hugging Face config (Llama, Qwen2/3, Mistral and alike)."""

    d: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    model_type: str = ""

    @classmethod
    def of(cls, config: Any) -> Shape:
        """From a transformers config (or anything with its attribute names)."""
        get = (lambda k, default=None: config.get(k, default)) if isinstance(config, dict) else \
            (lambda k, default=None: getattr(config, k, default))
        heads = get("num_attention_heads")
        model_type = get("model_type", "") or ""
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
                   if not isinstance(get(k), int)]
        if missing:
            raise ConfigError(f"relign plan reads decoder configs (Llama, Qwen2/3, Mistral, ...): this {model_type or 'model'} "
                              f"config has no {', '.join(missing)}")
        return cls(d=get("hidden_size"), layers=get("num_hidden_layers"), heads=heads,
                   kv_heads=get("num_key_value_heads") or heads, head_dim=get("head_dim") or get("hidden_size") // heads,
                   intermediate=get("intermediate_size"), vocab=get("vocab_size"),
                   tied=bool(get("tie_word_embeddings", True)),
                   qkv_bias=model_type == "qwen2" or bool(get("attention_bias", False)),
                   qk_norm=model_type == "qwen3", model_type=model_type)

    @property
    def q_width(self) -> int:
        """H D: the width of the queries (and of attention's output)."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """H_kv D: the width of the keys (and of the values)."""
        return self.kv_heads * self.head_dim

    @property
    def attention_linear(self) -> int:
        """Weights of one layer's q, k, v, o projections: d (H D + 2 H_kv D) + H D d."""
        return self.d * (self.q_width + 2 * self.kv_width) + self.q_width * self.d

    @property
    def mlp_linear(self) -> int:
        """Weights of one layer's gate, up and down projections: 3 d I."""
        return 3 * self.d * self.intermediate

    @property
    def layer_params(self) -> int:
        """One decoder layer: its linear weights, the q/k/v biases (Qwen2), two norms (and Qwen3's q/k norms)."""
        bias = self.q_width + 2 * self.kv_width if self.qkv_bias else 0
        return self.attention_linear + self.mlp_linear + bias + 2 * self.d + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def embedding(self) -> int:
        return self.vocab * self.d

    @property
    def params(self) -> int:
        """N = V d (embeddings) + L x layer + d (final norm) + V d when the LM head is not tied."""
        return self.embedding * (1 if self.tied else 2) + self.layers * self.layer_params + self.d

    @property
    def linear_params(self) -> int:
        """Every linear weight a forward multiplies by: L (attention + MLP) + V d (the LM head)."""
        return self.layers * (self.attention_linear + self.mlp_linear) + self.embedding

    def config(self) -> Any:
        """The shape under transformers' attribute names (what ``models/flops.ModelFlops`` reads)."""
        from types import SimpleNamespace

        return SimpleNamespace(hidden_size=self.d, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                               num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                               intermediate_size=self.intermediate, vocab_size=self.vocab)

    def lora_params(self, r: int, targets: list[str] | str) -> int:
        """A LoRA adapter's trainable weights: r (in + out) per adapted linear (``all-linear``: every
        projection of every layer, not the LM head)."""
        shapes = {"q_proj": (self.d, self.q_width), "k_proj": (self.d, self.kv_width), "v_proj": (self.d, self.kv_width),
                  "o_proj": (self.q_width, self.d), "gate_proj": (self.d, self.intermediate),
                  "up_proj": (self.d, self.intermediate), "down_proj": (self.intermediate, self.d)}
        names = list(shapes) if targets in ("all-linear", ["all-linear"]) else [t for t in targets if t in shapes]
        return self.layers * sum(r * sum(shapes[n]) for n in names)


# --------------------------------------------------------------------------- precision


@dataclass(frozen=True)
class Precision:
    """``model.dtype`` as bytes: of the weights (and gradients, AdamW's moments), and of the compute."""

    name: str
    param: int
    compute: int
    mode: str = ""
    """The row's compute mode (``dtypes.DTYPES``): "", "autocast" or "cast"."""

    @property
    def mixed(self) -> bool:
        """bf16-mixed: fp32 weights, bf16 products under autocast (the residual stream and norms fp32)."""
        return self.mode == "autocast"

    @property
    def cast(self) -> bool:
        """bf16-compute: fp32 weights, the forward on bf16 copies of all of them, everything in bf16."""
        return self.mode == "cast"

    @property
    def activation(self) -> int:
        """The bytes of the activations' dtype where the residual stream runs: 4 (fp32, bf16-mixed), 2."""
        return 4 if self.mixed else self.compute

    @classmethod
    def of(cls, dtype: str) -> Precision:
        """``model.dtype``'s bytes (``models/precision.py``)."""
        if dtype in DTYPES:
            row = DTYPES[dtype]
            return cls(dtype, _BYTES[row.param], _BYTES[row.compute], row.mode)
        raise ConfigError(f"bad value for 'model.dtype': {dtype!r}; choose one of fp32, bf16, bf16-mixed, bf16-compute")


# --------------------------------------------------------------------------- terms: model states


def weight_bytes(params: int, p: int) -> int:
    """The weights: N x b_p (fp32 under fp32 and bf16-mixed, bf16 under bf16)."""
    return params * p


def grad_bytes(trainable: int, p: int) -> int:
    """The gradients, from a step's first backward to ``zero_grad(set_to_none=True)`` after its
    optimizer step: N_t x b_p (autograd accumulates them in the weights' dtype)."""
    return trainable * p


def adamw_bytes(trainable: int, p: int) -> int:
    """AdamW's state (``optim.build_optimizer``, torch's AdamW): exp_avg and exp_avg_sq like each
    trainable weight, 2 N_t b_p (2 x fp32 under fp32 and bf16-mixed), from the first step on."""
    return 2 * trainable * p


def weight_copy_bytes(s: Shape, prec: Precision, *, lean: bool, layers: int | None = None, tp: int = 1,
                      head: bool = True) -> int:
    """The bf16 copies of fp32 weights that a forward makes and autograd keeps for the backward
    (``models/precision.py``). bf16-mixed: autocast's weight cache, 2 x (L x the attention projections
    + V d for the LM head), and L x 3 d I more without lean activations (the lean SwiGLU keeps the
    fp32 MLP weights and casts in its backward). bf16-compute: the cast copy of every weight,
    2 x (L x (attention + MLP + 2 d) + V d) (the norms' weights too, a few d). ``layers``: how many
    layers hold their copies at once (L; 1 under gradient checkpointing, whose layers run again one at
    a time). Tensor parallel: each rank casts its 1/tp of the layers' projections, the head whole.
    ``head=False`` (stage b, the fused LM head): the model's own head does not run, so no copy of its
    weight is kept (the fused head casts its own in each pass, ``fused_head_bytes``; an embedding
    lookup keeps no copy of its table): no V d."""
    n = s.layers if layers is None else layers
    vd = s.embedding if head else 0
    if prec.cast:
        return prec.compute * (n * (s.attention_linear + s.mlp_linear) // tp + n * 2 * s.d + vd)
    if not prec.mixed:
        return 0
    per_layer = s.attention_linear + (0 if lean else s.mlp_linear)
    return prec.compute * (n * per_layer // tp + vd)


def embedding_grad_bytes(s: Shape, p: int, *, accumulating: bool, head: bool = True, in_place: bool = False,
                         upcast: bool = False) -> int:
    """The end of a backward, past the loss's head: the embedding matrix's gradients beside the
    others (whose ``.grad``, the embedding's included, ``grad_bytes`` counts). Tied to the LM head,
    the head's weight gradient (V d) and the embedding's (a dense V d: ``EmbeddingBackward``) are
    summed before they join ``.grad``. Where the head's arrives as a tensor of its own (``in_place``:
    the fused head's dW, stage b; autocast's cast back to fp32 under bf16-mixed) the sum goes into
    it, which then becomes ``.grad``: V d b_p beyond it, 2 V d b_p when ``.grad`` already holds an
    earlier micro-batch's. Where it is a transposed product (stage a in fp32 or bf16) the sum is a
    new tensor: 2 V d b_p, and 3 V d b_p when accumulating. ``upcast`` (bf16-compute on stage b):
    the embedding's comes from its bf16 copy and is cast up, 2 V d more. (Measured on the allocator,
    tests/test_plan.py.) Untied, or a model without the head (a critic): the embedding's alone,
    V d b_p."""
    if not (head and s.tied):
        return s.embedding * p
    if in_place:
        return (2 if accumulating else 1) * s.embedding * p + (2 * s.embedding if upcast else 0)
    return (3 if accumulating else 2) * s.embedding * p


def grad_norm_bytes(largest: int) -> int:
    """The optimizer step's transient beyond the states: ``optim.clip_gradients`` takes each
    gradient's norm in float64, one tensor at a time, through a float64 copy of it: 8 x the largest
    trainable tensor's elements (the embedding's V d, usually)."""
    return 8 * largest


# --------------------------------------------------------------------------- terms: activations


def layer_saved_bytes(s: Shape, tokens: int, prec: Precision, *, lean: bool = True, packed: bool = False,
                      tp: int = 1) -> int:
    """What one decoder layer keeps for its backward over ``tokens`` tokens (counted on the Qwen2 /
    Llama layer with ``saved_tensors_hooks``: tests/test_plan.py), per token:

    * fp32 (b = 4): b (4 d + 2 H D + 2 H_kv D + 2 I) + 4 H + 8 with lean activations: the layer's
      input and the residual after attention (each norm's input), the normalized input of q/k/v and
      of the MLP; the rotated queries and attention's output; keys and values; the MLP's g and u
      (``models/lean.py``); attention's log-sum-exp; the two norms' 1/rms. Without lean: b (6 d +
      2 H D + 2 H_kv D + 4 I) + 4 H + 8 (each norm keeps its normalized x, the MLP silu(g) and
      silu(g) u); in general (8 + 4 b) d + b (2 H D + 2 H_kv D + 4 I) + 4 H + 8, as each norm keeps
      its input upcast to fp32.
    * bf16-mixed, lean: 4 x 3 d (the residual stream and the MLP's input stay fp32) + 2 (3 d +
      2 H D + 2 H_kv D) (the three casts of the normalized input for q, k and v, the queries,
      attention's output, keys, values) + 2 x 2 I + 4 H + 8. Without lean: 4 x 4 d + 2 (5 d +
      2 H D + 2 H_kv D + 4 I) + 4 H + 8.
    * bf16 and bf16-compute (everything in bf16): the fp32 count with b = 2 (the log-sum-exp and
      1/rms stay fp32).
    * packed rows (``models/varlen.py``: one attention call per sequence): + b_c H D, each
      sequence's attention output kept apart from their concatenation.

    Here d is the model width and H D the query width (equal for most models), as in the table of
    docs/plan.md. Tensor parallel (``models/tp.py``): a rank holds 1/tp of the heads and of the MLP
    width, so H, H D, H_kv D and I are divided by tp; the residual stream stays whole."""
    d, q, kv, i, h = s.d, s.q_width // tp, s.kv_width // tp, s.intermediate // tp, s.heads // tp
    if prec.mixed:
        if lean:
            per = 4 * 3 * d + 2 * (3 * d + 2 * q + 2 * kv) + 2 * 2 * i
        else:
            per = 4 * 4 * d + 2 * (5 * d + 2 * q + 2 * kv + 4 * i)
    else:
        b = prec.compute
        # without lean, each norm keeps its input upcast to fp32 (4 d: x itself in fp32) and its normalized
        # output in x's dtype (b d), beside the projections' normalized inputs
        per = b * (4 * d + 2 * q + 2 * kv + 2 * i) if lean else (8 + 4 * b) * d + b * (2 * q + 2 * kv + 4 * i)
    per += 4 * h + 8
    if packed:
        per += prec.compute * q
    return per * tokens


def position_bytes(s: Shape, positions: int) -> int:
    """The rotary table of a forward, computed once and kept by every layer: cos and sin, 2 x 4 D per
    position (fp32; one position per token of a packed row, one per column of padded rows)."""
    return 8 * s.head_dim * positions


def head_input_bytes(s: Shape, tokens: int, positions: int, prec: Precision, *, fused: bool = False) -> int:
    """Kept around the LM head: the final norm's input and 1/rms (b d + 4 per token, b the residual
    stream's: 4 under fp32 and bf16-mixed) and the normalized hidden states of the kept positions the
    head multiplies (b_c d per kept position; as fp32 too under bf16-mixed on stage a: the norm's
    output before autocast's cast). Stage b (``fused``) keeps b_c d per position: the h its
    backward recomputes the logits from, or (SFT) the gradient dh it took in the forward."""
    kept = prec.compute + (4 if prec.mixed and not fused else 0)
    return (prec.activation * s.d + 4) * tokens + kept * s.d * positions


def activation_bytes(s: Shape, tokens: int, positions: int, prec: Precision, *, lean: bool = True,
                     checkpointing: bool = False, packed: bool = False, rope_positions: int | None = None,
                     tp: int = 1, fused: bool = False) -> int:
    """Everything a training forward of ``tokens`` tokens keeps for its backward but the logits:
    L x ``layer_saved_bytes`` + ``position_bytes`` + ``head_input_bytes``.

    With gradient checkpointing (``model.gradient_checkpointing``: transformers' per-layer
    checkpoints, non-reentrant) each layer keeps only its input, L x 4 d T (the fp32 residual stream;
    2 d T under bf16), and the backward recomputes one layer at a time: + one ``layer_saved_bytes``."""
    one = layer_saved_bytes(s, tokens, prec, lean=lean, packed=packed, tp=tp)
    layers = s.layers * prec.activation * s.d * tokens + one if checkpointing else s.layers * one
    return layers + position_bytes(s, tokens if rope_positions is None else rope_positions) + \
        head_input_bytes(s, tokens, positions, prec, fused=fused)


def _chunks(positions: int, chunk: int) -> tuple[int, int]:
    """(c, c_2) of K positions cut in chunks of ``chunk``: the first chunk's size, and the size of
    the chunk that runs while a full chunk's result is still held (the second; c_2 = 0 for one chunk)."""
    c = min(positions, chunk)
    n = math.ceil(positions / chunk)
    return c, (0 if n == 1 else c if n > 2 else positions - c)


def _scaled(prec: Precision, temperature: float) -> int:
    """u: the bytes per element of a chunk's fp32 z = x / T when it is a new tensor (bf16 logits, or T != 1), else 0."""
    return 4 if prec.compute != 4 or temperature != 1.0 else 0


def logits_bytes(positions: int, vocab: int, *, grad: bool = True, prec: Precision | None = None,
                 chunk: int = CHUNK_TOKENS, entropy: bool = False, entropy_grad: bool = False,
                 temperature: float = 1.0, adapted: bool = False) -> int:
    """Stage a: the model's own logits through ``models/fused_ce.LogSoftmaxGather`` (the shared-prefix
    layout, context parallel, FSDP2, other architectures, an adapted LM head), at their peak. K
    positions in chunks of c = min(K, 4096), b the logits' dtype (the compute's), u = 4 where a
    chunk's fp32 z = x / T is a copy (bf16 logits, or T != 1; else z is the logits themselves).
    Counted with the allocator (tests/test_plan.py).

    Forward, at a chunk: the logits beside the chunk's z and logsumexp's exp(z - max) (4 c), or
    with the entropy (RL's update logs it) log p, p and p log p (12 c): b K V + (u + 4 | 12) c V.
    Backward: the saved logits (no copy), their gradient (b K V, written chunk by chunk) and one
    chunk's z and log p, turned in place into its gradient (4 c; with a differentiated entropy p
    too, 4 c more): 2 b K V + (u + 4 (+ 4)) c V. Without gradients (a reference or eval pass):
    the forward's. ``adapted`` (LoRA on ``lm_head``): peft's forward holds the base product, the
    adapter's B A h and its scaled copy at once before their sum, 3 b K V."""
    if positions <= 0:
        return 0
    K, b = positions, (prec.compute if prec is not None else 4)
    c = min(K, chunk)
    u = _scaled(prec or Precision.of("fp32"), temperature)
    forward = max(b * K + (u + (12 if entropy else 4)) * c, 3 * b * K if adapted else 0)
    if not grad:
        return vocab * forward
    backward = 2 * b * K + (u + 4 + (4 if entropy_grad else 0)) * c
    return vocab * max(forward, backward)


def fused_head_bytes(s: Shape, positions: int, prec: Precision, *, grad: bool = True, weighted: bool = False,
                     head_grad: bool = True, chunk: int = CHUNK_TOKENS, entropy: bool = False,
                     entropy_grad: bool = False, temperature: float = 1.0) -> int:
    """Stage b: the LM head applied by ``models/fused_ce`` one chunk of positions at a time, so no
    [K, V] logits exist (``fused_ce.head_of``: plain Qwen2/3, Llama, Mistral on one process; docs/plan.md),
    at its peak beyond the saved head input (``head_input_bytes``). K positions in chunks of c
    (c_2: the chunk that runs while the previous chunk's gradient is still held, 0 for one chunk),
    b = b_c, u as in ``logits_bytes``; W_c = b_c V d, the head's weight cast to the compute dtype
    in each pass (where the weights are fp32 and the compute bf16: bf16-mixed, bf16-compute; else 0);
    dW = 4 V d, the head's fp32 weight gradient (``head_grad``: not under LoRA, whose head is frozen);
    dh = b_c K d. A chunk's arithmetic: its logits x (b c), z (u c), and logsumexp's temporary or
    log p (4 c); with the entropy log p, p and p log p (12 c); with a differentiated entropy p (4 c).

    * ``LinearLogSoftmaxGather`` (DPO, the RL update, recomputed in the backward), forward:
      W_c + (b + u + 4 | 12) c V; backward: dh + dW + W_c + V max((b + u + 4 (+ 4)) c,
      b c + (b + u + 4 (+ 4)) c_2), the previous chunk's gradient (b c) held while the next runs;
      a bf16 weight (``model.dtype=bf16``) then gets its gradient cast from dW (2 V d, after the chunks).
    * ``LinearWeightedSum`` (SFT, gradients in the forward), forward: dW + W_c + b_c K d (the h it
      multiplies) + V max((b + u + 4) c, b c + (b + u + 4) c_2, 2 b c + b c_2), the last when the
      next chunk's logits are made beside the previous chunk's and its gradient; backward: dW and
      its scaled copy (8 V d, + 2 V d for a bf16 weight) beside dh and its (2 b_c K d).
    * Without gradients (reference, old log-probs, eval): the recomputing forward's, no dh, no dW.
    Left out: the [V, d] temporary of a bf16 chunk's weight-gradient product (b_c V d, beside the
    chunk's gradient only: below the chunk's peak for c > d / 5) and the [T, d] final hidden states
    a forward holds while the head runs (d of V)."""
    if positions <= 0:
        return 0
    K, V, d, b = positions, s.vocab, s.d, prec.compute
    c, c2 = _chunks(K, chunk)
    u = _scaled(prec, temperature)
    cast = b * V * d if prec.param != prec.compute else 0
    forward = cast + (b + u + (12 if entropy else 4)) * c * V
    if not grad:
        return forward
    dw = 4 * V * d if head_grad else 0
    to_bf16 = 2 * V * d if head_grad and prec.param == 2 else 0
    dh = b * K * d
    x = b + u + 4 + (4 if entropy_grad and not weighted else 0)  # a chunk's gradient, bytes per element of c V
    if weighted:
        chunks = V * max(x * c, b * c + x * c2, 2 * b * c + b * c2)
        return max(dw + cast + dh + chunks, 2 * dw + 2 * dh + to_bf16)
    return max(forward, dh + dw + cast + max(V * max(x * c, b * c + x * c2), to_bf16))


def nograd_forward_bytes(s: Shape, tokens: int, positions: int, prec: Precision, *, fused: bool = False,
                         copies: int = 0, temperature: float = 1.0, adapted: bool = False) -> int:
    """The peak of a forward without gradients (reference, old log-probs, eval, a prefill): the
    residual stream and the widest intermediates of one layer at a time, b_c (2 d + 3 I) T + 4 d T
    (gate, up and their product beside the hidden states), then the LM head beside the hidden
    states (4 d T): the logits (stage a, ``logits_bytes`` without gradients) or one chunk's
    (stage b, ``fused``: ``fused_head_bytes`` without gradients). ``copies``: bf16-compute's cast
    copy of every weight, made at the forward's start and dropped when the decoder stack returns,
    before the fused head runs (stage a's head runs inside the model's forward, beside them).
    ``adapted``: LoRA on the LM head (stage a, ``logits_bytes``)."""
    layer = (prec.compute * (2 * s.d + 3 * s.intermediate) + 4 * s.d) * tokens
    if fused:
        head = fused_head_bytes(s, positions, prec, grad=False, temperature=temperature)
        return max(layer + copies, 4 * s.d * tokens + head)
    return copies + max(layer, 4 * s.d * tokens + logits_bytes(positions, s.vocab, grad=False, prec=prec,
                                                               temperature=temperature, adapted=adapted))


# --------------------------------------------------------------------------- terms: the rollout engine


def kv_cache_bytes(s: Shape, rows: int, length: int, b: int) -> int:
    """The HF engine's KV cache (``rollout/kv_cache.GrowingLayer``): keys and values of every layer,
    2 L H_kv D b x rows x length, b the compute dtype's (bf16 under bf16-mixed); length = the
    call's longest prompt + max_new_tokens, allocated at once."""
    return 2 * s.layers * s.kv_width * b * rows * length


def kv_bytes_per_token(s: Shape, b: int) -> int:
    """One token in any engine's cache: 2 L H_kv D b (``rollout/vllm_engine.kv_bytes_per_token``)."""
    return 2 * s.layers * s.kv_width * b


def decode_copy_bytes(s: Shape, b: int) -> int:
    """The HF engine's per-call weight copies (``rollout/fast_decode.Weights``): every linear weight,
    fused and transposed, in the compute dtype, while ``generate`` runs: b x (L (attention + MLP) + V d)."""
    return b * s.linear_params


def decode_step_bytes(s: Shape, rows: int) -> int:
    """A decode step's transients over the vocabulary: fp32 logits, their softmax and its cumulative
    sum for inverse-CDF sampling (``rollout/sampling.sample_tokens``): 3 x 4 V per row."""
    return 12 * s.vocab * rows


def fsdp_gather_bytes(s: Shape, prec: Precision, dp: int, *, trainable: bool = True) -> int:
    """FSDP2 over dp > 1 ranks (``distributed.wrap_fsdp``): the parameters a rank holds whole while a
    forward or backward runs: the root's (embeddings, final norm: (V d + d) b_p, kept gathered from
    the forward to the backward) and two decoder layers in the compute dtype (the one running and
    the one prefetched), plus a layer's gradients before their reduce-scatter. 0 on one rank."""
    if dp <= 1:
        return 0
    root = (s.embedding * (1 if s.tied else 2) + s.d) * prec.param
    layers = 2 * s.layer_params * prec.compute
    grads = s.layer_params * prec.param if trainable else 0
    return root + layers + grads


# --------------------------------------------------------------------------- the plan


@dataclass
class Stage:
    """One stage of a step: what is in memory at its peak, term by term (bytes per rank)."""

    name: str
    terms: dict[str, int]
    key: str = ""
    """The config key that makes this stage smaller."""
    seconds: float | None = None
    """Its arithmetic time on the device (FLOPs / peak, or bytes / bandwidth), None when unknown."""

    @property
    def total(self) -> int:
        return sum(self.terms.values())


@dataclass(frozen=True)
class Fit:
    """The largest value of a config key whose stages fit the device."""

    key: str
    value: int
    """0: not even 1 fits."""
    now: int | None
    """The config's value (None: by device; 0: the key's off / no-limit value)."""
    whole: str = ""
    """What ``value`` is when it is the search's top (e.g. "the rank's whole batch"); "" when the search stops there."""
    top: bool = False
    """``value`` is the top of the search: every larger value is the same plan (or was not searched)."""
    stages: tuple[str, ...] = ()
    """The stages the key sizes (whose fit decided ``value``)."""

    @property
    def now_text(self) -> str:
        return "now by device" if self.now is None else f"now {self.now:,}"

    def __str__(self) -> str:
        if not self.value:
            return f"{self.key}: no value fits, not even 1"
        if self.top and self.whole:
            return f"{self.key}: any value fits ({self.value:,} is {self.whole}; {self.now_text})"
        if self.top:
            return f"{self.key}: {self.value:,} or more ({self.now_text})"
        return f"{self.key}: up to {self.value:,} ({self.now_text})"


@dataclass
class Plan:
    """A recipe's stages on a device, and what fits."""

    recipe: str
    device: Device
    stages: list[Stage]
    facts: list[str] = field(default_factory=list)
    """Lines about the run's shape: the model, the layout, the largest micro-batch."""
    fits: list[Fit] = field(default_factory=list)
    """The largest settings that fit."""
    ranks: int = 1
    """Processes sharing the device's memory (torchrun on one CPU machine: all of them)."""

    @property
    def peak(self) -> Stage:
        return max(self.stages, key=lambda st: st.total)

    @property
    def need(self) -> int:
        """Bytes the device must have: the peak, times the ranks that share it."""
        return self.peak.total * self.ranks

    @property
    def fits_device(self) -> bool:
        return self.need <= self.device.available


def largest_fitting(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest value v in [low, high] with ``fits(v)`` (``fits`` falls as v grows), 0 when none:
    a bisection, ~log2(high) calls."""
    if high < low or not fits(low):
        return 0
    if fits(high):
        return high
    lo, hi = low, high  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def per_token_bytes(s: Shape, prec: Precision, *, lean: bool = True, checkpointing: bool = False, packed: bool = True,
                    logit_share: float = 1.0) -> float:
    """A training micro-batch's bytes per token: its saved activations, rotary table and head inputs,
    plus its logits at a ``logit_share`` of its positions, priced at 12 V bytes (stage a's backward
    in one chunk: the saved logits, their gradient, and the chunk's fp32 z and log p, whatever the
    logits' dtype, ``logits_bytes``; more chunks cost less per position, and the fused head, stage b,
    far less: the estimate errs safe)."""
    act = activation_bytes(s, 1, 0, prec, lean=lean, checkpointing=checkpointing, packed=packed)
    return act + logit_share * (head_input_bytes(s, 0, 1, prec) + 12 * s.vocab)


def fitting_tokens(s: Shape, prec: Precision, free: int, *, lean: bool = True, checkpointing: bool = False,
                   packed: bool = True, logit_share: float = 1.0, margin: float = 0.9) -> int:
    """The largest token budget of one forward/backward pass that fits ``free`` bytes (what a device has
    once the weights, gradients and optimizer state are in place): margin x free / ``per_token_bytes``.
    For sizing micro-batches from free memory (e.g. ``torch.cuda.mem_get_info`` after loading)."""
    per = per_token_bytes(s, prec, lean=lean, checkpointing=checkpointing, packed=packed, logit_share=logit_share)
    return max(0, int(margin * free / per))


def env_local_ranks() -> int:
    """Processes of this launch on this machine (torchrun's LOCAL_WORLD_SIZE; 1 without torchrun)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
