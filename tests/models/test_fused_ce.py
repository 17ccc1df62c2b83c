"""The log-prob paths that keep no fp32 [tokens x vocabulary] (``models.fused_ce``) against the plain
autograd path written out here: ``log_softmax(logits.float() / T)``, gathered, and the entropy
``-(p log p).sum()``, values and gradients.

Stage a (from the logits) and stage b (from the hidden states and the LM-head weight) are checked
at temperature 0.7, with the entropy detached and differentiated, and at the chunk edges: N not
a multiple of the chunk, N smaller than a chunk, N equal to a chunk."""

from __future__ import annotations

import pytest
import torch

from relign.models.fused_ce import linear_log_softmax_gather, linear_weighted_sum, log_softmax_gather

N, V, D = 11, 37, 8
CHUNKS = [4, 16, 11]  # 11 = 2 x 4 + 3; one chunk larger than N; exactly N
ENTROPY = ["none", "detached", "grad"]


def _reference(logits, index, temperature):
    """The plain path: the full fp32 log-softmax (kept for the backward), gathered; entropy -(p log p)."""
    lsm = torch.log_softmax(logits.float() / temperature, -1)
    return lsm.gather(-1, index[:, None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


def _loss(logp, ent, g, entropy):
    """A loss that weighs every output differently (so each row's gradient is checked on its own)."""
    loss = (logp * g[0]).sum()
    if entropy == "grad":
        loss = loss + (ent * g[1]).sum()
    return loss


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=gen) * 3
    index = torch.randint(0, V, (N,), generator=gen)
    g = torch.randn(2, N, generator=gen)
    return logits, index, g, gen


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("entropy", ENTROPY)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_stage_a_equals_the_plain_path_in_fp32(chunk, entropy, temperature):
    logits, index, g, _ = _inputs()
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    lp, ent = log_softmax_gather(a, index, temperature=temperature, chunk_tokens=chunk, with_entropy=entropy != "none",
                                 entropy_grad=entropy == "grad")
    want_lp, want_ent = _reference(b, index, temperature)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    if entropy == "none":
        assert ent is None
    else:
        torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
        assert ent.requires_grad == (entropy == "grad")
    _loss(lp, ent, g, entropy).backward()
    _loss(want_lp, want_ent, g, entropy).backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=0)


def test_stage_a_hand_values():
    # logits [0, ln 3] -> softmax [1/4, 3/4]: log p(1) = ln 0.75, H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351446;
    # d log p(1) / dx = e_1 - p = [-0.25, 0.25]
    x = torch.tensor([[0.0, 1.0986122886681098]], requires_grad=True)
    lp, ent = log_softmax_gather(x, torch.tensor([1]), with_entropy=True)
    assert lp.item() == pytest.approx(-0.2876820725, abs=1e-7) and ent.item() == pytest.approx(0.5623351446, abs=1e-7)
    lp.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([[-0.25, 0.25]]), atol=1e-7, rtol=0)


@pytest.mark.parametrize("entropy", ENTROPY)
def test_stage_a_bf16_logits(entropy):
    """bf16 logits (bf16-mixed): values equal the plain path's (both upcast the same bf16 numbers),
    gradients to one bf16 rounding (both round an fp32 gradient to bf16; the fp32 sums differ)."""
    logits, index, g, _ = _inputs(1)
    a = logits.bfloat16().requires_grad_(True)
    b = logits.bfloat16().requires_grad_(True)
    lp, ent = log_softmax_gather(a, index, temperature=0.7, chunk_tokens=4, with_entropy=entropy != "none",
                                 entropy_grad=entropy == "grad")
    want_lp, want_ent = _reference(b, index, 0.7)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    _loss(lp, ent, g, entropy).backward()
    _loss(want_lp, want_ent, g, entropy).backward()
    assert a.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=1e-6, rtol=2**-7)


