"""Token budgets by device (models.budget): the CPU keeps its default, CUDA gets 32k tokens or
what its free memory holds, worked out by hand."""

from __future__ import annotations

import types

import pytest
import torch

from relign.models import budget


def _model():
    """A model of hidden 64, 2 layers, a 1,000-token vocabulary, 110 trainable parameters (and 10 frozen)."""
    m = torch.nn.Module()
    m.config = types.SimpleNamespace(hidden_size=64, num_hidden_layers=2, vocab_size=1000)
    m.train_me = torch.nn.Linear(10, 10)  # 100 + 10
    m.frozen = torch.nn.Parameter(torch.zeros(10), requires_grad=False)
    return m


def test_bytes_per_token_by_hand():
    # 2 layers x 48 x 64 + 6 x 1000 = 6,144 + 6,000
    assert budget.bytes_per_token(_model()) == 12144
    # checkpointing: 2 x (4 x 64 + 48 x 64 / 2) + 6,000 = 2 x 1,792 + 6,000
    assert budget.bytes_per_token(_model(), checkpointing=True) == 9584


def test_the_cpu_keeps_its_default_and_a_setting_wins(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: pytest.fail("the CPU asks no GPU"))
    assert budget.device_tokens(None, _model(), "cpu", cpu=4096) == 4096
    assert budget.device_tokens(None, _model(), "cpu", cpu=0) == 0
    assert budget.device_tokens(0, _model(), "cuda", cpu=4096) == 0  # 0 = no limit, on any device
    assert budget.device_tokens(8192, _model(), "cuda:0", cpu=4096) == 8192


@pytest.mark.parametrize("free, checkpointing, want", [
    (1 << 30, False, 32768),        # 0.6 (2^30 - 12 x 110) / 12,144 = 53,050 tokens: capped at 32,768
    (100 << 20, False, 5120),       # 0.6 (104,857,600 - 1,320) / 12,144 = 5,180 -> 5 x 1,024
    (100 << 20, True, 6144),        # ... / 9,584 = 6,564 -> 6 x 1,024
    (1 << 20, False, 1024),         # 51 tokens: never under 1,024
])
def test_cuda_from_free_memory_by_hand(monkeypatch, free, checkpointing, want):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    assert budget.device_tokens(None, _model(), "cuda", cpu=4096, checkpointing=checkpointing) == want
