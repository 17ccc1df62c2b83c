"""Offline preference losses (DPO family, SimPO, ORPO, KTO) and the Bradley-Terry reward-model loss.

Each loss returns ``(losses [B], metrics)``: one loss per example (per pair; per unpaired
example for KTO), for the caller to average, and a dict of detached float tensors [B] for the
caller to average the same way. The paired losses report

  "rewards/chosen", "rewards/rejected"   the implicit rewards of the two responses
  "margins"                              rewards/chosen - rewards/rejected
  "accuracy"                             1.0 where rewards/chosen > rewards/rejected, else 0.0

Notation: x the prompt, y_w / y_l the chosen / rejected response, pi the policy, pi_ref the
frozen reference, sigma the logistic function. Unless a function says otherwise the log-prob
inputs are *summed* over the response tokens, log pi(y | x) = sum_t log pi(y_t | x, y_<t):

  pc = log pi(y_w | x)   pr = log pi(y_l | x)   rc = log pi_ref(y_w | x)   rr = log pi_ref(y_l | x)

* DPO    h = beta [ (pc - rc) - (pr - rr) ]
         L = -(1 - eps) log sigma(h) - eps log sigma(-h)
         (Rafailov et al., arXiv 2305.18290; eps > 0 is conservative DPO, E. Mitchell 2023,
         "A note on DPO with noisy preferences & relationship to IPO", no arXiv id; TRL's
         "sigmoid" loss with label_smoothing)
* IPO    L = ( (pc - rc) - (pr - rr) - 1 / (2 beta) )^2             (Azar et al., arXiv 2310.12036)
* DPOP   L = -log sigma( beta [ (pc - rc) - (pr - rr) - lambda max(0, rc - pc) ] )
         (DPO-Positive, Pal et al., arXiv 2402.13228)
* Step-DPO  DPO on the log-probs of the first differing reasoning step, the shared prefix
         being part of the context                                 (Lai et al., arXiv 2406.18629)
* SimPO  L = -log sigma( beta avg_c - beta avg_r - gamma ),  avg = 1/|y| log pi(y | x)
         (Meng et al., arXiv 2405.14734; no reference model)
* ORPO   odds(y) = p / (1 - p),  p = exp(avg log pi(y | x))
         L = L_NLL(y_w) - lambda log sigma( log odds(y_w) - log odds(y_l) )
         (Hong et al., arXiv 2403.07691; no reference model)
* KTO    r = log pi(y | x) - log pi_ref(y | x),  z0 = max(0, KL estimate), detached
         desirable:    L = w_D (1 - sigma(beta (r - z0)))
         undesirable:  L = w_U (1 - sigma(beta (z0 - r)))           (Ethayarajh et al., arXiv 2402.01306)
* Bradley-Terry reward model  L = -log sigma(r_w - r_l - m) + c (r_w + r_l)^2
         (margin m: Llama 2, arXiv 2307.09288; centering c: Eisenstein et al., arXiv 2312.09244)

-log sigma(h) is computed as -logsigmoid(h), which is finite for any finite h (a naive
log(sigmoid(h)) is -inf once sigmoid underflows, around h < -88 in float32). The math is done
in float32 at least (bf16 log-prob differences lose most of their digits). Reference log-probs
(and KTO's z0, the reward margin m) are detached: they are targets, not functions of the
parameters being trained.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# ORPO: an average log-prob at (or rounded to) 0 means p = 1 and infinite odds. Average
# log-probs are clamped to at most this value before the log-odds: p <= 1 - 1e-6, so a log odds
# of at most ~13.8 and a log-odds gradient 1 / (1 - p) of at most 1e6.
ORPO_MAX_AVG_LOGP = -1e-6


def _dtype(*xs: torch.Tensor) -> torch.dtype:
    """The common float dtype of the inputs, float32 at least."""
    return functools.reduce(torch.promote_types, (x.dtype for x in xs), torch.float32)


def _target(x: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """A detached float tensor (references, reference points, margins are constants)."""
    return torch.as_tensor(x).detach().to(dtype)


def _pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "margins": chosen_rewards - rejected_rewards,
        "accuracy": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
    }


def _smoothed_logistic_loss(h: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - eps) log sigma(h) - eps log sigma(-h): the logistic loss of a preference that is
    flipped with probability eps. eps = 0.5 makes it symmetric in h (no preference)."""
    if not 0.0 <= label_smoothing <= 0.5:
        # eps > 0.5 would train towards the rejected response.
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    loss = -F.logsigmoid(h)
    if label_smoothing > 0.0:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-h)
    return loss


