"""KL estimators (k1/k2/k3) and the KL reward penalty: hand values, naive formulas, exact
expectations over a small vocabulary (unbiasedness and what each gradient estimates)."""

from __future__ import annotations

import math

import pytest
import torch

from relign.algorithms.kl import kl_estimate, kl_penalty_rewards


def test_kl_estimators_by_hand():
    # pi(y) = 0.5, pi_ref(y) = 0.25: log r = log(0.25 / 0.5) = -log 2 = -0.693147
    #   k1 = -log r             = 0.693147
    #   k2 = 0.5 * (log 2)^2    = 0.5 * 0.480453 = 0.240227
    #   k3 = (0.5 - 1) + log 2  = 0.193147
    logps = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    ln2 = math.log(2.0)
    assert kl_estimate(logps, ref, "k1").item() == pytest.approx(ln2, rel=1e-6)
    assert kl_estimate(logps, ref, "k2").item() == pytest.approx(0.5 * ln2**2, rel=1e-6)
    assert kl_estimate(logps, ref, "k3").item() == pytest.approx(-0.5 + ln2, rel=1e-6)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_naive_formula(kind):
    g = torch.Generator().manual_seed(0)
    logps = torch.randn(3, 5, generator=g, dtype=torch.float64) - 2.0
    ref = torch.randn(3, 5, generator=g, dtype=torch.float64) - 2.0
    got = kl_estimate(logps, ref, kind)
    want = []
    for lp, rp in zip(logps.flatten().tolist(), ref.flatten().tolist()):
        log_r = rp - lp
        want.append({"k1": -log_r, "k2": 0.5 * log_r**2, "k3": math.exp(log_r) - 1.0 - log_r}[kind])
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64).reshape(3, 5))
    if kind != "k1":
        assert (got >= 0).all()


def _exact_expectations(kind: str):
    """Exact E_{y ~ pi}[k(y)] and E_{y ~ pi}[d k(y) / d theta] over a 6-token vocabulary."""
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    ref_logits = torch.randn(6, generator=g, dtype=torch.float64)
    logp, ref = torch.log_softmax(theta, -1), torch.log_softmax(ref_logits, -1)
    pi = logp.exp().detach()  # the sampling distribution: not differentiated
    k = kl_estimate(logp.unsqueeze(0), ref.unsqueeze(0), kind).squeeze(0)
    (grad,) = torch.autograd.grad((pi * k).sum(), theta, retain_graph=True)
    return theta, logp, ref, (pi * k).sum().item(), grad


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_k1_k3_are_unbiased(kind):
    _, logp, ref, expectation, _ = _exact_expectations(kind)
    true_kl = (logp.exp() * (logp - ref)).sum().item()  # KL(pi || ref) = sum_y pi log(pi / ref)
    assert expectation == pytest.approx(true_kl, rel=1e-10)


def test_gradients_as_loss_match_the_module_docstring():
    # k1: E[d k1] = 0
    theta, logp, ref, _, grad = _exact_expectations("k1")
    torch.testing.assert_close(grad, torch.zeros_like(grad))
    # k2: E[d k2] = d KL(pi || ref)
    theta, logp, ref, _, grad = _exact_expectations("k2")
    (want,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    torch.testing.assert_close(grad, want)
    # k3: E[d k3] = d KL(ref || pi)
    theta, logp, ref, _, grad = _exact_expectations("k3")
    (want,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)
    torch.testing.assert_close(grad, want)


def test_identical_policies_give_zero_kl_and_zero_k2_k3_gradient():
    logps = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    for kind in ("k1", "k2", "k3"):
        kl = kl_estimate(logps, logps.detach(), kind)
        assert torch.equal(kl, torch.zeros_like(kl))
        (grad,) = torch.autograd.grad(kl.sum(), logps)
        # d k1 / d logp = 1; d k2 / d logp = -log r = 0; d k3 / d logp = -r + 1 = 0
        torch.testing.assert_close(grad, torch.ones_like(grad) if kind == "k1" else torch.zeros_like(grad))


def test_k3_does_not_overflow_and_clamp():
    # log r = 0 - (-100) = 100: exp(100) overflows float32; the exponent is capped at 20
    # -> k3 = exp(20) - 1 - 100 = 4.85165e8 - 101
    logps = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.0]])
    kl = kl_estimate(logps, ref, "k3")
    assert torch.isfinite(kl).all()
    assert kl[0, 0].item() == pytest.approx(math.exp(20.0) - 101.0, rel=1e-6)
    # veRL-style clamp to [-10, 10]: 10 where it bites, and no gradient there
    kl = kl_estimate(logps, ref, "k3", clamp=10.0)
    assert kl[0, 0].item() == 10.0 and kl[0, 1].item() == 0.0
    (grad,) = torch.autograd.grad(kl.sum(), logps)
    assert torch.isfinite(grad).all() and grad[0, 0] == 0
    # the clamp applies to k1 too (the one estimator that can go negative): k1 = -100 - 0 -> -10
    assert kl_estimate(logps, ref, "k1", clamp=10.0)[0, 0].item() == -10.0


def test_kl_dtype_and_unknown_kind():
    kl = kl_estimate(torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16), "k3")
    assert kl.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "low_var_kl")


def test_kl_penalty_rewards_by_hand():
    # beta 0.5, mask [0, 1, 1]: position 0 -> 0; position 1: 0 - 0.5 * 0.2 = -0.1;
    # position 2: 1 - 0.5 * 0.3 = 0.85
    r = torch.tensor([[7.0, 0.0, 1.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3]], requires_grad=True)
    out = kl_penalty_rewards(r, kl, 0.5, torch.tensor([[0.0, 1.0, 1.0]]))
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.1, 0.85]]))
    assert not out.requires_grad  # a reward, not a loss


def test_kl_penalty_rewards_random_and_empty_mask():
    g = torch.Generator().manual_seed(2)
    r, kl = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    m = torch.rand(3, 4, generator=g) > 0.5
    out = kl_penalty_rewards(r, kl, torch.tensor(0.05), m)
    for i in range(3):
        for t in range(4):
            want = r[i, t].item() - 0.05 * kl[i, t].item() if m[i, t] else 0.0
            assert out[i, t].item() == pytest.approx(want, abs=1e-6)
    assert torch.equal(kl_penalty_rewards(r, kl, 0.1, torch.zeros(3, 4)), torch.zeros(3, 4))
