"""Trust Region Policy Optimization (Schulman et al., arXiv 1502.05477) on a causal LM.

Maximise the surrogate under a trust region on the mean KL (the paper's eq. 12, sample form
eq. 14), with the step found by conjugate gradient and a line search (Appendix C):

    L(θ) = mean_t A_t π_θ(y_t) / π_old(y_t)              surrogate, maximised; L(θ_old) = mean A
    g    = ∇L(θ_old)
    F    = ∇² KL̄(θ_old, θ) at θ = θ_old                  Fisher information (+ damping·I)
    s    = F⁻¹ g                                          conjugate_gradient, never forming F
    β    = sqrt(2δ / sᵀFs)                                ½ (βs)ᵀF(βs) = δ: the quadratic KL model
    θ    = θ_old + 0.8^k β s,  k = 0, 1, ...              first k with KL̄(π_old ‖ π_θ) ≤ δ and L up

Mechanics and defaults from stable-baselines3-contrib ``sb3_contrib/trpo/trpo.py``: δ
(``max_kl``) 0.01, damping 0.1, 15 CG iterations, line-search fractions 0.8^k for
k < max_backtracks = 10, accept only if the KL holds *and* the surrogate improves, otherwise
put the old parameters back. (sb3 tests KL < δ, baselines KL ≤ 1.5δ; here KL ≤ δ, as the spec.) From openai/baselines ``trpo_mpi.py``: the Fisher-vector
product may use a subsample (every 5th sample, ``arr[::5]``), candidates with a non-finite
surrogate or KL are rejected, and a ≈ 0 gradient skips the update.

LLM specifics (the spec's §4 and §7.5):
* The Fisher is the Hessian at θ_old of KL(stop_grad(π_θ) ‖ π_θ) over the full vocabulary
  (``self_kl``): its value and gradient are 0 at θ, its Hessian is E_π[∇log π ∇log πᵀ], so
  no old logits are needed for the FVP. Pass ``kl_fn_fvp`` a closure over a subsample.
* The line search needs KL(π_old ‖ π_new) (``token_kl``) over the whole batch, as baselines'
  line search computes its mean KL on every sample: keep the old log-softmax [B, t, V] of every
  row, and recompute the new one with the current params. Only the FVP subsamples.
* Cost ≈ 1 gradient + cg_iters double backwards + ≤ max_backtracks forwards: practical only
  for small trainable sets (tiny models, LoRA). There is no optimizer state; it acts on the
  params it is given, in place. Not for FSDP (flat vectors, double backward).

Layout: ``mask`` [B, T] marks the rows of ``logits`` [B, T, V] that are scored, i.e. the
distributions that predict a trained token. With relign's token layout (``logps[:, t]``
scores ``input_ids[:, t]``) that is ``logits[:, :-1]`` with ``response_mask[:, 1:]``.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

ZERO_GRAD_NORM = 1e-12


def flat_params(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The params, detached and concatenated into one vector (a copy, in their dtype)."""
    return torch.cat([p.detach().reshape(-1) for p in params])


