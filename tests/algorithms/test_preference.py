"""Preference losses: hand values for every loss, the limiting cases (beta -> 0, h = 0, label
smoothing 0.5, DPOP's one-sided penalty, ORPO at p -> 0 and p -> 1, KTO with one kind only),
autograd gradients against the closed forms, naive re-implementations on random inputs, and
the metrics."""

from __future__ import annotations

import math

import pytest
import torch

from relign.algorithms.preference import (
    bradley_terry_loss,
    dpo_loss,
    dpop_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    sdpo_loss,
    simpo_loss,
)

F64 = torch.float64
PAIR_KEYS = {"rewards/chosen", "rewards/rejected", "margins", "accuracy"}


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def neg_log_sigmoid(x: float) -> float:
    return -math.log(sigmoid(x))


def t(values: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=grad)


def close(actual: torch.Tensor, expected: list[float] | torch.Tensor, **kw) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, **kw)


def _pair(seed: int, n: int = 64, scale: float = 5.0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(-scale * torch.rand(n, generator=g, dtype=F64) for _ in range(4))


# ---------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------


def test_dpo_by_hand_and_metrics():
    # beta 0.1:
    #   pair 0: pc -1, rc -2, pr -3, rr -3: h = 0.1 ((-1 + 2) - (-3 + 3)) =  0.1 -> -log sigma(0.1)  = 0.64440
    #   pair 1: pc -5, rc -4, pr -4, rr -6: h = 0.1 ((-5 + 4) - (-4 + 6)) = -0.3 -> -log sigma(-0.3) = 0.85436
    pc, pr = t([-1.0, -5.0], grad=True), t([-3.0, -4.0], grad=True)
    rc, rr = t([-2.0, -4.0]), t([-3.0, -6.0])
    losses, m = dpo_loss(pc, pr, rc, rr, beta=0.1)
    close(losses, [neg_log_sigmoid(0.1), neg_log_sigmoid(-0.3)])
    close(losses, [0.64440, 0.85436], atol=1e-5, rtol=0)
    assert set(m) == PAIR_KEYS
    # rewards beta (pc - rc) = [0.1, -0.1], beta (pr - rr) = [0, 0.2]; margins = h; accuracy [1, 0].
    close(m["rewards/chosen"], [0.1, -0.1])
    close(m["rewards/rejected"], [0.0, 0.2])
    close(m["margins"], [0.1, -0.3])
    close(m["accuracy"], [1.0, 0.0])
    assert all(not v.requires_grad for v in m.values())

    # d L / d pc = -beta (1 - sigma(h)), d L / d pr = +beta (1 - sigma(h))   (eps = 0)
    g_c, g_r = torch.autograd.grad(losses.sum(), (pc, pr))
    expected = [-0.1 * (1 - sigmoid(0.1)), -0.1 * (1 - sigmoid(-0.3))]
    close(g_c, expected)
    close(g_r, [-x for x in expected])


def test_dpo_equal_logps_is_log2_and_beta_to_zero():
    # h = 0 -> -log sigma(0) = log 2, whatever beta.
    z = t([-7.0, -1.0])
    losses, m = dpo_loss(z, z, z, z, beta=0.5)
    close(losses, [math.log(2)] * 2)
    close(m["accuracy"], [0.0, 0.0])  # a tie is not counted as correct

    # beta -> 0: h -> 0, so the loss -> log 2 and the gradient beta (sigma(h) - 1) -> 0.
    pc, pr, rc, rr = _pair(0, n=8)
    pc.requires_grad_(True)
    for beta, tol in [(1e-6, 1e-5), (0.0, 0.0)]:
        losses, _ = dpo_loss(pc, pr, rc, rr, beta=beta)
        close(losses, [math.log(2)] * 8, atol=tol, rtol=0)
        (g,) = torch.autograd.grad(losses.sum(), pc)
        close(g, [0.0] * 8, atol=tol, rtol=0)


def test_dpo_label_smoothing():
    pc, pr, rc, rr = t([-1.0], grad=True), t([-3.0]), t([-2.0]), t([-3.0])  # h = 0.1 as above
    # eps 0.2: -(0.8 log sigma(0.1) + 0.2 log sigma(-0.1)) = 0.8 * 0.64440 + 0.2 * 0.74440 = 0.66440
    losses, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.2)
    close(losses, [0.8 * neg_log_sigmoid(0.1) + 0.2 * neg_log_sigmoid(-0.1)])
    close(losses, [0.66440], atol=1e-5, rtol=0)
    # d L / d h = sigma(h) - (1 - eps), times dh/dpc = beta
    (g,) = torch.autograd.grad(losses.sum(), pc)
    close(g, [0.1 * (sigmoid(0.1) - 0.8)])

    # eps 0.5: -(0.5 log sigma(h) + 0.5 log sigma(-h)), the same for h and -h:
    # h = +-0.1 -> 0.5 (0.64440 + 0.74440) = 0.69440
    up, _ = dpo_loss(t([-1.0]), t([-3.0]), t([-2.0]), t([-3.0]), beta=0.1, label_smoothing=0.5)
    down, _ = dpo_loss(t([-3.0]), t([-1.0]), t([-3.0]), t([-2.0]), beta=0.1, label_smoothing=0.5)
    close(up, [0.5 * (neg_log_sigmoid(0.1) + neg_log_sigmoid(-0.1))])
    close(up, [0.69440], atol=1e-5, rtol=0)
    close(down, up)
    # ... minimal (= log 2) with zero gradient at h = 0
    x = t([-2.0], grad=True)
    losses, _ = dpo_loss(x, t([-2.0]), t([-2.0]), t([-2.0]), beta=0.1, label_smoothing=0.5)
    close(losses, [math.log(2)])
    (g,) = torch.autograd.grad(losses.sum(), x)
    close(g, [0.0])

    # cDPO's optimum is finite: the gradient vanishes at h* = log((1 - eps) / eps).
    eps, beta = 0.1, 0.1
    x = t([math.log(0.9 / 0.1) / beta], grad=True)  # pc - rc = h* / beta, the rejected side at 0
    losses, _ = dpo_loss(x, t([0.0]), t([0.0]), t([0.0]), beta=beta, label_smoothing=eps)
    (g,) = torch.autograd.grad(losses.sum(), x)
    close(g, [0.0], atol=1e-12, rtol=0)

    for bad in (-0.1, 0.6):
        with pytest.raises(ValueError):
            dpo_loss(t([0.0]), t([0.0]), t([0.0]), t([0.0]), label_smoothing=bad)


