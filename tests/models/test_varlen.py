"""Packed rows run sequence by sequence (relign.models.varlen): the same numbers as each
sequence alone, no dense mask, and every other call exactly as transformers' SDPA."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers

from relign.models import varlen
from relign.models.logprobs import kv_cache_kwargs

LENS = [5, 11, 1, 8, 17]


def _model(arch: str, **extra):
    """A tiny random decoder with 3 query heads per key/value head."""
    common = dict(vocab_size=200, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, **extra)
    cfg = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
           "qwen3": lambda **kw: transformers.Qwen3Config(head_dim=16, **kw)}[arch](**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    assert model.config._attn_implementation == "sdpa"
    return model


def _packed(lens):
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 200, (n,), generator=g) for n in lens]
    return seqs, torch.cat(seqs)[None], torch.cat([torch.arange(n) for n in lens])[None]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_packed_row_equals_each_sequence_alone_with_its_gradients(arch):
    model = _model(arch)
    alone = copy.deepcopy(model)
    assert varlen.enable(model) and model.config._attn_implementation == varlen.NAME
    seqs, ids, pos = _packed(LENS)
    w = torch.randn(sum(LENS), 200, generator=torch.Generator().manual_seed(2))  # a loss that weighs every logit

    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    (logits * w).sum().backward()
    rows = [alone(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
    (torch.cat(rows) * w).sum().backward()

    torch.testing.assert_close(logits, torch.cat(rows), atol=1e-5, rtol=0)
    for (name, p), q in zip(model.named_parameters(), alone.parameters(), strict=True):
        # fp32 sums in another order: ~2e-7 of the largest entry (gradients here reach ~100)
        torch.testing.assert_close(p.grad, q.grad, atol=2e-6 * q.grad.abs().max().item(), rtol=0, msg=name)
    # the stock SDPA path (dense block mask) gives the same numbers too
    stock = _model(arch)(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    torch.testing.assert_close(logits, stock.detach(), atol=1e-5, rtol=0)


def test_no_mask_and_no_cross_sequence_work(monkeypatch):
    model = _model("qwen2")
    varlen.enable(model)
    _, ids, pos = _packed(LENS)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[2], k.shape[2], attn_mask, kw.get("is_causal"), kw.get("enable_gqa")))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, use_cache=False)
    # one causal call per sequence and layer, each over that sequence only, K/V heads not repeated
    assert [(q, k) for q, k, *_ in calls] == [(n, n) for n in LENS] * 2
    assert all(mask is None and causal and gqa for _, _, mask, causal, gqa in calls)


def test_padded_and_cached_calls_are_transformers_sdpa():
    """A padded batch with its mask, a prefill into a KV cache and a multi-token continuation of
    it (no mask, queries behind cached keys): the same numbers as the stock SDPA model."""
    stock = _model("llama")
    model = copy.deepcopy(stock)
    varlen.enable(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 200, (3, 12), generator=g)
    left = torch.ones(3, 12, dtype=torch.long)
    left[0, :4] = 0
    left[2, :7] = 0
    right = left.flip(-1)
    with torch.no_grad():
        for mask in (left, right):
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            a = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
            b = stock(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
            torch.testing.assert_close(a * mask[..., None], b * mask[..., None], atol=1e-6, rtol=0)
        outs = []
        for m in (model, stock):
            cache = transformers.DynamicCache(config=m.config)
            m(input_ids=ids[:, :7], use_cache=True, **kv_cache_kwargs(cache))
            outs.append(m(input_ids=ids[:, 7:], use_cache=True, **kv_cache_kwargs(cache)).logits)
        torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)
        full = stock(input_ids=ids, use_cache=False).logits[:, 7:]
        torch.testing.assert_close(outs[0], full, atol=1e-5, rtol=0)


def test_what_it_does_not_cover_keeps_sdpa_and_packing_warns():
    eager = _model("qwen2")
    eager.config._attn_implementation = "eager"
    assert "not sdpa" in varlen.supported(eager)
    sliding = _model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "sliding" in varlen.supported(sliding)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    assert "gpt2" in varlen.supported(gpt2) and not varlen.enable(gpt2)
    assert gpt2.config._attn_implementation != varlen.NAME
    with pytest.warns(UserWarning, match="dense block-diagonal mask.*not sdpa"):
        varlen.packed_attention(eager, "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        varlen.packed_attention(_model("qwen2"), "sdpa")  # enabled, nothing to say
        varlen.packed_attention(_model("qwen2"), "flash_attention_2")  # its own varlen kernel


def test_segment_bounds():
    assert varlen.segment_bounds(torch.tensor([[0, 1, 2, 0, 0, 1]])) == [0, 3, 4, 6]
    assert varlen.segment_bounds(torch.tensor([3, 4, 0, 1])) == [0, 2, 4]  # a row that starts mid-sequence
    assert varlen.segment_bounds(torch.tensor([0, 1, 5, 6, 7])) == [0, 2, 5]  # a restart not at 0
    assert varlen.segment_bounds(torch.arange(5)) == [0, 5]


def test_two_packed_rows_in_one_batch():
    model = _model("qwen2")
    alone = copy.deepcopy(model)
    varlen.enable(model)
    lens = [[5, 11], [9, 7]]  # two rows of 16 tokens, each holding two sequences
    seqs = [[torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(10 * i + j)) for j, n in enumerate(row)]
            for i, row in enumerate(lens)]
    ids = torch.stack([torch.cat(row) for row in seqs])
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        want = torch.stack([torch.cat([alone(input_ids=s[None], use_cache=False).logits[0] for s in row]) for row in seqs])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_segments_read_continuations_of_a_root():
    # [0..4] a root; [3, 4] continues its first 3 tokens; [0, 1] a new root; [1, 2, 3] continues it
    pos = torch.tensor([0, 1, 2, 3, 4, 3, 4, 0, 1, 1, 2, 3])
    assert varlen.segments(pos) == [(0, 5, None, 0), (5, 7, 0, 3), (7, 9, None, 0), (9, 12, 7, 1)]
    # no root before it, or one too short to hold its prefix: it stands alone, as transformers reads it
    assert varlen.segments(torch.tensor([3, 4, 0, 1, 5, 6])) == [(0, 2, None, 3), (2, 4, None, 0), (4, 6, None, 5)]


def _group(lens_resp, P=7, seed=4):
    """A prompt of P tokens and responses of the given lengths: the full rows, and the packed row
    ``[prompt, r_1][prompt[-1], r_2]...`` with its position ids."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 200, (P,), generator=g)
    resp = [torch.randint(1, 200, (n,), generator=g) for n in lens_resp]
    rows = [torch.cat([prompt, r]) for r in resp]
    ids = torch.cat([rows[0]] + [torch.cat([prompt[-1:], r]) for r in resp[1:]])[None]
    pos = torch.cat([torch.arange(P + lens_resp[0])] + [torch.arange(P - 1, P + n) for n in lens_resp[1:]])[None]
    return rows, ids, pos


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_continuations_equal_the_full_rows_with_their_gradients(arch):
    """A group's responses continuing its prompt in one packed row: each continuation's logits are
    those of its full row from the prompt's last token on, and every parameter's gradient is that
    of the full rows run alone (the prompt's gradient summed over the responses)."""
    model = _model(arch)
    alone = copy.deepcopy(model)
    varlen.enable(model)
    P, lens = 7, [5, 9, 5, 3, 9]  # equal lengths (one batched call) and distinct ones
    rows, ids, pos = _group(lens, P)
    # the rows' logits at the positions the packed row computes: all of row 0, then each other row
    # from the prompt's last token on
    keep = [slice(0, P + lens[0])] + [slice(P - 1, P + n) for n in lens[1:]]
    w = torch.randn(ids.shape[1], 200, generator=torch.Generator().manual_seed(5))

    got = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    (got * w).sum().backward()
    want = torch.cat([alone(input_ids=r[None], use_cache=False).logits[0][k] for r, k in zip(rows, keep)])
    (want * w).sum().backward()

    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for (name, p), q in zip(model.named_parameters(), alone.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-6 * q.grad.abs().max().item(), rtol=0, msg=name)


