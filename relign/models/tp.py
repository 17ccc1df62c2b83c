"""Tensor parallelism (``parallel.tp_size``; docs/parallel.md): each decoder layer's attention heads
and MLP width split over the tp ranks of the device mesh, with PyTorch's DTensor API.

Megatron's layout: q/k/v and gate/up are column-parallel (each rank computes its own heads, its
own slice of the MLP width, from the whole hidden state), o and down row-parallel (each rank
multiplies its slice and one all-reduce sums them back into the whole hidden state). So a layer
costs two all-reduces forward and two backward, and the residual stream, the norms, the
embeddings and the LM head stay whole on every rank: ``models/logprobs.py`` reads whole logits,
as on one process. Attention needs nothing: transformers reshapes q/k/v with ``-1`` heads, so it
sees the rank's local heads as ordinary tensors (``use_local_output``), and relign's varlen
attention works per head anyway.

The plan is the model's own ``config.base_model_tp_plan`` when transformers gives one, else
``PLAN`` (Llama, Qwen2, Qwen3, Mistral name their projections alike), its decoder layers' entries only. ``colwise`` and
``rowwise`` map to ``ColwiseParallel`` and ``RowwiseParallel``; ``replicated_with_grad_allreduce``
(Qwen3's per-head q_norm and k_norm: whole weights applied to the rank's own heads, so each
rank's weight gradient is a partial sum over heads) sums that gradient over the tp ranks. Any
other entry is refused with the name of the key. Apply before FSDP (``distributed.wrap_fsdp``
shards the DTensor weights once more over dp x cp).
"""

from __future__ import annotations

import re
import types

import torch
import torch.distributed as dist

from ..errors import ConfigError
from . import lean

# relign's table where a model's config has no plan: module paths under the base model
PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}
_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def check_heads(config, tp_size: int, cp_size: int = 1) -> None:
    """One line naming the key when the model's heads cannot be split: tp and cp ranks each
    take whole query and key-value heads."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    for key, n in (("parallel.tp_size", tp_size), ("parallel.cp_size", cp_size)):
        for what, count in (("attention heads", heads), ("key-value heads", kv)):
            if n > 1 and count is not None and count % n:
                raise ConfigError(f"{key}={n} does not divide the model's {count} {what} (num_"
                                  f"{'attention_heads' if what == 'attention heads' else 'key_value_heads'})")
    if tp_size > 1 and cp_size > 1 and kv is not None and kv % (tp_size * cp_size):
        raise ConfigError(f"parallel.tp_size x parallel.cp_size = {tp_size * cp_size} does not divide the model's "
                          f"{kv} key-value heads (num_key_value_heads)")


def plan_of(model: torch.nn.Module) -> dict[str, str]:
    """{module path under the decoder stack's parent: style}: the decoder layers' entries of the
    model's own plan, or ``PLAN``. Entries outside the layers (transformers' vocab-parallel
    ``embed_tokens``) are left out: embeddings, final norm and LM head stay whole in this version,
    so the log-probs are read from whole logits."""
    config = getattr(model, "config", None)
    own = getattr(config, "base_model_tp_plan", None) or PLAN
    return {k: v for k, v in own.items() if k.startswith("layers.")}


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The module the plan's paths start from: the one holding ``layers`` (``model.model`` of a causal LM,
    found by name so a critic or a peft wrapper works too)."""
    for m in model.modules():
        if isinstance(getattr(m, "layers", None), torch.nn.ModuleList):
            return m
    raise ConfigError(f"parallel.tp_size: {type(model).__name__} has no decoder stack ('layers') to split")


def apply_tp(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    """Split ``model``'s decoder layers over ``tp_mesh`` (in place; returns it)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_heads(model.config, tp_mesh.size())
    base = _base(model)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan, reduce_grad = {}, []
    names = dict(base.named_modules())
    for pattern, style in plan_of(model).items():
        if style not in _STYLES:
            raise ConfigError(f"parallel.tp_size: the model's tensor-parallel plan splits {pattern} as {style!r}; "
                              f"relign applies {', '.join(_STYLES)}")
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        for name in [n for n in names if regex.match(n)]:
            if style in styles:
                plan[name] = styles[style]()
            else:
                reduce_grad.append(names[name])
    if not plan:
        raise ConfigError(f"parallel.tp_size: no module of {type(model).__name__} matches its tensor-parallel plan")
    parallelize_module(base, tp_mesh, plan)
    for norm in reduce_grad:
        if type(norm).__name__ not in lean.NORMS:  # its forward is rewritten: only where it is RMSNorm's exactly
            raise ConfigError(f"parallel.tp_size: the model's tensor-parallel plan sums the weight gradient of a "
                              f"{type(norm).__name__} over the tp ranks; relign does that for {', '.join(lean.NORMS)} only")
        norm.forward = types.MethodType(_norm_summing_weight_grad(tp_mesh.get_group()), norm)
    return model


class _SumGrad(torch.autograd.Function):
    """Identity forward; the gradient summed over a process group backward (Megatron's ``f``
    for a replicated weight that each rank applies to its own part of the work)."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, dw):
        dw = dw.contiguous().clone()
        dist.all_reduce(dw, group=ctx.group)
        return dw, None


def _norm_summing_weight_grad(group):
    """An RMSNorm forward (one of ``lean.NORMS``: in fp32, the product with the weight in the
    input's dtype; relign's lean kernel where the module runs it) whose weight gradient is summed
    over ``group``: Qwen3's q_norm and k_norm on a rank's own heads."""
    def forward(self, x):
        return lean.rms_norm(self, x, _SumGrad.apply(self.weight, group))

    return forward
