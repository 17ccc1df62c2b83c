"""Packed rows without a block mask: causal attention run sequence by sequence (varlen SDPA).

A packed row ``[1, sum T_i]`` holds several examples, with position ids that restart at 0 for
each. With ``attn_implementation="sdpa"`` transformers turns those position ids into a dense
block-diagonal mask of (sum T_i)^2 entries and SDPA then does (sum T_i)^2 work per head, most of
it on pairs the mask throws away; with a mask it also repeats grouped K/V heads. Flash-attention
on a GPU avoids both with its varlen kernel; this module does the same on any device with plain
SDPA: one causal call per sequence over its slice of Q, K and V (sum T_i^2 work, no mask, K/V
heads grouped), the outputs concatenated back into the row.

``enable(model)`` switches a model to it: the attention function and its mask function are
registered with transformers under ``NAME`` and the config points at them. Every call that is
not a packed row (a padding mask, a KV cache, one sequence per row) goes to transformers' own SDPA
function with the mask it would have had, so one model serves packed training and padded
evaluation alike. ``_attn_implementation`` is not saved with the config, so a checkpoint still
loads with the attention it was trained under.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "relign_varlen_sdpa"
# Architectures whose decoder hands ``position_ids`` to the attention function and builds only a
# causal (+ padding) mask: the segments are read from the position ids, and nothing else is lost
# by skipping the mask. Others keep SDPA and its block mask.
SUPPORTED = ("qwen2", "qwen3", "llama", "mistral")


def segment_bounds(position_ids: torch.Tensor) -> list[int]:
    """[0, s_1, ..., T] of one row: a sequence starts wherever the position ids do not go up by
    one (a restart at 0, as transformers reads packed rows), and the row ends at T."""
    pos = position_ids.reshape(-1)
    starts = ((pos[1:] - pos[:-1]) != 1).nonzero().squeeze(-1) + 1
    return [0, *starts.tolist(), pos.numel()]


def varlen_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          is_causal=None, **kwargs):
    """transformers' attention-function interface: query [B, H, T, D], key/value [B, H_kv, T, D]
    -> ([B, T, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, _, T, _ = query.shape
    position_ids = kwargs.get("position_ids")
    packed = (attention_mask is None and position_ids is not None and T > 1 and key.shape[2] == T == position_ids.shape[-1]
              and bool((position_ids.diff(dim=-1) != 1).any()))  # one check (and sync) per layer
    if not packed:  # transformers' SDPA path as it is
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    rows = [segment_bounds(r) for r in position_ids.expand(B, -1)]
    gqa = query.shape[1] != key.shape[1]
    p = dropout if module.training else 0.0
    out = [torch.cat([F.scaled_dot_product_attention(query[i : i + 1, :, a:e], key[i : i + 1, :, a:e], value[i : i + 1, :, a:e],
                                                     dropout_p=p, is_causal=True, scale=scaling, enable_gqa=gqa)
                      for a, e in zip(b[:-1], b[1:])], dim=2)
           for i, b in enumerate(rows)]
    return torch.cat(out, dim=0).transpose(1, 2).contiguous(), None


def _mask(*args, attention_mask=None, q_length=None, kv_length=None, q_offset=0, **kwargs):
    # A square, uncached call with no padding mask is a causal row or a packed one; the attention
    # function reads a packed row's sequences from its position ids, so no dense mask is built.
    # Everything else (padding, a KV cache) gets the mask SDPA would have had.
    if attention_mask is None and q_length == kv_length and not q_offset:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     **kwargs)


def supported(model) -> str | None:
    """None when ``enable`` applies to this model, else why not."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return "no config"
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", NAME):
        return f"attn_implementation is {getattr(cfg, '_attn_implementation', None)!r}, not sdpa"
    if getattr(cfg, "model_type", None) not in SUPPORTED:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {', '.join(SUPPORTED)}"
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return "sliding-window attention"
    return None


def enable(model) -> bool:
    """Run packed rows of ``model`` (a transformers model, or a peft/FSDP wrapper sharing its
    config) sequence by sequence; True if it applies (see ``supported``)."""
    if supported(model) is not None:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_sdpa_attention)
    AttentionMaskInterface.register(NAME, _mask)
    model.config._attn_implementation = NAME
    return True


def packed_attention(model, attn_implementation: str) -> None:
    """For a run that packs rows: ``enable`` where it applies; flash-attention needs nothing (its
    varlen kernel reads the position ids); otherwise warn what packing costs."""
    if attn_implementation.startswith("flash_attention") or enable(model):
        return
    import warnings

    warnings.warn(f"packing=true runs attention over a dense block-diagonal mask ({supported(model)}): it then costs "
                  "(sum of lengths)^2 per micro-batch, and packing=false (length-sorted padded micro-batches) is "
                  "usually faster; packing still saves memory.", stacklevel=2)
