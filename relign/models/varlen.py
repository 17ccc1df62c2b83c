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


def segments(position_ids: torch.Tensor) -> list[tuple[int, int, int | None, int]]:
    """The sequences ``(a, e, r, s)`` of one packed row: tokens ``[a, e)``, first position ``s``.

    A sequence whose positions start at 0 stands alone (``r`` None). One that starts at ``s > 0``
    *continues the first s tokens of its root*, the latest sequence before it that started at 0
    (at column ``r``), if that holds at least ``s`` tokens: it attends to them and to itself, causally, as
    if it followed them in its own row. That is how a group's responses share their prompt in a
    packed row: ``[prompt, response_1][prompt[-1], response_2]...``, with position ids
    ``0..P+T_1-1, P-1..P-1+T_2, ...``, runs the prompt once (each continuation repeats the
    prompt's last token, whose logits score the response's first). A start at ``s > 0`` with no
    long enough root before it stands alone, as transformers reads it."""
    bounds = segment_bounds(position_ids)
    first = position_ids.reshape(-1)[bounds[:-1]].tolist()
    out, root, root_len = [], None, 0
    for a, e, s in zip(bounds[:-1], bounds[1:], first):
        if s == 0:
            root, root_len = a, e - a
        out.append((a, e, root if s and root is not None and s <= root_len else None, s))
    return out


def _row_attention(q, k, v, pos, *, p: float, scale, gqa: bool) -> torch.Tensor:
    """One packed row: q [1, H, T, D], k/v [1, H_kv, T, D] -> [1, H, T, D]. Each standalone
    sequence is one causal call over its own slice; the continuations of one root that share the
    same prefix length and own length run as one batched call against [prefix keys; own keys],
    with the offset causal mask (prefix all visible, own keys up to the query)."""
    pieces: dict[int, torch.Tensor] = {}
    batches: dict[tuple[int, int, int], list[int]] = {}
    for a, e, r, s in segments(pos):
        if r is None:
            pieces[a] = F.scaled_dot_product_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], dropout_p=p,
                                                       is_causal=True, scale=scale, enable_gqa=gqa)[0]
        else:
            batches.setdefault((r, s, e - a), []).append(a)
    for (r, s, n), starts in batches.items():
        own = lambda x: torch.stack([x[0, :, a : a + n] for a in starts])  # noqa: E731  [m, H, n, D]
        ctx = lambda x: torch.cat([x[:, :, r : r + s].expand(len(starts), -1, -1, -1), own(x)], dim=2)  # noqa: E731
        mask = torch.ones(n, s + n, dtype=torch.bool, device=q.device)
        mask[:, s:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        res = F.scaled_dot_product_attention(own(q), ctx(k), ctx(v), attn_mask=mask, dropout_p=p, scale=scale,
                                             enable_gqa=gqa)
        pieces.update(zip(starts, res.unbind(0)))
    return torch.cat([pieces[a] for a in sorted(pieces)], dim=1)[None]


def pack_index(lens: torch.Tensor, starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [S], col [S]): columns ``starts[i] .. lens[i] - 1`` of each right-padded row ``i``, row
    after row, as one packed row. ``col`` is also each token's position id: a row packed from
    column 0 stands alone, and one packed from ``P - 1`` (its prompt's last token) continues the
    prompt of the row before it (``segments``)."""
    starts = torch.zeros_like(lens) if starts is None else starts
    counts = lens - starts
    row = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), counts)
    offset = torch.repeat_interleave(starts - (counts.cumsum(0) - counts), counts)
    return row, torch.arange(int(counts.sum()), device=lens.device) + offset


def continuation_starts(prompt_lens: torch.Tensor, continues: torch.Tensor) -> torch.Tensor:
    """``pack_index``'s starts: ``P_i - 1`` where row ``i`` shares the previous row's prompt of
    ``P_i`` tokens (``continues[i]``), else 0."""
    return torch.where(continues, (prompt_lens - 1).clamp_min(0), torch.zeros_like(prompt_lens))


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
    kw = dict(p=dropout if module.training else 0.0, scale=scaling, gqa=query.shape[1] != key.shape[1])
    out = [_row_attention(query[i : i + 1], key[i : i + 1], value[i : i + 1], pos, **kw)
           for i, pos in enumerate(position_ids.expand(B, -1))]
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


packed_mask = _mask  # the mask function of an attention that reads packed rows (models.cp registers it too)


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


WRAPPERS: set[str] = set()
"""Attention functions that run this module's on packed rows and so read continuations too
(context parallel's Ulysses attention, ``models.cp``, adds itself)."""


def active(model) -> bool:
    """Whether ``model`` runs this module's attention (and so reads continuations)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl == NAME or impl in WRAPPERS


def packed_attention(model, attn_implementation: str) -> bool:
    """For a run that packs rows: ``enable`` where it applies; flash-attention needs nothing (its
    varlen kernel reads the position ids); otherwise warn what packing costs. True when the
    model now runs this module's attention, which also reads continuations (``segments``):
    only then may a packed row share a prompt between sequences."""
    if enable(model):
        return True
    if attn_implementation.startswith("flash_attention"):
        return False
    import warnings

    warnings.warn(f"packing=true runs attention over a dense block-diagonal mask ({supported(model)}): it then costs "
                  "(sum of lengths)^2 per micro-batch, and packing=false (length-sorted padded micro-batches) is "
                  "usually faster; packing still saves memory.", stacklevel=2)
    return False


def choose(models, attn_implementation: str, *, packing: bool, share: bool) -> tuple[bool, bool]:
    """(pack, share) for a run's models (the policy, and its reference and critic if any).

    ``packing``: packed rows (``packed_attention`` on each model); a group's sequences then
    share their prompt in the row only if every model reads continuations. Else ``share`` (run
    each group's prompt once): where this module's attention applies to every model it does
    so in a packed row, the group's responses continuing the prompt (no padding, no mask, K/V
    heads grouped); otherwise the caller's padded shared-prompt path (a KV cache of the prompt)."""
    models = [m for m in models if m is not None]
    if packing:
        continued = all([packed_attention(m, attn_implementation) for m in models])
        return True, share and continued
    if share and all(supported(m) is None for m in models):
        return all([enable(m) for m in models]), True
    return False, share