def test_continuations_of_one_length_run_as_one_call(monkeypatch):
    model = _model("qwen2")
    varlen.enable(model)
    P, lens = 7, [5, 9, 5, 3, 9]
    _, ids, pos = _group(lens, P)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[0], q.shape[2], k.shape[1], k.shape[2], attn_mask, kw.get("is_causal"), kw.get("enable_gqa")))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, use_cache=False)
    layer = calls[: len(calls) // 2]
    assert [c[:4] for c in calls] == [c[:4] for c in layer] * 2  # the same calls in both layers
    assert all(c[6] for c in calls)  # K/V heads grouped, never repeated
    root, *cont = layer
    assert root[:4] == (1, P + 5, 2, P + 5) and root[4] is None and root[5]  # the prompt and r_1: plain causal
    # r_2 and r_5 (9 tokens) together, r_3 (5), r_4 (3): queries 1 + n, keys the prompt's first P - 1 and their own
    assert sorted(c[:4] for c in cont) == sorted([(2, 10, 2, P + 9), (1, 6, 2, P + 5), (1, 4, 2, P + 3)])
    for m, n, _, s, mask, causal, _ in cont:
        assert not causal and mask.shape == (n, s)
        assert mask[:, : s - n].all() and torch.equal(mask[:, s - n :], torch.ones(n, n, dtype=torch.bool).tril())


def test_choose_the_layout_a_run_can_use():
    """(pack, share): a shared prompt is a packed row of continuations only where every model
    runs varlen's attention; elsewhere the prompt is shared through a KV cache (no warning),
    and packing=true packs whole rows (warning about the block mask where it applies)."""
    ok, other = _model("qwen2"), _model("llama")
    assert varlen.choose([ok, None, other], "sdpa", packing=False, share=True) == (True, True)
    assert varlen.active(ok) and varlen.active(other)
    eager = _model("qwen2")
    eager.config._attn_implementation = "eager"
    fresh = _model("qwen2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert varlen.choose([fresh, eager], "sdpa", packing=False, share=True) == (False, True)
        assert not varlen.active(fresh)  # not switched when another model of the run cannot follow
        assert varlen.choose([_model("qwen2")], "sdpa", packing=False, share=False) == (False, False)
    flash = _model("qwen2")
    flash.config._attn_implementation = "flash_attention_2"
    assert varlen.choose([flash], "flash_attention_2", packing=True, share=True) == (True, False)  # whole rows
    with pytest.warns(UserWarning, match="dense block-diagonal mask"):
        assert varlen.choose([eager], "eager", packing=True, share=True) == (True, False)
