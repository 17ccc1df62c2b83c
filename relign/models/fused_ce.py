"""Log-probs and entropy of chosen tokens that keep no fp32 [tokens x vocabulary] for the backward.

The plain autograd path ``logsumexp(logits.float() / T)`` keeps the fp32 copy of every chunk of
bf16 logits alive until the backward, because ``logsumexp`` saves its input: for Qwen2.5's
151,936-token vocabulary that is 0.6 MB per token, 9.96 GB for a micro-batch of 8 x 2,048 tokens,
twice the bf16 logits themselves (for fp32 logits: a scaled copy at T != 1, and the softmax and
its product for a differentiated entropy). Two replacements, each one ``autograd.Function`` over
chunks of rows:

* ``LogSoftmaxGather`` (stage a) takes the logits the model returned and saves only them (no
  copy) and the fp32 log-sum-exp [N] (and the entropy [N] when it is differentiated). Its backward
  recomputes the softmax of one chunk at a time from the two and writes the gradient in the
  logits' dtype.
* ``LinearLogSoftmaxGather`` and ``LinearWeightedSum`` (stage b) take the final hidden states
  [N, d] and the LM-head weight [V, d] instead, and compute ``logits = h W^T`` one chunk at a time,
  so the [N, V] logits never exist at all (Liger-Kernel's fused linear cross-entropy). The first
  recomputes each chunk's logits in its backward (one more [N, d] x [d, V] product, for any loss);
  the second is for a loss that is a fixed weighted sum of log-probs (SFT: ``aggregate`` of
  -log p is linear in log p, its weights known before the forward), so its forward computes the
  gradients at once and the backward only scales them: no recomputation.

The arithmetic per chunk is the plain path's: the logits (bf16 from a bf16 product, as the
model's LM head computes them) upcast to fp32, divided by the temperature, log-sum-exp and the
picked logit in fp32. So the values equal the plain path's to fp32 rounding, and the gradients
too (tested, ``tests/models/test_fused_ce.py``).

Gradients, for z = x / T, log p = z - lse, p = softmax(z), H = -sum p log p:
    d log p_y / dz = e_y - p,        d H / dz = -p (log p + H),       d / dx = (d / dz) / T.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

DEFAULT_CHUNK_TOKENS = 4096
# causal LMs whose forward is exactly ``lm_head(backbone(...).last_hidden_state[:, keep])``: no
# logit scaling or soft-capping (Gemma, Cohere, Granite scale theirs), so the fused head computes
# what their forward computes
PLAIN_CAUSAL_LMS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")


# --------------------------------------------------------------------------- the chunk arithmetic


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = x / T in fp32 (fp64 stays fp64). A new tensor unless x is already fp32 and T = 1."""
    z = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return z if temperature == 1.0 else z / temperature


