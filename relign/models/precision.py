"""Mixed precision: fp32 master weights, bf16 arithmetic (``model.dtype=bf16-mixed``).

Why not train bf16 weights (``model.dtype=bf16``)? bf16 keeps 8 bits of mantissa, so a weight
w moves only if its update is larger than about |w| / 256. An AdamW step moves each weight by
about lr: at lr = 1e-6 and |w| ~ 0.02 that is 1/80 of the spacing between bf16 numbers, and the
update rounds to nothing (measured: 10 steps change 2% of the weights of a bf16 matrix and
all of an fp32 one). TRL's ``bf16=True``, accelerate, Lightning's ``bf16-mixed`` and veRL's FSDP
all keep fp32 weights and optimizer state and compute in bf16. So does this module.

How: the model's ``forward`` (and its decoder stack's, which the value and reward heads call
directly) runs under ``torch.autocast(device, bfloat16)``: matrix products and attention in
bf16, softmax, norms and the residual stream in fp32 (autocast's own op lists; transformers'
RMSNorm upcasts). Gradients reach the fp32 weights in fp32. The forward is bound as a method
of the module, so a ``deepcopy`` (the engine's replica under torchrun) keeps its own weights.
Logits come out in bf16; ``relign.models.logprobs`` upcasts them a chunk at a time, so a
150k-token vocabulary never has its fp32 logits in memory at once.

``model.dtype=bf16-compute`` (optional, issue 45 item 5): fp32 master weights too, but the
forward runs on bf16 copies of *every* parameter, without autocast (``enable_compute_weights``):
the embedding's output, the residual stream, the norms' inputs and outputs and the logits are
bf16, which halves the bytes of every elementwise op between the products (autocast keeps the
residual stream and the norms in fp32: ``docs/sft.md``). The copies are made by one
differentiable cast per parameter at each forward (``torch.func.functional_call``), so the
gradients reach the fp32 weights in fp32 (a bf16 gradient, upcast), the optimizer and the
checkpoints see fp32 as under bf16-mixed, and the numbers are exactly those of the model cast to
bf16 (tested). The cast per forward replaces autocast's per-forward weight casts; it is not a
persistent shadow copy, because an in-place fused AdamW step bumps no version counter a cache
could watch (``rollout/fast_decode.py``). It changes the numerics on purpose, so it is a flag,
and in this version it runs on one process (under torchrun FSDP2's own ``param_dtype`` would do
it) without gradient checkpointing (the recompute would run outside the cast).
"""

from __future__ import annotations

import contextlib
import contextvars
import types

import torch

from ..dtypes import DTYPES

ATTR = "_relign_autocast"  # the compute dtype, set on each module whose forward is wrapped
CAST_ATTR = "_relign_compute_weights"  # True on a module whose forward runs on cast copies (bf16-compute)
_CASTING = contextvars.ContextVar("relign_casting", default=False)  # inside a forward that cast the weights


def autocast_dtype(name: str) -> torch.dtype | None:
    """The compute dtype of ``model.dtype`` = ``name`` when it is a mixed mode, else None."""
    row = DTYPES.get(name)
    return getattr(torch, row.compute) if row is not None and row.mode == "autocast" else None


def _autocast_forward(self, *args, **kwargs):
    with torch.autocast(_device_type(self), dtype=getattr(self, ATTR)):
        return type(self).forward(self, *args, **kwargs)


def _device_type(module: torch.nn.Module) -> str:
    p = next(module.parameters(), None)
    return p.device.type if p is not None else "cpu"


def _backbone(model: torch.nn.Module) -> torch.nn.Module | None:
    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if prefix else None
    return inner if isinstance(inner, torch.nn.Module) and inner is not model else None


def enable_autocast(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Run ``model``'s forward, and its decoder stack's, under autocast to ``dtype``. In place;
    returns ``model``. Call before LoRA wrapping (the adapter calls these forwards)."""
    for m in (model, _backbone(model)):
        if m is not None:
            setattr(m, ATTR, dtype)
            m.forward = types.MethodType(_autocast_forward, m)
    return model


def _cast_forward(self, *args, **kwargs):
    if _CASTING.get():  # an outer forward cast the weights already (the LM's forward calls its backbone's)
        return type(self).forward(self, *args, **kwargs)
    from torch.func import functional_call

    dtype = getattr(self, ATTR)
    # named_parameters lists a tied weight once: its one copy serves both uses (tie_weights)
    copies = {n: p.to(dtype) if p.is_floating_point() else p for n, p in self.named_parameters()}
    token = _CASTING.set(True)
    try:
        return functional_call(self, copies, args, kwargs, tie_weights=True, strict=False)
    finally:
        _CASTING.reset(token)


def enable_compute_weights(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Run ``model``'s forward, and its decoder stack's, on ``dtype`` copies of all its parameters
    (``model.dtype=bf16-compute``). In place; returns ``model``. Call before LoRA wrapping: the
    adapter's own weights are cast too, as they are the model's parameters at call time. Code that
    runs the modules one by one (the HF engine's decode step, ``autocast_of``) computes as
    bf16-mixed does, with the model's compute dtype."""
    for m in (model, _backbone(model)):
        if m is not None:
            setattr(m, ATTR, dtype)
            setattr(m, CAST_ATTR, True)
            m.forward = types.MethodType(_cast_forward, m)
    return model


def enable(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """``model.dtype`` = ``name``'s compute mode on ``model``: autocast (bf16-mixed), cast weights
    (bf16-compute), or nothing (fp32, bf16: the parameters' own dtype)."""
    row = DTYPES.get(name)
    if row is not None and row.mode == "autocast":
        return enable_autocast(model, getattr(torch, row.compute))
    if row is not None and row.mode == "cast":
        return enable_compute_weights(model, getattr(torch, row.compute))
    return model


def compute_weights(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or a module in it) runs on cast weight copies (``model.dtype=bf16-compute``)."""
    return any(getattr(m, CAST_ATTR, False) for m in model.modules())


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes in: its autocast dtype, else its parameters'."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = getattr(base, ATTR, None)
    return dtype if dtype is not None else next(model.parameters()).dtype


def mixed_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The autocast dtype of ``model`` or of any module inside it (a critic's or a LoRA
    wrapper's backbone), None when nothing in it computes mixed."""
    return next((getattr(m, ATTR) for m in model.modules() if getattr(m, ATTR, None) is not None), None)


def autocast_of(model: torch.nn.Module):
    """A context that computes as ``model``'s forward does, for code that runs its modules one
    by one (the HF engine's decode step)."""
    dtype = getattr(model, ATTR, None)
    return torch.autocast(_device_type(model), dtype=dtype) if dtype is not None else contextlib.nullcontext()
