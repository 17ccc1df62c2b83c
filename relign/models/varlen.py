"""Packed rows without a block mask: causal attention sequence by sequence (varlen attention).

A packed row ``[1, sum T_i]`` holds several examples, with position ids that restart at 0 for
each. With ``attn_implementation="sdpa"`` transformers turns those position ids into a dense
block-diagonal mask of (sum T_i)^2 entries and SDPA then does (sum T_i)^2 work per head, most of
it on pairs the mask throws away; with a mask it also repeats grouped K/V heads. This module
runs each sequence on its own (sum T_i^2 work, no mask, K/V heads grouped).

Two ways in, and two kernels:

* **The collator's layout** (``data.collate.Packing``: ``cu_seq_lens_q/k`` int32, a constant
  ``max_length_q/k``, and for continuations the key/value gather index ``relign_kv_index``),
  passed as model kwargs under transformers' names by ``forward_kwargs``, with a ready-made
  empty 4-D mask (``no_mask``) so that transformers builds none: its packed-row check reads
  the device once per forward. Then on CUDA every layer makes one
  ``torch.nn.attention.varlen.varlen_attn`` call (torch's own flash kernel, K/V heads not
  repeated, causal aligned at the bottom right for continuations) and the forward reads
  nothing back to the host. On the CPU (and for fp32 CUDA, which the flash kernel does not take)
  it runs one SDPA call per sequence over the host lengths: today's numbers.
* **Position ids only** (a caller that hands no layout): the sequences are read from the
  position ids in every layer (``segments``: three device reads per layer), each one causal
  SDPA call, continuations batched by length.

``enable(model)`` switches a model to it: the attention function and its mask function are
registered with transformers under ``NAME`` and the config points at them. Every call that is
not a packed row (a padding mask, a KV cache, one sequence per row) goes to transformers' own SDPA
function with the mask it would have had, so one model serves packed training and padded
evaluation alike. ``_attn_implementation`` is not saved with the config, so a checkpoint still
loads with the attention it was trained under.
"""

from __future__ import annotations

import importlib
import inspect

import torch
import torch.nn.functional as F

from ..data.collate import Packing

NAME = "relign_varlen_sdpa"
# Architectures whose decoder hands ``position_ids`` and its kwargs to the attention function,
# builds only a causal (+ padding) mask and takes a 4-D mask as built: the segments are read from
# the layout or the position ids, and nothing else is lost by skipping the mask. Others keep SDPA
# and its block mask.
SUPPORTED = ("qwen2", "qwen3", "llama", "mistral")
KV_INDEX = "relign_kv_index"  # the model kwarg that carries ``Packing.kv_index``


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


def layout_of(position_ids: torch.Tensor) -> Packing:
    """The ``Packing`` of packed rows [B, T] read from their position ids (``segments``; the rows
    count as one of B * T tokens), for callers that hand only position ids: the device is read
    once here instead of in every layer."""
    T = position_ids.shape[-1]
    cu, cu_k, keys, longest = [0], [0], [], 1
    for b, pos in enumerate(position_ids.reshape(-1, T)):
        for a, e, r, s in segments(pos):
            o = b * T
            own = list(range(o + a, o + e))
            keys.extend((list(range(o + r, o + r + s)) if r is not None else []) + own)
            cu.append(o + e)
            cu_k.append(len(keys))
            longest = max(longest, len(keys) - cu_k[-2])
    dev = position_ids.device
    cu_q = torch.tensor(cu, dtype=torch.int32, device=dev)
    if cu_k == cu:  # no continuations: the keys are the row
        return Packing(cu_q, cu_q, longest, longest)
    return Packing(cu_q, torch.tensor(cu_k, dtype=torch.int32, device=dev), longest, longest,
                   torch.tensor(keys, dtype=torch.long, device=dev))


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


