"""The SFT, DPO and RL log-prob paths at the defaults a user runs with (issue 45, item 2).

1. SFT's loss through the fused LM head (gradients taken in the forward) equals the loss written
   out from each example's own full log-softmax, gradients included.
2. What autograd saves for the backward, seen through ``saved_tensors_hooks``, on a model whose
   vocabulary (8,192) makes [T, V] the largest thing in the graph (hidden 32, so V x d = 262k
   elements < K x V for the K >= 60 scored tokens here). The promise:
   * the fused head (SFT, DPO, the RL update's packed and padded layouts, plain HF causal LMs):
     nothing of K x V elements or more is saved, in any dtype: the logits never exist;
   * stage a (the shared-prefix layout, and any model the fused head does not cover): under
     bf16-mixed nothing fp32 of K x V or more (the bf16 logits the model returned are kept, not
     an fp32 copy); for an fp32 model the one fp32 [K, V] tensor kept is the logits themselves,
     no upcast, scaled or softmax copy beside it.
"""

from __future__ import annotations

import contextlib
import copy
import random

import pytest
import torch

from relign.data.preference import PairExample
from relign.data.sft import SFTExample
from relign.models import lean, varlen
from relign.models.logprobs import entropy_from_logits, selective_log_softmax, shared_prefix_token_logps, token_logps
from relign.models.precision import enable_autocast
from relign.recipes.pairs import collate_pairs, sequence_logps
from relign.recipes.sft import accumulate_gradients

V = 8192


