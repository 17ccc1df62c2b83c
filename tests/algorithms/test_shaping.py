"""DAPO shaping: dynamic-sampling group filter, soft overlong punishment, overlong filtering."""

from __future__ import annotations

import pytest
import torch

from relign.algorithms.advantages import group_advantages
from relign.algorithms.shaping import (
    keep_mask_for_rows,
    overlong_penalty,
    truncation_loss_mask,
    zero_variance_groups,
)


def test_zero_variance_groups_by_hand():
    # groups of 2: [1, 1] equal; [0, 1] not; [0, 0] equal; [0.5, 0.5] equal
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert zero_variance_groups(r, 2).tolist() == [True, False, True, True]
    # exactly the groups whose GRPO advantages are all 0
    A = group_advantages(r, 2).reshape(4, 2)
    assert (A == 0).all(dim=-1).tolist() == [True, False, True, True]


def test_zero_variance_groups_eps_and_group_of_one():
    r = torch.tensor([1.0, 1.0 + 1e-9, 1.0, 1.0 + 1e-3], dtype=torch.float64)
    assert zero_variance_groups(r, 2).tolist() == [True, False]  # spread 1e-9 <= eps 1e-8
    assert zero_variance_groups(r, 2, eps=1e-2).tolist() == [True, True]
    assert zero_variance_groups(torch.tensor([0.0, 1.0, 2.0]), 1).tolist() == [True, True, True]
    with pytest.raises(ValueError, match="groups of 3"):
        zero_variance_groups(torch.zeros(4), 3)


def test_keep_mask_for_rows():
    # group 0 kept, group 1 dropped, G = 3 -> rows [T, T, T, F, F, F]
    assert keep_mask_for_rows(torch.tensor([True, False]), 3).tolist() == [True, True, True, False, False, False]
    r = torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert keep_mask_for_rows(~zero_variance_groups(r, 2), 2).tolist() == [False, False, True, True]


def test_overlong_penalty_by_hand():
    # L_max 20, L_cache 4 -> ramp starts after 16:
    #   L 10 -> 0;  16 -> 0;  17 -> (16-17)/4 = -0.25;  18 -> -0.5;  20 -> (16-20)/4 = -1;  21 -> -1
    L = torch.tensor([10, 16, 17, 18, 20, 21])
    want = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(L, max_len=20, cache_len=4), want)
    # factor 0.5 halves every value
    torch.testing.assert_close(
        overlong_penalty(L, max_len=20, cache_len=4, factor=0.5), torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    )
    # cache_len 0: a hard step, 0 up to L_max, -1 beyond (no 0/0)
    want = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -1.0])
    torch.testing.assert_close(overlong_penalty(L, max_len=20, cache_len=0), want)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(L, max_len=20, cache_len=30)


def test_overlong_penalty_matches_naive_formula():
    def naive(L, Lmax, Lc, f):
        if L <= Lmax - Lc:
            return 0.0
        if L <= Lmax:
            return ((Lmax - Lc) - L) / Lc * f
        return -f

    L = torch.arange(0, 140)
    got = overlong_penalty(L, max_len=128, cache_len=32, factor=0.7)
    want = torch.tensor([naive(x, 128, 32, 0.7) for x in L.tolist()])
    torch.testing.assert_close(got, want)
    assert (got <= 0).all() and (got >= -0.7).all()


def test_truncation_loss_mask():
    # row 1 truncated -> its mask becomes 0; the others are unchanged (float and bool masks)
    m = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = truncation_loss_mask(torch.tensor([False, True, False]), m)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    out_b = truncation_loss_mask(torch.tensor([True, False, False]), m.bool())
    assert out_b.dtype == torch.bool and out_b.tolist() == [[False] * 3, [True] * 3, [True, True, False]]
