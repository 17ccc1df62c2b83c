"""Policy/value losses: hand values for every clip branch, naive re-implementations, and the
gradient properties (zero exactly where clipped, GSPO = sequence-level objective)."""

from __future__ import annotations

import math

import pytest
import torch

from relign.algorithms.aggregation import aggregate
from relign.algorithms.policy_losses import (
    behaviour_weights,
    entropy_bonus_loss,
    gspo_loss,
    ppo_clip_loss,
    value_clip_fraction,
    value_loss,
)


def _logps_for(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """logps with exp(logps - old_logps) = ratios (old_logps = 0), as a [1, T] leaf."""
    return torch.tensor([[math.log(x) for x in ratios]], dtype=torch.float64, requires_grad=True), torch.zeros(
        1, len(ratios), dtype=torch.float64
    )


# ---------------------------------------------------------------------------------------------
# PPO clip
# ---------------------------------------------------------------------------------------------


def test_ppo_clip_by_hand_every_branch():
    # eps 0.2 -> clip range [0.8, 1.2]. loss = -min(rho A, clip(rho) A); d loss / d logp = -A rho unclipped.
    #   rho 1.5, A +1: -min(1.5, 1.2)   = -1.2   clipped high, grad 0
    #   rho 0.5, A +1: -min(0.5, 0.8)   = -0.5   unclipped,    grad -0.5
    #   rho 0.5, A -1: -min(-0.5, -0.8) =  0.8   clipped low,  grad 0
    #   rho 1.5, A -1: -min(-1.5, -1.2) =  1.5   unclipped,    grad 1.5
    #   rho 1.1, A +2: -min(2.2, 2.2)   = -2.2   inside,       grad -2.2
    #   rho 1.3, A  0:                     0     no signal,    grad 0 (not counted as clipped)
    logps, old = _logps_for([1.5, 0.5, 0.5, 1.5, 1.1, 1.3])
    A = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0, 0.0]], dtype=torch.float64)
    loss, d = ppo_clip_loss(logps, old, A)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 0.8, 1.5, -2.2, 0.0]], dtype=torch.float64))
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, 0.0, 1.5, -2.2, 0.0]], dtype=torch.float64))
    assert d["clipped_high"].tolist() == [[1, 0, 0, 0, 0, 0]]
    assert d["clipped_low"].tolist() == [[0, 0, 1, 0, 0, 0]]
    assert d["clipped"].tolist() == [[1, 0, 1, 0, 0, 0]]
    assert d["dual_clipped"].tolist() == [[0] * 6]
    torch.testing.assert_close(d["ratio"], torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.1, 1.3]], dtype=torch.float64))


def test_ppo_clip_higher_is_asymmetric():
    # DAPO clip-higher, [1 - 0.2, 1 + 0.28] = [0.8, 1.28]:
    #   rho 1.25, A +1: inside -> -1.25 (the symmetric 0.2 clip would give -1.2)
    #   rho 1.30, A +1: clipped high -> -1.28
    #   rho 0.75, A -1: clipped low -> 0.8
    logps, old = _logps_for([1.25, 1.3, 0.75])
    A = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64).unsqueeze(0)
    loss, d = ppo_clip_loss(logps, old, A, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.25, -1.28, 0.8]], dtype=torch.float64))
    assert d["clipped"].tolist() == [[0, 1, 1]]
    sym, _ = ppo_clip_loss(logps, old, A)
    assert sym[0, 0].item() == pytest.approx(-1.2)


def test_ppo_dual_clip_by_hand():
    # c = 3, applies only to A < 0:
    #   rho 5,   A -1:   max(5, 1.2) = 5 -> min(5, 3 * 1) = 3          dual-clipped, grad 0
    #   rho 2,   A -1:   max(2, 1.2) = 2 -> min(2, 3) = 2              inactive,     grad 2
    #   rho 5,   A -0.5: max(2.5, 0.6) = 2.5 -> min(2.5, 1.5) = 1.5    dual-clipped, grad 0
    #   rho 0.5, A -1:   max(0.5, 0.8) = 0.8 -> min(0.8, 3) = 0.8      clipped low,  grad 0
    #   rho 5,   A +1:   -min(5, 1.2) = -1.2 (no dual clip for A > 0)  clipped high, grad 0
    logps, old = _logps_for([5.0, 2.0, 5.0, 0.5, 5.0])
    A = torch.tensor([[-1.0, -1.0, -0.5, -1.0, 1.0]], dtype=torch.float64)
    loss, d = ppo_clip_loss(logps, old, A, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0, 1.5, 0.8, -1.2]], dtype=torch.float64))
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2.0, 0.0, 0.0, 0.0]], dtype=torch.float64))
    assert d["dual_clipped"].tolist() == [[1, 0, 1, 0, 0]]
    assert d["clipped"].tolist() == [[1, 0, 1, 1, 1]]
    # without dual clip the first token would cost 5
    assert ppo_clip_loss(logps, old, A)[0][0, 0].item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logps, old, A, dual_clip=1.0)