def test_dpo_extreme_margins_are_finite_in_float32():
    # h = +-1000 (log-prob gaps a naive log(sigmoid(h)) turns into -inf): loss ~ max(0, -h) = [0, 1000].
    pc = torch.tensor([0.0, -10000.0], requires_grad=True)
    pr = torch.tensor([-10000.0, 0.0])
    z = torch.zeros(2)
    losses, _ = dpo_loss(pc, pr, z, z, beta=0.1)
    close(losses, [0.0, 1000.0])
    (g,) = torch.autograd.grad(losses.sum(), pc)
    assert torch.isfinite(g).all()
    close(g, [0.0, -0.1])


def test_dpo_matches_naive_formula_random():
    pc, pr, rc, rr = _pair(1)
    for eps in (0.0, 0.3):
        h = 0.2 * ((pc - rc) - (pr - rr))
        naive = -(1 - eps) * torch.log(torch.sigmoid(h)) - eps * torch.log(torch.sigmoid(-h))
        losses, m = dpo_loss(pc, pr, rc, rr, beta=0.2, label_smoothing=eps)
        close(losses, naive)
        close(m["margins"], h)
        close(m["accuracy"], (h > 0).to(F64))


def test_dpo_detaches_reference_and_upcasts_bf16():
    pc, pr, rc, rr = (x.clone().requires_grad_(True) for x in _pair(2, n=4))
    losses, _ = dpo_loss(pc, pr, rc, rr)
    losses.sum().backward()
    assert rc.grad is None and rr.grad is None
    assert pc.grad is not None and pr.grad is not None

    bf = [x.detach().to(torch.bfloat16) for x in (pc, pr, rc, rr)]
    losses, m = dpo_loss(*bf)
    assert losses.dtype == torch.float32 and m["margins"].dtype == torch.float32


def test_sdpo_is_dpo_on_step_logps():
    pc, pr, rc, rr = _pair(3, n=8)
    a, ma = sdpo_loss(pc, pr, rc, rr, beta=0.3, label_smoothing=0.1)
    b, mb = dpo_loss(pc, pr, rc, rr, beta=0.3, label_smoothing=0.1)
    close(a, b)
    for k in PAIR_KEYS:
        close(ma[k], mb[k])


