"""What the advantage estimators read, and the table that picks one by name.

``shaped_rewards`` turns a step's scored episodes into ``Rewards``: the sequence rewards the
group estimators compare, the per-token rewards of the token-level ones, GDPO's reward terms
with their weights, DAPO's overlong penalty and the KL when it is in the reward. Every
estimator then has one signature, ``fn(rewards, mask, values, options) -> (advantages,
returns)``, and ``ESTIMATORS`` maps the config's name to it, with what it needs (a critic's
values, G >= 2 samples) and the checks of its own: the recipe never tests an estimator's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..algorithms import advantages as adv_fns
from ..algorithms import shaping
from ..config import ConfigError
from ..rollout.batch import RolloutBatch


@dataclass
class Rewards:
    """What the estimators read. Sequence level: ``seq`` [N] = task reward (+ overlong penalty)
    (- beta * sum_t KL_t with the KL in the reward) and GDPO's ``terms`` [N, K] with
    ``term_weights`` [K]. Token level: ``token`` [N, L], the task's rewards per token (outcome,
    or turn rewards, plus the overlong penalty, on the last model token), and ``penalties``
    [N, L] = -beta * KL_t when the KL is in the reward."""

    seq: torch.Tensor
    token: torch.Tensor
    terms: torch.Tensor
    term_weights: torch.Tensor
    penalties: torch.Tensor | None = None
    outcome: torch.Tensor | None = None
    """[N] the task reward with its shaping, before any KL term (what reward/mean reports)."""


@dataclass(frozen=True)
class AdvantageOptions:
    group_size: int
    scale_rewards: str = "none"
    gamma: float = 1.0
    lam: float = 1.0
    whiten: bool = True


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: ``fn(rewards, mask, values, options) -> (advantages [N, L], returns | None)``."""

    fn: Callable
    values: str = ""
    """What V(s_t) it needs: "" (none), "critic" (a learned value model, trained on the returns) or
    "monte_carlo" (VinePPO: K continuations from every step boundary, ``rollout.vine``)."""
    compares_samples: bool = False
    """It compares the G samples of a prompt (needs rollout.n >= 2)."""
    check: Callable[[Any], None] | None = None
    """Its own settings' checks, ``check(cfg)`` before anything is loaded (VinePPO's vine.*)."""
    check_task: Callable[[str, str, str], None] | None = None
    """``check_task(task name, multi-turn env, step delimiter)`` once the task is built (VinePPO: single-turn, steps)."""
    check_groups: Callable[[Any, Callable[[str], float]], None] | None = None
    """``check_groups(groups, term_weight)`` on every step's scored episodes (GDPO: the terms add up to the reward)."""


def _group(baseline: str) -> Callable:
    def fn(r: Rewards, mask, values, o: AdvantageOptions):
        a = adv_fns.group_advantages(r.seq, o.group_size, baseline=baseline, scale=o.scale_rewards)
        return a.unsqueeze(-1) * mask, None  # the sequence's advantage on each of its tokens
    return fn


def _gdpo(r: Rewards, mask, values, o: AdvantageOptions):
    return adv_fns.gdpo_advantages(r.terms, o.group_size, r.term_weights).unsqueeze(-1) * mask, None


def _reinforce_pp(baseline: str) -> Callable:
    def fn(r: Rewards, mask, values, o: AdvantageOptions):
        a = adv_fns.reinforce_pp_advantages(r.token, mask, gamma=o.gamma, group_size=o.group_size, baseline=baseline,
                                            token_penalties=r.penalties)
        return a, None
    return fn


def _gae(r: Rewards, mask, values, o: AdvantageOptions):
    rewards = r.token if r.penalties is None else r.token + r.penalties
    a, returns = adv_fns.gae(rewards, values, mask, gamma=o.gamma, lam=o.lam)
    return (adv_fns.masked_whiten(a, mask) if o.whiten else a) * mask, returns


def _vine(r: Rewards, mask, values, o: AdvantageOptions):
    """VinePPO: A_i = r_i + V_{i+1} - V_i per step from the Monte-Carlo values (``rollout.vine``),
    r_i = 0 but for the last step, whose r is the sequence reward; each token gets its step's
    A; whitened over the batch (treetune's ``whiten_advantages``)."""
    a = torch.zeros_like(mask)
    for i, sv in enumerate(values):
        if not sv.ends:
            continue
        step_r = [0.0] * (len(sv.ends) - 1) + [float(r.seq[i])]
        A = adv_fns.vine_step_advantages(adv_fns.vine_step_values(sv.mc, step_r), step_r)
        a[i, sv.offset : sv.offset + sv.ends[-1]] = adv_fns.step_to_token_advantages(A, sv.ends, sv.ends[-1]).to(a)
    return adv_fns.masked_whiten(a, mask) * mask, None


