"""Advantage estimators: hand-worked values, naive re-implementations of the papers' formulas,
and the edge cases (group of 1, all-equal rewards, empty masks, skipped env tokens)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from relign.algorithms.advantages import (
    gae,
    gdpo_advantages,
    group_advantages,
    masked_whiten,
    reinforce_pp_advantages,
)

# ---------------------------------------------------------------------------------------------
# group_advantages (GRPO / Dr. GRPO / RLOO)
# ---------------------------------------------------------------------------------------------


def test_grpo_by_hand_two_groups_of_two():
    # groups [1, 0] and [0, 1]: mean 0.5, unbiased std = sqrt((0.5^2 + 0.5^2) / 1) = sqrt(0.5)
    # A = +-0.5 / sqrt(0.5) = +-sqrt(0.5) = +-0.70711
    A = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, eps=0.0)
    s = math.sqrt(0.5)
    torch.testing.assert_close(A, torch.tensor([s, -s, -s, s]))


def test_grpo_by_hand_group_of_three():
    # [1, 2, 6]: mean 3, deviations [-2, -1, 3], sum of squares 4 + 1 + 9 = 14,
    # unbiased var 14 / 2 = 7, std sqrt(7) = 2.64575 -> A = [-0.75593, -0.37796, 1.13389]
    A = group_advantages(torch.tensor([1.0, 2.0, 6.0]), 3, eps=0.0)
    torch.testing.assert_close(A, torch.tensor([-2.0, -1.0, 3.0]) / math.sqrt(7.0))


def test_dr_grpo_has_no_std_scaling():
    # [1, 2, 6] - mean 3 = [-2, -1, 3]
    A = group_advantages(torch.tensor([1.0, 2.0, 6.0]), 3, scale="none")
    torch.testing.assert_close(A, torch.tensor([-2.0, -1.0, 3.0]))


def test_rloo_by_hand():
    # r_i - mean of the others: 1 - (2+6)/2 = -3;  2 - (1+6)/2 = -1.5;  6 - (1+2)/2 = 4.5
    A = group_advantages(torch.tensor([1.0, 2.0, 6.0]), 3, baseline="leave_one_out", scale="none")
    torch.testing.assert_close(A, torch.tensor([-3.0, -1.5, 4.5]))
    # the identity: G/(G-1) (r - mean) = 3/2 * [-2, -1, 3] = [-3, -1.5, 4.5]
    torch.testing.assert_close(A, 1.5 * torch.tensor([-2.0, -1.0, 3.0]))


@pytest.mark.parametrize("G", [2, 3, 5])
def test_rloo_identity_random(G):
    r = torch.randn(4 * G, generator=torch.Generator().manual_seed(G))
    loo = group_advantages(r, G, baseline="leave_one_out", scale="none")
    grpo = group_advantages(r, G, baseline="mean", scale="none")
    torch.testing.assert_close(loo, G / (G - 1) * grpo)
    # and with the std scale both are divided by the same group std
    torch.testing.assert_close(
        group_advantages(r, G, baseline="leave_one_out"), G / (G - 1) * group_advantages(r, G)
    )


def _naive_group_advantages(rewards: list[float], G: int, baseline: str, scale: str, eps: float) -> list[float]:
    out = []
    for g in range(len(rewards) // G):
        grp = rewards[g * G : (g + 1) * G]
        std = statistics.stdev(grp) if G > 1 else 0.0
        for i, r in enumerate(grp):
            if baseline == "mean":
                b = sum(grp) / G
            else:
                b = sum(grp[j] for j in range(G) if j != i) / (G - 1)
            a = r - b
            out.append(a / (std + eps) if scale == "std" else a)
    return out


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("scale", ["std", "none"])
def test_group_advantages_match_naive_formula(baseline, scale):
    g = torch.Generator().manual_seed(1)
    r = torch.randn(12, generator=g, dtype=torch.float64)
    got = group_advantages(r, 4, baseline=baseline, scale=scale, eps=1e-6)
    want = _naive_group_advantages(r.tolist(), 4, baseline, scale, 1e-6)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("scale", ["std", "none"])
def test_group_of_size_one_is_zero_not_nan(baseline, scale):
    A = group_advantages(torch.tensor([1.0, 0.0, 3.0]), 1, baseline=baseline, scale=scale)
    assert torch.equal(A, torch.zeros(3))


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
def test_all_equal_group_is_exactly_zero(baseline):
    # In float32 mean([7.3, 7.3, 7.3]) - 7.3 = 4.8e-7, and / (0 + 1e-6) would make that an
    # advantage of 0.3 without the all-equal guard.
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 7.3, 7.3, 7.3])
    A = group_advantages(r, 3, baseline=baseline)
    assert torch.equal(A[:3], torch.zeros(3))
    assert torch.equal(A[6:], torch.zeros(3))
    assert A[3] > 0 and A[4] < 0


def test_group_advantages_dtype_and_errors():
    A = group_advantages(torch.tensor([1, 0, 0, 1], dtype=torch.bfloat16), 2)
    assert A.dtype == torch.float32
    assert group_advantages(torch.tensor([True, False]), 2).dtype == torch.float32
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(torch.zeros(4), 2, baseline="median")
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(4), 2, scale="mad")


# ---------------------------------------------------------------------------------------------
# masked_whiten
# ---------------------------------------------------------------------------------------------


def test_masked_whiten_by_hand():
    # masked values [1, 2, 3]: mean 2, unbiased var (1 + 0 + 1) / 2 = 1 -> [-1, 0, 1]; 100 is masked
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(masked_whiten(x, m), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    # shift_mean=False keeps the mean: [-1, 0, 1] + 2 = [1, 2, 3]
    torch.testing.assert_close(masked_whiten(x, m, shift_mean=False), torch.tensor([[1.0, 2.0, 3.0, 0.0]]))


def test_masked_whiten_all_equal_values_is_exactly_zero():
    # float32 mean of 7.3s is off by ~5e-7; / (0 + eps) must not turn that into +-0.3
    x = torch.full((3, 4), 7.3)
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert torch.equal(masked_whiten(x, m, eps=1e-6), torch.zeros(3, 4))
    assert torch.equal(masked_whiten(x, m, shift_mean=False, eps=1e-6), x * m)


def test_masked_whiten_degenerate_masks():
    x = torch.tensor([[1.0, float("nan"), float("inf")]])
    assert torch.equal(masked_whiten(x, torch.zeros(1, 3)), torch.zeros(1, 3))  # empty
    assert torch.equal(masked_whiten(x, torch.tensor([[1.0, 0.0, 0.0]])), torch.zeros(1, 3))  # one token: x - mean = 0


# ---------------------------------------------------------------------------------------------
# REINFORCE++
# ---------------------------------------------------------------------------------------------


def test_reinforce_pp_by_hand():
    # gamma 0.5. Row 0: rewards [0, 0, 1] -> returns [0.25, 0.5, 1].
    # Row 1: rewards [0, 2, (pad)] -> returns [1, 2, -].
    # Masked returns [0.25, 0.5, 1, 1, 2]: mean 4.75 / 5 = 0.95,
    # deviations [-0.7, -0.45, 0.05, 0.05, 1.05], squares sum 0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025 = 1.8,
    # unbiased var 1.8 / 4 = 0.45 -> A = deviation / sqrt(0.45)
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    A = reinforce_pp_advantages(r, m, gamma=0.5, eps=0.0)
    s = math.sqrt(0.45)
    want = torch.tensor([[-0.7 / s, -0.45 / s, 0.05 / s], [0.05 / s, 1.05 / s, 0.0]])
    torch.testing.assert_close(A, want)


def test_reinforce_pp_baseline_by_hand():
    # G = 2, gamma 1. Outcome rewards 1 and 0 -> totals R = [1, 0], group mean 0.5.
    # Returns minus baseline: row 0 [1, 1] - 0.5 = [0.5, 0.5], row 1 [0, 0] - 0.5 = [-0.5, -0.5].
    # Whitening: mean 0, unbiased var 4 * 0.25 / 3 = 1/3 -> +-0.5 * sqrt(3) = +-0.86603
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    m = torch.ones(2, 2)
    A = reinforce_pp_advantages(r, m, group_size=2, baseline="group_mean", eps=0.0)
    v = 0.5 * math.sqrt(3.0)
    torch.testing.assert_close(A, torch.tensor([[v, v], [-v, -v]]))


def test_reinforce_pp_skips_unmasked_tokens_inside_a_sequence():
    # Multi-turn: position 1 is an environment token (reward 5 there must be ignored, and it
    # must not cost a discount step). gamma 0.5 -> returns [0.25, -, 0.5, 1] as if it were absent.
    r_turns = torch.tensor([[0.0, 5.0, 0.0, 1.0], [0.0, 0.0, 2.0, 0.0]])
    m_turns = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    r_flat = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    A_turns = reinforce_pp_advantages(r_turns, m_turns, gamma=0.5)
    A_flat = reinforce_pp_advantages(r_flat, torch.ones(2, 3), gamma=0.5)
    torch.testing.assert_close(A_turns[0, [0, 2, 3]], A_flat[0])
    torch.testing.assert_close(A_turns[1, :3], A_flat[1])
    assert A_turns[0, 1] == 0 and A_turns[1, 3] == 0


def _naive_reinforce_pp(r, m, gamma, group_size=None, baseline="none", eps=1e-6):
    B, T = len(r), len(r[0])
    r = [list(row) for row in r]
    if baseline == "group_mean":  # the group's mean total reward comes off each outcome (last masked token)
        totals = [sum(r[i][t] for t in range(T) if m[i][t]) for i in range(B)]
        for i in range(B):
            g0 = (i // group_size) * group_size
            b = sum(totals[g0 : g0 + group_size]) / group_size
            r[i][max(t for t in range(T) if m[i][t])] -= b
    G_ret = [[0.0] * T for _ in range(B)]
    for i in range(B):
        idx = [t for t in range(T) if m[i][t]]
        for k, t in enumerate(idx):
            G_ret[i][t] = sum(gamma ** (l - k) * r[i][idx[l]] for l in range(k, len(idx)))
    vals = [G_ret[i][t] for i in range(B) for t in range(T) if m[i][t]]
    mean = sum(vals) / len(vals)
    if baseline == "group_mean":  # centred by the group baseline: scaled by the batch std only
        std = statistics.stdev(vals)
        return [[G_ret[i][t] / (std + eps) if m[i][t] else 0.0 for t in range(T)] for i in range(B)]
    std = statistics.stdev(vals)
    return [[(G_ret[i][t] - mean) / (std + eps) if m[i][t] else 0.0 for t in range(T)] for i in range(B)]


@pytest.mark.parametrize("baseline", ["none", "group_mean"])
def test_reinforce_pp_matches_naive_formula(baseline):
    g = torch.Generator().manual_seed(2)
    r = torch.randn(6, 7, generator=g, dtype=torch.float64)
    m = torch.rand(6, 7, generator=g) > 0.3  # includes holes in the middle of rows
    m[:, 0] = True
    got = reinforce_pp_advantages(r, m, gamma=0.9, group_size=3, baseline=baseline)
    want = _naive_reinforce_pp(r.tolist(), m.tolist(), 0.9, 3, baseline)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))


def test_reinforce_pp_all_equal_returns_give_zero():
    # every sequence has outcome 7.3 on its last token, gamma 1: every return is 7.3 -> A = 0
    r = torch.zeros(4, 3)
    r[:, -1] = 7.3
    A = reinforce_pp_advantages(r, torch.ones(4, 3))
    assert torch.equal(A, torch.zeros(4, 3))
    # with the group baseline every return becomes 7.3 - 7.3 = 0 -> 0
    A = reinforce_pp_advantages(r, torch.ones(4, 3), group_size=2, baseline="group_mean")
    assert torch.equal(A, torch.zeros(4, 3))


def test_reinforce_pp_baseline_with_discount_by_hand():
    # G = 2, gamma 0.5, outcomes 1 and 0 on the last of 2 tokens. b = 0.5 comes off the outcome:
    # r' = [[0, 0.5], [0, -0.5]] -> returns [[0.25, 0.5], [-0.25, -0.5]]; mean 0,
    # unbiased var (0.0625 + 0.25 + 0.0625 + 0.25) / 3 = 0.208333 -> std 0.456435.
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    A = reinforce_pp_advantages(r, torch.ones(2, 2), gamma=0.5, group_size=2, baseline="group_mean", eps=0.0)
    s = math.sqrt(0.625 / 3)
    torch.testing.assert_close(A, torch.tensor([[0.25 / s, 0.5 / s], [-0.25 / s, -0.5 / s]]))


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_reinforce_pp_baseline_equal_group_gives_zero_for_any_gamma(gamma):
    # Both groups' rewards are all equal (1, 1 and 0.3, 0.3): nothing to learn, whatever gamma.
    # (Subtracting the baseline from every return left (gamma^(T-t) - 1) R != 0 for gamma < 1.)
    r = torch.zeros(4, 3)
    r[:, -1] = torch.tensor([1.0, 1.0, 0.3, 0.3])
    A = reinforce_pp_advantages(r, torch.ones(4, 3), gamma=gamma, group_size=2, baseline="group_mean")
    assert torch.equal(A, torch.zeros(4, 3))


def test_reinforce_pp_penalties_come_after_the_baseline():
    # Equal outcomes (baseline takes them to 0): only the per-token penalties -beta*kl remain.
    # penalties [[-0.1, -0.3], [0, -0.2]], gamma 1 -> returns [[-0.4, -0.3], [-0.2, -0.2]]
    # masked mean -0.275; deviations [-0.125, -0.025, 0.075, 0.075]; var (0.015625 + 0.000625
    # + 0.005625 * 2) / 3 = 0.0091667; the baseline variant scales without re-centring
    r = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    pen = torch.tensor([[-0.1, -0.3], [0.0, -0.2]])
    A = reinforce_pp_advantages(r, torch.ones(2, 2), group_size=2, baseline="group_mean", token_penalties=pen, eps=0.0)
    s = math.sqrt((0.015625 + 0.000625 + 2 * 0.005625) / 3)
    torch.testing.assert_close(A, torch.tensor([[-0.4, -0.3], [-0.2, -0.2]]) / s)


def test_reinforce_pp_baseline_equal_group_stays_zero_beside_other_groups():
    # group 0 all equal (1, 1); group 1 (0, 1) with different lengths, so the batch mean of the
    # returns is not 0 (it would move group 0 off 0 if the batch were re-centred): gamma 0.9
    r = torch.zeros(4, 3)
    r[:, -1] = torch.tensor([1.0, 1.0, 0.0, 1.0])
    m = torch.ones(4, 3)
    m[3, 0] = 0.0
    A = reinforce_pp_advantages(r, m, gamma=0.9, group_size=2, baseline="group_mean")
    assert torch.equal(A[:2], torch.zeros(2, 3))
    assert (A[2, :] < 0).all() and (A[3, 1:] > 0).all()


def test_reinforce_pp_empty_mask_and_errors():
    r = torch.randn(2, 3)
    for m in (torch.zeros(2, 3), torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])):
        A = reinforce_pp_advantages(r, m, group_size=2, baseline="group_mean")
        assert torch.isfinite(A).all() and torch.equal(A, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="group_size"):
        reinforce_pp_advantages(r, torch.ones(2, 3), baseline="group_mean")
    with pytest.raises(ValueError, match="baseline"):
        reinforce_pp_advantages(r, torch.ones(2, 3), baseline="mean")


# ---------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------

# gamma 0.9, lam 0.8 (gamma * lam = 0.72), rewards [0, 0, 1], values [0.5, 0.6, 0.7]:
#   t=2: delta = 1 + 0.9*0   - 0.7 = 0.3    A = 0.3
#   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03   A = 0.03 + 0.72*0.3   = 0.246
#   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04   A = 0.04 + 0.72*0.246 = 0.21712
#   returns = A + V = [0.71712, 0.846, 1.0]
GAE_A = [0.21712, 0.246, 0.3]
GAE_R = [0.71712, 0.846, 1.0]


def test_gae_by_hand():
    A, R = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=0.9, lam=0.8)
    torch.testing.assert_close(A, torch.tensor([GAE_A]))
    torch.testing.assert_close(R, torch.tensor([GAE_R]))


def test_gae_skips_prompt_env_and_padding_tokens():
    # [prompt, resp, env, resp, resp, pad]: the prompt/env/pad rewards and values (9, 99, ...) are
    # ignored and the chain jumps over the env token, so the response tokens get the values above.
    r = torch.tensor([[9.0, 0.0, 9.0, 0.0, 1.0, 9.0]])
    V = torch.tensor([[99.0, 0.5, 99.0, 0.6, 0.7, 99.0]])
    m = torch.tensor([[0.0, 1.0, 0.0, 1.0, 1.0, 0.0]])
    A, R = gae(r, V, m, gamma=0.9, lam=0.8)
    torch.testing.assert_close(A, torch.tensor([[0.0, GAE_A[0], 0.0, GAE_A[1], GAE_A[2], 0.0]]))
    torch.testing.assert_close(R, torch.tensor([[0.0, GAE_R[0], 0.0, GAE_R[1], GAE_R[2], 0.0]]))


def test_gae_special_cases():
    r, V, m = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]), torch.ones(1, 3)
    # gamma = lam = 1: Monte Carlo, A_t = sum_{s>=t} r_s - V_t = [1-0.5, 1-0.6, 1-0.7]
    A, R = gae(r, V, m)
    torch.testing.assert_close(A, torch.tensor([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(R, torch.ones(1, 3))
    # lam = 0: one-step TD error, A_t = delta_t = [0.04, 0.03, 0.3] (see the hand values above)
    A, _ = gae(r, V, m, gamma=0.9, lam=0.0)
    torch.testing.assert_close(A, torch.tensor([[0.04, 0.03, 0.3]]))


def _naive_gae(r, V, m, gamma, lam):
    """A_t = sum_l (gamma lam)^l delta_{t+l} over the masked positions of each row (paper eq. 16)."""
    B, T = len(r), len(r[0])
    A = [[0.0] * T for _ in range(B)]
    for i in range(B):
        idx = [t for t in range(T) if m[i][t]]
        vals = [V[i][t] for t in idx] + [0.0]
        deltas = [r[i][t] + gamma * vals[k + 1] - vals[k] for k, t in enumerate(idx)]
        for k, t in enumerate(idx):
            A[i][t] = sum((gamma * lam) ** l * deltas[k + l] for l in range(len(idx) - k))
    R = [[A[i][t] + V[i][t] if m[i][t] else 0.0 for t in range(T)] for i in range(B)]
    return A, R


def test_gae_matches_naive_formula():
    g = torch.Generator().manual_seed(3)
    r = torch.randn(5, 8, generator=g, dtype=torch.float64)
    V = torch.randn(5, 8, generator=g, dtype=torch.float64)
    m = torch.rand(5, 8, generator=g) > 0.35
    m[4] = False  # one row with nothing to train
    A, R = gae(r, V, m, gamma=0.95, lam=0.7)
    A_want, R_want = _naive_gae(r.tolist(), V.tolist(), m.tolist(), 0.95, 0.7)
    torch.testing.assert_close(A, torch.tensor(A_want, dtype=torch.float64))
    torch.testing.assert_close(R, torch.tensor(R_want, dtype=torch.float64))


def test_gae_empty_mask_and_detached_values():
    V = torch.randn(2, 4, requires_grad=True)
    A, R = gae(torch.randn(2, 4), V, torch.zeros(2, 4), gamma=0.9, lam=0.9)
    assert torch.equal(A, torch.zeros(2, 4)) and torch.equal(R, torch.zeros(2, 4))
    A, R = gae(torch.randn(2, 4), V, torch.ones(2, 4))
    assert not A.requires_grad and not R.requires_grad  # targets, never differentiated


# ---------------------------------------------------------------------------------------------
# GDPO
# ---------------------------------------------------------------------------------------------


def test_gdpo_by_hand():
    # G = 2, K = 2. s = sqrt(0.5) = 0.70711 (a 2-group with distinct rewards normalizes to +-s).
    # component 0: [1, 0 | 1, 1] -> [+s, -s | 0, 0]
    # component 1: [0, 1 | 1, 0] -> [-s, +s | +s, -s]
    rc = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    s = math.sqrt(0.5)
    # weights 1, no batch norm: [s - s, -s + s, 0 + s, 0 - s] = [0, 0, s, -s]
    A = gdpo_advantages(rc, 2, eps=0.0, batch_norm=False)
    torch.testing.assert_close(A, torch.tensor([0.0, 0.0, s, -s]))
    # weights [2, 1]: [2s - s, -2s + s, s, -s] = [s, -s, s, -s]; batch norm: mean 0,
    # unbiased var 4 * 0.5 / 3 = 2/3 -> s / sqrt(2/3) = sqrt(0.75) = 0.86603
    A = gdpo_advantages(rc, 2, weights=[2.0, 1.0], eps=0.0)
    v = math.sqrt(0.75)
    torch.testing.assert_close(A, torch.tensor([v, -v, v, -v]))


def test_gdpo_keeps_reward_combinations_that_grpo_collapses():
    # The paper's motivating case, G = 2, two binary rewards.
    # Group 0: (1, 0) vs (0, 0); group 1: (1, 1) vs (0, 0).
    # GRPO on the summed reward: [1, 0] and [2, 0] both normalize to [+s, -s] (collapse).
    # GDPO: group 0 -> [s + 0, -s + 0], group 1 -> [s + s, -s - s]: group 1 gets twice the signal.
    rc = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    grpo = group_advantages(rc.sum(-1), 2)
    torch.testing.assert_close(grpo[:2], grpo[2:])
    A = gdpo_advantages(rc, 2, batch_norm=False)
    torch.testing.assert_close(A[2:], 2 * A[:2])


def _naive_gdpo(rc, G, w, eps):
    B, K = len(rc), len(rc[0])
    pre = [0.0] * B
    for k in range(K):
        comp = _naive_group_advantages([rc[i][k] for i in range(B)], G, "mean", "std", eps)
        for i in range(B):
            pre[i] += w[k] * comp[i]
    mean = sum(pre) / B
    std = statistics.stdev(pre)
    return [(a - mean) / (std + eps) for a in pre]


def test_gdpo_matches_naive_formula():
    g = torch.Generator().manual_seed(4)
    rc = torch.randn(12, 3, generator=g, dtype=torch.float64)
    w = [1.0, 0.5, 2.0]
    got = gdpo_advantages(rc, 4, weights=w)
    torch.testing.assert_close(got, torch.tensor(_naive_gdpo(rc.tolist(), 4, w, 1e-6), dtype=torch.float64))
    # one component without batch norm is GRPO
    torch.testing.assert_close(gdpo_advantages(rc[:, :1], 4, batch_norm=False), group_advantages(rc[:, 0], 4))


def test_gdpo_edge_cases():
    # all components equal within every group, and groups of 1: zero, not NaN
    assert torch.equal(gdpo_advantages(torch.ones(4, 2), 2), torch.zeros(4))
    assert torch.equal(gdpo_advantages(torch.randn(3, 2), 1), torch.zeros(3))
    with pytest.raises(ValueError, match="weights"):
        gdpo_advantages(torch.ones(4, 2), 2, weights=[1.0])
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        gdpo_advantages(torch.ones(4), 2)
