"""Advantage estimators: group-relative (GRPO, Dr. GRPO, RLOO, GDPO), REINFORCE++ and GAE.

Notation: B sequences, T tokens, G samples per prompt. Groups are contiguous: rows
[g*G, (g+1)*G) are the G samples of prompt g. ``mask`` [B, T] marks the trained
(model-generated) tokens; every other position is skipped and gets advantage 0.

Sequence-level (one scalar per sequence, the recipe broadcasts it over the tokens):

* GRPO       A_i = (r_i - mean(r)) / (std(r) + eps)                  (DeepSeekMath, arXiv 2402.03300)
* Dr. GRPO   A_i =  r_i - mean(r)                                      (arXiv 2503.20783)
* RLOO       A_i =  r_i - 1/(G-1) sum_{j != i} r_j = G/(G-1) (r_i - mean(r))   (arXiv 2402.14740)
* GDPO       A_i = whiten_batch( sum_k w_k (r_ik - mean(r_k)) / (std(r_k) + eps) )   (arXiv 2601.05242)

Token-level:

* REINFORCE++  G_t = sum_{s >= t} gamma^(s-t) r_s, then (G_t - mean(G)) / (std(G) + eps) over
  every trained token of the batch; the -baseline variant first takes the group's mean
  reward off each outcome                                            (arXiv 2501.03262)
* GAE          delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},
  R_t = A_t + V_t                                                    (arXiv 1506.02438)

In the token-level recursions "t+1" is the next *trained* token: untrained positions inside
a sequence (environment/tool tokens between turns) are jumped over, not treated as steps.

mean/std are over the group (of G rewards) unless said otherwise. Every std here is the
unbiased one (Bessel's correction, divide by n-1), as ``torch.std`` computes it in TRL and
veRL; a std over a single element is taken as 0 instead of NaN. Advantages are targets,
not functions of the parameters: inputs are detached and computed in (at least) float32.
"""

from __future__ import annotations

import torch