def _stage_b_inputs(seed=2):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=gen)
    w = torch.randn(V, D, generator=gen) * 0.7
    index = torch.randint(0, V, (N,), generator=gen)
    g = torch.randn(2, N, generator=gen)
    return h, w, index, g


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("entropy", ENTROPY)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_stage_b_equals_the_plain_path_in_fp32(chunk, entropy, temperature):
    """Gradients with respect to the hidden states and the LM-head weight included."""
    h, w, index, g = _stage_b_inputs()
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = linear_log_softmax_gather(h1, w1, index, dtype=torch.float32, temperature=temperature, chunk_tokens=chunk,
                                        with_entropy=entropy != "none", entropy_grad=entropy == "grad")
    want_lp, want_ent = _reference(h2 @ w2.t(), index, temperature)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    if entropy != "none":
        torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    _loss(lp, ent, g, entropy).backward()
    _loss(want_lp, want_ent, g, entropy).backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_weighted_sum_equals_the_plain_path_in_fp32(chunk, temperature):
    """S = sum c log p with the gradients taken in the forward: the same S, dS/dh and dS/dW, scaled
    by the upstream gradient (-2.5 here, as a loss -S times a scale would send)."""
    h, w, index, g = _stage_b_inputs(3)
    c = g[0].abs() * (torch.arange(N) % 3 != 0)  # some positions weigh 0, as non-targets do
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    s, lp = linear_weighted_sum(h1, w1, index, c, dtype=torch.float32, temperature=temperature, chunk_tokens=chunk)
    want_lp, _ = _reference(h2 @ w2.t(), index, temperature)
    want = (want_lp * c).sum()
    torch.testing.assert_close(s, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    assert not lp.requires_grad
    (-2.5 * s).backward()
    (-2.5 * want).backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("weighted", [False, True])
def test_stage_b_bf16_products_with_fp32_master_weights(weighted):
    """bf16-mixed: the hidden states and the fp32 weight are multiplied in bf16, as autocast runs the
    model's LM head; the gradients reach the fp32 weight in fp32. Within bf16's rounding of the
    logits and of the gradients' products."""
    h, w, index, g = _stage_b_inputs(4)
    c = g[0]
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    if weighted:
        s, lp = linear_weighted_sum(h1, w1, index, c, dtype=torch.bfloat16, temperature=0.7, chunk_tokens=4)
    else:
        lp, _ = linear_log_softmax_gather(h1, w1, index, dtype=torch.bfloat16, temperature=0.7, chunk_tokens=4)
        s = (lp * c).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(h2, w2)
    assert logits.dtype == torch.bfloat16
    want_lp, _ = _reference(logits, index, 0.7)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)  # the same bf16 logits, upcast alike
    s.backward()
    (want_lp * c).sum().backward()
    assert w1.grad.dtype == torch.float32 and h1.grad.dtype == torch.float32
    for got, want in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)


def test_no_gradient_wanted_computes_none():
    h, w, index, g = _stage_b_inputs(5)
    w = w.requires_grad_(True)  # the head's weight trains, the hidden states do not
    s, _ = linear_weighted_sum(h, w, index, g[0], dtype=torch.float32)
    s.backward()
    assert h.grad is None and w.grad is not None
    with torch.no_grad():
        lp, _ = linear_log_softmax_gather(h, w, index, dtype=torch.float32)
    assert not lp.requires_grad


def test_empty_input():
    lp, ent = log_softmax_gather(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    lp, _ = linear_log_softmax_gather(torch.zeros(0, 3), torch.zeros(5, 3), torch.zeros(0, dtype=torch.long),
                                      dtype=torch.float32)
    assert lp.shape == (0,)


# --------------------------------------------------------------------------- through a model: token_logps


def _qwen(vocab=300, hidden=32, layers=2, seed=0, **extra):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **extra)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _naive_token_logps(model, ids, temperature, position_ids=None):
    """The plain path of a whole batch: the model's logits [B, T, V], the fp32 log-softmax of all of
    them, token t scored by position t - 1."""
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    lp, ent = _reference(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), temperature)
    pad = lambda x: torch.nn.functional.pad(x.view(ids.shape[0], -1), (1, 0))  # noqa: E731
    return pad(lp), pad(ent)