# ---------------------------------------------------------------------------------------------
# IPO
# ---------------------------------------------------------------------------------------------


def test_ipo_by_hand_and_gradient():
    # h = (pc - rc) - (pr - rr) = (-1 + 2) - (-3 + 3) = 1 (no beta inside).
    #   beta 0.1: (1 - 1/0.2)^2 = (1 - 5)^2 = 16;   beta 0.5: (1 - 1)^2 = 0 (at the target).
    pc, pr, rc, rr = t([-1.0], grad=True), t([-3.0]), t([-2.0]), t([-3.0])
    losses, m = ipo_loss(pc, pr, rc, rr, beta=0.1)
    close(losses, [16.0])
    close(m["margins"], [0.1])  # beta h
    close(m["accuracy"], [1.0])
    (g,) = torch.autograd.grad(losses.sum(), pc)
    close(g, [2 * (1 - 5.0)])  # d/dpc (h - 1/(2 beta))^2 = 2 (h - 1/(2 beta)) = -8
    close(ipo_loss(pc, pr, rc, rr, beta=0.5)[0], [0.0])


def test_ipo_equal_logps_and_naive():
    # h = 0 -> (1 / (2 beta))^2 = 1 / (4 beta^2): beta 0.1 -> 25, beta 2 -> 1/16.
    z = t([-4.0, -0.5])
    close(ipo_loss(z, z, z, z, beta=0.1)[0], [25.0, 25.0])
    close(ipo_loss(z, z, z, z, beta=2.0)[0], [1 / 16] * 2)
    pc, pr, rc, rr = _pair(4)
    close(ipo_loss(pc, pr, rc, rr, beta=0.3)[0], ((pc - rc) - (pr - rr) - 1 / 0.6) ** 2)
    with pytest.raises(ValueError):
        ipo_loss(z, z, z, z, beta=0.0)


# ---------------------------------------------------------------------------------------------
# DPOP
# ---------------------------------------------------------------------------------------------


def test_dpop_penalty_only_below_reference():
    # beta 0.1, lambda 50.
    #   pair 0: pc -1 > rc -2: penalty max(0, rc - pc) = 0 -> exactly DPO, h = 0.1, loss 0.64440
    #   pair 1: pc -3 < rc -2: penalty 1; pr - rr = -5 + 3 = -2:
    #           h = 0.1 ((-1) - (-2) - 50 * 1) = -4.9 -> -log sigma(-4.9) = 4.90742
    #           (plain DPO would give h = 0.1 -> 0.64440: it does not see the chosen drop)
    #   pair 2: pc = rc (boundary): penalty 0
    pc = t([-1.0, -3.0, -2.0], grad=True)
    pr, rc, rr = t([-3.0, -5.0, -4.0]), t([-2.0, -2.0, -2.0]), t([-3.0, -3.0, -3.0])
    losses, m = dpop_loss(pc, pr, rc, rr, beta=0.1, lambda_dpop=50.0)
    close(losses, [neg_log_sigmoid(0.1), neg_log_sigmoid(-4.9), neg_log_sigmoid(0.1)])
    close(losses[:2], [0.64440, 4.90742], atol=1e-5, rtol=0)
    close(m["penalty"], [0.0, 1.0, 0.0])
    close(m["margins"], [0.1, 0.1, 0.1])  # the implicit rewards are DPO's, without the penalty
    dpo, _ = dpo_loss(pc, pr, rc, rr, beta=0.1)
    close(losses[[0, 2]], dpo[[0, 2]])
    # d L / d pc = -(1 - sigma(h)) dh/dpc with dh/dpc = beta (1 + lambda) where the penalty is
    # active, beta where it is not (at the tie pc = rc the penalty is off: relu's gradient at 0 is 0).
    (g,) = torch.autograd.grad(losses.sum(), pc)
    close(g, [-0.1 * (1 - sigmoid(0.1)), -0.1 * 51 * (1 - sigmoid(-4.9)), -0.1 * (1 - sigmoid(0.1))])


def test_dpop_lambda_zero_is_dpo_and_naive():
    pc, pr, rc, rr = _pair(5)
    close(dpop_loss(pc, pr, rc, rr, beta=0.2, lambda_dpop=0.0)[0], dpo_loss(pc, pr, rc, rr, beta=0.2)[0])
    h = 0.2 * ((pc - rc) - (pr - rr) - 7.0 * torch.relu(rc - pc))
    close(dpop_loss(pc, pr, rc, rr, beta=0.2, lambda_dpop=7.0)[0], -torch.log(torch.sigmoid(h)))