def varlen_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          is_causal=None, **kwargs):
    """transformers' attention-function interface: query [B, H, T, D], key/value [B, H_kv, T, D]
    -> ([B, T, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    p = dropout if module.training else 0.0
    if kwargs.get("cu_seq_lens_q") is not None:  # the collator's layout (forward_kwargs): no host reads on CUDA
        return attend(query, key, value, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs["max_length_q"],
                      kwargs["max_length_k"], kwargs.get(KV_INDEX), scale=scaling, dropout=p), None
    B, _, T, _ = query.shape
    position_ids = kwargs.get("position_ids")
    packed = (attention_mask is None and position_ids is not None and T > 1 and key.shape[2] == T == position_ids.shape[-1]
              and bool((position_ids.diff(dim=-1) != 1).any()))  # one check (and sync) per layer
    if not packed:  # transformers' SDPA path as it is
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kw = dict(p=p, scale=scaling, gqa=query.shape[1] != key.shape[1])
    out = [_row_attention(query[i : i + 1], key[i : i + 1], value[i : i + 1], pos, **kw)
           for i, pos in enumerate(position_ids.expand(B, -1))]
    return torch.cat(out, dim=0).transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------- the collator's layout


def attend(query, key, value, cu_seq_q, cu_seq_k, max_q: int, max_k: int, kv_index=None, *, scale=None,
           dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of packed rows sequence by sequence, from their ``Packing``: query
    [B, H, T, D], key/value [B, H_kv, T, D] -> [B, T, H, D]. The B rows are read as one row of
    B * T tokens (the cumulative lengths count over it)."""
    B, H, T, D = query.shape
    q = query.transpose(1, 2).flatten(0, 1)  # [B T, H, D]: a view when B = 1 (the layout varlen_attn takes)
    k, v = (x.transpose(1, 2).flatten(0, 1) for x in (key, value))  # [B T, H_kv, D]
    if kv_index is not None:  # continuations: each sequence's keys are its prefix's then its own
        k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)  # [T_k, H_kv, D]
    kernel = _kernel_for(q, dropout)
    if kernel is None:
        out = _by_sequence(q, k, v, cu_seq_q, cu_seq_k, scale=scale, dropout=dropout)
    else:
        out = kernel(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale)
    return out.reshape(B, T, H, D)


def _by_sequence(q, k, v, cu_seq_q, cu_seq_k, *, scale=None, dropout: float = 0.0) -> torch.Tensor:
    """The CPU twin of ``varlen_attn`` (q [T, H, D], k/v [T_k, H_kv, D] -> [T, H, D]): one causal
    SDPA call per sequence over its slices (views, as ``_row_attention``), the continuations with
    the same (queries, keys) counts batched into one call under the bottom-right causal mask.
    It reads the cumulative lengths on the host: free on the CPU, one sync per layer on CUDA
    (where only fp32 or dropout lands here)."""
    bq, bk = cu_seq_q.tolist(), cu_seq_k.tolist()
    gqa = q.shape[1] != k.shape[1]
    heads = lambda x, a, n: x[a : a + n].transpose(0, 1)  # noqa: E731  [T, H, D] -> [H, n, D]
    pieces: list[torch.Tensor | None] = [None] * (len(bq) - 1)
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(len(bq) - 1):
        nq, nk = bq[i + 1] - bq[i], bk[i + 1] - bk[i]
        if nq == nk:
            pieces[i] = F.scaled_dot_product_attention(heads(q, bq[i], nq)[None], heads(k, bk[i], nk)[None],
                                                       heads(v, bk[i], nk)[None], dropout_p=dropout, is_causal=True,
                                                       scale=scale, enable_gqa=gqa)[0]
        else:
            groups.setdefault((nq, nk), []).append(i)
    for (nq, nk), idx in groups.items():
        stack = lambda x, b, n: torch.stack([heads(x, b[i], n) for i in idx])  # noqa: E731  [m, H, n, D]
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)  # prefix all, own keys causal
        res = F.scaled_dot_product_attention(stack(q, bq, nq), stack(k, bk, nk), stack(v, bk, nk), attn_mask=mask,
                                             dropout_p=dropout, scale=scale, enable_gqa=gqa)
        for i, r in zip(idx, res.unbind(0)):
            pieces[i] = r
    return torch.cat(pieces, dim=1).transpose(0, 1)  # [T, H, D]


_FLASH: dict = {}  # torch's varlen_attn and the keywords this torch spells causal and GQA with, once loaded
REPEAT_KV = False
"""Repeat grouped K/V heads before the flash kernel (bench/ab/varlen.py measures both; the flash
kernel takes H_kv < H itself)."""
CPU_KERNEL = None
"""A one-call kernel for CPU tensors (``reference_varlen_attn``), or None: SDPA by sequence. Tests
and the GPU check's smoke run set it to run the CUDA path's code (layout, gather, one call) on
the CPU: no host reads, one graph under ``torch.compile``."""