def chunk_stats(x: torch.Tensor, index: torch.Tensor, temperature: float, with_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log p of ``index``, lse, entropy or None), each [n], of one chunk of logits x [n, V]."""
    z = _scaled(x, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, index.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if with_entropy:
        # H = -sum p log p, not lse - sum p z: the two terms of the latter are each ~ max z and cancel
        # (1e-5 off in fp32 at logits ~ 10)
        logp_all = z - lse.unsqueeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, lse, ent


def chunk_grad(x: torch.Tensor, index: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
               g_logp: torch.Tensor | None, g_ent: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """d loss / d x [n, V] (fp32) of one chunk, from the upstream gradients of its log-probs and
    entropies (None: not used by the loss): -p (g_logp + g_ent (log p + H)) + g_logp e_y, over T."""
    z = _scaled(x, temperature)
    logp_all = z - lse.unsqueeze(-1)  # a new tensor: z may be the saved logits themselves
    if g_ent is not None:
        p = logp_all.exp()
        coef = logp_all.add_(ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1))
        if g_logp is not None:
            coef.add_(g_logp.unsqueeze(-1))
        dz = p.mul_(coef).neg_()
    else:  # one chunk-sized temporary: log p, then p, then the gradient, in place
        dz = logp_all.exp_().mul_(g_logp.unsqueeze(-1)).neg_()
    if g_logp is not None:
        dz.scatter_add_(-1, index.unsqueeze(-1), g_logp.unsqueeze(-1).to(dz.dtype))
    return dz if temperature == 1.0 else dz.div_(temperature)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _no_autocast(device: torch.device):
    # the chunks choose their own dtypes (bf16 products, fp32 softmax): an autocast region around
    # the call (the model's forward is one) must not recast them
    return torch.autocast(device.type, enabled=False)


def _chunks(n: int, size: int):
    return ((s, min(s + size, n)) for s in range(0, n, size))


def _stats_by_chunk(logits_of, index, chunk_tokens: int, temperature: float, with_entropy: bool, out: tuple):
    """Fill ``out`` = (log p [N], lse [N], entropy [N] or None) chunk by chunk from
    ``logits_of(a, b)``, the logits of rows a..b (a slice, or the head's product of them)."""
    logp, lse, ent = out
    for a, b in _chunks(index.shape[0], chunk_tokens):
        lp, ls, e = chunk_stats(logits_of(a, b), index[a:b], temperature, with_entropy)
        logp[a:b], lse[a:b] = lp, ls
        if e is not None:
            ent[a:b] = e


def _outputs(ctx, logp, ent, entropy_grad: bool):
    """An autograd forward's (log p, entropy): the entropy None when not asked for, and
    non-differentiable when not differentiated."""
    ctx.set_materialize_grads(False)  # a None upstream gradient (entropy unused) skips its term
    if ent is None:
        return logp, None
    if not entropy_grad:
        ctx.mark_non_differentiable(ent)
    return logp, ent


# --------------------------------------------------------------------------- stage a: from the logits


class LogSoftmaxGather(torch.autograd.Function):
    """(log softmax(x / T)[index], entropy) of logits x [N, V]: saves x itself, lse [N] (fp32) and
    the entropy [N] when it is differentiated; nothing of size N x V that x does not already hold."""

    @staticmethod
    def forward(ctx, logits, index, temperature, chunk_tokens, with_entropy, entropy_grad):
        N = logits.shape[0]
        dt = _out_dtype(logits)
        logp = logits.new_empty(N, dtype=dt)
        lse = logits.new_empty(N, dtype=dt)
        ent = logits.new_empty(N, dtype=dt) if with_entropy else None
        with _no_autocast(logits.device):
            _stats_by_chunk(lambda a, b: logits[a:b], index, chunk_tokens, temperature, with_entropy, (logp, lse, ent))
        ctx.save_for_backward(logits, index, lse, ent if entropy_grad else None)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return _outputs(ctx, logp, ent, entropy_grad)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, g_ent):
        logits, index, lse, ent = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (g_logp is None and (g_ent is None or ent is None)):
            return None, None, None, None, None, None
        g_ent = g_ent if ent is not None else None
        grad = torch.empty_like(logits)
        with _no_autocast(logits.device):
            for a, b in _chunks(logits.shape[0], ctx.chunk_tokens):
                grad[a:b] = chunk_grad(logits[a:b], index[a:b], lse[a:b], None if ent is None else ent[a:b],
                                       None if g_logp is None else g_logp[a:b], None if g_ent is None else g_ent[a:b],
                                       ctx.temperature)
        return grad, None, None, None, None, None


def log_softmax_gather(logits: torch.Tensor, index: torch.Tensor, *, temperature: float = 1.0,
                       chunk_tokens: int = DEFAULT_CHUNK_TOKENS, with_entropy: bool = False,
                       entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p [N], entropy [N] or None) of logits [N, V] at ``index`` [N], stage a. fp32 out (fp64
    for fp64 logits); the entropy is detached unless ``entropy_grad``."""
    return LogSoftmaxGather.apply(logits, index, float(temperature), int(chunk_tokens), with_entropy, entropy_grad)


# --------------------------------------------------------------------------- stage b: from the hidden states


def _add_outer(dw: torch.Tensor, dx: torch.Tensor, h: torch.Tensor) -> None:
    """dw [V, d] (fp32) += dx^T h: in place where the dtypes agree (no [V, d] temporary); else each
    chunk's product in the compute dtype (as the model's head computes its weight gradient), summed in fp32."""
    if dx.dtype == dw.dtype:
        dw.addmm_(dx.t(), h)
    else:
        dw += dx.t() @ h


def _logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One chunk's logits h [n, d] x w [V, d]^T in their shared dtype: the model's own LM-head product."""
    return h @ w.t()