# ---------------------------------------------------------------------------------------------
# SimPO
# ---------------------------------------------------------------------------------------------


def test_simpo_by_hand_margin_and_gradient():
    # avg_c -0.5, avg_r -1.0, beta 2, gamma 0.5: h = 2 (-0.5) - 2 (-1) - 0.5 = 0.5 -> -log sigma(0.5) = 0.47408
    c, r = t([-0.5], grad=True), t([-1.0], grad=True)
    losses, m = simpo_loss(c, r, beta=2.0, gamma=0.5)
    close(losses, [neg_log_sigmoid(0.5)])
    close(losses, [0.47408], atol=1e-5, rtol=0)
    close(m["rewards/chosen"], [-1.0])
    close(m["rewards/rejected"], [-2.0])
    close(m["margins"], [1.0])  # without gamma
    close(m["accuracy"], [1.0])
    # d L / d avg_c = -beta (1 - sigma(h)) = -2 (1 - sigma(0.5)); d / d avg_r is its negative
    g_c, g_r = torch.autograd.grad(losses.sum(), (c, r))
    close(g_c, [-2.0 * (1 - sigmoid(0.5))])
    close(g_r, [2.0 * (1 - sigmoid(0.5))])

    # the margin: gamma 0 -> h = 1 -> 0.31326; equal averages -> h = -gamma -> -log sigma(-0.5) = 0.97408
    close(simpo_loss(c, r, beta=2.0, gamma=0.0)[0], [neg_log_sigmoid(1.0)])
    close(simpo_loss(r, r, beta=2.0, gamma=0.5)[0], [0.97408], atol=1e-5, rtol=0)
    # gamma is the margin itself, not gamma / beta: beta 4, gamma 1, avg_c - avg_r = 0.25 ->
    # h = 4 * 0.25 - 1 = 0 -> log 2 (a gamma_beta_ratio of 1 would give h = 4 (0.25 - 1) = -3).
    close(simpo_loss(t([-0.75]), t([-1.0]), beta=4.0, gamma=1.0)[0], [math.log(2)])


def test_simpo_label_smoothing_and_naive():
    # eps 0.2, h = 0.5: 0.8 (-log sigma(0.5)) + 0.2 (-log sigma(-0.5))
    losses, _ = simpo_loss(t([-0.5]), t([-1.0]), beta=2.0, gamma=0.5, label_smoothing=0.2)
    close(losses, [0.8 * neg_log_sigmoid(0.5) + 0.2 * neg_log_sigmoid(-0.5)])
    c, r, _, _ = _pair(6, scale=3.0)
    h = 2.5 * c - 2.5 * r - 0.3
    close(simpo_loss(c, r, beta=2.5, gamma=0.3)[0], -torch.log(torch.sigmoid(h)))


# ---------------------------------------------------------------------------------------------
# ORPO
# ---------------------------------------------------------------------------------------------


def test_orpo_by_hand_and_gradient():
    # p_c = 0.5 -> odds 1 -> log odds 0; p_r = 0.2 -> odds 0.25 -> log odds log(1/4).
    # log odds ratio = log 4, sigma(log 4) = 4/5 -> -log sigma = -log 0.8 = 0.22314.
    # chosen_nll = -log 0.5 = 0.69315, lam 0.1: L = 0.69315 + 0.1 * 0.22314 = 0.71546
    c, r = t([math.log(0.5)], grad=True), t([math.log(0.2)], grad=True)
    losses, m = orpo_loss(c, r, -c, lam=0.1)
    close(losses, [math.log(2) - 0.1 * math.log(0.8)])
    close(losses, [0.71546], atol=1e-5, rtol=0)
    close(m["log_odds_ratio"], [math.log(4)])
    close(m["rewards/chosen"], [0.1 * math.log(0.5)])
    close(m["rewards/rejected"], [0.1 * math.log(0.2)])
    close(m["accuracy"], [1.0])
    assert set(m) == PAIR_KEYS | {"log_odds_ratio"}
    # d log odds / d avg = 1 + p / (1 - p) = 1 / (1 - p); d(-log sigma(d)) / d d = -(1 - sigma(d)) = -0.2
    #   d L / d avg_c = -1 (the NLL) + 0.1 * (-0.2) * 1 / (1 - 0.5) = -1.04
    #   d L / d avg_r = 0.1 * 0.2 * 1 / (1 - 0.2) = 0.025
    g_c, g_r = torch.autograd.grad(losses.sum(), (c, r))
    close(g_c, [-1.04])
    close(g_r, [0.025])


