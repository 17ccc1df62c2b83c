"""A lean one-token decode step for Llama-family decoders (Llama, Qwen2, Qwen3), for the HF engine.

Why: on a small model the built-in engine's decode step is mostly overhead around the matrix
products. transformers' forward rebuilds a 4-D attention mask every token, runs each
projection as its own small matmul, and its CPU SDPA kernel spends ~0.6 ms per layer on a
single query row: in a profile of the GRPO bench's rollout (32 rows x 128 tokens, tiny
"small" Qwen2) SDPA was 32% and the matmuls 49% of the time. Here a decode step is

    h = embed(token)
    per layer:  x = RMSNorm(h);  q, k, v = x W_q^T, x W_k^T, x W_v^T (+ b);  RoPE(q, k) at each row's position
                K, V <- append k, v (the engine's preallocated cache, written in place)
                h += softmax(q K^T * scale + mask) V  W_o^T
                x = RMSNorm(h);  h += (silu(x W_g^T) * x W_u^T) W_d^T
    logits = RMSNorm(h) W_lm^T

with the model's own modules for the norms and the rotary table, and a plain matmul attention
over the cached keys (grouped-query heads without repeating K/V). The prefill still runs
through the model's forward. The numbers equal the model's forward to float rounding (the
engine's log-probs are tested against the trainer's).

The products run on copies of the weights made at the start of each ``generate`` call
(``Weights``): [W_q; W_k; W_v]^T, W_o^T, [W_g; W_u]^T, W_d^T and W_lm^T, transposed to
[in, out] and contiguous, in the dtype the model computes in. On a 2-core CPU, at the GRPO
bench's 32 rows, the fused and transposed products made the rollout 4-5% faster with the same
tokens (BENCHMARKS.md, HF engine). The copies live for one call and are never reused: an
engine that shares the trainer's module must sample from the weights of the last update, and
an in-place fused AdamW step does not bump a parameter's version counter, so a copy kept
across calls could not tell it went stale (such copies were measured before and dropped for
that reason). Their cost: one pass over the weights per call, about what two or three decode
steps of one row read, and the linear weights' bytes again while the call runs (under
``bf16-mixed``, in bf16: half of them). In the RL loop that stays under the training phase's
peak: the gradients (the same bytes) are freed after every optimizer step, before the next
rollout. A model this does not cover (another architecture, LoRA or quantized layers,
sliding-window attention) keeps the model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.precision import autocast_of, compute_dtype

ARCHITECTURES = ("llama", "qwen2", "qwen3")


def unsupported_reason(model) -> str | None:
    """None if ``model`` can use this decode step, else why not (for a debug message)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in ARCHITECTURES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {ARCHITECTURES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window layers"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if inner is None or type(head) is not torch.nn.Linear or not hasattr(inner, "rotary_emb"):
        return "not a <Model>ForCausalLM with model.layers and a plain lm_head"
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        if any(type(x) is not torch.nn.Linear for x in linears):
            return "a projection is not a plain nn.Linear (LoRA or quantized)"
        if m.gate_proj.bias is not None or m.up_proj.bias is not None:
            return "MLP biases"
        if (a.q_proj.bias is None) != (a.k_proj.bias is None) or (a.q_proj.bias is None) != (a.v_proj.bias is None):
            return "mixed q/k/v biases"
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Weights:
    """One ``generate`` call's copies of a model's projections (see the module docstring): per
    layer the (weight [in, out], bias or None) pairs of qkv, o, gate-up and down; and the head's."""

    def __init__(self, model):
        dtype = compute_dtype(model)

        def fused(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
            w = torch.cat([x.weight.detach() for x in linears]).t().to(dtype).contiguous()
            b = None if linears[0].bias is None else torch.cat([x.bias.detach() for x in linears]).to(dtype)
            return w, b

        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((fused(a.q_proj, a.k_proj, a.v_proj), fused(a.o_proj), fused(m.gate_proj, m.up_proj),
                                fused(m.down_proj)))
        self.lm = fused(model.lm_head)


def _linear(x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    w, b = wb
    return x @ w if b is None else torch.addmm(b, x, w)


class FastDecoder:
    """``step(tokens, positions, mask_bias, cache, weights) -> logits`` for one new token per row."""

    def __init__(self, model):
        self.model = model
        self.inner = model.model
        cfg = model.config
        self.H = cfg.num_attention_heads
        self.Hkv = getattr(cfg, "num_key_value_heads", None) or self.H
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H

    def weights(self) -> Weights:
        """This call's weight copies: make them after the last update, once per ``generate``."""
        return Weights(self.model)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, mask_bias: torch.Tensor, cache, weights: Weights
             ) -> torch.Tensor:
        """tokens, positions [R]; mask_bias [R, L] additive (0 or -inf) over the cache's columns
        after this token is written; ``cache``: the engine's ``DynamicCache`` of ``GrowingLayer``s;
        ``weights``: ``self.weights()`` of this call. Returns the next-token logits [R, V]."""
        with autocast_of(self.model):  # model.dtype=bf16-mixed: compute as the model's forward does
            return self._step(tokens, positions, mask_bias, cache, weights)

    def _step(self, tokens, positions, mask_bias, cache, weights: Weights) -> torch.Tensor:
        R, H, Hkv, D = tokens.shape[0], self.H, self.Hkv, self.D
        g = H // Hkv
        h = self.inner.embed_tokens(tokens)  # [R, hidden]
        cos, sin = self.inner.rotary_emb(h, positions[:, None])  # [R, 1, D]
        bias = mask_bias[:, None, None, :].to(h.dtype)  # [R, 1, 1, L]
        for layer, kv, (qkv, o_proj, gate_up, down) in zip(self.inner.layers, cache.layers, weights.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = _linear(x, qkv).split([H * D, Hkv * D, Hkv * D], dim=-1)
            q, k, v = q.reshape(R, H, D), k.reshape(R, Hkv, D), v.reshape(R, Hkv, D)
            if hasattr(a, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
                q, k = a.q_norm(q), a.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            K, V = kv.update(k[:, :, None], v[:, :, None])  # [R, Hkv, L, D], views of the preallocated buffers
            scores = torch.matmul(q.view(R, Hkv, g, D), K.transpose(-1, -2)) * a.scaling + bias  # [R, Hkv, g, L]
            p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(p, V).reshape(R, H * D)
            h = h + _linear(o, o_proj)
            x = layer.post_attention_layernorm(h)
            gate, up = _linear(x, gate_up).chunk(2, dim=-1)
            h = h + _linear(F.silu(gate) * up, down)
        return _linear(self.inner.norm(h), weights.lm)