def _log_ratios(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
                ref_rejected_logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pc - rc, pr - rr), each [B], in float32 at least, with the reference detached."""
    dtype = _dtype(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    chosen_log_ratio = chosen_logps.to(dtype) - _target(ref_chosen_logps, dtype)  # [B]
    rejected_log_ratio = rejected_logps.to(dtype) - _target(ref_rejected_logps, dtype)  # [B]
    return chosen_log_ratio, rejected_log_ratio


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, beta: float = 0.1, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO loss per pair (Rafailov et al., arXiv 2305.18290, eq. 7), [B] -> [B].

        h = beta [ (pc - rc) - (pr - rr) ]
        L = -(1 - eps) log sigma(h) - eps log sigma(-h)

    Inputs are summed response log-probs [B] (the paper's log pi(y | x)).
    label_smoothing eps in [0, 0.5]: eps = 0 is the paper's loss; eps > 0 is conservative
    DPO (cDPO, E. Mitchell 2023, "A note on DPO with noisy preferences & relationship to IPO",
    no arXiv id): each label is assumed flipped with probability eps, which bounds the loss's
    optimum (h* = log((1 - eps) / eps)) instead of pushing h to infinity. This is TRL's
    "sigmoid" loss with label_smoothing; it is not rDPO (Chowdhury et al., arXiv 2403.00409),
    which also divides by 1 - 2 eps. d L / d h = sigma(h) - (1 - eps).

    Implicit rewards (the paper's r(x, y) = beta log pi(y|x) / pi_ref(y|x), up to the
    partition function): rewards/chosen = beta (pc - rc), rewards/rejected = beta (pr - rr),
    so margins = h.
    """
    chosen_log_ratio, rejected_log_ratio = _log_ratios(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    )  # [B], [B]
    h = beta * (chosen_log_ratio - rejected_log_ratio)  # [B]
    losses = _smoothed_logistic_loss(h, label_smoothing)  # [B]
    return losses, _pair_metrics(beta * chosen_log_ratio, beta * rejected_log_ratio)


