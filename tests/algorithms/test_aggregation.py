"""aggregate(): every mode by hand, global normalizers, packed segments, empty masks."""

from __future__ import annotations

import pytest
import torch

from relign.algorithms.aggregation import aggregate, aggregate_count

# Two sequences: row 0 has 3 valid tokens (1, 2, 3), row 1 has 1 valid token (4).
V = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
M = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_token_mean_by_hand():
    # (1 + 2 + 3 + 4) / 4 tokens = 2.5
    assert aggregate(V, M, "token-mean").item() == pytest.approx(2.5)


def test_seq_mean_token_mean_by_hand():
    # seq means: (1+2+3)/3 = 2 and 4/1 = 4; mean over 2 sequences = 3
    assert aggregate(V, M, "seq-mean-token-mean").item() == pytest.approx(3.0)


def test_seq_mean_token_sum_by_hand():
    # seq sums: 6 and 4; mean over 2 sequences = 5
    assert aggregate(V, M, "seq-mean-token-sum").item() == pytest.approx(5.0)


def test_seq_mean_token_sum_norm_by_hand():
    # Dr. GRPO: (6 + 4) / (2 sequences * L=4) = 1.25; with max_len 10: 10 / 20 = 0.5
    assert aggregate(V, M, "seq-mean-token-sum-norm").item() == pytest.approx(1.25)
    assert aggregate(V, M, "seq-mean-token-sum-norm", max_len=10).item() == pytest.approx(0.5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_split_batches_with_global_normalizer_sum_to_full(mode):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(6, 5, generator=g)
    m = (torch.rand(6, 5, generator=g) > 0.3).float()
    m[:, 0] = 1
    full = aggregate(v, m, mode, max_len=5)
    n = sum(aggregate_count(m[i : i + 2], mode, max_len=5) for i in range(0, 6, 2))
    parts = sum(aggregate(v[i : i + 2], m[i : i + 2], mode, n, max_len=5) for i in range(0, 6, 2))
    torch.testing.assert_close(parts, full)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_packed_segments_equal_padded_rows(mode):
    # Pack the two rows above into one row [1, 2, 3, 4] with segments [0, 0, 0, 1].
    packed_v = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    packed_m = torch.ones(1, 4)
    seg = torch.tensor([[0, 0, 0, 1]])
    assert aggregate(packed_v, packed_m, mode, segment_ids=seg).item() == pytest.approx(aggregate(V, M, mode).item())
    assert aggregate_count(packed_m, mode, segment_ids=seg).item() == aggregate_count(M, mode).item()


def test_empty_mask_is_zero_not_nan():
    for mode in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        out = aggregate(V, torch.zeros_like(M), mode)
        assert out.item() == 0.0


def test_sequence_with_empty_mask_does_not_count():
    m = M.clone()
    m[1] = 0
    # only row 0 remains: seq mean 2, one sequence
    assert aggregate(V, m, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert aggregate_count(m, "seq-mean-token-mean").item() == 1


def test_unknown_mode():
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        aggregate(V, M, "mean")
