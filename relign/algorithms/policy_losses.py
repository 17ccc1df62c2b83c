"""Per-token policy and value losses. Each returns a [B, T] loss to be reduced by the caller with
``aggregation.aggregate(loss, mask, mode)``; the policy losses also return a dict of per-token
diagnostics (detached float tensors [B, T]; aggregate them with the same mask for metrics).

Ratios rho_t = pi(y_t) / pi_old(y_t) = exp(logps_t - old_logps_t); A = advantage.

* PPO-clip   L_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)
             (Schulman et al., arXiv 1707.06347; asymmetric "clip-higher": DAPO, arXiv 2503.14476)
* dual-clip  for A < 0:  L_t = min( max(-rho_t A, -clip(rho_t) A), -c A ),  c > 1
             (Ye et al., arXiv 1912.09729)
* GSPO       s_i = exp( 1/|y_i| sum_t log(pi(y_it) / pi_old(y_it)) )
             L_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
             (Zheng et al., arXiv 2507.18071)
* value      1/2 (V_t - R_t)^2, optionally clipped around V_old (PPO2 / OpenAI baselines)
* entropy    -H_t (minimised, it raises the entropy)
* TIS        w_t = min(pi_old(y_t) / pi_sampler(y_t), C)   (Yao et al. 2025, blog post
             "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training")
* MIS        w_t = pi_prox(y_t) / pi_behav(y_t) if that is <= C, else 0: the behaviour weight of
             decoupled PPO (Hilton et al., arXiv 2110.00641; AReaL, arXiv 2505.24298, masks
             the tokens above the cap instead of truncating them)

Advantages, old log-probs and returns are detached inside: they are targets. The math is
done in float32 at least (bf16 log-prob differences lose most of their digits).
"""

from __future__ import annotations

import torch

# Log-ratios are clamped to [-20, 20] before exp: exp(20) ~ 4.9e8 is already far outside any
# clip range, and the clamp keeps a token whose log-prob collapsed from giving inf (and
# inf * 0 = NaN after masking). Where the clamp is active its gradient is 0; with the PPO
# clip ranges used in practice such a token is clipped anyway.
MAX_LOG_RATIO = 20.0


def _float_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages [B] (one per sequence) or [B, T] -> detached float [B, T]-broadcastable."""
    A = advantages.detach().to(_float_dtype(like))
    if A.dim() == like.dim() - 1:
        A = A.unsqueeze(-1)  # [B, 1]
    return A


def _clip_diagnostics(
    ratio: torch.Tensor, A: torch.Tensor, clip_low: float, clip_high: float
) -> dict[str, torch.Tensor]:
    """Where the clipped branch of -min(rho A, clip(rho) A) is strictly the larger loss, i.e.
    where clipping sets the gradient to 0: A > 0 and rho > 1 + eps_high ("clipped_high"),
    or A < 0 and rho < 1 - eps_low ("clipped_low")."""
    high = (A > 0) & (ratio > 1.0 + clip_high)
    low = (A < 0) & (ratio < 1.0 - clip_low)
    shape = torch.broadcast_shapes(ratio.shape, A.shape)
    return {
        "clipped_low": low.expand(shape).float(),
        "clipped_high": high.expand(shape).float(),
    }


def ppo_clip_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, *, clip_low: float = 0.2,
                  clip_high: float = 0.2, dual_clip: float | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss per token (arXiv 1707.06347), see the module docstring.

    logps, old_logps: [B, T] log-probs of the sampled tokens under the current policy and
    under the policy that generated the batch (detached). advantages: [B] or [B, T].
    clip_low / clip_high: rho is clipped to [1 - clip_low, 1 + clip_high] (equal values give
    the paper's symmetric epsilon; DAPO's clip-higher uses e.g. 0.2 / 0.28).
    dual_clip: c > 1 (veRL's default is 3); for A < 0 the loss is capped at -c A, so a huge
    ratio on a negative-advantage token cannot produce an unbounded update.

    Returns (loss [B, T], diagnostics) with diagnostics:
      "ratio"         rho_t
      "clipped_low"   A < 0 and rho < 1 - clip_low      (gradient 0)
      "clipped_high"  A > 0 and rho > 1 + clip_high     (gradient 0)
      "dual_clipped"  A < 0 and rho > c                  (gradient 0)
      "clipped"       the union of the three: every token whose gradient clipping zeroed
    """
    dtype = _float_dtype(logps)
    log_ratio = (logps.to(dtype) - old_logps.detach().to(dtype)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)  # [B, T]
    A = _per_token(advantages, logps)  # [B, T] or [B, 1]

    loss_unclipped = -A * ratio
    loss_clipped = -A * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)  # = -min(rho A, clip(rho) A)

    diag = _clip_diagnostics(ratio.detach(), A, clip_low, clip_high)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss_dual = -A * dual_clip  # a constant: where it is the min, the gradient is 0
        dual_active = (A < 0) & (loss > loss_dual)  # with c > 1 > 1 - clip_low: rho > c
        loss = torch.where(A < 0, torch.minimum(loss, loss_dual), loss)
        diag["dual_clipped"] = dual_active.detach().expand_as(loss).float()
    else:
        diag["dual_clipped"] = torch.zeros_like(loss, dtype=torch.float32).detach()
    diag["clipped"] = ((diag["clipped_low"] + diag["clipped_high"] + diag["dual_clipped"]) > 0).float()
    diag["ratio"] = ratio.detach()
    return loss, diag