def _model(dtype: str, vocab: int = V, seed: int = 0):
    """A one-layer Qwen2 as relign loads it: lean activations on, bf16-mixed when asked."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    lean.lean_activations(model)
    return enable_autocast(model) if dtype == "bf16-mixed" else model


def _examples(vocab: int = V) -> list[SFTExample]:
    rng = random.Random(0)
    out = []
    for n, p in [(30, 6), (21, 3), (40, 11)]:  # (length, prompt tokens)
        out.append(SFTExample([rng.randrange(3, vocab) for _ in range(n)], [0] * p + [1] * (n - p)))
    return out


def _pairs(vocab: int = V) -> list[PairExample]:
    rng = random.Random(1)
    out = []
    for plen, c, r in [(9, 25, 17), (4, 30, 22)]:
        prompt = [rng.randrange(3, vocab) for _ in range(plen)]
        chosen, rejected = prompt + [rng.randrange(3, vocab) for _ in range(c)], prompt + [rng.randrange(3, vocab) for _ in range(r)]
        out.append(PairExample(chosen, [0] * plen + [1] * c, rejected, [0] * plen + [1] * r, plen))
    return out


# --------------------------------------------------------------------------- 1. SFT's loss


def _naive_sft_loss(model, examples, loss_agg):
    """From each example alone: -log p of its trainable tokens from the full fp32 log-softmax,
    token-mean over all of them or the mean over examples of each one's token mean."""
    per_example, tokens = [], 0
    for e in examples:
        ids = torch.tensor([e.input_ids])
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        nll = -torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        m = torch.tensor(e.loss_mask[1:], dtype=torch.float32)
        per_example.append(((nll * m).sum(), m.sum()))
        tokens += m.sum()
    if loss_agg == "token-mean":
        return sum(s for s, _ in per_example) / tokens
    return sum(s / n for s, n in per_example) / len(per_example)


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_sft_loss_equals_the_plain_path(packing, loss_agg):
    model = _model("fp32", vocab=500)
    examples = _examples(500)
    with varlen_for(model, packing):
        loss = accumulate_gradients(model, examples, micro_batch_size=2, packing=packing, loss_agg=loss_agg, pad_id=0,
                                    device="cpu")
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = _naive_sft_loss(model, examples, loss_agg)
    want.backward()
    # the reduction's count: 24 + 18 + 29 trainable targets (the first token is never one)
    assert sum(sum(e.loss_mask[1:]) for e in examples) == 71
    torch.testing.assert_close(loss, want.detach(), atol=1e-5, rtol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


@contextlib.contextmanager
def varlen_for(model, packing):
    """SFT's packed rows run relign's varlen attention (``packed_attention``), as the recipe sets up."""
    if packing:
        assert varlen.enable(model)
    yield


# --------------------------------------------------------------------------- 2. what is saved


@contextlib.contextmanager
def _saved():
    """(dtype, elements, storage address) of every tensor autograd saves for the backward."""
    seen: list[tuple[torch.dtype, int, int]] = []

    def pack(t):
        seen.append((t.dtype, t.numel(), t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def _big(seen, K, dtype=None):
    return {(d, ptr) for d, n, ptr in seen if n >= K * V and (dtype is None or d == dtype)}


@pytest.mark.parametrize("dtype", ["fp32", "bf16-mixed"])
def test_sft_saves_no_logits(dtype):
    model = _model(dtype)
    examples = _examples()
    K = sum(sum(e.loss_mask[1:]) for e in examples)  # 71 targets
    with varlen_for(model, True), _saved() as seen:
        accumulate_gradients(model, examples, micro_batch_size=3, packing=True, loss_agg="token-mean", pad_id=0,
                             device="cpu")
    assert seen and not _big(seen, K)


@pytest.mark.parametrize("dtype", ["fp32", "bf16-mixed"])
def test_dpo_sequence_logps_save_no_logits(dtype):
    """DPO's default layout (share_prompt, varlen: each rejected row continues its prompt in one packed row)."""
    model = _model(dtype)
    assert varlen.enable(model)
    pairs = _pairs()
    K = sum(sum(p.chosen_mask) + sum(p.rejected_mask) for p in pairs)  # 94 targets
    with _saved() as seen:
        logps, _ = sequence_logps(model, collate_pairs(pairs, 0, "cpu"), share_prompt=True, packed=True)
    assert logps.requires_grad and seen and not _big(seen, K)


def _rl_rows(G=2):
    rng = random.Random(2)
    rows, plens = [], []
    for plen in (7, 5):
        prompt = [rng.randrange(3, V) for _ in range(plen)]
        for k in range(G):
            rows.append(prompt + [rng.randrange(3, V) for _ in range(30 + 5 * k)])
            plens.append(plen)
    L = max(map(len, rows))
    ids, attn, resp = torch.zeros(len(rows), L, dtype=torch.long), torch.zeros(len(rows), L, dtype=torch.long), torch.zeros(len(rows), L)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)], resp[i, plens[i] : len(r)] = torch.tensor(r), 1, 1
    return ids, attn, resp, torch.tensor(plens)


@pytest.mark.parametrize("dtype", ["fp32", "bf16-mixed"])
def test_rl_update_logps_save_no_logits(dtype):
    """The RL update's call (temperature 0.7, the entropy differentiated for an entropy bonus) in
    its padded layout: the fused head."""
    model = _model(dtype)
    ids, attn, resp, _ = _rl_rows()
    K = int(resp.sum())  # 130 response tokens
    with _saved() as seen:
        lp, ent = token_logps(model, ids, attention_mask=attn, target_mask=resp, temperature=0.7, with_entropy=True,
                              entropy_grad=True)
    assert lp.requires_grad and ent.requires_grad and seen and not _big(seen, K)


@pytest.mark.parametrize("dtype", ["fp32", "bf16-mixed"])
def test_shared_prefix_layout_keeps_only_the_logits(dtype):
    """Stage a, in the RL update's shared-prompt layout: the responses' logits are kept (one
    tensor, in the model's dtype), no fp32 copy of them."""
    model = _model(dtype)
    ids, attn, resp, plens = _rl_rows()
    K = int(resp.sum())
    with _saved() as seen:
        shared_prefix_token_logps(model, ids, attn, plens, 2, temperature=0.7, with_entropy=True, entropy_grad=True)
    if dtype == "bf16-mixed":
        assert not _big(seen, K, torch.float32) and len(_big(seen, K, torch.bfloat16)) == 1
    else:
        assert len(_big(seen, K, torch.float32)) == 1


@pytest.mark.parametrize("dtype", ["fp32", "bf16-mixed"])
def test_stage_a_keeps_the_logits_and_nothing_else(dtype):
    """selective_log_softmax and entropy_from_logits (context parallel runs these on the model's
    logits) at temperature 0.7: the only [K, V] tensor kept is the model's logits, uncopied."""
    model = _model(dtype)
    ids = torch.randint(3, V, (2, 48), generator=torch.Generator().manual_seed(3))
    logits = model(input_ids=ids, use_cache=False).logits  # whole: a [:, :-1] view would be copied to be flattened
    K = 2 * 48
    with _saved() as seen:
        lp = selective_log_softmax(logits, torch.nn.functional.pad(ids[:, 1:], (0, 1)), temperature=0.7)
        ent = entropy_from_logits(logits, temperature=0.7)
    (lp.sum() + ent.sum()).backward()
    assert _big(seen, K) == {(logits.dtype, logits.untyped_storage().data_ptr())}
