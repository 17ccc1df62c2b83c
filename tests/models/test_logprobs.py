"""Chunked log-probs and entropy against the naive full log-softmax."""

from __future__ import annotations

import math

import pytest
import torch

from relign.models.logprobs import entropy_from_logits, selective_log_softmax, shifted_token_logps


def _naive(logits, index):
    return torch.log_softmax(logits.float(), -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_selective_matches_naive(dtype, tol, chunk):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 11, 257, generator=g) * 4).to(dtype)
    index = torch.randint(0, 257, (3, 11), generator=g)
    got = selective_log_softmax(logits, index, chunk_tokens=chunk)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and got.shape == (3, 11)
    # bf16 logits are upcast per chunk, exactly as the naive version upcasts the whole tensor
    naive = torch.log_softmax(logits if dtype == torch.float64 else logits.float(), -1)
    torch.testing.assert_close(got, naive.gather(-1, index.unsqueeze(-1)).squeeze(-1), atol=tol, rtol=0)


def test_selective_gradient_matches_naive():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 5, 33, generator=g, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    idx = torch.randint(0, 33, (2, 5), generator=g)
    selective_log_softmax(a, idx, chunk_tokens=3).sum().backward()
    _naive(b, idx).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_hand_value():
    # logits [0, ln 3] -> softmax [1/4, 3/4]; log p(1) = ln 0.75
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert selective_log_softmax(logits, torch.tensor([1])).item() == pytest.approx(math.log(0.75))
    # entropy of [1/4, 3/4] = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351446
    assert entropy_from_logits(logits).item() == pytest.approx(0.5623351446, abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_matches_naive(dtype):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, 9, 100, generator=g) * 3).to(dtype)
    p = torch.softmax(logits.float(), -1)
    naive = -(p * torch.log_softmax(logits.float(), -1)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_tokens=5), naive, atol=1e-5, rtol=0)


def test_shifted_alignment_and_temperature():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 20, generator=g)
    ids = torch.randint(0, 20, (2, 6), generator=g)
    logps, ent = shifted_token_logps(logits, ids, temperature=0.5, with_entropy=True)
    assert logps.shape == ids.shape and (logps[:, 0] == 0).all() and (ent[:, 0] == 0).all()
    expect = torch.log_softmax(logits[:, 2] / 0.5, -1).gather(-1, ids[:, 3:4]).squeeze(-1)
    torch.testing.assert_close(logps[:, 3], expect)


def test_empty_input():
    out = selective_log_softmax(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_target_mask_scores_only_targets_and_matches_full(tiny_model_dir, temperature):
    """logits_to_keep with an index tensor: same log-probs/entropy/gradients on the targets, 0 elsewhere."""
    from transformers import AutoModelForCausalLM

    from relign.models.logprobs import token_logps

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (3, 12), generator=g)
    target = torch.zeros(3, 12)
    target[0, 5:9] = 1
    target[1, 7:12] = 1
    target[2, 10] = 1
    full, full_ent = token_logps(model, ids, temperature=temperature, with_entropy=True)
    (-(full * target).sum()).backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    part, part_ent = token_logps(model, ids, temperature=temperature, with_entropy=True, target_mask=target)
    (-(part * target).sum()).backward()
    on = target.bool()
    torch.testing.assert_close(part[on], full[on], atol=1e-5, rtol=0)
    torch.testing.assert_close(part_ent[on], full_ent[on], atol=1e-5, rtol=0)
    assert (part[~on] == 0).all() and (part_ent[~on] == 0).all()  # only the targets are scored
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, full_grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_shared_prefix_equals_full_rows(tiny_model_dir):
    """Groups of rows sharing a prompt: computing the prompt once gives the full rows' log-probs,
    entropies and gradients (prompts and responses of different lengths, right padding)."""
    from transformers import AutoModelForCausalLM

    from relign.models.logprobs import shared_prefix_token_logps, token_logps

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    G, prompts = 3, [[5, 6, 7, 8, 9], [10, 11, 12]]
    rows, plens = [], []
    for gi, p in enumerate(prompts):
        for k in range(G):
            # the longest row (long prompt) is not the longest response (short prompt): its
            # padding then points past the batch width, which once overwrote its last token
            rows.append(p + torch.randint(3, 1000, (4 + 2 * k + gi,), generator=g).tolist())
            plens.append(len(p))
    N, L = len(rows), max(map(len, rows))
    ids = torch.zeros(N, L, dtype=torch.long)
    attn = torch.zeros(N, L, dtype=torch.long)
    resp = torch.zeros(N, L)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        resp[i, plens[i] : len(r)] = 1
    full, full_ent = token_logps(model, ids, attention_mask=attn, with_entropy=True, temperature=0.7)
    (-(full * resp).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    shared, shared_ent = shared_prefix_token_logps(model, ids, attn, torch.tensor(plens), G, with_entropy=True, temperature=0.7)
    (-(shared * resp).sum()).backward()
    torch.testing.assert_close(shared, full * resp, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared_ent, full_ent * resp, atol=1e-5, rtol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_right_padding_runs_without_a_mask_and_equals_each_row_alone(tiny_model_dir, monkeypatch):
    """A right-padded attention mask is dropped (SDPA's causal kernel, grouped K/V unrepeated):
    each row's log-probs and the summed gradients equal those of the row run alone, unpadded.
    A mask with a pad before a real token (left padding) is kept."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from relign.models.logprobs import right_padded, token_logps

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query heads
    g = torch.Generator().manual_seed(0)
    lens = [12, 7, 9]
    ids = torch.randint(3, 1000, (3, 12), generator=g)
    mask = (torch.arange(12)[None] < torch.tensor(lens)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    target = mask.clone()
    target[:, :3] = 0
    sdpa, seen = F.scaled_dot_product_attention, []
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: seen.append(k.get("attn_mask")) or sdpa(*a, **k))
    batch, _ = token_logps(model, ids, attention_mask=mask, target_mask=target)
    assert seen and all(m is None for m in seen)
    (-(batch * target).sum()).backward()
    batch_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for i, n in enumerate(lens):
        alone, _ = token_logps(model, ids[i : i + 1, :n], target_mask=target[i : i + 1, :n])
        torch.testing.assert_close(batch[i, :n], alone[0], atol=1e-5, rtol=0)
        assert (batch[i, n:] == 0).all()
        (-(alone * target[i : i + 1, :n]).sum()).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(batch_grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)

    left = mask.flip(-1)
    assert right_padded(mask) and not right_padded(left) and right_padded(torch.ones(2, 4))
    seen.clear()
    token_logps(model, ids.flip(-1), attention_mask=left, target_mask=target.flip(-1))
    assert seen and all(m is not None for m in seen)