def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _batch(layout, vocab=300):
    gen = torch.Generator().manual_seed(7)
    B, T = (1, 23) if layout == "packed" else (3, 13)
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    pos = None
    if layout == "packed":  # three sequences of 9, 6 and 8 tokens in one row
        pos = torch.cat([torch.arange(9), torch.arange(6), torch.arange(8)])[None]
    target = torch.ones(B, T)
    if layout == "targets":  # logits_to_keep: targets in some columns only, different per row
        target = torch.zeros(B, T)
        target[0, 4:9], target[1, 7:], target[2, 12] = 1, 1, 1
    target[:, 0] = 0
    if pos is not None:
        target = target * (pos != 0)  # a packed sequence's first token is scored against another
    g = torch.randn(2, B, T, generator=gen)
    return ids, pos, target, g


@pytest.mark.parametrize("layout", ["all", "targets", "packed"])
@pytest.mark.parametrize("fused", [True, False])
def test_token_logps_equals_the_plain_path(layout, fused):
    """Both paths (fused head, stage a on the model's logits), fp32, temperature 0.7, the entropy
    differentiated, a 5-token chunk (no batch is a multiple of it): values on the targets and
    every parameter's gradient, the tied embedding / LM head included."""
    model = _qwen()
    ids, pos, target, g = _batch(layout)
    from relign.models.logprobs import token_logps

    lp, ent = token_logps(model, ids, position_ids=pos, temperature=0.7, with_entropy=True, entropy_grad=True,
                          target_mask=target, chunk_tokens=5, fused_head=fused)
    ((lp * g[0] + ent * g[1]) * target).sum().backward()
    got = _grads(model)
    want_lp, want_ent = _naive_token_logps(model, ids, 0.7, pos)
    ((want_lp * g[0] + want_ent * g[1]) * target).sum().backward()
    want = _grads(model)
    on = target.bool()
    torch.testing.assert_close(lp[on], want_lp[on], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[on], want_ent[on], atol=1e-5, rtol=0)
    assert (lp[~on] == 0).all() and (ent[~on] == 0).all()
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("fused", [True, False])
def test_detached_entropy_adds_no_gradient(fused):
    model = _qwen()
    ids, pos, target, g = _batch("targets")
    from relign.models.logprobs import token_logps

    lp, ent = token_logps(model, ids, with_entropy=True, target_mask=target, chunk_tokens=4, fused_head=fused)
    assert not ent.requires_grad
    ((lp * g[0] + ent * g[1]) * target).sum().backward()
    got = _grads(model)
    want_lp, want_ent = _naive_token_logps(model, ids, 1.0)
    torch.testing.assert_close(ent * target, want_ent * target, atol=1e-5, rtol=0)
    (want_lp * g[0] * target).sum().backward()
    for n, w in _grads(model).items():
        torch.testing.assert_close(got[n], w, atol=1e-5, rtol=1e-4, msg=n)


