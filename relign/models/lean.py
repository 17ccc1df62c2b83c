"""Save fewer activations for backward (``model.lean_activations``, on by default): the
SwiGLU MLP keeps two tensors, not four, and the RMSNorm keeps its input, not its output too.

Why: on a decoder layer of a Llama/Qwen-shaped model, most of what autograd keeps for the
backward pass is the MLP's. ``down(silu(gate(x)) * up(x))`` saves, per token, g = gate(x) (for
silu's backward), silu(g) and u = up(x) (for the product's backward) and p = silu(g) * u (for
down's weight gradient): four vectors of the MLP width I, against about 1.5 hidden-size vectors
for the rest of the layer. silu and the product are elementwise, so recomputing them from g and
u in backward costs two passes over [tokens, I], next to the six matrix products of the MLP's
forward and backward. Liger-Kernel's SwiGLU recomputes silu(g) * u too but still saves p for
``down``; here ``down``'s weight gradient is computed in the same backward, so p is never kept.
Each RMSNorm also keeps its normalized input for the product with its weight: one hidden-size
vector per token, recomputed here from x and 1/rms. Measured on ``tiny:small`` (10 layers, hidden
256, I 1024), SFT with micro-batches of 8 rows up to 520 tokens: peak RSS 3,042 -> 2,625 MB, the
speed within noise (BENCHMARKS.md).

The MLP's forward and backward run the same kernels on the same shapes as the module's own
forward and autograd's backward of it, so its outputs and gradients are bitwise equal (tested in
fp32 and bf16); the norm's outputs are bitwise and its gradients equal to rounding. The
replacement only runs when it can be exact: plain ``nn.Linear`` projections without bias and a
SiLU activation, checked at every call, so a LoRA adapter (peft swaps the projections for its own
layers) or another activation falls back to the module's own forward; norms only of the
``NORMS`` classes. Without gradients (rollouts, reference passes) it is the module's own forward
too, and so it is inside ``plain()``, for graphs that are differentiated twice. Under autocast
(``model.dtype=bf16-mixed``) the MLP's backward runs under the same autocast state as its
forward, as autograd's own backward of those ops would compute: products in bf16, gradients cast
back to the fp32 weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import types

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

_SILU = ("SiLU", "SiLUActivation")
# norms whose forward is exactly RMSNorm.forward's (Gemma's (1 + w) and OLMo-2's order differ)
NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
_ATTR = "_relign_lean"  # marks an MLP or a norm whose forward is this module's
_ON = contextvars.ContextVar("relign_lean_on", default=True)


class SwiGLU(torch.autograd.Function):
    """y = W_d (silu(W_g x) * (W_u x)), saving x, g = W_g x and u = W_u x only."""

    @staticmethod
    def forward(ctx, x, w_g, w_u, w_d):
        g = F.linear(x, w_g)
        u = F.linear(x, w_u)
        y = F.linear(F.silu(g) * u, w_d)
        ctx.save_for_backward(x, w_g, w_u, w_d, g, u)
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        return y

    @staticmethod
    @once_differentiable  # g and u are not inputs: a second derivative through them would be wrong, so it errors
    def backward(ctx, dy):
        x, w_g, w_u, w_d, g, u = ctx.saved_tensors
        device, enabled, dtype = ctx.autocast
        need_x, need_g, need_u, need_d = ctx.needs_input_grad[:4]
        dx = dw_g = dw_u = dw_d = None
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            a = F.silu(g)                      # recomputed, not saved
            dp = dy @ w_d                      # dL/dp, p = a * u
            if need_d:
                dw_d = _outer(dy, a * u)       # p recomputed for down's weight gradient
            du = dp * a
            dg = torch.ops.aten.silu_backward(dp * u, g)
            if need_x:  # each term in x's dtype before the sum, as autograd adds the grads of x's two uses
                dx = (dg @ w_g).to(x.dtype) + (du @ w_u).to(x.dtype)
            if need_g:
                dw_g = _outer(dg, x)
            if need_u:
                dw_u = _outer(du, x)
        return dx, dw_g, dw_u, dw_d


class RMSNorm(torch.autograd.Function):
    """y = w * (x / sqrt(mean(x^2) + eps)) as Llama/Qwen compute it (in fp32, the product with w
    in x's dtype), saving x and r = 1 / sqrt(mean(x^2) + eps) only: the normalized x is
    recomputed. The backward is autograd's op for op, but x's gradient terms (two here, one from
    the residual) are added in another order than autograd's, so gradients agree to rounding."""

    @staticmethod
    def forward(ctx, x, w, eps):
        h = x.to(torch.float32)
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        y = w * (h * r).to(x.dtype)
        ctx.save_for_backward(x, w, r)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, w, r = ctx.saved_tensors
        h = x.to(torch.float32)
        n = (h * r).to(x.dtype)  # recomputed, not saved
        dw = (dy * n).sum_to_size(w.shape) if ctx.needs_input_grad[1] else None
        dx = None
        if ctx.needs_input_grad[0]:
            dn = (dy * w).to(torch.float32)
            dr = (dn * h).sum(-1, keepdim=True)
            dv = (-0.5 * dr) * r.pow(3)                                   # d rsqrt(v) / dv
            dsq = dv.expand(h.shape) / h.shape[-1]                      # d mean / d (h^2)
            dx = (dn * r + dsq * (2.0 * h.pow(1.0))).to(x.dtype)        # both paths into h
        return dx, dw, None


def _outer(grad_out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight gradient, sum over tokens of grad_out ⊗ inp: [out, in]."""
    return grad_out.reshape(-1, grad_out.shape[-1]).t() @ inp.reshape(-1, inp.shape[-1])


def _exact(mlp: torch.nn.Module) -> bool:
    """The replacement computes exactly what this MLP's own forward does."""
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    # a tensor-parallel MLP (relign.models.tp) has DTensor weights whose modules' hooks lay its
    # input and output out over the tp ranks: calling F.linear on the weights would skip them
    return (type(mlp.act_fn).__name__ in _SILU
            and all(type(p) is torch.nn.Linear and p.bias is None and not isinstance(p.weight, DTensor) for p in projections))


def _lean_forward(self, x):
    if torch.is_grad_enabled() and _ON.get() and _exact(self):
        return SwiGLU.apply(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
    return type(self).forward(self, x)


@contextlib.contextmanager
def plain():
    """The modules' own forwards inside this block: for a graph that is differentiated twice
    (TRPO's Fisher-vector products), which the lean backward does not support."""
    token = _ON.set(False)
    try:
        yield
    finally:
        _ON.reset(token)


def rms_norm(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``module``'s RMSNorm of ``x`` (one of ``NORMS``) with ``weight`` in place of its own: the
    lean kernel where ``module`` runs it, else the same ops as its forward."""
    if getattr(module, _ATTR, False) and torch.is_grad_enabled() and _ON.get():
        return RMSNorm.apply(x, weight, module.variance_epsilon)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return weight * h.to(x.dtype)


def _lean_norm_forward(self, x):
    if torch.is_grad_enabled() and _ON.get():
        return RMSNorm.apply(x, self.weight, self.variance_epsilon)
    return type(self).forward(self, x)


def lean_activations(model: torch.nn.Module) -> int:
    """Give each SwiGLU MLP in ``model`` (modules with ``gate_proj``, ``up_proj``, ``down_proj``
    and ``act_fn``) and each RMSNorm of the ``NORMS`` classes the lean forward; in place.
    Returns how many modules it applies to. Bound as a method of each module, so a ``deepcopy``
    keeps it; call before LoRA wrapping or FSDP."""
    n = 0
    for m in model.modules():
        if getattr(m, _ATTR, False):
            continue
        if all(hasattr(m, k) for k in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            m.forward = types.MethodType(_lean_forward, m)
        elif type(m).__name__ in NORMS:
            m.forward = types.MethodType(_lean_norm_forward, m)
        else:
            continue
        setattr(m, _ATTR, True)
        n += 1
    return n