def _naive_ppo(rho: float, A: float, cl: float, ch: float, c: float | None) -> float:
    loss = -min(rho * A, min(max(rho, 1 - cl), 1 + ch) * A)
    if c is not None and A < 0:
        loss = min(loss, -c * A)
    return loss


@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_ppo_matches_naive_formula_and_gradient_is_zero_exactly_where_clipped(dual_clip):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(6, 10, generator=g, dtype=torch.float64) - 1.0
    logps = (old + 0.6 * torch.randn(6, 10, generator=g, dtype=torch.float64)).requires_grad_()
    A = torch.randn(6, 10, generator=g, dtype=torch.float64)
    A[0, :3] = 0.0
    loss, d = ppo_clip_loss(logps, old, A, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)

    rho = (logps - old).exp().detach()
    want = [[_naive_ppo(rho[i, t].item(), A[i, t].item(), 0.2, 0.28, dual_clip) for t in range(10)] for i in range(6)]
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64))

    (grad,) = torch.autograd.grad(loss.sum(), logps)
    clipped = d["clipped"].bool()
    active = ~clipped & (A != 0)
    assert clipped.any() and active.any() and (dual_clip is None or d["dual_clipped"].any())
    assert torch.equal(grad[clipped], torch.zeros_like(grad[clipped]))
    assert torch.equal(grad[A == 0], torch.zeros_like(grad[A == 0]))
    torch.testing.assert_close(grad[active], (-A * rho)[active])  # the unclipped surrogate's gradient
    assert (grad[active] != 0).all()


def test_ppo_on_policy_gradient_is_the_policy_gradient():
    # rho = 1 (first epoch): d loss / d logp_t = -A_t, i.e. REINFORCE with advantage A
    logps = torch.randn(2, 3, requires_grad=True)
    A = torch.tensor([0.5, -1.5])
    loss, d = ppo_clip_loss(logps, logps.detach(), A)
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    torch.testing.assert_close(grad, -A.unsqueeze(-1).expand(2, 3))
    assert d["clipped"].sum() == 0


def test_ppo_sequence_advantages_broadcast():
    g = torch.Generator().manual_seed(1)
    old = torch.randn(3, 4, generator=g)
    logps = old + 0.5 * torch.randn(3, 4, generator=g)
    A = torch.randn(3, generator=g)
    l1, d1 = ppo_clip_loss(logps, old, A, dual_clip=2.0)
    l2, d2 = ppo_clip_loss(logps, old, A.unsqueeze(-1).expand(3, 4), dual_clip=2.0)
    torch.testing.assert_close(l1, l2)
    for k in d1:
        assert d1[k].shape == (3, 4)
        torch.testing.assert_close(d1[k], d2[k])


def test_ppo_masked_tokens_do_not_matter():
    g = torch.Generator().manual_seed(2)
    old = torch.randn(2, 5, generator=g)
    base = old + 0.3 * torch.randn(2, 5, generator=g)
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0, 0.0]])
    A = torch.tensor([1.0, -1.0])
    logps = base.clone().requires_grad_()
    out = aggregate(ppo_clip_loss(logps, old, A)[0], m)
    (grad,) = torch.autograd.grad(out, logps)
    assert torch.equal(grad[m == 0], torch.zeros_like(grad[m == 0]))
    changed = torch.where(m.bool(), base, base + 7.0)  # garbage at prompt/pad positions
    torch.testing.assert_close(aggregate(ppo_clip_loss(changed, old, A)[0], m), out)