class LinearLogSoftmaxGather(torch.autograd.Function):
    """(log p, entropy) of logits h W^T that are never stored: hidden h [N, d] in the compute dtype,
    W [V, d] the LM head's weight (fp32 master weights under bf16-mixed, cast to the compute dtype
    once in the forward and once in the backward). Saves h, W (both held anyway), lse [N] and the entropy [N] when it is
    differentiated; the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, h, weight, index, dtype, temperature, chunk_tokens, with_entropy, entropy_grad):
        N = h.shape[0]
        logp = h.new_empty(N, dtype=torch.float32)
        lse = h.new_empty(N, dtype=torch.float32)
        ent = h.new_empty(N, dtype=torch.float32) if with_entropy else None
        with _no_autocast(h.device):
            w = weight.to(dtype)
            _stats_by_chunk(lambda a, b: _logits(h[a:b], w), index, chunk_tokens, temperature, with_entropy,
                            (logp, lse, ent))
        ctx.save_for_backward(h, weight, index, lse, ent if entropy_grad else None)
        ctx.dtype, ctx.temperature, ctx.chunk_tokens = dtype, temperature, chunk_tokens
        return _outputs(ctx, logp, ent, entropy_grad)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, g_ent):
        h, weight, index, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        g_ent = g_ent if ent is not None else None
        if not (need_h or need_w) or (g_logp is None and g_ent is None):
            return None, None, None, None, None, None, None, None
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        with _no_autocast(h.device):
            w = weight.to(ctx.dtype)
            for a, b in _chunks(h.shape[0], ctx.chunk_tokens):
                dx = chunk_grad(_logits(h[a:b], w), index[a:b], lse[a:b], None if ent is None else ent[a:b],
                                None if g_logp is None else g_logp[a:b], None if g_ent is None else g_ent[a:b],
                                ctx.temperature).to(ctx.dtype)
                if need_h:
                    dh[a:b] = dx @ w
                if need_w:
                    _add_outer(dw, dx, h[a:b])
        return dh, dw.to(weight.dtype) if need_w else None, None, None, None, None, None, None


class LinearWeightedSum(torch.autograd.Function):
    """S = sum_t c_t log p_t with logits h W^T never stored, for fixed weights c [N] (an SFT loss is
    -S for the c of its reduction). Its gradients are known in the forward, so they are computed
    there, chunk by chunk, and kept (dh [N, d], dW [V, d] in fp32) instead of anything to recompute
    them from; the backward multiplies them by dL/dS. Returns (S, log p [N] detached)."""

    @staticmethod
    def forward(ctx, h, weight, index, c, dtype, temperature, chunk_tokens):
        N = h.shape[0]
        need_h, need_w = ctx.needs_input_grad[:2]
        logp = h.new_empty(N, dtype=torch.float32)
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        c = c.to(torch.float32)
        with _no_autocast(h.device):
            w = weight.to(dtype)
            for a, b in _chunks(N, chunk_tokens):
                x = _logits(h[a:b], w)
                lp, lse, _ = chunk_stats(x, index[a:b], temperature, False)
                logp[a:b] = lp
                if need_h or need_w:
                    dx = chunk_grad(x, index[a:b], lse, None, c[a:b], None, temperature).to(dtype)
                    if need_h:
                        dh[a:b] = dx @ w
                    if need_w:
                        _add_outer(dw, dx, h[a:b])
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(logp)
        return (logp * c).sum(), logp

    @staticmethod
    @once_differentiable
    def backward(ctx, g_sum, _g_logp):
        dh, dw = ctx.saved_tensors
        if g_sum is None:
            return None, None, None, None, None, None, None
        dh = (dh.float() * g_sum).to(dh.dtype) if dh is not None else None
        dw = (dw * g_sum).to(ctx.weight_dtype) if dw is not None else None
        return dh, dw, None, None, None, None, None


def linear_log_softmax_gather(h: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, *, dtype: torch.dtype,
                              temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                              with_entropy: bool = False, entropy_grad: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p [N], entropy [N] or None) of the logits ``h.to(dtype) @ weight.to(dtype)^T`` at ``index``,
    stage b; fp32 out. h [N, d], weight [V, d]."""
    return LinearLogSoftmaxGather.apply(h.to(dtype), weight, index, dtype, float(temperature), int(chunk_tokens),
                                        with_entropy, entropy_grad)


def linear_weighted_sum(h: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, c: torch.Tensor, *,
                        dtype: torch.dtype, temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(S = sum c log p, log p [N] detached) of the logits ``h.to(dtype) @ weight.to(dtype)^T`` at
    ``index``, gradients computed in the forward; S fp32 []."""
    return LinearWeightedSum.apply(h.to(dtype), weight, index, c, dtype, float(temperature), int(chunk_tokens))


def head_of(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Parameter] | None:
    """(the decoder stack, the LM head's weight) of a plain Hugging Face causal LM, also under a
    peft LoRA wrapper, or None where the fused head cannot stand in for the model's own: another
    architecture (one that scales or caps its logits), an LM head with a bias or adapted by LoRA,
    and FSDP2 or tensor-parallel weights (DTensors: the root module's hooks gather them, and a
    forward around them would skip those hooks). Those keep stage a."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if type(base).__name__ not in PLAIN_CAUSAL_LMS:  # FSDP2 renames the class it wraps (FSDPQwen2ForCausalLM)
        return None
    head = getattr(base, "lm_head", None)
    backbone = getattr(base, getattr(base, "base_model_prefix", ""), None)
    if type(head) is not torch.nn.Linear or head.bias is not None or not isinstance(backbone, torch.nn.Module):
        return None
    if isinstance(head.weight, DTensor):
        return None
    return backbone, head.weight
