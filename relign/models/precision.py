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
"""

from __future__ import annotations

import contextlib
import types

import torch

MIXED = {"bf16-mixed": torch.bfloat16}
ATTR = "_relign_autocast"  # the compute dtype, set on each module whose forward is wrapped


def autocast_dtype(name: str) -> torch.dtype | None:
    """The compute dtype of ``model.dtype`` = ``name`` when it is a mixed mode, else None."""
    return MIXED.get(name)


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