def test_ppo_zero_advantage_empty_mask_and_extreme_ratios():
    logps = torch.randn(2, 3, requires_grad=True)
    old = torch.randn(2, 3)
    # zero advantages: loss 0 and gradient 0
    loss, _ = ppo_clip_loss(logps, old, torch.zeros(2))
    assert torch.equal(loss, torch.zeros(2, 3))
    (grad,) = torch.autograd.grad(aggregate(loss, torch.ones(2, 3)), logps)
    assert torch.equal(grad, torch.zeros(2, 3))
    # empty mask: aggregate 0, gradient finite (0)
    loss, _ = ppo_clip_loss(logps, old, torch.tensor([1.0, -1.0]))
    out = aggregate(loss, torch.zeros(2, 3), "seq-mean-token-mean")
    (grad,) = torch.autograd.grad(out, logps)
    assert out.item() == 0.0 and torch.equal(grad, torch.zeros(2, 3))
    # log-ratio of +-100 would be inf / 0 without the [-20, 20] clamp
    lp = torch.tensor([[100.0, -100.0, 100.0]], requires_grad=True)
    loss, d = ppo_clip_loss(lp, torch.zeros(1, 3), torch.tensor([[1.0, -1.0, -1.0]]))
    # A +1: clipped high -1.2; A -1, rho ~0: clipped low 0.8; A -1, rho = e^20: 4.85e8 (finite)
    assert loss[0, 0].item() == pytest.approx(-1.2) and loss[0, 1].item() == pytest.approx(0.8)
    assert loss[0, 2].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert torch.isfinite(grad).all() and torch.isfinite(d["ratio"]).all()


def test_ppo_bf16_inputs_compute_in_float32():
    logps = torch.randn(2, 3).to(torch.bfloat16)
    loss, d = ppo_clip_loss(logps, logps, torch.ones(2))
    assert loss.dtype == torch.float32 and d["ratio"].dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# GSPO
# ---------------------------------------------------------------------------------------------


def test_gspo_by_hand():
    # clip range [1 - 3e-4, 1 + 4e-4] = [0.9997, 1.0004].
    # row 0: log-ratios [0.1, 0.3, (5.0 masked)] -> s = exp((0.1 + 0.3) / 2) = exp(0.2) = 1.221403
    #        A = +1: -min(1.2214, 1.0004) = -1.0004 on both tokens (clipped high), 0 on the masked one
    # row 1: log-ratios [1e-4, -1e-4, 0] -> s = exp(0) = 1; A = -2: -min(-2, -2) = 2 (inside)
    # row 2: as row 0 but A = -1: -min(-1.2214, -1.0004) = 1.2214 (unclipped: s > 1 and A < 0)
    old = torch.zeros(3, 3, dtype=torch.float64)
    logps = torch.tensor([[0.1, 0.3, 5.0], [1e-4, -1e-4, 0.0], [0.1, 0.3, 5.0]], dtype=torch.float64)
    logps.requires_grad_()
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    A = torch.tensor([1.0, -2.0, -1.0], dtype=torch.float64)
    loss, d = gspo_loss(logps, old, A, m)
    e = math.exp(0.2)
    torch.testing.assert_close(
        loss, torch.tensor([[-1.0004, -1.0004, 0.0], [2.0, 2.0, 2.0], [e, e, 0.0]], dtype=torch.float64)
    )
    torch.testing.assert_close(d["ratio"], torch.tensor([[e] * 3, [1.0] * 3, [e] * 3], dtype=torch.float64))
    assert d["clipped_high"].tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]  # per sequence, broadcast
    assert d["clipped"].tolist() == d["clipped_high"].tolist()
    assert d["clipped_low"].sum() == 0 and d["dual_clipped"].sum() == 0
    # gradient: row 0 clipped -> 0; row 1: d L_t / d logp_t = -A s = 2; row 2: -A s = e; masked -> 0
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [2.0, 2.0, 2.0], [e, e, 0.0]], dtype=torch.float64))


