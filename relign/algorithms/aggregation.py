"""Reduce per-token values (losses) to one scalar, with the reduction named and explicit.

The normalizer is separate so a recipe can pass the count over the *whole* step's batch
(all micro-batches, all ranks). Then sum over micro-batches of ``aggregate(...)`` equals the
loss of the full batch, whatever the micro-batch size, packing or number of ranks.

Modes (values v, mask m, sequences i, tokens t, |o_i| = tokens of sequence i):

* ``token-mean``              sum_{i,t} m v / sum_{i,t} m                     (DAPO; SFT default)
* ``seq-mean-token-mean``     1/N sum_i ( sum_t m v / |o_i| )                  (GRPO, DeepSeekMath)
* ``seq-mean-token-sum``      1/N sum_i sum_t m v
* ``seq-mean-token-sum-norm`` 1/(N L) sum_i sum_t m v, L a constant max length (Dr. GRPO)
"""

from __future__ import annotations

import torch

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _segments(mask: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
    """A sequence id per token: the row index, or the given ids for packed rows."""
    if segment_ids is not None:
        return segment_ids.long()
    rows = torch.arange(mask.shape[0], device=mask.device).unsqueeze(-1)
    return rows.expand_as(mask)


def aggregate_count(
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    segment_ids: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """The local denominator of ``mode``: masked tokens, or sequences with at least one
    masked token (times ``max_len`` for seq-mean-token-sum-norm). Sum it over micro-batches
    and ranks and pass the total as ``normalizer``."""
    if mode not in MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {', '.join(MODES)}")
    m = mask.to(torch.float32)
    if mode == "token-mean":
        return m.sum()
    seg = _segments(mask, segment_ids)[mask.bool()]
    n_seq = torch.tensor(float(torch.unique(seg).numel()), device=mask.device)
    if mode == "seq-mean-token-sum-norm":
        return n_seq * float(max_len if max_len is not None else mask.shape[-1])
    return n_seq


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    *,
    segment_ids: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce ``values`` [B, T] over ``mask`` [B, T] to a scalar, see the module docstring.

    normalizer: the denominator; ``None`` uses this batch's own ``aggregate_count``.
    segment_ids: [B, T] ids of the example each token belongs to, for packed rows (ids must
    be unique across the tensor); ``None`` means one example per row.
    An empty mask gives 0 (not NaN) when no normalizer is given.
    """
    if mode not in MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {', '.join(MODES)}")
    m = mask.to(values.dtype)
    if normalizer is None:
        normalizer = aggregate_count(mask, mode, segment_ids=segment_ids, max_len=max_len)
    if isinstance(normalizer, torch.Tensor):
        normalizer = normalizer.to(values.dtype).clamp_min(1e-8)
    else:
        normalizer = max(float(normalizer), 1e-8)

    if mode == "seq-mean-token-mean":
        # weight each token by 1/|o_i| of its own sequence, then sum
        seg = _segments(mask, segment_ids)
        flat_seg = seg.reshape(-1)
        offset = flat_seg.min() if flat_seg.numel() else 0
        counts = torch.bincount((flat_seg - offset), weights=m.reshape(-1).float())
        per_token = counts[(flat_seg - offset)].reshape(seg.shape).to(values.dtype).clamp_min(1.0)
        return (values * m / per_token).sum() / normalizer
    return (values * m).sum() / normalizer
