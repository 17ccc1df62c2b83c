"""TRPO pieces: CG on a known system, the FVP against torch.func's exact Hessian of the KL on a
2-layer Qwen2 (a trainable subset), the trust region and surrogate gain after a step, the
bitwise restore when the line search rejects, the zero-gradient skip, and the KLs by hand."""

from __future__ import annotations

import math

import pytest
import torch

from relign.algorithms.trpo import (
    conjugate_gradient,
    fisher_vector_product,
    flat_grad,
    flat_params,
    self_kl,
    set_flat_params,
    surrogate_objective,
    token_kl,
    trpo_step,
)
from relign.models.logprobs import shifted_token_logps
from relign.models.tiny import SIZES

B, T, PROMPT = 6, 10, 4  # 6 rows of 10 tokens; tokens 4..9 are the "response"


def _tiny_lm(vocab: int = 64, seed: int = 0):
    """relign's "micro" Qwen2 shape (2 layers, hidden 64) with a 64-token vocabulary, fp64.

    Built from the config rather than ``build_tiny_model`` so no tokenizer is trained and the
    vocabulary (hence the KL sums) stays small; eager attention so torch.func can vmap it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, inter = SIZES["micro"]
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
                      tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).double().eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    response_mask = torch.zeros(B, T)
    response_mask[:, PROMPT:] = 1.0
    return model, ids, response_mask


def _trainable(model, names):
    """Freeze everything except ``names``; returns those params (the trainable subset)."""
    named = dict(model.named_parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    params = [named[n] for n in names]
    for p in params:
        p.requires_grad_(True)
    return params


LAST_LAYER = "model.layers.1."


def _pg_problem(advantages_fn, seed: int = 0):
    """A one-batch policy-gradient problem on the tiny LM, trainable subset = last layer + final
    norm. Returns (model, params, surrogate_fn, kl_fn_fvp, kl_old_new_fn, measure_kl)."""
    model, ids, response_mask = _tiny_lm(seed=seed)
    names = [n for n, _ in model.named_parameters() if n.startswith(LAST_LAYER)] + ["model.norm.weight"]
    params = _trainable(model, names)
    logit_mask = response_mask[:, 1:]  # logits[:, t] predicts token t + 1
    with torch.no_grad():
        old_logits = model(input_ids=ids).logits
        old_logps, _ = shifted_token_logps(old_logits, ids)  # [B, T]
        old_logp_all = torch.log_softmax(old_logits[:, :-1], -1)  # [B, T-1, V], kept for the line search

    def surrogate_fn():
        logps, _ = shifted_token_logps(model(input_ids=ids).logits, ids)
        return surrogate_objective(logps, old_logps, advantages_fn(), response_mask)

    def kl_fn_fvp():  # baselines subsamples every 5th sample; here every 2nd row of 6
        return self_kl(model(input_ids=ids[::2]).logits[:, :-1], logit_mask[::2])

    def kl_old_new_fn():
        return token_kl(old_logp_all, torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1), logit_mask)

    def measure_kl():  # an independent full-batch KL(pi_old || pi_new), straight from the definition
        with torch.no_grad():
            p_old = torch.softmax(old_logits[:, :-1], -1)
            p_new = torch.softmax(model(input_ids=ids).logits[:, :-1], -1)
            kl = (p_old * (p_old.log() - p_new.log())).sum(-1)
            return ((kl * logit_mask).sum() / logit_mask.sum()).item()

    return model, params, surrogate_fn, kl_fn_fvp, kl_old_new_fn, measure_kl


def _zero_mean_advantages(seed: int = 1) -> torch.Tensor:
    """One advantage per sequence, mean 0 (every row has the same response length), so the
    surrogate at theta_old is mean(A) = 0 whichever sign the advantages are given."""
    A = torch.randn(B, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return A - A.mean()


# ---------------------------------------------------------------------------------------------
# conjugate gradient, flat helpers
# ---------------------------------------------------------------------------------------------


def test_cg_solves_random_spd_system():
    g = torch.Generator().manual_seed(0)
    M = torch.randn(20, 20, generator=g, dtype=torch.float64)
    A = M @ M.T + 20.0 * torch.eye(20, dtype=torch.float64)
    b = torch.randn(20, generator=g, dtype=torch.float64)
    x = conjugate_gradient(lambda v: A @ v, b, iters=20)  # exact after n = 20 steps up to rounding
    torch.testing.assert_close(x, torch.linalg.solve(A, b), rtol=0, atol=1e-6)
    x15 = conjugate_gradient(lambda v: A @ v, b)  # the default 15 iterations: already close
    assert (A @ x15 - b).norm() / b.norm() < 1e-4


def test_cg_zero_rhs_gives_zero_without_calling_fvp():
    calls = []
    x = conjugate_gradient(lambda v: calls.append(1) or v, torch.zeros(5, dtype=torch.float64))
    assert torch.equal(x, torch.zeros(5, dtype=torch.float64)) and not calls


def test_flat_params_roundtrip_and_flat_grad_zeros_for_unused():
    a = torch.arange(6.0).reshape(2, 3).requires_grad_()
    b = torch.tensor([7.0, 8.0], requires_grad=True)
    flat = flat_params([a, b])
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
    set_flat_params([a, b], flat * 2)
    assert a.tolist() == [[0, 2, 4], [6, 8, 10]] and b.tolist() == [14, 16]
    assert flat_grad((a**2).sum(), [a, b]).tolist() == [0, 4, 8, 12, 16, 20, 0, 0]  # b unused -> 0


# ---------------------------------------------------------------------------------------------
# KLs and the Fisher-vector product
# ---------------------------------------------------------------------------------------------


def test_token_kl_by_hand():
    # token 1: old [1/2, 1/4, 1/4], new [1/4, 1/2, 1/4]
    #   KL = 1/2 ln 2 + 1/4 ln(1/2) + 1/4 ln 1 = 1/4 ln 2 = 0.1732868
    # token 2: old [1/3, 1/3, 1/3], new [1/2, 1/4, 1/4]
    #   KL = 1/3 (ln(2/3) + ln(4/3) + ln(4/3)) = 1/3 ln(32/27) = 0.0566330
    # mask [1, 1]: mean = 0.1149599; mask [1, 0]: 0.1732868
    old = torch.tensor([[[1 / 2, 1 / 4, 1 / 4], [1 / 3, 1 / 3, 1 / 3]]], dtype=torch.float64).log()
    new = torch.tensor([[[1 / 4, 1 / 2, 1 / 4], [1 / 2, 1 / 4, 1 / 4]]], dtype=torch.float64).log()
    kl1, kl2 = 0.25 * math.log(2), math.log(32 / 27) / 3
    assert token_kl(old, new, torch.tensor([[1.0, 1.0]])).item() == pytest.approx((kl1 + kl2) / 2, rel=1e-12)
    assert token_kl(old, new, torch.tensor([[1.0, 0.0]])).item() == pytest.approx(kl1, rel=1e-12)
    assert (kl1 + kl2) / 2 == pytest.approx(0.1149599, abs=1e-7)


def test_self_kl_is_zero_with_zero_gradient_at_theta():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64,
                         requires_grad=True)
    kl = self_kl(logits, torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert kl.item() == 0.0
    (grad,) = torch.autograd.grad(kl, logits)
    assert grad.abs().max().item() < 1e-15


def test_fvp_equals_exact_hessian_of_kl_on_two_layer_model():
    """F v by double backprop through self_kl == torch.func.hessian of theta -> KL(pi_old || pi_theta)
    at theta_old (pi_old a constant, no stop-gradient trick) times v; trainable subset = the
    last layer's norm weights and v bias plus the final norm (160 parameters)."""
    from torch.func import functional_call, hessian

    model, ids, response_mask = _tiny_lm()
    names = [LAST_LAYER + "input_layernorm.weight", LAST_LAYER + "self_attn.v_proj.bias", "model.norm.weight"]
    params = _trainable(model, names)
    logit_mask = response_mask[:, 1:]
    theta_old = flat_params(params)
    frozen = {n: p.detach() for n, p in model.named_parameters()}
    with torch.no_grad():
        old_logp_all = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1)

    def kl_of(flat):
        sub, i = {}, 0
        for n, p in zip(names, params):
            sub[n] = flat[i : i + p.numel()].view_as(p)
            i += p.numel()
        logits = functional_call(model, {**frozen, **sub}, (ids,)).logits
        return token_kl(old_logp_all, torch.log_softmax(logits[:, :-1], -1), logit_mask)

    H = hessian(kl_of)(theta_old)  # [160, 160]
    assert H.shape == (160, 160)
    v = torch.randn(160, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    kl_fn = lambda: self_kl(model(input_ids=ids).logits[:, :-1], logit_mask)  # noqa: E731

    # The eager attention's softmax runs in float32, so the two agree to ~1e-8 of max|Hv|, not to
    # fp64 rounding: well inside the 1e-5 asked for. That rounding error is relative to the whole
    # vector's scale, not to each element: an element 1e5x smaller than the largest carries about
    # the same absolute error (measured: max error 7.0e-9 x max|Hv| on an AVX2 CPU, where one
    # element of 1e-6 was off by 1.4e-10), so the per-element check's floor is float32's eps there.
    Fv = fisher_vector_product(kl_fn, params, v, damping=0.0)
    assert (H @ v).norm() > 1e-3  # a non-trivial curvature to compare
    scale = (H @ v).abs().max().item()
    torch.testing.assert_close(Fv, H @ v, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(Fv, H @ v, rtol=1e-5, atol=torch.finfo(torch.float32).eps * scale)
    Fv_damped = fisher_vector_product(kl_fn, params, v, damping=0.1)
    torch.testing.assert_close(Fv_damped, Fv + 0.1 * v, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# trpo_step
# ---------------------------------------------------------------------------------------------


def test_trpo_step_stays_in_trust_region_and_improves_surrogate():
    A = _zero_mean_advantages()
    model, params, surrogate_fn, kl_fvp, kl_old_new, measure_kl = _pg_problem(lambda: A)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with torch.no_grad():
        L_old = surrogate_fn().item()
    m = trpo_step(params, surrogate_fn, kl_fvp, kl_old_new, max_kl=0.01)
    with torch.no_grad():
        L_new = surrogate_fn().item()
    kl = measure_kl()

    assert m["trpo/accepted"] == 1.0 and m["trpo/reason"] == "accepted"
    assert kl <= 1.05 * 0.01
    assert kl > 0.1 * 0.01  # a real step, not a vanishing one: the quadratic model aims at KL = delta
    assert kl == pytest.approx(m["trpo/kl"], rel=1e-9)
    assert L_new > L_old and m["trpo/surrogate_gain"] == pytest.approx(L_new - L_old, rel=1e-9)
    assert m["trpo/expected_gain"] > 0 and m["trpo/step_norm"] > 0 and m["trpo/grad_norm"] > 0
    for n, p in model.named_parameters():  # only the trainable subset moved
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n])


def test_reversed_advantages_make_line_search_reject_and_restore_params_bitwise():
    """The gradient (and so the proposed step) is taken with advantages A; the line search scores
    every candidate with -A, the reversed advantages. With mean(A) = 0 the surrogate is 0 at
    theta_old either way, and along the ascent direction of L_A every candidate (the smallest,
    0.8^9 of the full step, included) has L_{-A} = -L_A < 0, so none improves: all 10 are
    rejected and theta_old is copied back."""
    A = _zero_mean_advantages()
    model, params, surrogate_fn, kl_fvp, kl_old_new, _ = _pg_problem(
        lambda: A if torch.is_grad_enabled() else -A  # trpo_step evaluates candidates under no_grad
    )
    before = [p.detach().clone() for p in model.parameters()]
    m = trpo_step(params, surrogate_fn, kl_fvp, kl_old_new, max_kl=0.01, max_backtracks=10)
    assert m["trpo/accepted"] == 0.0 and m["trpo/reason"] == "line search failed"
    assert m["trpo/backtracks"] == 10
    assert m["trpo/kl"] == 0.0 and m["trpo/surrogate_gain"] == 0.0 and m["trpo/step_norm"] == 0.0
    assert m["trpo/expected_gain"] > 0  # the step itself was a proper ascent step for A
    for p, p0 in zip(model.parameters(), before):
        assert torch.equal(p, p0)


def test_kl_above_max_kl_everywhere_rejects_each_candidate_once():
    A = _zero_mean_advantages()
    model, params, surrogate_fn, kl_fvp, _, _ = _pg_problem(lambda: A)
    calls = []

    def kl_always_too_big():
        calls.append(1)
        return torch.tensor(0.02, dtype=torch.float64)

    before = [p.detach().clone() for p in model.parameters()]
    m = trpo_step(params, surrogate_fn, kl_fvp, kl_always_too_big, max_kl=0.01, max_backtracks=3)
    assert len(calls) == 3 and m["trpo/backtracks"] == 3 and m["trpo/accepted"] == 0.0
    for p, p0 in zip(model.parameters(), before):
        assert torch.equal(p, p0)


def test_line_search_shrinks_by_backtrack_ratio_until_accepted():
    """Candidates are 1, 0.8, 0.8^2, ... times the full step: with the KL check failing on the
    first two, the accepted step is 0.64 of the full step and two backtracks are counted."""
    A = _zero_mean_advantages()
    steps = {}
    for fail_first in (0, 2):
        model, params, surrogate_fn, kl_fvp, kl_old_new, _ = _pg_problem(lambda: A)
        theta_old = flat_params(params)
        calls = []

        def kl_fn(calls=calls, fail_first=fail_first):
            calls.append(1)
            return torch.tensor(1.0, dtype=torch.float64) if len(calls) <= fail_first else kl_old_new()

        m = trpo_step(params, surrogate_fn, kl_fvp, kl_fn)
        assert m["trpo/accepted"] == 1.0 and m["trpo/backtracks"] == fail_first
        steps[fail_first] = flat_params(params) - theta_old
    torch.testing.assert_close(steps[2], 0.8**2 * steps[0], rtol=1e-9, atol=1e-12)


def test_zero_advantages_give_no_update():
    zeros = torch.zeros(B, dtype=torch.float64)
    model, params, surrogate_fn, _, kl_old_new, _ = _pg_problem(lambda: zeros)
    fvp_calls = []

    def kl_fvp():
        fvp_calls.append(1)
        raise AssertionError("no FVP for a zero gradient")

    before = [p.detach().clone() for p in model.parameters()]
    m = trpo_step(params, surrogate_fn, kl_fvp, kl_old_new)
    assert m["trpo/accepted"] == 0.0 and m["trpo/reason"] == "zero gradient" and m["trpo/grad_norm"] == 0.0
    assert not fvp_calls
    for p, p0 in zip(model.parameters(), before):
        assert torch.equal(p, p0)
