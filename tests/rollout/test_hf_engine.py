"""HFEngine: sampling log-probs vs the trainer's, seeds, greedy vs transformers, stops, batching."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from relign.rollout.engine import Completion, Engine, SamplingParams
from relign.rollout.fast_decode import DecodePlan
from relign.rollout.hf_engine import HFEngine
from relign.rollout.sampling import sample_tokens

from .conftest import trainer_logps

PROMPT_TEXTS = [
    "Compute 12 * 3.",
    "The answer is",
    "Janet buys 3 apples and 4 books for 12 dollars each week",
    "Let's think step by step",
]


@pytest.fixture
def prompts(enc):
    ps = [enc(t) for t in PROMPT_TEXTS]
    assert len({len(p) for p in ps}) == len(ps)  # all lengths differ: left padding is exercised
    return ps


def _key(groups: list[list[Completion]]):
    return [[(c.token_ids, c.logps, c.text, c.finish_reason, c.stop_reason) for c in g] for g in groups]


def _ids(groups):
    return [[c.token_ids for c in g] for g in groups]


def _assert_logps_match(model, prompts, groups, temperature, tol=1e-4):
    flat_p = [p for p, g in zip(prompts, groups) for _ in g]
    flat_c = [c for g in groups for c in g]
    ref = trainer_logps(model, flat_p, [c.token_ids for c in flat_c], temperature)
    worst = 0.0
    for c, r in zip(flat_c, ref):
        assert len(c.logps) == len(c.token_ids) == len(r)
        worst = max([worst] + [abs(a - b) for a, b in zip(c.logps, r)])
    assert worst < tol, worst


def _stop_ids(tokenizer, every: int = 10) -> list[int]:
    """About 10% of the vocabulary: sampled rows end at many different lengths."""
    return list(range(100, len(tokenizer), every))


# ---------------------------------------------------------------------------- 1. logps


@pytest.mark.parametrize(
    "temperature, top_p, top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.9, 50), (0.7, 0.9, 50)]
)
def test_sampling_logps_equal_trainer_logps(model, tokenizer, prompts, compactions, temperature, top_p, top_k):
    engine = HFEngine(model, tokenizer, seed=1, compact_fraction=0.1)
    params = SamplingParams(
        n=4, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=24,
        stop_token_ids=_stop_ids(tokenizer, every=20), stop=["e>", "th"],
    )
    out = engine.generate(prompts, params)
    assert len(out) == len(prompts) and all(len(g) == 4 for g in out)
    flat = [c for g in out for c in g]
    # the batch really shrank while rows were still decoding, at several different lengths
    assert len(compactions) >= 2 and compactions == sorted(compactions, reverse=True)
    assert len({len(c.token_ids) for c in flat}) >= 4
    assert all(len(c.token_ids) == 24 for c in flat if c.finish_reason == "length")
    assert {type(c.stop_reason) for c in flat if c.finish_reason == "stop"} == {int, str}
    _assert_logps_match(model, prompts, out, temperature)


def test_reported_logps_are_before_truncation(model, tokenizer, prompts):
    # top_k=1 samples the argmax; its reported logp is that of the full distribution (< 0),
    # not the renormalised one (0), and equals the greedy one reported at T=1.
    engine = HFEngine(model, tokenizer, seed=0)
    top1 = engine.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8))
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert _ids(top1) == _ids(greedy)
    for a, b in zip(top1, greedy):
        assert all(lp < -1e-3 for lp in a[0].logps)
        assert a[0].logps == pytest.approx(b[0].logps, abs=1e-6)
    _assert_logps_match(model, prompts, greedy, 1.0)


# ---------------------------------------------------------------------------- 2. seeds


def test_same_seed_same_completions_different_seed_different(model, tokenizer, prompts):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=123)
    e1 = HFEngine(model, tokenizer, seed=0)
    a = e1.generate(prompts, params)
    assert _key(e1.generate(prompts, params)) == _key(a)
    # the per-call seed does not depend on the engine's own seed or stream
    assert _key(HFEngine(model, tokenizer, seed=99).generate(prompts, params)) == _key(a)
    b = e1.generate(prompts, replace(params, seed=124))
    assert _ids(b) != _ids(a)
    # the n samples of one prompt are different draws
    assert all(len({tuple(c.token_ids) for c in g}) == 3 for g in a)


def test_unseeded_calls_continue_the_stream_and_state_dict_restores_it(model, tokenizer, prompts):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10)
    e1, e2 = HFEngine(model, tokenizer, seed=7), HFEngine(model, tokenizer, seed=7)
    a1 = e1.generate(prompts, params)
    a2 = e1.generate(prompts, params)
    assert _ids(a1) != _ids(a2)  # seed=None continues the stream
    assert _key(e2.generate(prompts, params)) == _key(a1)  # same engine seed: same stream
    assert _key(e2.generate(prompts, params)) == _key(a2)
    assert _ids(HFEngine(model, tokenizer, seed=8).generate(prompts, params)) != _ids(a1)

    state = e1.state_dict()
    x = e1.generate(prompts, params)
    after_x = e1.state_dict()
    assert not torch.equal(after_x["generator"], state["generator"])
    # a seeded call leaves the engine's stream where it was
    e1.generate(prompts, replace(params, seed=5))
    assert torch.equal(e1.state_dict()["generator"], after_x["generator"])

    e1.load_state_dict(state)
    assert _key(e1.generate(prompts, params)) == _key(x)
    # restoring into another engine (a resumed run) repeats the same call too
    e3 = HFEngine(model, tokenizer, seed=12345)
    e3.load_state_dict(state)
    assert _key(e3.generate(prompts, params)) == _key(x)


# ---------------------------------------------------------------------------- 3. greedy


def test_greedy_equals_transformers_generate(model, tokenizer, prompts):
    N = 16
    out = HFEngine(model, tokenizer).generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=N))
    pad = tokenizer.pad_token_id
    # transformers, one prompt at a time (no padding) ...
    for p, g in zip(prompts, out):
        ref = model.generate(
            torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
            max_new_tokens=N, pad_token_id=pad,
        )[0, len(p):].tolist()
        assert g[0].token_ids == ref and g[1].token_ids == ref
        assert g[0].finish_reason == "length" and len(ref) == N
    # ... and batched with left padding
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=N, pad_token_id=pad)[:, L:]
    assert [g[0].token_ids for g in out] == ref.tolist()
    # greedy reports T=1 log-probs
    _assert_logps_match(model, prompts, out, 1.0)


# ---------------------------------------------------------------------------- 4. stops


def _greedy(engine, prompt, n_tokens):
    return engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=n_tokens))[0][0].token_ids


@pytest.mark.parametrize("mid_token", [True, False])
def test_stop_string_cuts_text_and_keeps_completing_token(model, tokenizer, prompts, mid_token):
    engine = HFEngine(model, tokenizer)
    dec = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for prompt in prompts:
        g = _greedy(engine, prompt, 30)
        pieces = [dec([t]) for t in g]
        for i in range(1, len(g) - 1):
            a, b = pieces[i], pieces[i + 1]
            if not (len(a) >= 2 and len(b) >= 2 and (a + b).isascii() and (a + b).isprintable()):
                continue
            stop = a[-1] + b[0] if mid_token else a + b
            if stop not in dec(g[: i + 1]) and dec(g[: i + 2]).endswith(a + b):
                break
        else:
            continue
        break
    else:
        pytest.fail("no usable greedy continuation for a stop string")

    k = i + 2  # the token that completes the stop string is the (i+2)-th
    full = dec(g[:k])
    params = SamplingParams(temperature=0.0, max_new_tokens=30, stop=["never-occurs", stop])
    c = engine.generate([prompt], params)[0][0]
    assert c.token_ids == g[:k]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[: full.index(stop)]
    assert c.text == (dec(g[: i + 1])[:-1] if mid_token else dec(g[:i]))
    assert len(c.logps) == k


def _eos_biased(model, tokenizer, bias: float):
    with torch.no_grad():
        model.lm_head.bias[tokenizer.eos_token_id] = bias
    return model


def test_eos_stops_with_eos_as_last_token(model, tokenizer, prompts):
    eos = tokenizer.eos_token_id
    engine = HFEngine(_eos_biased(model, tokenizer, 100.0), tokenizer)
    for c in (g[0] for g in engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))):
        assert c.token_ids == [eos] and c.finish_reason == "stop" and c.stop_reason == eos and c.text == ""
    # min_new_tokens: EOS is banned for the first 3 tokens, then it wins again
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, min_new_tokens=3, seed=0))
    for c in (g[0] for g in out):
        assert len(c.token_ids) == 4 and c.token_ids[-1] == eos and eos not in c.token_ids[:3]
        assert c.finish_reason == "stop" and c.stop_reason == eos
    _assert_logps_match(model, prompts, out, 1.0)
    # ignore_eos: exactly max_new_tokens tokens, EOS included
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True))
    for c in (g[0] for g in out):
        assert c.token_ids == [eos] * 5 and c.finish_reason == "length" and c.stop_reason is None


def test_eos_sampled_at_different_times(model, tokenizer, prompts):
    eos = tokenizer.eos_token_id
    engine = HFEngine(_eos_biased(model, tokenizer, 8.0), tokenizer, compact_fraction=0.0)
    out = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=12, min_new_tokens=2, seed=3))
    flat = [c for g in out for c in g]
    stopped = [c for c in flat if c.finish_reason == "stop"]
    assert stopped and len(stopped) < len(flat) and len({len(c.token_ids) for c in stopped}) >= 3
    for c in flat:
        assert eos not in c.token_ids[:-1]
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and c.stop_reason == eos and len(c.token_ids) >= 3
        else:
            assert len(c.token_ids) == 12 and c.stop_reason is None and c.token_ids[-1] != eos
    _assert_logps_match(model, prompts, out, 1.0)
    # the same rows ignoring EOS all run to max_new_tokens and contain it somewhere
    out = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=3))
    flat = [c for g in out for c in g]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in flat)
    assert any(eos in c.token_ids for c in flat)


def test_max_new_tokens_length_and_stop_token_ids_with_min_new_tokens(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    for p in prompts:
        c = engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=7))[0][0]
        assert len(c.token_ids) == 7 and c.finish_reason == "length" and c.stop_reason is None
    p = prompts[0]
    g = _greedy(engine, p, 12)
    stop_tok = g[1]
    assert stop_tok not in g[:1]
    c = engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop_tok]))[0][0]
    assert c.token_ids == g[:2] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    # with min_new_tokens the stop id is banned for the first 4 tokens: no stop before it
    c = engine.generate(
        [p], SamplingParams(temperature=0.0, max_new_tokens=12, min_new_tokens=4, stop_token_ids=[stop_tok])
    )[0][0]
    assert stop_tok not in c.token_ids[:4] and len(c.token_ids) >= 5
    assert c.token_ids[0] == g[0] and c.token_ids[1] != stop_tok
    if c.finish_reason == "stop":
        assert c.token_ids[-1] == stop_tok and stop_tok not in c.token_ids[:-1]


def test_min_new_tokens_also_holds_back_stop_strings(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    g = _greedy(engine, prompts[0], 12)
    stop = tokenizer.decode(g[:1], skip_special_tokens=True)
    c = engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_new_tokens=12, min_new_tokens=4, stop=[stop]))
    assert len(c[0][0].token_ids) >= 4


# ---------------------------------------------------------------------------- 5. batching


def test_max_batch_rows_chunks_keep_prompt_order(model, tokenizer, prompts):
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=10)
    ref = HFEngine(model, tokenizer).generate(prompts, greedy)
    for rows in (1, 3, 5):  # 1 < n: a chunk is one prompt's n rows
        out = HFEngine(model, tokenizer, max_batch_rows=rows).generate(prompts, greedy)
        meta = lambda groups: [[(c.text, c.finish_reason) for c in g] for g in groups]  # noqa: E731
        assert meta(out) == meta(ref)
        assert _ids(out) == _ids(ref)
        for ga, gb in zip(out, ref):
            for a, b in zip(ga, gb):
                assert a.logps == pytest.approx(b.logps, abs=1e-5)
    # sampled: n per prompt, in prompt order (each completion scores right under its own prompt)
    out = HFEngine(model, tokenizer, max_batch_rows=3).generate(
        prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=0)
    )
    assert len(out) == len(prompts) and all(len(g) == 3 for g in out)
    _assert_logps_match(model, prompts, out, 1.0)


def test_compaction_does_not_change_greedy_results(model, tokenizer, prompts, compactions):
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=20, stop_token_ids=_stop_ids(tokenizer, every=7))
    compacted = HFEngine(model, tokenizer, compact_fraction=0.0).generate(prompts, params)
    n_compactions = len(compactions)
    plain = HFEngine(model, tokenizer, compact_fraction=1.0).generate(prompts, params)
    assert n_compactions >= 1 and len(compactions) == n_compactions  # 1.0 never compacts
    assert len({len(g[0].token_ids) for g in plain}) >= 3  # rows did finish at different times
    assert _ids(compacted) == _ids(plain)
    for ga, gb in zip(compacted, plain):
        for a, b in zip(ga, gb):
            assert (a.text, a.finish_reason, a.stop_reason) == (b.text, b.finish_reason, b.stop_reason)
            assert a.logps == pytest.approx(b.logps, abs=1e-5)


# ---------------------------------------------------------------------------- 6. sample_tokens


def test_sample_tokens_top_k_1_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 100, generator=g) * 3
    tok, lp = sample_tokens(logits, temperature=1.3, top_k=1, generator=g)
    assert torch.equal(tok, logits.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits / 1.3, -1).max(-1).values)


def test_sample_tokens_tiny_top_p_keeps_only_top_token():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 100, generator=g)
    tok, _ = sample_tokens(logits, temperature=2.0, top_p=1e-6, generator=g)
    assert torch.equal(tok, logits.argmax(-1))


def test_sample_tokens_top_p_boundary():
    # probs [0.5, 0.3, 0.2]: top_p=0.5 keeps token 0 only; 0.6 keeps {0, 1}; 1.0 keeps all
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(4000, 1)
    for top_p, allowed in ((0.5, {0}), (0.6, {0, 1}), (1.0, {0, 1, 2})):
        tok, lp = sample_tokens(logits, temperature=1.0, top_p=top_p, generator=torch.Generator().manual_seed(2))
        assert set(tok.tolist()) == allowed
        torch.testing.assert_close(lp, torch.log(torch.tensor([0.5, 0.3, 0.2]))[tok])


def test_sample_tokens_plain_sampling_is_inverse_cdf_of_the_softmax():
    # the path RL rollouts take (no top-k/top-p/ban): tokens by hand from the CDF of
    # softmax(logits / T) and the given uniforms, log-probs = log_softmax at those tokens
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(256, 50, generator=g) * 2
    u = torch.rand(256, generator=g)
    for T in (1.0, 0.7):
        cdf = torch.softmax(logits / T, -1).cumsum(-1)
        want = (cdf <= (u * cdf[:, -1])[:, None]).sum(-1)  # first index whose CDF passes u
        tok, lp = sample_tokens(logits, temperature=T, uniforms=u)
        assert torch.equal(tok, want)
        torch.testing.assert_close(lp, torch.log_softmax(logits / T, -1).gather(-1, tok[:, None])[:, 0], atol=1e-6, rtol=0)


def test_sample_tokens_banned_never_sampled():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2000, 10, generator=g)
    logits[:, 3] += 20.0  # by far the most likely token
    logits[:, 7] += 10.0
    for T in (0.0, 1.0, 5.0):
        tok, lp = sample_tokens(logits, temperature=T, banned=[3], generator=g)
        assert not (tok == 3).any()
        scale = T if T > 0 else 1.0
        # the reported logp is still of the unbanned distribution
        torch.testing.assert_close(lp, torch.log_softmax(logits / scale, -1).gather(-1, tok[:, None])[:, 0])
    tok, _ = sample_tokens(logits, temperature=0.0, banned=[3])
    assert (tok == 7).all()


def test_sample_tokens_hand_computed():
    # logits [0, ln 3] -> probs [1/4, 3/4] at T=1; at T=0.5 -> [1/10, 9/10]
    logits = torch.tensor([[0.0, math.log(3.0)]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(4)
    tok, lp = sample_tokens(logits, temperature=1.0, generator=g)
    assert tok.float().mean().item() == pytest.approx(0.75, abs=0.015)
    expected = torch.where(tok == 1, math.log(0.75), math.log(0.25))
    torch.testing.assert_close(lp, expected.float())
    tok, lp = sample_tokens(logits, temperature=0.5, generator=g)
    assert tok.float().mean().item() == pytest.approx(0.9, abs=0.01)
    torch.testing.assert_close(lp, torch.where(tok == 1, math.log(0.9), math.log(0.1)).float())
    # greedy: token 1, reported at T=1; top_k=1 at T=0.5 reports the T=0.5 logp, not 0
    tok, lp = sample_tokens(logits[:1], temperature=0.0)
    assert tok.tolist() == [1] and lp.item() == pytest.approx(math.log(0.75))
    tok, lp = sample_tokens(logits[:1], temperature=0.5, top_k=1, generator=g)
    assert tok.tolist() == [1] and lp.item() == pytest.approx(math.log(0.9))


def test_sample_tokens_seeded_generator_is_reproducible():
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(5))
    a = sample_tokens(logits, temperature=1.0, top_p=0.8, top_k=20, generator=torch.Generator().manual_seed(9))
    b = sample_tokens(logits, temperature=1.0, top_p=0.8, top_k=20, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------- 7. load_weights


def test_load_weights_shared_is_noop_and_foreign_weights_are_copied(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    before = engine.generate(prompts, greedy)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.load_weights(model.named_parameters())
    for n, p in model.named_parameters():
        assert p.data_ptr() == ptrs[n] and torch.equal(p, values[n])
    assert _key(engine.generate(prompts, greedy)) == _key(before)

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    expected = HFEngine(other, tokenizer).generate(prompts, greedy)
    assert _ids(expected) != _ids(before)
    # sent as another dtype, as from a bf16 trainer
    engine.load_weights((n, t.detach().double()) for n, t in other.named_parameters())
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert p.dtype == torch.float32 and p.data_ptr() == ptrs[n]
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert _key(engine.generate(prompts, greedy)) == _key(expected)

    with pytest.raises(KeyError):
        engine.load_weights([("no.such.weight", torch.zeros(1))])


# ---------------------------------------------------------------------------- 8. protocol


def test_engine_protocol_and_small_contract(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    assert isinstance(engine, Engine)
    engine.sleep()
    engine.wake()
    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(ValueError):
        engine.generate([[]], SamplingParams())
    c = engine.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=0))
    assert [[(x.token_ids, x.finish_reason) for x in g] for g in c] == [[([], "length")] * 2] * 2
    model.train()
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=2))
    assert model.training  # the caller's mode is restored
    model.eval()
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=2))
    assert not model.training


# ---------------------------------------------------------------------------- 9. static shapes (issue 46)

# what a CUDA graph needs, run eagerly on the CPU: rows in buckets, attention over the whole
# capacity, the host reading every 8 steps
STATIC = DecodePlan(static=True, read_every=8, row_buckets=(4, 8, 16), length_bucket=32)


def _assert_same(a, b, tol=1e-5):
    """The same tokens, text, finish and stop reasons; log-probs to float rounding (another batch
    size and attention width round the products differently)."""
    assert [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in g] for g in a] == \
        [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in g] for g in b]
    worst = max(abs(x - y) for ga, gb in zip(a, b) for ca, cb in zip(ga, gb) for x, y in zip(ca.logps, cb.logps))
    assert worst < tol, worst


@pytest.mark.parametrize("case", ["sampled", "greedy", "min_new_tokens"])
def test_static_shapes_equal_the_default_decode(model, tokenizer, prompts, compactions, case):
    """Seeded sampling (top-k and top-p), greedy decoding, stop tokens and strings, min_new_tokens:
    the static-shape decode gives the tokens and log-probs of the default one, its rows leaving in
    buckets, and so does the default decode reading the host every 8 steps instead of every one."""
    params = {
        "sampled": SamplingParams(n=4, temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=24,
                                  stop_token_ids=_stop_ids(tokenizer, every=20), stop=["e>", "th"]),
        "greedy": SamplingParams(n=2, temperature=0.0, max_new_tokens=20, stop_token_ids=_stop_ids(tokenizer, every=7)),
        "min_new_tokens": SamplingParams(n=3, temperature=1.0, max_new_tokens=24, min_new_tokens=5,
                                         stop_token_ids=_stop_ids(tokenizer, every=20), stop=["an"]),
    }[case]
    seeds = [11, 12, 13, 14]
    want = HFEngine(model, tokenizer, compact_fraction=0.1).generate(prompts, params, seeds=seeds)
    compactions.clear()
    got = HFEngine(model, tokenizer, compact_fraction=0.1, decode=STATIC).generate(prompts, params, seeds=seeds)
    _assert_same(got, want)
    assert compactions and set(compactions) <= {4, 8}  # 16 or 8 rows moved into smaller buckets
    lengths = {len(c.token_ids) for g in want for c in g}
    assert len(lengths) >= 3 and {c.finish_reason for g in want for c in g} == {"stop", "length"}
    if case == "min_new_tokens":
        assert min(lengths) >= 5
    _assert_same(HFEngine(model, tokenizer, compact_fraction=0.1, decode=DecodePlan(read_every=8)).generate(
        prompts, params, seeds=seeds), want)


def test_static_shapes_multiturn_equal_the_default_decode(model, tokenizer, enc):
    """A multi-turn rollout (the env's text appended in the same sequence, each turn one engine call)."""
    from relign.rollout.multiturn import run_episodes

    from .test_multiturn import ObservingCalculatorEnv, make_calculator_records

    records = make_calculator_records(2, seed=2)
    prompts, infos = [enc(r["prompt"]) for r in records], [r["extra_info"] for r in records]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, stop=["</calc>"], seed=11)

    def run(plan):
        out = run_episodes(HFEngine(model, tokenizer, seed=0, decode=plan), tokenizer, ObservingCalculatorEnv(), prompts,
                           infos, params, max_turns=3, max_response_tokens=40, seeds=[5, 9])
        return [e for g in out for e in g]

    a, b = run(None), run(STATIC)
    assert sum(e.turns for e in a) >= 9
    assert [(e.response_ids, e.response_mask, e.finish_reason, e.turns) for e in a] == \
        [(e.response_ids, e.response_mask, e.finish_reason, e.turns) for e in b]
    assert max(abs(x - y) for ea, eb in zip(a, b) for x, y in zip(ea.sampling_logps, eb.sampling_logps)) < 1e-5


def test_static_shapes_unseeded_calls_draw_from_the_engine_stream(model, tokenizer, prompts):
    """Without per-row seeds a static-shape call draws its uniforms [rows, tokens] from the engine's
    generator at its start: the stream moves on, repeats from a saved state, and the log-probs are
    the trainer's."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, stop_token_ids=_stop_ids(tokenizer))
    engine = HFEngine(model, tokenizer, seed=7, decode=STATIC)
    state = engine.state_dict()
    a = engine.generate(prompts, params)
    assert _ids(engine.generate(prompts, params)) != _ids(a)
    engine.load_state_dict(state)
    assert _key(engine.generate(prompts, params)) == _key(a)
    _assert_logps_match(model, prompts, a, 1.0)