def gspo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              clip_low: float = 3e-4, clip_high: float = 4e-4) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO loss per token (Zheng et al., arXiv 2507.18071), in the paper's GSPO-token form.

    Sequence ratio (length-normalized, so it does not grow with |y_i|):
        s_i = exp( 1/|y_i| sum_t m_t (log pi(y_it) - log pi_old(y_it)) )
    Per token, with sg = stop-gradient:
        s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]      (value s_i, d s_it = s_i d log pi(y_it))
        L_it = -min(s_it A_i, clip(s_it, 1 - clip_low, 1 + clip_high) A_i)

    Aggregated with ``aggregate(loss, mask, "seq-mean-token-mean")`` this has the value and
    the gradient of the paper's sequence-level objective -1/B sum_i min(s_i A_i, clip(s_i) A_i):
    every token of sequence i sees the same s_i (so the clip decision is per sequence) and
    1/|y_i| sum_t s_i d log pi(y_it) = d s_i. Other aggregation modes weigh sequences
    differently and are not GSPO. With advantages [B, T] this is GSPO-token with
    per-token advantages.

    Defaults are the paper's clip ranges (3e-4, 4e-4). Positions outside ``mask`` get loss 0
    and do not enter s_i; a row with an empty mask has s_i = 1.
    Diagnostics as ``ppo_clip_loss`` ("ratio" is s_i broadcast over the row, the clip flags
    are per sequence broadcast over its tokens); "dual_clipped" is always 0 (GSPO has no
    dual clip) and present so recipes can log the same keys for either loss.
    """
    dtype = _float_dtype(logps)
    m = mask.bool()
    lp = torch.where(m, logps.to(dtype), 0.0)  # [B, T]; where(): garbage at padding never reaches the grad
    old_lp = torch.where(m, old_logps.detach().to(dtype), 0.0)
    n = m.sum(dim=-1, keepdim=True).clamp_min(1).to(dtype)  # [B, 1] |y_i|
    seq_log_ratio = ((lp - old_lp).sum(dim=-1, keepdim=True) / n).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [B, 1]
    s_i = torch.exp(seq_log_ratio)  # [B, 1]
    s_it = torch.exp(seq_log_ratio.detach() + lp - lp.detach())  # [B, T], value s_i
    A = _per_token(advantages, logps)  # [B, 1] or [B, T]

    loss = torch.maximum(-A * s_it, -A * s_it.clamp(1.0 - clip_low, 1.0 + clip_high))
    loss = torch.where(m, loss, torch.zeros_like(loss))

    diag = _clip_diagnostics(s_i.detach().expand_as(loss), A, clip_low, clip_high)
    diag["dual_clipped"] = torch.zeros_like(loss, dtype=torch.float32).detach()
    diag["clipped"] = ((diag["clipped_low"] + diag["clipped_high"]) > 0).float()
    diag["ratio"] = s_i.detach().expand_as(loss).clone()
    return loss, diag


def _value_clipped(values: torch.Tensor, old_values: torch.Tensor, clip: float) -> torch.Tensor:
    """V_old + clamp(V - V_old, -c, c): the value prediction kept within c of the old one."""
    return old_values + (values - old_values).clamp(-clip, clip)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, clip: float | None = None
) -> torch.Tensor:
    """Critic loss per token, [B, T].

    clip None:  1/2 (V - R)^2
    clip c:     1/2 max( (V - R)^2, (V_old + clamp(V - V_old, -c, c) - R)^2 )
    The clipped form is PPO2's (OpenAI baselines ppo2, used by veRL/OpenRLHF; not in the
    PPO paper): it stops the update on tokens where V already moved more than c from V_old
    in the direction that lowers the error. old_values and returns are detached targets.
    """
    dtype = _float_dtype(values)
    V = values.to(dtype)
    R = returns.detach().to(dtype)
    loss = (V - R) ** 2
    if clip is not None:
        V_clip = _value_clipped(V, old_values.detach().to(dtype), clip)
        loss = torch.maximum(loss, (V_clip - R) ** 2)
    return 0.5 * loss


def value_clip_fraction(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    """Per token, 1.0 where the clipped term of ``value_loss`` is strictly the larger one (the
    gradient there is 0), else 0.0; [B, T]. ``aggregate(..., mask, "token-mean")`` of it is
    the clip fraction metric."""
    with torch.no_grad():
        dtype = _float_dtype(values)
        V, R = values.to(dtype), returns.to(dtype)
        V_clip = _value_clipped(V, old_values.to(dtype), clip)
        return ((V_clip - R) ** 2 > (V - R) ** 2).float()


def entropy_bonus_loss(entropy: torch.Tensor) -> torch.Tensor:
    """-H_t per token, [B, T]: minimising it maximises the entropy. The recipe multiplies it
    by its coefficient and aggregates it with the mask like the policy loss."""
    return -entropy


BEHAVIOUR_MODES = ("truncate", "mask")


def behaviour_weights(prox_logps: torch.Tensor, behav_logps: torch.Tensor, *, cap: float, mode: str = "truncate"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The behaviour weights of decoupled PPO, [B, T], and where they hit the cap (bool [B, T]).

        w_t = pi_prox(y_t) / pi_behav(y_t)
        truncate:  min(w_t, C)                 (TIS, Yao et al. 2025: bounded variance, a little bias)
        mask:      w_t if w_t <= C else 0      (MIS, AReaL: a token sampled by a policy too
                                                far from pi_prox leaves the loss, counted)

    pi_behav is the policy that sampled y (the engine's log-probs, possibly several updates
    old: ``rollout.max_staleness``); pi_prox the trainer's recomputation with the weights
    before this step's update, which the PPO ratio is clipped against. At staleness 0 the two
    are the same weights in two kernels (the engine's and the trainer's), and w corrects their
    numerical drift. Detached: the weight scales each token's loss, it is not optimised.
    Log-ratios are clamped to [-20, 20] first.
    """
    if mode not in BEHAVIOUR_MODES:
        raise ValueError(f"behaviour weight mode {mode!r}; choose one of {', '.join(BEHAVIOUR_MODES)}")
    dtype = torch.promote_types(prox_logps.dtype, torch.float32)
    log_w = (prox_logps.detach().to(dtype) - behav_logps.detach().to(dtype)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    w = torch.exp(log_w)
    over = w > cap
    return (w.clamp(max=cap) if mode == "truncate" else w.masked_fill(over, 0.0)), over
