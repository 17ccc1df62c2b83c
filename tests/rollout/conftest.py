"""Fixtures for the rollout tests: a tiny model with a sharper, untied output head.

The micro model's tied head makes greedy decoding repeat the last token forever and its
distributions nearly uniform; an untied random head (std 0.3, with a bias) gives varied text,
peaked distributions (so top-p/top-k matter) and lets a test push one token's logit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ..conftest import torch_threads


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def sharp_model_proto(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    V, H = model.lm_head.weight.shape
    g = torch.Generator().manual_seed(1234)
    head = torch.nn.Linear(H, V, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
        head.bias.zero_()
    model.lm_head = head
    model.config.tie_word_embeddings = False
    model.eval()
    return model


@pytest.fixture
def model(sharp_model_proto):
    """A fresh copy per test (some tests change weights)."""
    return copy.deepcopy(sharp_model_proto)


@pytest.fixture
def enc(tokenizer):
    return lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]


@pytest.fixture
def compactions(monkeypatch):
    """Record every batch compaction (rows kept) the engine does on its decode state."""
    from relign.rollout.hf_engine import HFEngine

    calls: list[int] = []
    orig = HFEngine._compact

    def spy(self, slot, rows, kv, keep):
        calls.append(len(keep))
        return orig(self, slot, rows, kv, keep)

    monkeypatch.setattr(HFEngine, "_compact", spy)
    return calls


def trainer_logps(model, prompts: list[list[int]], responses: list[list[int]], temperature: float) -> list[list[float]]:
    """What the trainer recomputes: token_logps over right-padded prompt+response rows."""
    from relign.models.logprobs import token_logps

    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    T = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), T), dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        lp, _ = token_logps(model, ids, attention_mask=mask, temperature=temperature)
    return [lp[i, len(p) : len(p) + len(r)].tolist() for i, (p, r) in enumerate(zip(prompts, responses))]
