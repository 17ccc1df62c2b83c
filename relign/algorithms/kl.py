"""Per-token estimates of KL(pi || pi_ref) from tokens sampled from pi, and the KL reward penalty.

Schulman's estimators (http://joschu.net/blog/kl-approx.html; a blog post, no arXiv id).
With the log-ratio  log r_t = log pi_ref(y_t) - log pi(y_t)  and y_t ~ pi:

* k1 = -log r                  unbiased, high variance, can be negative
* k2 = 1/2 (log r)^2           biased, low variance, >= 0
* k3 = (r - 1) - log r         unbiased, low variance, >= 0     (GRPO's KL term, 2402.03300)

The two ways a recipe uses them:

1. KL as a per-token reward penalty (InstructGPT, arXiv 2203.02155; PPO-RLHF, REINFORCE++):
   r_t <- r_t - beta * kl_t before computing returns, see ``kl_penalty_rewards``. No
   gradient flows through the KL; it acts through the advantages.
2. KL as a loss term (GRPO): loss = policy_loss + beta * aggregate(kl_estimate(...), mask).
   Here the gradient does flow through ``logps``. Note what each estimator's *gradient*
   estimates when used this way (on-policy, E over y ~ pi, d = derivative w.r.t. theta):
   E[d k1] = E[d log pi] = 0, so k1 as a loss does nothing in expectation;
   E[d k2] = E[(log pi - log pi_ref) d log pi] = d KL(pi || pi_ref), the reverse KL;
   E[d k3] = -E[(pi_ref / pi) d log pi] = d KL(pi_ref || pi), the *forward* KL.
"""

from __future__ import annotations

import torch

KINDS = ("k1", "k2", "k3")

# exp(20) ~ 4.9e8: far beyond any ratio that carries information, far below float32 overflow.
MAX_LOG_RATIO = 20.0


def kl_estimate(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    kind: str = "k1",
    *,
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref), [B, T] -> [B, T], see the module docstring.

    logps: log pi(y_t) of the sampled tokens (carries the gradient when used as a loss).
    ref_logps: log pi_ref(y_t) (detached here: the reference model is frozen).
    kind: "k1", "k2" or "k3".
    clamp: if given, the estimate is clamped to [-clamp, clamp] (veRL uses 10 for k3);
        where the clamp is active the gradient is 0.

    For k3 the exponent log r is capped at MAX_LOG_RATIO = 20 inside exp only, so a token
    the policy has all but ruled out (pi << pi_ref) gives a large finite value instead of
    inf; the "- log r" term is left exact. (veRL clamps log r to [-20, 20] everywhere.)
    Computed in float32 (bf16 log-prob differences lose most of their digits).
    Values at masked positions are whatever the inputs give; the caller masks them.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KINDS)}")
    dtype = torch.promote_types(logps.dtype, torch.float32)
    log_r = ref_logps.detach().to(dtype) - logps.to(dtype)  # [B, T]
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * log_r**2
    else:
        kl = torch.exp(log_r.clamp(max=MAX_LOG_RATIO)) - 1.0 - log_r
    if clamp is not None:
        kl = kl.clamp(min=-clamp, max=clamp)
    return kl


def kl_penalty_rewards(
    token_rewards: torch.Tensor,
    kl: torch.Tensor,
    beta: float | torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """r_t - beta * kl_t on the masked tokens, 0 elsewhere; [B, T] -> [B, T].

    The KL-as-reward option (InstructGPT arXiv 2203.02155, eq. 2, applied per token as in
    PPO-RLHF implementations). ``kl`` is detached: as a reward it shapes the advantages and
    must not be differentiated through.
    """
    dtype = torch.promote_types(token_rewards.dtype, torch.float32)
    r = token_rewards.detach().to(dtype) - beta * kl.detach().to(dtype)
    return torch.where(mask.bool(), r, torch.zeros_like(r))