def load_flash() -> bool:
    """Import torch's varlen attention (torch >= 2.10) once, outside any compiled region; False
    where this torch has none (the CUDA forward then runs SDPA by sequence)."""
    if not _FLASH and importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        fn = importlib.import_module("torch.nn.attention.varlen").varlen_attn
        params = inspect.signature(fn).parameters
        # 2.10 spells causal is_causal=True, 2.11 on window_size=(-1, 0); 2.12 adds enable_gqa (a
        # Python check: the kernel itself has always taken fewer K/V heads)
        causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        _FLASH.update(fn=fn, causal=causal, gqa="enable_gqa" in params)
    return bool(_FLASH)


def _flash(q, k, v, cu_seq_q, cu_seq_k, max_q: int, max_k: int, *, scale=None) -> torch.Tensor:
    """``varlen_attn`` in the autocast dtype (it is not autocast-aware; the flash kernel takes
    bf16/fp16 only), causal, K/V heads as they are."""
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
    q, k, v = (x.to(dtype) for x in (q, k, v))
    kw = dict(_FLASH["causal"])
    if q.shape[1] != k.shape[1]:
        if REPEAT_KV:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        elif _FLASH["gqa"]:
            kw["enable_gqa"] = True
    return _FLASH["fn"](q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, **kw)


def _kernel_for(q: torch.Tensor, dropout: float):
    """The one-call varlen kernel for ``q``'s device and dtype, or None (SDPA by sequence): CUDA,
    torch's varlen attention loaded, a half-precision compute dtype and no dropout; on the CPU
    ``CPU_KERNEL``, and the dense reference inside ``torch.compile`` (the eager twin's host
    reads would break the graph at every layer; its O(T T_k) mask is what a CPU run can afford)."""
    if q.device.type == "cpu" and not dropout:
        if CPU_KERNEL is not None:
            return CPU_KERNEL
        if torch.compiler.is_compiling():  # a compiled CPU layer (model.compile=true): one graph, no host reads
            return reference_varlen_attn
    if q.device.type != "cuda" or not _FLASH or dropout:
        return None
    half = (torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in (torch.bfloat16, torch.float16)
            ) or q.dtype in (torch.bfloat16, torch.float16)
    return _flash if half else None


def reference_varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q: int, max_k: int, *, scale=None) -> torch.Tensor:
    """What ``varlen_attn(..., window_size=(-1, 0))`` computes, as one dense masked SDPA call built
    from the cumulative lengths on the device (no host reads; O(T T_k) memory): each query sees
    the keys of its own sequence up to its own offset from the bottom right. The stand-in for the
    flash kernel in CPU tests and in the GPU check's alignment test."""
    seq_q = torch.searchsorted(cu_seq_q[1:].long(), torch.arange(q.shape[0], device=q.device), right=True)  # [T]
    seq_k = torch.searchsorted(cu_seq_k[1:].long(), torch.arange(k.shape[0], device=k.device), right=True)  # [T_k]
    at_q = torch.arange(q.shape[0], device=q.device) - cu_seq_q[seq_q]  # each query's index in its sequence
    at_k = torch.arange(k.shape[0], device=k.device) - cu_seq_k[seq_k]
    shift = (cu_seq_k.diff() - cu_seq_q.diff())[seq_q]  # keys before the sequence's own (a continuation's prefix)
    mask = (seq_q[:, None] == seq_k[None, :]) & (at_k[None, :] <= (at_q + shift)[:, None])  # [T, T_k]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def no_mask(batch_size: int, device) -> torch.Tensor:
    """An empty [B, 1, 0, 0] attention mask: transformers takes any 4-D mask as already built and
    skips building its own (which would read the device once per forward to look for packed
    rows); the attention function reads the sequences from the layout instead and ignores it."""
    return torch.ones(batch_size, 1, 0, 0, dtype=torch.bool, device=device)


def forward_kwargs(model, packing: Packing | None, batch_size: int = 1) -> dict:
    """The model kwargs that hand ``packing`` to the attention (transformers' flash-attention names
    plus ``relign_kv_index``, and ``no_mask``), or {} where ``model`` does not run this module's
    attention (it then reads the position ids as before)."""
    if packing is None or not active(model):
        return {}
    if packing.cu_seq_lens_q.device.type == "cuda":
        load_flash()
    return {"attention_mask": no_mask(batch_size, packing.cu_seq_lens_q.device),
            "cu_seq_lens_q": packing.cu_seq_lens_q, "cu_seq_lens_k": packing.cu_seq_lens_k,
            "max_length_q": packing.max_length_q, "max_length_k": packing.max_length_k, KV_INDEX: packing.kv_index}


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