def _sequence_level_gspo(logps, old, A, m, cl, ch):
    """The paper's objective, written at the sequence level: -1/B sum_i min(s_i A_i, clip(s_i) A_i)."""
    terms = []
    for i in range(logps.shape[0]):
        idx = m[i].bool()
        s_i = torch.exp((logps[i][idx] - old[i][idx]).mean())
        terms.append(torch.minimum(s_i * A[i], s_i.clamp(1 - cl, 1 + ch) * A[i]))
    return -torch.stack(terms).mean()


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.01, 0.015)])
def test_gspo_token_form_equals_sequence_objective_value_and_gradient(clip):
    cl, ch = clip
    g = torch.Generator().manual_seed(3)
    old = torch.randn(8, 6, generator=g, dtype=torch.float64) - 1.0
    logps = (old + 0.03 * torch.randn(8, 6, generator=g, dtype=torch.float64)).requires_grad_()
    A = torch.randn(8, generator=g, dtype=torch.float64)
    m = (torch.rand(8, 6, generator=g) > 0.3).double()
    m[:, 0] = 1.0
    loss, d = gspo_loss(logps, old, A, m, clip_low=cl, clip_high=ch)
    ours = aggregate(loss, m, "seq-mean-token-mean")
    ref = _sequence_level_gspo(logps, old, A, m, cl, ch)
    torch.testing.assert_close(ours, ref)
    (g_ours,) = torch.autograd.grad(ours, logps)
    (g_ref,) = torch.autograd.grad(ref, logps)
    torch.testing.assert_close(g_ours, g_ref)
    # the sequence ratio diagnostic is exp(mean masked log-ratio)
    for i in range(8):
        idx = m[i].bool()
        s_i = torch.exp((logps[i][idx] - old[i][idx]).mean()).item()
        assert d["ratio"][i].tolist() == pytest.approx([s_i] * 6)
    if clip == (0.01, 0.015):  # this seed has both clipped and unclipped sequences
        clipped_rows = d["clipped"][:, 0].bool()
        assert clipped_rows.any() and (~clipped_rows).any()
        assert torch.equal(g_ours[clipped_rows], torch.zeros_like(g_ours[clipped_rows]))


def test_gspo_edge_cases():
    logps = torch.randn(3, 4, requires_grad=True)
    old = logps.detach() + 0.01 * torch.randn(3, 4)
    m = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # a row with an empty mask: s = exp(0 / 1) = 1, loss 0 there, everything finite
    loss, d = gspo_loss(logps, old, torch.tensor([1.0, 1.0, -1.0]), m)
    assert torch.equal(loss[1], torch.zeros(4)) and d["ratio"][1].tolist() == [1.0] * 4
    (grad,) = torch.autograd.grad(aggregate(loss, m, "seq-mean-token-mean"), logps)
    assert torch.isfinite(grad).all() and torch.equal(grad[m == 0], torch.zeros_like(grad[m == 0]))
    # fully empty mask: loss 0, gradient 0
    loss, _ = gspo_loss(logps, old, torch.ones(3), torch.zeros(3, 4))
    (grad,) = torch.autograd.grad(aggregate(loss, torch.zeros(3, 4), "seq-mean-token-mean"), logps)
    assert torch.equal(loss, torch.zeros(3, 4)) and torch.equal(grad, torch.zeros(3, 4))
    # zero advantages: loss 0, gradient 0
    loss, _ = gspo_loss(logps, old, torch.zeros(3), m)
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    assert torch.equal(loss, torch.zeros(3, 4)) and torch.equal(grad, torch.zeros(3, 4))
    # inf/NaN at masked positions never reaches the loss or the gradient
    bad = logps.detach().clone()
    bad[0, 3] = float("-inf")
    bad_old = old.clone()
    bad_old[1, 0] = float("nan")
    lp = bad.requires_grad_()
    loss, d = gspo_loss(lp, bad_old, torch.ones(3), m)
    (grad,) = torch.autograd.grad(aggregate(loss, m, "seq-mean-token-mean"), lp)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all() and torch.isfinite(d["ratio"]).all()


# ---------------------------------------------------------------------------------------------
# value loss, entropy, truncated IS
# ---------------------------------------------------------------------------------------------


def test_value_loss_by_hand():
    # unclipped: 0.5 (1.5 - 1)^2 = 0.125;  0.5 (0 - 2)^2 = 2
    loss = value_loss(torch.tensor([[1.5, 0.0]]), torch.zeros(1, 2), torch.tensor([[1.0, 2.0]]))
    torch.testing.assert_close(loss, torch.tensor([[0.125, 2.0]]))
    # clipped, c = 0.2, V_old = 1:
    #   V 1.5, R 2: (1.5-2)^2 = 0.25 vs V_clip 1.2: (1.2-2)^2 = 0.64 -> 0.5 * 0.64 = 0.32, grad 0, clipped
    #   V 1.5, R 1: 0.25 vs (1.2-1)^2 = 0.04 -> 0.125, grad V - R = 0.5
    #   V 1.1, R 2: inside the clip range, both (0.9)^2 = 0.81 -> 0.405, grad -0.9
    V = torch.tensor([[1.5, 1.5, 1.1]], requires_grad=True)
    old, R = torch.ones(1, 3), torch.tensor([[2.0, 1.0, 2.0]])
    loss = value_loss(V, old, R, clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.32, 0.125, 0.405]]))
    (grad,) = torch.autograd.grad(loss.sum(), V)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.5, -0.9]]))
    assert value_clip_fraction(V, old, R, 0.2).tolist() == [[1.0, 0.0, 0.0]]