def test_orpo_extreme_probabilities_are_finite():
    # float32, as from a bf16 model. p -> 0: log odds -> avg itself (log(1 - p) -> 0).
    c = torch.tensor([-50.0, -1e4, 0.0, -1e-9, 0.0, math.log(0.999)], requires_grad=True)
    r = torch.tensor([-80.0, -2e4, -1e-7, 0.0, 0.0, math.log(0.5)], requires_grad=True)
    losses, m = orpo_loss(c, r, -c, lam=0.1)
    g_c, g_r = torch.autograd.grad(losses.sum(), (c, r))
    for x in (losses, g_c, g_r, m["log_odds_ratio"]):
        assert torch.isfinite(x).all(), x
    lor = m["log_odds_ratio"]
    close(lor[:2], [30.0, 1e4])
    # p -> 1: avg is clamped to -1e-6, log odds = -1e-6 - log(1 - exp(-1e-6)) = 13.8155 (finite);
    # both at p = 1 -> ratio 0 -> the odds term is log 2.
    close(lor[4], torch.tensor(0.0))
    close(losses[4], torch.tensor(0.1 * math.log(2)))
    # log(1 - p) is accurate near p = 1: p_c = 0.999 -> log odds log(999) = 6.90675; p_r = 0.5 -> 0.
    close(lor[5], torch.tensor(math.log(999.0)), atol=2e-4, rtol=0)


def test_orpo_matches_naive_formula_random():
    g = torch.Generator().manual_seed(7)
    c, r = -3 * torch.rand(32, generator=g, dtype=F64) - 0.01, -3 * torch.rand(32, generator=g, dtype=F64) - 0.01
    nll = torch.rand(32, generator=g, dtype=F64)
    pc, pr = c.exp(), r.exp()
    lor = torch.log(pc / (1 - pc)) - torch.log(pr / (1 - pr))
    losses, m = orpo_loss(c, r, nll, lam=0.25)
    close(losses, nll - 0.25 * torch.log(torch.sigmoid(lor)))
    close(m["log_odds_ratio"], lor)


# ---------------------------------------------------------------------------------------------
# KTO
# ---------------------------------------------------------------------------------------------


def test_kto_by_hand_weights_and_gradient():
    # beta 0.1, z0 0.5, r = policy - ref = [-1 + 2, -5 + 3] = [1, -2]
    #   example 0, desirable:   w_D (1 - sigma(0.1 (1 - 0.5)))  = 2.0 * (1 - sigma(0.05)) = 2.0 * 0.48750
    #   example 1, undesirable: w_U (1 - sigma(0.1 (0.5 + 2))) = 0.5 * (1 - sigma(0.25)) = 0.5 * 0.43782
    pol = t([-1.0, -5.0], grad=True)
    ref = t([-2.0, -3.0])
    des = torch.tensor([True, False])
    losses, m = kto_loss(pol, ref, des, 0.5, beta=0.1, desirable_weight=2.0, undesirable_weight=0.5)
    close(losses, [2.0 * (1 - sigmoid(0.05)), 0.5 * (1 - sigmoid(0.25))])
    close(losses, [2.0 * 0.48750, 0.5 * 0.43782], atol=1e-5, rtol=0)
    close(m["rewards"], [0.1, -0.2])
    close(m["is_desirable"], [1.0, 0.0])
    # d/dr of w (1 - sigma(beta s (r - z0))) = -w beta s sigma (1 - sigma), s = +1 desirable, -1 undesirable
    (g,) = torch.autograd.grad(losses.sum(), pol)
    s0, s1 = sigmoid(0.05), sigmoid(0.25)
    close(g, [-2.0 * 0.1 * s0 * (1 - s0), 0.5 * 0.1 * s1 * (1 - s1)])