def test_shared_prefix_layout_equals_the_plain_path():
    """Groups sharing a prompt (the prompt's KV cache, stage a on the responses' logits), temperature
    0.7, the entropy differentiated, against the whole rows' plain path."""
    from relign.models.logprobs import shared_prefix_token_logps

    model = _qwen()
    gen = torch.Generator().manual_seed(8)
    G, prompts, rows, plens = 2, [[5, 6, 7, 8, 9], [10, 11, 12]], [], []
    for gi, p in enumerate(prompts):
        for k in range(G):
            rows.append(p + torch.randint(3, 300, (3 + 2 * k + gi,), generator=gen).tolist())
            plens.append(len(p))
    L = max(map(len, rows))
    ids, attn, resp = torch.zeros(len(rows), L, dtype=torch.long), torch.zeros(len(rows), L, dtype=torch.long), torch.zeros(len(rows), L)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)], resp[i, plens[i] : len(r)] = torch.tensor(r), 1, 1
    g = torch.randn(2, *ids.shape, generator=gen)
    lp, ent = shared_prefix_token_logps(model, ids, attn, torch.tensor(plens), G, temperature=0.7, with_entropy=True,
                                        entropy_grad=True, chunk_tokens=3)
    ((lp * g[0] + ent * g[1]) * resp).sum().backward()
    got = _grads(model)
    # right padding under causal attention: each real token's outputs are those of its row alone
    want_lp, want_ent = _naive_token_logps(model, ids, 0.7)
    ((want_lp * g[0] + want_ent * g[1]) * resp).sum().backward()
    torch.testing.assert_close(lp, want_lp * resp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent * resp, atol=1e-5, rtol=0)
    for n, w in _grads(model).items():
        torch.testing.assert_close(got[n], w, atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("fused", [True, False])
def test_bf16_mixed_model(fused):
    """bf16-mixed (fp32 weights, the forward under autocast): both paths against the model's own
    bf16 logits upcast whole. The fused head multiplies in chunks, so a logit may round to the next
    bf16 number (1/128 at |logit| ~ 1): log-probs within 2e-2. Its weight gradient sums each chunk's
    bf16 product in fp32 where autograd rounds one product over all positions: gradients within 4
    bf16 roundings (2^-6) of their largest entry (0.4% seen over 4 seeds)."""
    from relign.models.logprobs import token_logps
    from relign.models.precision import enable_autocast

    model = enable_autocast(_qwen(hidden=64))
    ids, pos, target, g = _batch("targets")
    lp, ent = token_logps(model, ids, temperature=0.7, with_entropy=True, entropy_grad=True, target_mask=target,
                          chunk_tokens=4, fused_head=fused)
    ((lp * g[0] + ent * g[1]) * target).sum().backward()
    got = _grads(model)
    want_lp, want_ent = _naive_token_logps(model, ids, 0.7)
    ((want_lp * g[0] + want_ent * g[1]) * target).sum().backward()
    on = target.bool()
    torch.testing.assert_close(lp[on], want_lp[on], atol=2e-2, rtol=0)
    torch.testing.assert_close(ent[on], want_ent[on], atol=2e-2, rtol=0)
    for n, w in _grads(model).items():
        assert got[n].dtype == torch.float32
        torch.testing.assert_close(got[n], w, atol=2**-6 * w.abs().max().item() + 1e-8, rtol=0, msg=n)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_head_of_plain_and_wrapped_models():
    """The fused head stands in where the model is a plain causal LM, also under LoRA (the adapter's
    layers run inside the decoder stack); not where LoRA adapts the LM head, nor for an
    architecture outside ``PLAIN_CAUSAL_LMS``, which keep stage a (and the same numbers)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from relign.models.fused_ce import head_of
    from relign.models.loading import apply_lora
    from relign.models.logprobs import token_logps

    model = _qwen()
    backbone, weight = head_of(model)
    assert backbone is model.model and weight is model.lm_head.weight
    lora = apply_lora(_qwen(), r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    assert head_of(lora)[1] is lora.get_base_model().lm_head.weight
    assert head_of(apply_lora(_qwen(), r=4, alpha=8, dropout=0.0, target_modules=["lm_head"])) is None
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2))
    assert head_of(gpt2) is None

    ids, _, target, g = _batch("targets")
    for lora_b in [p for n, p in lora.named_parameters() if "lora_B" in n]:
        torch.nn.init.normal_(lora_b, std=0.1)  # a live adapter (peft starts B at 0)
    out = []
    for fused in (True, False):
        lp, _ = token_logps(lora, ids, temperature=0.7, target_mask=target, fused_head=fused)
        (lp * g[0]).sum().backward()
        out.append((lp.detach(), _grads(lora)))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=0)
    assert out[0][1].keys() == out[1][1].keys() and all("lora_" in n for n in out[0][1])
    for n in out[0][1]:
        torch.testing.assert_close(out[0][1][n], out[1][1][n], atol=1e-5, rtol=1e-4, msg=n)