def test_value_loss_matches_naive_formula():
    g = torch.Generator().manual_seed(4)
    V, old, R = (torch.randn(4, 5, generator=g, dtype=torch.float64) for _ in range(3))
    loss = value_loss(V, old, R, clip=0.3)
    frac = value_clip_fraction(V, old, R, 0.3)
    for i in range(4):
        for t in range(5):
            v, vo, r = V[i, t].item(), old[i, t].item(), R[i, t].item()
            v_clip = vo + min(max(v - vo, -0.3), 0.3)
            assert loss[i, t].item() == pytest.approx(0.5 * max((v - r) ** 2, (v_clip - r) ** 2))
            assert frac[i, t].item() == float((v_clip - r) ** 2 > (v - r) ** 2)
    torch.testing.assert_close(value_loss(V, old, R), 0.5 * (V - R) ** 2)
    assert 0 < frac.sum() < 20


def test_value_loss_targets_are_detached():
    V = torch.randn(2, 3, requires_grad=True)
    R = torch.randn(2, 3, requires_grad=True)
    old = torch.randn(2, 3, requires_grad=True)
    value_loss(V, old, R, clip=0.1).sum().backward()
    assert V.grad is not None and R.grad is None and old.grad is None


def test_entropy_bonus_loss():
    # -H: [0.5, 1.0] -> [-0.5, -1.0]; d(-H)/dH = -1, so gradient descent raises H
    H = torch.tensor([[0.5, 1.0]], requires_grad=True)
    loss = entropy_bonus_loss(H)
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -1.0]]))
    loss.sum().backward()
    torch.testing.assert_close(H.grad, -torch.ones(1, 2))


def test_truncated_behaviour_weights_by_hand():
    # pi_old / pi_sampler = [1.5, 3 -> capped at 2, 0.5, e^100 -> capped at 2, e^-100 -> e^-20 after the clamp]
    old = torch.tensor([[math.log(1.5), math.log(3.0), math.log(0.5), 100.0, -100.0]], requires_grad=True)
    w = behaviour_weights(old, torch.zeros(1, 5), cap=2.0)[0]
    torch.testing.assert_close(w, torch.tensor([[1.5, 2.0, 0.5, 2.0, math.exp(-20.0)]]))
    assert not w.requires_grad
    assert behaviour_weights(old, torch.zeros(1, 5), cap=10.0)[0][0, 1].item() == pytest.approx(3.0)


def test_truncated_behaviour_weights_naive():
    g = torch.Generator().manual_seed(5)
    old, samp = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    w = behaviour_weights(old, samp, cap=1.5)[0]
    want = [[min(math.exp(o - s), 1.5) for o, s in zip(ro, rs)] for ro, rs in zip(old.tolist(), samp.tolist())]
    torch.testing.assert_close(w, torch.tensor(want))


def test_behaviour_weights_by_hand():
    """w = pi_prox / pi_behav; truncate: min(w, C); mask: w where w <= C, else 0; the flags mark w > C."""
    prox = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.3), 0.0]])
    behav = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.6), math.log(0.25)]])
    # w = 1, 3, 0.5, 4
    w, over = behaviour_weights(prox, behav, cap=2.0, mode="truncate")
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 0.5, 2.0], rel=1e-6)
    assert over.tolist() == [[False, True, False, True]]
    w, over = behaviour_weights(prox, behav, cap=2.0, mode="mask")
    assert w.tolist()[0] == pytest.approx([1.0, 0.0, 0.5, 0.0], rel=1e-6)
    assert over.tolist() == [[False, True, False, True]]
    with pytest.raises(ValueError, match="truncate, mask"):
        behaviour_weights(prox, behav, cap=2.0, mode="clip")