def sdpo_loss(chosen_step_logps: torch.Tensor, rejected_step_logps: torch.Tensor, ref_chosen_step_logps: torch.Tensor,
              ref_rejected_step_logps: torch.Tensor, *, beta: float = 0.1, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Step-level DPO (Step-DPO, Lai et al., arXiv 2406.18629), [B] -> [B].

    A pair is (x, s_1..s_{k-1}) -> s_w / s_l: both candidates continue the same prefix of
    reasoning steps and differ in the next step. The prefix is part of the context, so the
    loss is exactly ``dpo_loss`` applied to the summed log-probs of the differing step only,
    log pi(s_w | x, s_<k) etc. (the prefix tokens are masked out of these sums by the caller).
    Kept as its own name so recipes and docs can say which objective they run; see
    ``dpo_loss`` for beta, label_smoothing and the metrics.
    """
    return dpo_loss(chosen_step_logps, rejected_step_logps, ref_chosen_step_logps, ref_rejected_step_logps, beta=beta,
                    label_smoothing=label_smoothing)


def ipo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, beta: float = 0.1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IPO loss per pair (Azar et al., arXiv 2310.12036), [B] -> [B].

        h = (pc - rc) - (pr - rr)          (no beta inside)
        L = (h - 1 / (2 beta))^2            (the paper's tau is our beta)

    A squared loss: it regresses the log-ratio difference onto the finite target 1/(2 beta)
    instead of pushing it to infinity as DPO does when preferences are deterministic.

    Choice: the inputs are summed response log-probs, as in the paper (h is built from
    log pi(y | x)). TRL's "ipo" loss passes per-token *averaged* log-probs instead; a recipe
    wanting that behaviour passes averages, and beta then has a different scale (the target
    1/(2 beta) is per token rather than per sequence).

    Metrics as DPO (TRL's convention): rewards/chosen = beta (pc - rc), rewards/rejected =
    beta (pr - rr), margins = beta h.
    """
    if beta <= 0.0:
        raise ValueError(f"IPO needs beta > 0 (its target is 1 / (2 beta)), got {beta}")
    chosen_log_ratio, rejected_log_ratio = _log_ratios(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    )  # [B], [B]
    h = chosen_log_ratio - rejected_log_ratio  # [B]
    losses = (h - 1.0 / (2.0 * beta)) ** 2  # [B]
    return losses, _pair_metrics(beta * chosen_log_ratio, beta * rejected_log_ratio)


def dpop_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
              ref_rejected_logps: torch.Tensor, *, beta: float = 0.1, lambda_dpop: float = 50.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO-Positive loss per pair (Pal et al., arXiv 2402.13228, "Smaug"), [B] -> [B].

        L = -log sigma( beta [ (pc - rc) - (pr - rr) - lambda max(0, rc - pc) ] )

    DPO can lower the likelihood of the chosen response as long as the rejected one falls
    faster (the paper shows this happens on pairs with small edit distance). The penalty is
    active only where the policy's chosen log-prob has dropped below the reference's (pc < rc)
    and pushes it back up. lambda = 50 is the paper's value. Inputs are summed log-probs [B].

    Metrics as DPO (rewards beta (pc - rc), beta (pr - rr); margins without the penalty),
    plus "penalty" = max(0, rc - pc).
    """
    chosen_log_ratio, rejected_log_ratio = _log_ratios(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    )  # [B], [B]
    # max(0, rc - pc) [B]. relu, not clamp(min=0): at the tie pc = rc relu's gradient is 0 (the
    # penalty is off unless pc is strictly below rc), clamp's would already include lambda.
    penalty = torch.relu(-chosen_log_ratio)
    h = beta * (chosen_log_ratio - rejected_log_ratio - lambda_dpop * penalty)  # [B]
    losses = -F.logsigmoid(h)  # [B]
    metrics = _pair_metrics(beta * chosen_log_ratio, beta * rejected_log_ratio)
    metrics["penalty"] = penalty.detach()
    return losses, metrics


def simpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, *, beta: float = 2.0, gamma: float = 0.5,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO loss per pair (Meng et al., arXiv 2405.14734), [B] -> [B].

        h = beta avg_c - beta avg_r - gamma
        L = -(1 - eps) log sigma(h) - eps log sigma(-h)       (eps = 0 is the paper's loss)

    Inputs are the length-normalized log-probs avg = 1/|y| sum_t log pi(y_t | x, y_<t) [B]
    (the average over the response tokens, not the sum): SimPO's reward is beta * avg, which
    needs no reference model and does not favour long responses.

    gamma is the paper's target reward margin, used directly (as TRL's CPOTrainer
    simpo_gamma). The SimPO authors' trainer parameterizes it as gamma_beta_ratio = gamma /
    beta, h = beta (avg_c - avg_r - gamma_beta_ratio): the defaults here, beta = 2.0 and
    gamma = 0.5, are gamma_beta_ratio = 0.25 there. label_smoothing as in ``dpo_loss`` (the
    same option exists in both trainers).

    Metrics: rewards/chosen = beta avg_c, rewards/rejected = beta avg_r (margins without gamma).
    """
    dtype = _dtype(chosen_logps, rejected_logps)
    chosen_rewards = beta * chosen_logps.to(dtype)  # [B]
    rejected_rewards = beta * rejected_logps.to(dtype)  # [B]
    h = chosen_rewards - rejected_rewards - gamma  # [B]
    losses = _smoothed_logistic_loss(h, label_smoothing)
    return losses, _pair_metrics(chosen_rewards, rejected_rewards)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate over the whole range (Maechler 2012, "Accurately
    computing log(1 - exp(-|a|))"): log(-expm1(x)) near 0, where 1 - exp(x) cancels, and
    log1p(-exp(x)) for x < -log 2, where exp(x) is small."""
    near_zero = x > -0.6931471805599453
    # Both branches are finite for x < 0 (x is clamped by the caller), so where() gets no
    # NaN gradient from the branch it discards.
    return torch.where(near_zero, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_nll: torch.Tensor | None = None, *,
              lam: float = 0.1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO loss per pair (Hong et al., arXiv 2403.07691), [B] -> [B].

        log odds(y) = log p - log(1 - p),   p = exp(avg),  avg = 1/|y| log pi(y | x)
        L = chosen_nll - lambda log sigma( log odds(y_w) - log odds(y_l) )

    chosen_logps, rejected_logps: length-normalized (average per-token) log-probs [B]; the
    paper's odds are of the length-normalized likelihood. chosen_nll [B]: the SFT loss of
    the chosen response per example (the caller's token-mean NLL over that response, which
    is -chosen_logps when both use the same tokens: the default when it is None). Averaging L over B therefore weighs
    every pair equally; TRL instead takes the NLL as one token-mean over all chosen tokens of
    the batch, which weighs long responses more.

    log(1 - p) = log(1 - exp(avg)) is computed with ``_log1mexp``, and avg is first clamped to
    at most ORPO_MAX_AVG_LOGP = -1e-6: at avg = 0 (p = 1, e.g. after bf16 rounding) the odds
    are infinite. Departure: where the clamp is active (p > 1 - 1e-6) the odds term has no
    gradient for that response; the NLL term keeps its own. For p -> 0, log(1 - p) -> 0 and
    the log odds tend to avg itself (finite for finite inputs).

    Metrics (TRL's convention): rewards/chosen = lam avg_c, rewards/rejected = lam avg_r,
    margins, accuracy, plus "log_odds_ratio" = log odds(y_w) - log odds(y_l).
    """
    if chosen_nll is None:
        chosen_nll = -chosen_logps
    dtype = _dtype(chosen_logps, rejected_logps, chosen_nll)
    avg_c = chosen_logps.to(dtype)  # [B]
    avg_r = rejected_logps.to(dtype)  # [B]
    log_odds_c = avg_c.clamp(max=ORPO_MAX_AVG_LOGP)
    log_odds_c = log_odds_c - _log1mexp(log_odds_c)  # [B]
    log_odds_r = avg_r.clamp(max=ORPO_MAX_AVG_LOGP)
    log_odds_r = log_odds_r - _log1mexp(log_odds_r)  # [B]
    log_odds_ratio = log_odds_c - log_odds_r  # [B]
    losses = chosen_nll.to(dtype) - lam * F.logsigmoid(log_odds_ratio)  # [B]
    metrics = _pair_metrics(lam * avg_c, lam * avg_r)
    metrics["log_odds_ratio"] = log_odds_ratio.detach()
    return losses, metrics


def kto_reference_point(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0, a detached scalar (Ethayarajh et al., arXiv 2402.01306).

        z0 = max(0, mean_j [ log pi(y'_j | x_j) - log pi_ref(y'_j | x_j) ])

    policy_kl_logps, ref_kl_logps [M]: summed log-probs of *mismatched* pairs (x_j, y'_j),
    y'_j an output from another example of the batch (TRL shifts the outputs by one). This
    is the paper's biased batch estimate of KL(pi || pi_ref): it is clamped at 0 because a
    KL is >= 0 (the estimate can be negative) and detached because the paper does not
    backpropagate through it. In distributed training the caller gathers the two tensors
    over ranks first (as TRL does), so every rank uses the same z0. Empty inputs give 0.
    """
    dtype = _dtype(policy_kl_logps, ref_kl_logps)
    log_ratio = policy_kl_logps.detach().to(dtype) - ref_kl_logps.detach().to(dtype)  # [M]
    if log_ratio.numel() == 0:
        return torch.zeros((), dtype=dtype)
    return log_ratio.mean().clamp(min=0.0)


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, is_desirable: torch.Tensor,
             kl_ref: torch.Tensor | float, *, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO loss per (unpaired) example (Ethayarajh et al., arXiv 2402.01306), [B] -> [B].

        r  = log pi(y | x) - log pi_ref(y | x)                      (summed log-probs [B])
        desirable:    L = w_D (1 - sigma(beta (r - z0)))
        undesirable:  L = w_U (1 - sigma(beta (z0 - r)))

    This is the paper's lambda_y - v(x, y) with lambda_D = w_D, lambda_U = w_U. z0 = kl_ref is
    the reference point, a scalar from ``kto_reference_point`` (detached here in any case).
    is_desirable: bool [B]. Each example's loss depends only on itself and z0, so a batch of
    only desirable or only undesirable examples is fine. The paper suggests weights with
    w_D n_D / (w_U n_U) in [1, 4/3] when the two kinds are imbalanced (n = counts).

    Metrics: "rewards" = beta r, "is_desirable" (float 0/1), both [B] (KTO has no pairs, so
    no accuracy/margins; a caller can average "rewards" over either kind with is_desirable).
    """
    dtype = _dtype(policy_logps, ref_logps)
    r = policy_logps.to(dtype) - _target(ref_logps, dtype)  # [B]
    z0 = _target(kl_ref, dtype)  # []
    desirable = is_desirable.bool()
    desirable_losses = desirable_weight * (1.0 - torch.sigmoid(beta * (r - z0)))  # [B]
    undesirable_losses = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - r)))  # [B]
    losses = torch.where(desirable, desirable_losses, undesirable_losses)  # [B]
    metrics = {"rewards": (beta * r).detach(), "is_desirable": desirable.to(dtype)}
    return losses, metrics


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, *,
                       margin: torch.Tensor | float | None = None, center_coef: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pairwise reward-model loss per pair, [B] -> [B].

        L = -log sigma(r_w - r_l - m) + c (r_w + r_l)^2

    chosen_rewards, rejected_rewards [B]: the scalar reward-model outputs r(x, y_w), r(x, y_l).
    The first term is the Bradley-Terry negative log-likelihood of the preference (as in
    InstructGPT, arXiv 2203.02155). margin m [B] (or a float), optional: Llama 2's margin
    (arXiv 2307.09288), larger for pairs rated more clearly apart; it is a constant
    (detached). center_coef c: the auxiliary "centering" loss of Eisenstein et al. (arXiv
    2312.09244, TRL's center_rewards_coefficient), which pins the unidentified
    offset of a BT reward model near 0 so rewards are comparable across models and prompts.

    Metrics: rewards/chosen = r_w, rewards/rejected = r_l, margins = r_w - r_l (without m),
    accuracy.
    """
    dtype = _dtype(chosen_rewards, rejected_rewards)
    r_w = chosen_rewards.to(dtype)  # [B]
    r_l = rejected_rewards.to(dtype)  # [B]
    logits = r_w - r_l  # [B]
    if margin is not None:
        logits = logits - _target(margin, dtype)
    losses = -F.logsigmoid(logits)  # [B]
    if center_coef != 0.0:
        losses = losses + center_coef * (r_w + r_l) ** 2
    return losses, _pair_metrics(r_w, r_l)