def test_kto_only_one_kind_and_detached_reference_point():
    pol, ref, _, _ = _pair(8, n=6)
    pol.requires_grad_(True)
    z0 = torch.tensor(0.3, dtype=F64, requires_grad=True)
    r = pol.detach() - ref
    for kind in (True, False):
        des = torch.full((6,), kind)
        losses, m = kto_loss(pol, ref, des, z0, beta=0.2)
        s = 1.0 if kind else -1.0
        close(losses.detach(), 1 - torch.sigmoid(0.2 * s * (r - 0.3)))  # the naive per-example formula
        close(m["is_desirable"], [float(kind)] * 6)
        loss = losses.mean()  # what the caller does: finite with one kind only
        assert torch.isfinite(loss)
        loss.backward()
        assert torch.isfinite(pol.grad).all()
        assert z0.grad is None  # z0 is a constant: no gradient reaches it
        pol.grad = None
    # an empty batch is empty, not NaN
    e = torch.zeros(0, dtype=F64)
    assert kto_loss(e, e, torch.zeros(0, dtype=torch.bool), 0.0)[0].shape == (0,)


def test_kto_reference_point():
    # mean([-1 + 2, -2 + 2.5]) = mean([1, 0.5]) = 0.75
    p = t([-1.0, -2.0], grad=True)
    z0 = kto_reference_point(p, t([-2.0, -2.5]))
    close(z0, torch.tensor(0.75, dtype=F64))
    assert not z0.requires_grad and z0.shape == ()
    # a negative estimate (mean(-3 + 1) = -2) is clamped to 0: a KL is >= 0
    close(kto_reference_point(t([-3.0]), t([-1.0])), torch.tensor(0.0, dtype=F64))
    e = torch.zeros(0)
    close(kto_reference_point(e, e), torch.tensor(0.0))


# ---------------------------------------------------------------------------------------------
# Bradley-Terry reward model
# ---------------------------------------------------------------------------------------------


def test_bradley_terry_by_hand_margin_centering():
    # r_w [1, 0], r_l [0, 0.5], m [0.5, 0], c 0.01:
    #   pair 0: -log sigma(1 - 0 - 0.5) + 0.01 (1 + 0)^2   = 0.47408 + 0.01   = 0.48408
    #   pair 1: -log sigma(0 - 0.5 - 0) + 0.01 (0 + 0.5)^2 = 0.97408 + 0.0025 = 0.97658
    rw, rl = t([1.0, 0.0], grad=True), t([0.0, 0.5], grad=True)
    losses, m = bradley_terry_loss(rw, rl, margin=t([0.5, 0.0]), center_coef=0.01)
    close(losses, [neg_log_sigmoid(0.5) + 0.01, neg_log_sigmoid(-0.5) + 0.0025])
    close(losses, [0.48408, 0.97658], atol=1e-5, rtol=0)
    close(m["rewards/chosen"], [1.0, 0.0])
    close(m["rewards/rejected"], [0.0, 0.5])
    close(m["margins"], [1.0, -0.5])  # without m
    close(m["accuracy"], [1.0, 0.0])
    # d L / d r_w = -(1 - sigma(z)) + 2 c (r_w + r_l); d L / d r_l = +(1 - sigma(z)) + 2 c (r_w + r_l)
    g_w, g_l = torch.autograd.grad(losses.sum(), (rw, rl))
    close(g_w, [-(1 - sigmoid(0.5)) + 0.02 * 1.0, -(1 - sigmoid(-0.5)) + 0.02 * 0.5])
    close(g_l, [(1 - sigmoid(0.5)) + 0.02 * 1.0, (1 - sigmoid(-0.5)) + 0.02 * 0.5])

    # no margin, no centering: plain BT; a float margin broadcasts
    close(bradley_terry_loss(rw, rl)[0], [neg_log_sigmoid(1.0), neg_log_sigmoid(-0.5)])
    close(bradley_terry_loss(rw, rl, margin=0.5)[0], [neg_log_sigmoid(0.5), neg_log_sigmoid(-1.0)])
    # centering moves no preference: shifting both rewards changes only the centering term
    base, _ = bradley_terry_loss(rw + 3.0, rl + 3.0)
    close(base, bradley_terry_loss(rw, rl)[0])


def test_bradley_terry_naive_random():
    rw, rl, mg, _ = _pair(9)
    naive = -torch.log(torch.sigmoid(rw - rl - mg)) + 0.05 * (rw + rl) ** 2
    close(bradley_terry_loss(rw, rl, margin=mg, center_coef=0.05)[0], naive)