GROUP_BASELINES = ("mean", "leave_one_out")
GROUP_SCALES = ("std", "none")
REINFORCE_PP_BASELINES = ("none", "group_mean")


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """Detached, and at least float32 (bf16 rewards or values lose too much in a sum)."""
    return x.detach().to(torch.promote_types(x.dtype, torch.float32))


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B, ...] -> [B // G, G, ...], checking that the rows split into whole groups."""
    if group_size < 1 or x.shape[0] % group_size != 0:
        raise ValueError(f"batch of {x.shape[0]} rows does not split into groups of {group_size}")
    return x.reshape(x.shape[0] // group_size, group_size, *x.shape[1:])


def _std(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased std along ``dim``; 0 (not NaN) where there is a single element."""
    if x.shape[dim] < 2:
        return torch.zeros_like(x.select(dim, 0)).unsqueeze(dim)
    return x.std(dim=dim, correction=1, keepdim=True)


def group_advantages(rewards: torch.Tensor, group_size: int, *, baseline: str = "mean", scale: str = "std",
                     eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage of each sequence, [B] -> [B].

    baseline "mean":          b_i = 1/G sum_j r_j                     (GRPO 2402.03300)
    baseline "leave_one_out": b_i = 1/(G-1) sum_{j != i} r_j           (RLOO 2402.14740)
                              so r_i - b_i = G/(G-1) (r_i - mean(r))
    scale "std":   A_i = (r_i - b_i) / (std(r) + eps), std unbiased over the group (as TRL/veRL)
    scale "none":  A_i =  r_i - b_i                                    (Dr. GRPO 2503.20783)

    RLOO with scale "std" divides the leave-one-out difference by the same group std; the
    RLOO paper itself uses scale "none".

    Departures, both only where the formula is undefined or off by rounding:
    * a group of size 1 has no baseline to compare against (leave-one-out is 0/0 and GRPO
      gives r - r = 0): its advantage is 0;
    * a group whose rewards are all equal gets exactly 0. In exact arithmetic the formula
      already says so, but float rounding of the mean does not (float32 mean([7.3] * 3) - 7.3
      = -4.8e-7, which ``/ (0 + 1e-6)`` would turn into an advantage of -0.3).
    """
    if baseline not in GROUP_BASELINES:
        raise ValueError(f"unknown baseline {baseline!r}; choose one of {', '.join(GROUP_BASELINES)}")
    if scale not in GROUP_SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {', '.join(GROUP_SCALES)}")
    r = _grouped(_as_float(rewards), group_size)  # [B/G, G]
    G = group_size

    mean = r.mean(dim=-1, keepdim=True)  # [B/G, 1]
    if baseline == "mean":
        A = r - mean
    elif G > 1:
        A = r - (r.sum(dim=-1, keepdim=True) - r) / (G - 1)
    else:
        A = torch.zeros_like(r)

    if scale == "std":
        A = A / (_std(r, dim=-1) + eps)

    all_equal = (r == r[:, :1]).all(dim=-1, keepdim=True)  # [B/G, 1]
    A = torch.where(all_equal, torch.zeros_like(A), A)
    return A.reshape(-1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, scale_only: bool = False,
                  eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) with mean and std over the tokens where ``mask`` is set.

    shift_mean=False adds the mean back, (x - mean) / (std + eps) + mean, i.e. rescales the
    spread but keeps the mean; this is what TRL's and veRL's ``masked_whiten`` do (used to
    whiten rewards without changing their sign on average).
    scale_only=True gives x / (std + eps): values already centred by a baseline keep their
    sign and a 0 stays 0 (REINFORCE++-baseline).
    std is unbiased (n - 1), like TRL/veRL ``masked_var``; with 0 or 1 masked tokens it is 0.
    Positions outside the mask are 0 in the result (even if they hold inf/NaN there). An
    empty mask gives all zeros; all-equal masked values give exactly 0 (rounding guard, as in
    ``group_advantages``). The input is detached: whitened values are targets.
    """
    keep = mask.bool()
    x = torch.where(keep, _as_float(x), 0.0)  # where(), not * mask: inf * 0 would be NaN
    m = keep.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp_min(1.0)
    if x.numel():
        # All masked values equal: use that value as the mean, so x - mean is exactly 0 rather
        # than a rounding residual that / (0 + eps) would blow up.
        x_max = torch.where(keep, x, -torch.inf).amax()
        x_min = torch.where(keep, x, torch.inf).amin()
        mean = torch.where(x_max == x_min, x_max, mean)
    var = (((x - mean) * m) ** 2).sum() / (n - 1.0).clamp_min(1.0)
    if scale_only:  # no spread (one token, or all equal): no signal, rather than x / eps
        return torch.where(var > 0, x / (var.sqrt() + eps), 0.0) * m
    out = (x - mean) / (var.sqrt() + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def _masked_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t'} with t' the next masked position (G = 0 after the last).

    Positions outside the mask (prompt, padding, environment tokens between turns) are
    skipped: their reward is ignored, they do not consume a discount step, and their own
    return is 0. So gamma^(s-t) counts trained tokens, not raw positions.
    """
    m = mask.bool()
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])  # [B]
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(m[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(m[:, t], running, torch.zeros_like(running))
    return returns


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
                            group_size: int | None = None, baseline: str = "none",
                            token_penalties: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ advantages (Hu, arXiv 2501.03262), [B, T] -> [B, T].

    token_rewards [B, T]: the task's rewards per token, the outcome on the last response token
    (multi-turn: each turn's reward on its last model token). token_penalties [B, T]: terms
    added to every token's reward after the baseline, -beta * kl_t when the KL is in the
    reward (``kl.kl_penalty_rewards``).

        r_t  = token_rewards_t - [t = last] b_i + token_penalties_t
        G_t  = sum_{s >= t, s masked} gamma^(s-t) r_s                 (return-to-go)
        A_t  = (G_t - mean(G)) / (std(G) + eps)   mean/std over all masked tokens of the batch

    baseline "group_mean" (REINFORCE++-baseline): b_i is the mean over i's group of the
    sequences' total task reward R_j = sum_t token_rewards_jt, taken off the *outcome* (the
    last masked token) before discounting, as OpenRLHF subtracts the group mean from the
    sequence reward before the per-token KL is added. The group baseline centres the returns
    already, so they are only scaled by the batch std, A_t = G_t / (std(G) + eps), as
    ms-swift/TRL do (OpenRLHF also subtracts the batch mean again). A group whose rewards are
    all equal then gets A_t = 0 without a KL term, whatever gamma and whatever the rest of the
    batch. (Subtracting b from every token's return instead left G_t - b =
    (gamma^(T-t) - 1) R != 0 for gamma < 1, and re-centring on the batch mean moves a 0.)

    The batch is whitened as a whole; under data parallelism the caller passes the whole
    step's batch, or the statistics are per rank. Masked positions are 0.
    """
    if baseline not in REINFORCE_PP_BASELINES:
        raise ValueError(f"unknown baseline {baseline!r}; choose one of {', '.join(REINFORCE_PP_BASELINES)}")
    r = _as_float(token_rewards)  # [B, T]
    keep = mask.bool()
    r = torch.where(keep, r, 0.0)
    if baseline == "group_mean":
        if group_size is None:
            raise ValueError("baseline='group_mean' needs group_size")
        R = _grouped(r.sum(dim=-1), group_size)  # [B/G, G] total task reward of each sequence
        b = R.mean(dim=-1, keepdim=True)  # [B/G, 1]
        # all-equal guard, as in group_advantages: the rounding of a mean must not leave a residue
        b = torch.where((R == R[:, :1]).all(dim=-1, keepdim=True), R[:, :1], b)
        b = b.expand(-1, group_size).reshape(-1)  # [B]
        cols = torch.arange(r.shape[1], device=r.device).expand_as(r)
        last = torch.where(keep, cols, -1).amax(dim=-1)  # [B] last masked column (-1: none)
        at_last = (cols == last.unsqueeze(-1)) & keep
        r = r - at_last.to(r.dtype) * b.unsqueeze(-1)
    if token_penalties is not None:
        r = r + torch.where(keep, _as_float(token_penalties), 0.0)
    G_t = _masked_returns(r, mask, gamma)  # [B, T]
    return masked_whiten(G_t, mask, scale_only=baseline == "group_mean", eps=eps)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al., arXiv 1506.02438).

    rewards, values, mask: [B, T]. With t' the next masked position after t:

        delta_t = r_t + gamma * V_{t'} - V_t        (V_{t'} = 0 after the last masked token)
        A_t     = delta_t + gamma * lam * A_{t'}    (A_{t'} = 0 after the last masked token)
        R_t     = A_t + V_t                         (the value-function target)

    Positions outside the mask (prompt, padding, environment tokens in multi-turn) are
    skipped by the recursion (the chain jumps over them without a discount step; their
    reward and value are ignored) and get A = R = 0.
    The end of the response is treated as terminal (no bootstrap from V after it), which is
    right for completed answers; a truncated answer is also treated as terminal, as in
    veRL/OpenRLHF.
    Advantages are not whitened here; call ``masked_whiten`` on them (as PPO does).
    """
    r = _as_float(rewards)
    V = _as_float(values)  # detached: the critic learns from R through value_loss only
    m = mask.bool()
    zero = torch.zeros_like(r[:, 0])  # [B]
    A = torch.zeros_like(r)
    next_V, next_A = zero, zero
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_V - V[:, t]
        A_t = delta + gamma * lam * next_A
        next_A = torch.where(m[:, t], A_t, next_A)
        next_V = torch.where(m[:, t], V[:, t], next_V)
        A[:, t] = torch.where(m[:, t], A_t, zero)
    returns = torch.where(m, A + V, torch.zeros_like(A))
    return A, returns


def gdpo_advantages(reward_components: torch.Tensor, group_size: int,
                    weights: torch.Tensor | list[float] | None = None, *, eps: float = 1e-6, batch_norm: bool = True
) -> torch.Tensor:
    """GDPO advantages (Liu et al., arXiv 2601.05242), [B, K] -> [B].

    Each of the K reward components is normalized within its group on its own, so that
    different reward combinations do not collapse onto the same advantage (as they do when
    GRPO normalizes the summed reward):

        A_ik   = (r_ik - mean_group(r_k)) / (std_group(r_k) + eps)    (= group_advantages)
        A_i    = sum_k w_k A_ik                                        (w_k = 1 by default)
        A_i    = (A_i - mean_batch(A)) / (std_batch(A) + eps)          (batch_norm=True)

    The batch normalization keeps the scale from growing with K. Stds are unbiased, as in
    the authors' TRL/veRL code (which uses eps = 1e-4; the default here is 1e-6 like
    ``group_advantages``). Batch statistics are over the rows given; under data
    parallelism pass the whole step's batch. Components that are constant within a group
    contribute 0 (see ``group_advantages``).
    """
    r = _as_float(reward_components)  # [B, K]
    if r.dim() != 2:
        raise ValueError(f"reward_components must be [B, K], got shape {tuple(r.shape)}")
    K = r.shape[1]
    w = torch.ones(K) if weights is None else torch.as_tensor(weights)
    w = w.to(dtype=r.dtype, device=r.device)  # [K]
    if w.shape != (K,):
        raise ValueError(f"weights must have {K} entries, got shape {tuple(w.shape)}")
    A_k = torch.stack([group_advantages(r[:, k], group_size, eps=eps) for k in range(K)], dim=-1)  # [B, K]
    A = (A_k * w).sum(dim=-1)  # [B]
    if batch_norm:
        # all-equal guard as in group_advantages: a constant batch gives exactly 0
        mean = torch.where((A == A[:1]).all(), A[:1], A.mean())
        A = (A - mean) / (_std(A, dim=0).squeeze(0) + eps)
    return A


# --------------------------------------------------------------------------- VinePPO (step-level Monte-Carlo values)


def vine_step_values(mc_values: list[float | None], step_rewards: list[float]) -> list[float]:
    """V_0 .. V_L of a response of L steps from its Monte-Carlo estimates (Kazemnejad et al. 2024,
    "VinePPO", arXiv 2410.01679; treetune's backfill):

        V_L = 0                                   (the terminal state)
        V_i = V̂_i                                 (the mean reward of K continuations from s_i)
        V_i = r_i + V_{i+1}                       walking back from the end, for every state
                                                  without an estimate (past max_steps), until
                                                  the first estimated one

    ``mc_values`` holds V̂_i for i = 0 .. L-1 (None: not estimated); ``step_rewards`` r_0 .. r_{L-1}.
    """
    L = len(step_rewards)
    if len(mc_values) != L:
        raise ValueError(f"{len(mc_values)} value estimates for {L} steps")
    V = [0.0] * (L + 1)
    for i in range(L - 1, -1, -1):
        V[i] = float(mc_values[i]) if mc_values[i] is not None else float(step_rewards[i]) + V[i + 1]
    return V


def vine_step_advantages(values: list[float], step_rewards: list[float]) -> list[float]:
    """A_i = r_i + V_{i+1} - V_i for each step (``values`` has L + 1 entries, V_L = 0). A
    backfilled tail gets A = 0 by construction."""
    if len(values) != len(step_rewards) + 1:
        raise ValueError(f"need L + 1 = {len(step_rewards) + 1} values, got {len(values)}")
    return [float(r) + values[i + 1] - values[i] for i, r in enumerate(step_rewards)]


def step_to_token_advantages(step_adv: list[float], ends: list[int], n_tokens: int) -> torch.Tensor:
    """[n_tokens]: each token gets the advantage of the step it belongs to (``ends`` are the
    steps' exclusive token ends, the last = n_tokens). VinePPO maps by characters and gives a
    token its first character's step; relign's steps are cut in token ids, so the mapping is exact."""
    if len(step_adv) != len(ends) or (ends and ends[-1] != n_tokens):
        raise ValueError(f"{len(step_adv)} step advantages for step ends {ends} of {n_tokens} tokens")
    out = torch.zeros(n_tokens)
    start = 0
    for a, e in zip(step_adv, ends):
        out[start:e] = a
        start = e
    return out
