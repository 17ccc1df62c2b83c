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


# --------------------------------------------------------------------------- the collator's layout


def test_pack_rows_by_hand():
    """Rows of 5, 8 and 6 tokens; the second and third continue the first's first 4 tokens (packed
    from column 4): 5 + 4 + 2 tokens, keys 5, 4 + 4 and 4 + 2, gathered from the packed row."""
    from relign.data.collate import pack_rows

    row, col, p = pack_rows([5, 8, 6], [0, 4, 4])
    assert row.tolist() == [0] * 5 + [1] * 4 + [2] * 2
    assert col.tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 7, 4, 5]
    assert p.cu_seq_lens_q.dtype == p.cu_seq_lens_k.dtype == torch.int32
    assert p.cu_seq_lens_q.tolist() == [0, 5, 9, 11] and p.cu_seq_lens_k.tolist() == [0, 5, 13, 19]
    assert p.kv_index.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 5, 6, 7, 8, 0, 1, 2, 3, 9, 10]
    assert (p.max_length_q, p.max_length_k) == (5, 8)
    row, col, p = pack_rows([3, 2], max_length=64)  # whole rows: the keys are the row; the constant bound
    assert col.tolist() == [0, 1, 2, 0, 1] and p.kv_index is None and p.cu_seq_lens_k is p.cu_seq_lens_q
    assert (p.max_length_q, p.max_length_k) == (64, 64)
    with pytest.raises(ValueError, match="no earlier row"):
        pack_rows([5, 8], [0, 6])  # 6 prefix tokens of a 5-token root


def _layouts():
    """(name, full rows, packed ids [1, S], lens, starts, kept [S] slices of each row): packed whole
    rows; a group's responses continuing its prompt (shared prompts); DPO pairs, each rejected
    response continuing its chosen row's prompt."""
    g = torch.Generator().manual_seed(7)
    tok = lambda n: torch.randint(1, 200, (n,), generator=g)  # noqa: E731
    out = [("packed", [tok(n) for n in LENS], [0] * len(LENS))]
    prompt = tok(7)
    out.append(("continuations", [torch.cat([prompt, tok(n)]) for n in (5, 9, 5, 3, 9)], [0, 6, 6, 6, 6]))
    pairs, starts = [], []
    for p, c, r in [(5, 9, 3), (1, 4, 12), (11, 1, 6)]:
        pr = tok(p)
        pairs += [torch.cat([pr, tok(c)]), torch.cat([pr, tok(r)])]
        starts += [0, p - 1]
    out.append(("pairs", pairs, starts))
    return out


@pytest.mark.parametrize("kernel", ["cpu twin", "cuda path"])
@pytest.mark.parametrize("layout", ["packed", "continuations", "pairs"])
def test_layout_path_equals_position_ids_path_and_each_row_alone(monkeypatch, layout, kernel):
    """The collator's layout (``forward_kwargs``) gives the logits and gradients of today's
    position-id path and of each row run alone, fp32 within 1e-5: on the CPU twin (SDPA by
    sequence) and on the CUDA path's code (one gathered call per layer, the flash kernel replaced
    by the dense masked reference)."""
    from relign.data.collate import pack_rows

    if kernel == "cuda path":
        monkeypatch.setattr(varlen, "CPU_KERNEL", varlen.reference_varlen_attn)
    _, rows, starts = next(x for x in _layouts() if x[0] == layout)
    model = _model("qwen2")
    today, alone = copy.deepcopy(model), copy.deepcopy(model)
    varlen.enable(model)
    varlen.enable(today)
    row, col, packing = pack_rows([len(r) for r in rows], starts, max_length=64)
    ids, pos = torch.cat([r[s:] for r, s in zip(rows, starts)])[None], col[None]
    w = torch.randn(ids.shape[1], 200, generator=torch.Generator().manual_seed(8))

    got = model(input_ids=ids, position_ids=pos, use_cache=False, **varlen.forward_kwargs(model, packing)).logits[0]
    (got * w).sum().backward()
    old = today(input_ids=ids, position_ids=pos, use_cache=False).logits[0]  # position ids only: today's path
    (old * w).sum().backward()
    want = torch.cat([alone(input_ids=r[None], use_cache=False).logits[0][s:] for r, s in zip(rows, starts)])
    (want * w).sum().backward()

    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, old, atol=1e-5, rtol=0)
    for (name, p), q, o in zip(model.named_parameters(), alone.parameters(), today.parameters(), strict=True):
        tol = 2e-6 * q.grad.abs().max().item()  # fp32 sums in another order
        torch.testing.assert_close(p.grad, q.grad, atol=tol, rtol=0, msg=name)
        torch.testing.assert_close(p.grad, o.grad, atol=tol, rtol=0, msg=name)


class _HostRead(RuntimeError):
    pass


def _no_host_reads(monkeypatch):
    """Every way a tensor's value reaches Python raises."""
    def boom(*_, **__):
        raise _HostRead("a tensor's value was read on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)


@pytest.mark.parametrize("layout", ["packed", "continuations", "pairs"])
def test_cuda_path_reads_nothing_from_the_host(monkeypatch, layout):
    """The CUDA path's forward (the flash kernel replaced by the dense reference, which reads
    the cumulative lengths on the device only) with ``item``, ``tolist``, ``__bool__`` ... raising:
    it runs, and the position-id path under the same guard does not."""
    from relign.data.collate import pack_rows

    monkeypatch.setattr(varlen, "CPU_KERNEL", varlen.reference_varlen_attn)
    _, rows, starts = next(x for x in _layouts() if x[0] == layout)
    model = _model("llama")
    varlen.enable(model)
    _, col, packing = pack_rows([len(r) for r in rows], starts, max_length=64)
    ids, pos = torch.cat([r[s:] for r, s in zip(rows, starts)])[None], col[None]
    kw = varlen.forward_kwargs(model, packing)
    keep = torch.arange(3, ids.shape[1] - 1)  # the LM head at an index tensor too (token_logps)
    with monkeypatch.context() as m:
        _no_host_reads(m)
        out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep, **kw).logits
        with pytest.raises(_HostRead):
            model(input_ids=ids, position_ids=pos, use_cache=False)
    assert out.shape == (1, ids.shape[1] - 4, 200) and torch.isfinite(out).all()


@pytest.mark.parametrize("layout", ["packed", "continuations"])
def test_a_decoder_layer_compiles_to_one_graph_on_packed_rows(monkeypatch, layout):
    """``torch.compile(layer, backend="eager", fullgraph=True)`` traces a decoder layer on the
    collator's layout through the CUDA path's code in one graph (no graph break: no host read,
    no data-dependent shape), with the eager layer's outputs."""
    from relign.data.collate import pack_rows

    monkeypatch.setattr(varlen, "CPU_KERNEL", varlen.reference_varlen_attn)
    _, rows, starts = next(x for x in _layouts() if x[0] == layout)
    model = _model("qwen2")
    varlen.enable(model)
    _, col, packing = pack_rows([len(r) for r in rows], starts, max_length=64)
    ids, pos = torch.cat([r[s:] for r, s in zip(rows, starts)])[None], col[None]
    h = model.model.embed_tokens(ids)
    kw = dict(position_embeddings=model.model.rotary_emb(h, pos), position_ids=pos, **varlen.forward_kwargs(model, packing))
    layer = model.model.layers[0]
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(layer, backend="eager", fullgraph=True)(h, **kw)
        want = layer(h, **kw)
    got, want = (x[0] if isinstance(x, tuple) else x for x in (got, want))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
