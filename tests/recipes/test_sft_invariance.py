"""The SFT step's loss and gradient do not depend on micro-batching or packing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from relign.data.sft import SFTExample
from relign.models import varlen
from relign.recipes.sft import accumulate_gradients


def _examples(tokenizer) -> list[SFTExample]:
    texts = [
        ("What is 2 + 3?", "2 + 3 = 5. The answer is 5."),
        ("Name a color.", "Blue"),
        ("Count to four.", "one two three four, and that is all of them"),
        ("Say hi.", "hi"),
    ]
    out = []
    for p, r in texts:
        pi = tokenizer(p)["input_ids"]
        ri = tokenizer(r)["input_ids"] + [tokenizer.eos_token_id]
        out.append(SFTExample(pi + ri, [0] * len(pi) + [1] * len(ri)))
    assert len({len(e) for e in out}) > 1  # different lengths, so padding matters
    return out


def _grads(model_dir, examples, *, by_sequence=False, checkpointing=False, **kw):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if by_sequence:  # what sft.train does with packing=true: no block mask (relign.models.varlen)
        assert varlen.enable(model)
    if checkpointing:  # the backward pass reruns each layer's forward: it must split the row the same way
        if hasattr(model, "activation_checkpointing_enable"):  # the newer name (loading.py does the same)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    loss = accumulate_gradients(model, examples, pad_id=0, device="cpu", **kw)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b, tol=1e-5):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.allclose(loss_a, loss_b, atol=tol, rtol=0), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=tol, rtol=0, msg=name)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_times_accumulation_invariance(tiny_model_dir, tokenizer, loss_agg):
    ex = _examples(tokenizer)
    one_by_four = _grads(tiny_model_dir, ex, micro_batch_size=1, packing=False, loss_agg=loss_agg)
    four_by_one = _grads(tiny_model_dir, ex, micro_batch_size=4, packing=False, loss_agg=loss_agg)
    two_by_two = _grads(tiny_model_dir, ex, micro_batch_size=2, packing=False, loss_agg=loss_agg)
    _assert_same(one_by_four, four_by_one)
    _assert_same(two_by_two, four_by_one)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("by_sequence", [False, True], ids=["block-mask", "by-sequence"])
def test_packed_equals_padded(tiny_model_dir, tokenizer, loss_agg, micro, by_sequence):
    ex = _examples(tokenizer)
    padded = _grads(tiny_model_dir, ex, micro_batch_size=4, packing=False, loss_agg=loss_agg)
    packed = _grads(tiny_model_dir, ex, micro_batch_size=micro, packing=True, loss_agg=loss_agg, by_sequence=by_sequence)
    _assert_same(packed, padded)


def test_packed_by_sequence_with_gradient_checkpointing(tiny_model_dir, tokenizer):
    ex = _examples(tokenizer)
    padded = _grads(tiny_model_dir, ex, micro_batch_size=4, packing=False, loss_agg="token-mean")
    packed = _grads(tiny_model_dir, ex, micro_batch_size=4, packing=True, loss_agg="token-mean", by_sequence=True,
                    checkpointing=True)
    _assert_same(packed, padded)


def test_loss_is_the_hand_written_nll(tiny_model_dir, tokenizer):
    """token-mean loss == mean over trainable tokens of -log p(token | prefix), computed naively."""
    ex = _examples(tokenizer)
    loss, _ = _grads(tiny_model_dir, ex, micro_batch_size=2, packing=True, loss_agg="token-mean")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    nll, n = 0.0, 0
    with torch.no_grad():
        for e in ex:
            ids = torch.tensor([e.input_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            for t in range(1, len(e.input_ids)):
                if e.loss_mask[t]:
                    nll -= logp[t - 1, e.input_ids[t]].item()
                    n += 1
    assert loss.item() == pytest.approx(nll / n, abs=1e-5)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_micro_batches_change_nothing(tiny_model_dir, tokenizer, loss_agg):
    """Packed passes cut by a token budget (max_tokens_per_micro) instead of micro_batch_size: a
    budget below the shortest example (each alone), one that pairs some, and one above the whole
    step all give the padded step's loss and gradients."""
    ex = _examples(tokenizer)
    padded = _grads(tiny_model_dir, ex, micro_batch_size=4, packing=False, loss_agg=loss_agg)
    total = sum(len(e) for e in ex)
    for budget in (1, total // 2, 32768):
        packed = _grads(tiny_model_dir, ex, micro_batch_size=1, packing=True, loss_agg=loss_agg, by_sequence=True,
                        max_tokens=budget)
        _assert_same(packed, padded)


def test_token_budget_sizes_the_passes(tiny_model_dir, tokenizer, monkeypatch):
    """The passes a budget makes: the step's tokens in ceil(total / budget) or more balanced
    passes, none over the budget unless one example alone is."""
    from relign.recipes import sft

    ex = _examples(tokenizer)
    seen = []
    real = sft._collate
    monkeypatch.setattr(sft, "_collate", lambda group, *a: seen.append([len(e) for e in group]) or real(group, *a))
    _grads(tiny_model_dir, ex, micro_batch_size=1, packing=True, loss_agg="token-mean", by_sequence=True, max_tokens=32768)
    assert [sorted(part) for part in seen] == [sorted(len(e) for e in ex)]  # the whole step in one pass
    longest = max(len(e) for e in ex)
    seen.clear()
    _grads(tiny_model_dir, ex, micro_batch_size=1, packing=True, loss_agg="token-mean", by_sequence=True, max_tokens=longest)
    assert sorted(n for part in seen for n in part) == sorted(len(e) for e in ex)
    assert all(sum(part) <= longest for part in seen) and len(seen) < len(ex)


def test_a_ranks_filler_passes_add_nothing(tiny_model_dir, tokenizer, monkeypatch):
    """A rank with fewer token-budget passes than another runs filler passes (FSDP needs every
    rank's forwards): two of them change neither the loss nor the gradients."""
    from relign.recipes import sft

    ex = _examples(tokenizer)
    alone = _grads(tiny_model_dir, ex, micro_batch_size=1, packing=True, loss_agg="token-mean", by_sequence=True,
                   max_tokens=32768)
    monkeypatch.setattr(sft.distributed, "lockstep", lambda parts, filler: [(p, True) for p in parts] + [(filler, False)] * 2)
    padded = _grads(tiny_model_dir, ex, micro_batch_size=1, packing=True, loss_agg="token-mean", by_sequence=True,
                    max_tokens=32768)
    _assert_same(padded, alone)