def check_terms(groups, term_weight: Callable[[str], float]) -> None:
    """GDPO normalizes the reward's terms one by one, so they must add up to the reward."""
    for i, e in enumerate(e for g in groups for e in g.episodes):
        total = sum(term_weight(k) * v for k, v in e.terms.items())
        if e.reward_error is None and abs(total - e.reward) > 1e-5 * max(1.0, abs(e.reward)):
            raise ConfigError(
                f"algorithm.advantage=gdpo: completion {i}'s reward {e.reward:g} is not the weighted sum of its terms "
                f"{e.terms} (= {total:g}); return components that add up to the reward, or set algorithm.gdpo_weights")


def _check_vine(cfg) -> None:
    v = cfg.vine
    if v.k < 1 or (v.max_steps is not None and v.max_steps < 0):
        raise ConfigError("vine.k must be >= 1 and vine.max_steps >= 0 (or null)")
    if cfg.algorithm.kl == "reward":
        # The step rewards are [0, ..., 0, R] and V̂ has no KL: a sequence KL in R would all land
        # on the last step, wherever it was spent. The reference puts the KL in the loss only.
        raise ConfigError("algorithm.advantage=vine cannot take algorithm.kl=reward (its step rewards and Monte-Carlo "
                          "values carry no per-step KL): use algorithm.kl=loss, as the VinePPO reference does")
    if cfg.reward.model:
        raise ConfigError("algorithm.advantage=vine scores its Monte-Carlo continuations with the task's rule reward; "
                          "it cannot be combined with reward.model yet")


def _check_vine_task(task: str, env: str, delimiter: str) -> None:
    if env:
        raise ConfigError("algorithm.advantage=vine estimates values of single-turn responses, not of multi-turn episodes")
    if not delimiter:
        raise ConfigError(f"algorithm.advantage=vine splits responses into steps, and task '{task}' has no step "
                          "delimiter: set vine.delimiter (e.g. vine.delimiter='\\n')")


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(_group("mean"), compares_samples=True),
    "rloo": Estimator(_group("leave_one_out"), compares_samples=True),
    "gdpo": Estimator(_gdpo, compares_samples=True, check_groups=check_terms),
    "reinforce_pp": Estimator(_reinforce_pp("none")),
    "reinforce_pp_baseline": Estimator(_reinforce_pp("group_mean"), compares_samples=True),
    "gae": Estimator(_gae, values="critic"),
    "vine": Estimator(_vine, values="monte_carlo", check=_check_vine, check_task=_check_vine_task),
}


def shaped_rewards(groups, batch: RolloutBatch, *, term_weight: Callable[[str], float], overlong: str = "none",
                   max_len: int = 0, overlong_cache: int = 0, overlong_factor: float = 1.0,
                   kl_tok: torch.Tensor | None = None, kl_coef: float = 0.0) -> Rewards:
    """The step's rewards for the estimators (see ``Rewards``), from the episodes' task rewards.

    DAPO's overlong penalty compares an episode's response tokens (model and environment,
    what the token budget counts) with the episode's budget ``max_len``. With ``kl_tok``
    [N, L] the KL is in the reward: -beta * KL_t per token, -beta * sum_t KL_t per sequence,
    and a "kl" term for GDPO. Every term is one column of ``terms``, which GDPO normalizes
    within the group on its own and then weighs (the task's own weights, e.g. format_weight).
    """
    eps = [e for g in groups for e in g.episodes]
    dev = batch.input_ids.device
    seq = torch.tensor([e.reward for e in eps], dtype=torch.float32, device=dev)
    token = batch.token_rewards.clone()
    names = sorted({k for e in eps for k in e.terms})
    cols = [[e.terms.get(k, 0.0) for k in names] for e in eps]
    weights = [term_weight(k) for k in names]
    if overlong == "penalty":
        lengths = torch.tensor([len(e.response_ids) for e in eps], dtype=torch.float32, device=dev)
        pen = shaping.overlong_penalty(lengths, max_len=max_len, cache_len=overlong_cache, factor=overlong_factor)
        seq = seq + pen
        token[torch.arange(len(eps), device=dev), batch.last_token] += pen
        names, weights = names + ["overlong"], weights + [1.0]
        cols = [c + [p] for c, p in zip(cols, pen.tolist())]
    outcome, penalties = seq, None
    if kl_tok is not None:
        kl_tok = kl_tok * batch.response_mask
        penalties = -kl_coef * kl_tok
        kl_seq = kl_tok.sum(-1)  # [N]
        seq = seq - kl_coef * kl_seq  # the sequence-level form (RLOO, InstructGPT): R_i - beta * sum_t KL_t
        names, weights = names + ["kl"], weights + [-kl_coef]
        cols = [c + [k] for c, k in zip(cols, kl_seq.tolist())]
    return Rewards(seq=seq, token=token, terms=torch.tensor(cols, dtype=torch.float32, device=dev).reshape(len(eps), -1),
                   term_weights=torch.tensor(weights, dtype=torch.float32, device=dev), penalties=penalties, outcome=outcome)
