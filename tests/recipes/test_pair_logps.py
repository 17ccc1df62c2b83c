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


@pytest.mark.parametrize("layout", ["packed", "shared", "padded"])
def test_pair_logps_equal_each_row_alone_with_gradients(models, layout):
    model, packed = models
    net = packed if layout == "packed" else model
    pairs = _pairs()
    mb = collate_pairs(pairs, 0, "cpu")
    logps, lengths = sequence_logps(net, mb, share_prompt=layout == "shared", packed=layout == "packed")
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
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=2e-6 * p.grad.abs().max().item() + 1e-8, rtol=0, msg=n)


def test_unpaired_packed_equals_padded(models):
    model, packed = models
    exs = [UnpairedExample(p.chosen_ids, p.chosen_mask, p.prompt_len, True) for p in _pairs()]
    mb = collate_unpaired(exs, 0, "cpu")
    with torch.no_grad():
        a, na = sequence_logps(packed, mb, share_prompt=False, packed=True)
        b, nb = sequence_logps(model, mb, share_prompt=False)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    assert na.tolist() == nb.tolist()
