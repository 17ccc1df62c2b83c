"""Summed response log-probs of preference pairs: packed, shared-prompt and padded rows agree
with each row run alone, and so do their gradients."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from relign.data.preference import PairExample, UnpairedExample
from relign.models import varlen
from relign.recipes.pairs import collate_pairs, collate_unpaired, sequence_logps


def _pairs() -> list[PairExample]:
    rng = random.Random(0)
    out = []
    for plen, c, r in [(5, 9, 3), (1, 4, 12), (11, 1, 6), (3, 7, 7)]:  # a one-token prompt, a one-token response
        prompt = [rng.randrange(3, 200) for _ in range(plen)]
        chosen = prompt + [rng.randrange(3, 200) for _ in range(c)]
        rejected = prompt + [rng.randrange(3, 200) for _ in range(r)]
        out.append(PairExample(chosen, [0] * plen + [1] * c, rejected, [0] * plen + [1] * r, plen))
    return out


def _alone(model, ids: list[int], mask: list[int]) -> torch.Tensor:
    """sum_t mask_t log p(x_t | x_<t), the row run by itself."""
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return (lp * torch.tensor(mask[1:], dtype=lp.dtype)).sum()


@pytest.fixture()
def models(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    packed = copy.deepcopy(model)
    assert varlen.enable(packed)  # what dpo does with packing=true
    return model, packed


@pytest.mark.parametrize("layout", ["packed", "packed, prompt once", "packed, prompt once, cuda path", "shared", "padded"])
def test_pair_logps_equal_each_row_alone_with_gradients(models, layout, monkeypatch):
    model, packed = models
    if layout.endswith("cuda path"):  # one gathered varlen call per layer, the flash kernel replaced by the dense reference
        monkeypatch.setattr(varlen, "CPU_KERNEL", varlen.reference_varlen_attn)
    net = packed if layout.startswith("packed") else model
    pairs = _pairs()
    mb = collate_pairs(pairs, 0, "cpu")
    logps, lengths = sequence_logps(net, mb, share_prompt=layout == "shared" or "prompt once" in layout,
                                    packed=layout.startswith("packed"))
    rows = [r for p in pairs for r in ((p.chosen_ids, p.chosen_mask), (p.rejected_ids, p.rejected_mask))]
    want = torch.stack([_alone(model, ids, mask) for ids, mask in rows])
    torch.testing.assert_close(logps, want, atol=2e-5, rtol=0)
    assert lengths.tolist() == [float(sum(m)) for _, m in rows]
    w = torch.linspace(-1, 1, len(rows))  # a loss that weighs the rows differently
    net.zero_grad(set_to_none=True)
    (logps * w).sum().backward()
    got = {n: p.grad.clone() for n, p in net.named_parameters()}
    model.zero_grad(set_to_none=True)
    (want * w).sum().backward()
    # fp32 sums in another order: the tied embedding's gradient adds up every scored position's
    # LM-head and input terms, and with 2 threads it lands ~2e-6 of its largest entry away
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-5 * p.grad.abs().max().item() + 1e-8, rtol=0, msg=n)


def test_packed_pairs_run_each_prompt_once(models, monkeypatch):
    """With share_prompt the packed row holds each prompt once, plus its last token again before
    the rejected response: the tokens the forward sees, counted."""
    _, packed = models
    pairs = _pairs()
    seen = []
    real = packed.model.forward  # the decoder stack: the model's own forward and the fused head (token_logps) both run it
    monkeypatch.setattr(packed.model, "forward", lambda input_ids=None, **kw: seen.append(input_ids.shape[1]) or real(input_ids=input_ids, **kw))
    with torch.no_grad():
        sequence_logps(packed, collate_pairs(pairs, 0, "cpu"), share_prompt=True, packed=True)
    assert seen == [sum(len(p.chosen_ids) + len(p.rejected_ids) - p.prompt_len + 1 for p in pairs)]


def test_a_model_without_varlen_shares_the_prompt_through_its_kv_cache(models):
    """A reference of another architecture (no varlen) asked for packed shared rows would read a
    continuation as a sequence of its own: it runs the padded shared-prompt path instead."""
    model, packed = models
    mb = collate_pairs(_pairs(), 0, "cpu")
    with torch.no_grad():
        a, _ = sequence_logps(model, mb, share_prompt=True, packed=True)
        b, _ = sequence_logps(packed, mb, share_prompt=True, packed=True)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_unpaired_packed_equals_padded(models):
    model, packed = models
    exs = [UnpairedExample(p.chosen_ids, p.chosen_mask, p.prompt_len, True) for p in _pairs()]
    mb = collate_unpaired(exs, 0, "cpu")
    with torch.no_grad():
        a, na = sequence_logps(packed, mb, share_prompt=False, packed=True)
        b, nb = sequence_logps(model, mb, share_prompt=False)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    assert na.tolist() == nb.tolist()