@torch.no_grad()
def set_flat_params(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Write ``flat`` back into the params in place (cast to each param's dtype)."""
    i = 0
    for p in params:
        p.copy_(flat[i : i + p.numel()].view_as(p))
        i += p.numel()
    if i != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} entries, params have {i}")


def flat_grad(y: torch.Tensor, params: Sequence[torch.Tensor], *, retain_graph: bool = False,
              create_graph: bool = False) -> torch.Tensor:
    """∂y/∂params as one vector; zeros for a param that y does not depend on.

    create_graph (for a second derivative) also keeps the graph, as ``torch.autograd.grad`` does.
    """
    grads = torch.autograd.grad(y, list(params), retain_graph=retain_graph or create_graph, create_graph=create_graph,
                                allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def conjugate_gradient(fvp: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, iters: int = 15,
                       tol: float = 1e-10) -> torch.Tensor:
    """Solve F x = b for symmetric positive-definite F given only x ↦ F x (Hestenes–Stiefel).

    Starts at x = 0, not at sb3's 1e-4·randn: the result is deterministic, and for b = 0 the
    start is already the exact answer (r = 0, no iteration). Stops after ``iters`` steps or
    once the squared residual rᵀr < ``tol`` (sb3's and baselines' criterion).
    """
    x = torch.zeros_like(b)
    r = b.clone()  # r = b - F x
    p = r.clone()
    rr = r @ r
    for _ in range(iters):
        if rr < tol:
            break
        Fp = fvp(p)
        alpha = rr / (p @ Fp)
        x += alpha * p
        r -= alpha * Fp
        rr_new = r @ r
        p = r + (rr_new / rr) * p
        rr = rr_new
    return x


def self_kl(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over tokens of KL(stop_grad(π) ‖ π), full vocabulary; logits [B, T, V] -> [].

        KL_t = Σ_v p_v (log p_v - log π_v),  p = softmax(logits.detach()),  π = softmax(logits)

    Value 0 and gradient Σ_v (π_v - p_v) ∇z_v = 0 at θ; its Hessian at θ is the Fisher
    J_zᵀ (diag p - p pᵀ) J_z. In float32 at least.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp_new = torch.log_softmax(z, dim=-1)
    logp_old = logp_new.detach()
    kl = (logp_old.exp() * (logp_old - logp_new)).sum(-1)  # [B, T]
    m = mask.to(kl.dtype)
    return (kl * m).sum() / m.sum().clamp_min(1.0)


def token_kl(old_logp_all: torch.Tensor, new_logp_all: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over tokens of KL(π_old ‖ π_new) = Σ_v π_old,v (log π_old,v - log π_new,v).

    old_logp_all, new_logp_all: log-softmax [B, T, V]; mask [B, T]. Returns a scalar.
    """
    dtype = torch.promote_types(new_logp_all.dtype, torch.float32)
    old = old_logp_all.detach().to(dtype)
    kl = (old.exp() * (old - new_logp_all.to(dtype))).sum(-1)  # [B, T]
    m = mask.to(kl.dtype)
    return (kl * m).sum() / m.sum().clamp_min(1.0)


def surrogate_objective(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """L = masked mean of A_t exp(log π(y_t) - log π_old(y_t)), to maximise; [B, T] -> [].

    advantages [B] (one per sequence) or [B, T]; old_logps and advantages are detached.
    """
    dtype = torch.promote_types(logps.dtype, torch.float32)
    A = advantages.detach().to(dtype)
    if A.dim() == logps.dim() - 1:
        A = A.unsqueeze(-1)
    ratio = torch.exp(logps.to(dtype) - old_logps.detach().to(dtype))
    m = mask.to(dtype)
    return (A * ratio * m).sum() / m.sum().clamp_min(1.0)


def make_fvp(kl_fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor],
             damping: float = 0.1) -> Callable[[torch.Tensor], torch.Tensor]:
    """v ↦ F v + damping·v, with one forward and one first backward shared by every call.

    g = ∂KL/∂θ is built with create_graph, each call differentiates g·v once more (Pearlmutter's
    double backprop, as sb3 and baselines do); the graph is kept between calls.
    """
    params = list(params)
    g = flat_grad(kl_fn(), params, create_graph=True)

    def fvp(v: torch.Tensor) -> torch.Tensor:
        Fv = flat_grad(g @ v.detach().to(g.dtype), params, retain_graph=True)
        return Fv.to(v.dtype) + damping * v

    return fvp


def fisher_vector_product(kl_fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], v: torch.Tensor,
                          damping: float = 0.1) -> torch.Tensor:
    """F v + damping·v, F the Hessian of ``kl_fn()`` = KL(stop_grad(π_θ) ‖ π_θ) (``self_kl``) at θ."""
    return make_fvp(kl_fn, params, damping)(v)


def trpo_step(params: Sequence[torch.Tensor], surrogate_fn: Callable[[], torch.Tensor],
              kl_fn_fvp: Callable[[], torch.Tensor], kl_old_new_fn: Callable[[], torch.Tensor] | None = None, *,
              max_kl: float = 0.01, damping: float = 0.1, cg_iters: int = 15, backtrack_ratio: float = 0.8,
              max_backtracks: int = 10, candidate_fn: Callable[[], tuple[float, float]] | None = None) -> dict:
    """One TRPO update of ``params`` in place; see the module docstring. Returns the metrics.

    surrogate_fn(): L(θ) with the graph to the params, computed at the current params.
    kl_fn_fvp(): ``self_kl`` on the FVP subsample (graph to the params).
    kl_old_new_fn(): KL̄(π_old ‖ π_θ) at the current params (``token_kl`` against the kept old
        log-softmax); called under no_grad.
    candidate_fn(): (L(θ), KL̄(π_old ‖ π_θ)) of a line-search candidate in one pass, under no_grad,
        where one forward gives both (it replaces surrogate_fn() and kl_old_new_fn() there).
    Candidates are θ_old + backtrack_ratio^k β s for k = 0 .. max_backtracks - 1 (sb3's
    ``line_search_max_iter``); when all fail θ_old is copied back bitwise.

    Metrics: trpo/kl (after the accepted step, else 0), trpo/backtracks (rejected candidates),
    trpo/accepted (1.0 / 0.0), trpo/surrogate_gain (L_new - L_old, 0 if rejected),
    trpo/expected_gain (g·βs, the full step's first-order gain), trpo/step_norm (‖applied
    step‖, 0 if rejected), trpo/grad_norm (‖g‖), and trpo/reason ("accepted", "zero gradient",
    "non-positive curvature", "line search failed").
    """
    params = list(params)
    if candidate_fn is None and kl_old_new_fn is None:
        raise ValueError("trpo_step needs kl_old_new_fn or candidate_fn to measure a candidate's KL")
    if candidate_fn is None:
        def candidate_fn() -> tuple[float, float]:
            return surrogate_fn().item(), kl_old_new_fn().item()
    metrics = {"trpo/kl": 0.0, "trpo/backtracks": 0.0, "trpo/accepted": 0.0, "trpo/surrogate_gain": 0.0,
               "trpo/expected_gain": 0.0, "trpo/step_norm": 0.0, "trpo/grad_norm": 0.0}
    surr = surrogate_fn()
    L_old = surr.item()
    g = flat_grad(surr, params)
    dtype = torch.promote_types(g.dtype, torch.float32)  # CG in fp32 at least, even for bf16 params
    g = g.to(dtype)
    metrics["trpo/grad_norm"] = g.norm().item()
    if not metrics["trpo/grad_norm"] > ZERO_GRAD_NORM:  # also catches a NaN gradient
        return {**metrics, "trpo/reason": "zero gradient"}

    F = make_fvp(kl_fn_fvp, params, damping)
    s = conjugate_gradient(F, g, iters=cg_iters)
    sFs = (s @ F(s)).item()  # damped F, as in sb3 and baselines
    if not (sFs > 0 and math.isfinite(sFs)):
        return {**metrics, "trpo/reason": "non-positive curvature"}
    beta = math.sqrt(2.0 * max_kl / sFs)
    full_step = beta * s
    metrics["trpo/expected_gain"] = (g @ full_step).item()
    del F  # frees the double-backward graph before the line-search forwards

    theta_old = flat_params(params)  # exact copy in the params' dtype: restoring it is bitwise
    frac = 1.0
    with torch.no_grad():
        for k in range(max_backtracks):
            set_flat_params(params, theta_old.to(dtype) + frac * full_step)
            L_new, kl = candidate_fn()
            if math.isfinite(L_new) and math.isfinite(kl) and kl <= max_kl and L_new > L_old:
                metrics.update({"trpo/kl": kl, "trpo/backtracks": float(k), "trpo/accepted": 1.0,
                                "trpo/surrogate_gain": L_new - L_old,
                                "trpo/step_norm": (frac * full_step).norm().item()})
                return {**metrics, "trpo/reason": "accepted"}
            frac *= backtrack_ratio
    set_flat_params(params, theta_old)
    metrics["trpo/backtracks"] = float(max_backtracks)
    return {**metrics, "trpo/reason": "line search failed"}
