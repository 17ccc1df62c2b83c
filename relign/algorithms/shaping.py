"""Reward and batch shaping from DAPO (Yu et al., arXiv 2503.14476).

* Dynamic sampling: groups whose G rewards are all equal have group-relative advantage 0
  and give no gradient; DAPO drops them and samples more prompts until the batch is full.
  ``zero_variance_groups`` finds them, ``keep_mask_for_rows`` turns a per-group decision
  into a per-row one. The refilling itself is the recipe's job.
* Soft overlong punishment (eq. 13): a length-dependent penalty added to the reward,

      R_length(L) = 0                                   if L <= L_max - L_cache
                  = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
                  = -1                                  if L > L_max

  (times ``factor``; DAPO uses factor 1). ``overlong_penalty``.
* Overlong filtering: truncated completions are left out of the loss, since cutting a
  possibly-correct answer at the length limit and scoring it as wrong is noise.
  ``truncation_loss_mask``.
"""

from __future__ import annotations

import torch


def zero_variance_groups(rewards: torch.Tensor, group_size: int, *, eps: float = 1e-8) -> torch.Tensor:
    """True for each group whose rewards are all equal (max - min <= eps), [B] -> bool [B // G].

    A group of size 1 is always True: a single sample has nothing to be compared with and its
    group-relative advantage is 0.
    """
    if group_size < 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(f"batch of {rewards.shape[0]} rows does not split into groups of {group_size}")
    r = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32)).reshape(-1, group_size)  # [B/G, G]
    return (r.amax(dim=-1) - r.amin(dim=-1)) <= eps


def keep_mask_for_rows(group_keep: torch.Tensor, group_size: int) -> torch.Tensor:
    """Repeat a per-group bool [B // G] over the G rows of each group -> bool [B].
    E.g. ``keep_mask_for_rows(~zero_variance_groups(r, G), G)`` selects the rows to train on."""
    return group_keep.bool().repeat_interleave(group_size)


def overlong_penalty(
    lengths: torch.Tensor,
    *,
    max_len: int,
    cache_len: int,
    factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476, eq. 13), lengths [B] -> penalty [B].

    0 up to L_max - L_cache, then a linear ramp down to -factor at L = L_max, and -factor
    beyond. The ramp meets both pieces, so the penalty is continuous in L. cache_len = 0
    gives a hard step at L_max (the ramp interval is empty; the formula's 0/0 never occurs).
    The recipe adds the result to the task reward.
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    L = lengths.to(torch.float32)
    start = float(max_len - cache_len)  # L_max - L_cache
    ramp = (start - L) / max(cache_len, 1) * factor  # only used where cache_len > 0
    penalty = torch.where(L <= start, torch.zeros_like(L), ramp)
    return torch.where(L > max_len, torch.full_like(L, -factor), penalty)


def truncation_loss_mask(truncated: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Overlong filtering (DAPO): the loss mask [B, T] with the rows of truncated completions
    (truncated: bool [B]) set to 0. Same dtype as ``mask``."""
    keep = (~truncated.bool()).unsqueeze(-1)  # [B, 1]
    return mask * keep.to(mask.dtype)
