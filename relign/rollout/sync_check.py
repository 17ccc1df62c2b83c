"""After every weight sync: does the engine sample from the weights the trainer holds?

The field's most common silent failure is an engine that samples from other weights than the
trainer's: a LoRA adapter never merged, a layer whose name did not match, a skipped
``load_weights``, a dtype cast gone wrong. The rollout's own log-prob mismatch does not catch
it until the next step, and then only as a drift. So after each sync the engine and the
trainer score the same fixed probe sequences (a few of the task's prompts), and the mean
absolute gap of their log-probs must stay under ``rollout.sync_check_tol``; else the run stops
with one line naming the engine, the step and the gap.

An engine that holds the trainer's own tensors (the HF engine in one process without overlap)
has nothing to check: nothing was copied. An engine without ``score_tokens`` (optional in the
``Engine`` protocol) cannot be checked and is not.
"""

from __future__ import annotations

import torch

from .. import distributed
from ..errors import ConfigError
from ..models.logprobs import right_pad, token_logps


class SyncMismatch(ConfigError):
    """The engine's weights are not the trainer's (a ConfigError: the run stops with one line)."""


def can_check(engine, policy: torch.nn.Module) -> bool:
    """Whether the sync check applies: the engine holds weights of its own and can score tokens."""
    return hasattr(engine, "score_tokens") and not engine_shares_policy(engine, policy)


def engine_shares_policy(engine, policy: torch.nn.Module) -> bool:
    """Whether ``engine`` samples from ``policy``'s own parameter tensors (then a sync copies nothing)."""
    model = getattr(engine, "model", None)
    if model is None:
        return False
    engine_ptrs = {p.data_ptr() for p in model.parameters()}
    return all(p.data_ptr() in engine_ptrs for p in policy.parameters())


def probe_sequences(prompts: list[list[int]], count: int = 2, max_tokens: int = 64) -> list[list[int]]:
    """The probe: the first ``count`` prompts with at least two tokens, cut to ``max_tokens``."""
    return [list(p[:max_tokens]) for p in prompts if len(p) >= 2][:count]


def trainer_logps(policy: torch.nn.Module, sequences: list[list[int]], pad_id: int) -> list[list[float]]:
    """The trainer's log p(x_t | x_<t) of the probe (every rank runs it: the FSDP forward is a collective)."""
    device = next(policy.parameters()).device
    ids, mask = right_pad(sequences, pad_id, device)
    with torch.no_grad():
        logps, _ = token_logps(policy, ids, attention_mask=mask)
    distributed.reshard(policy)  # a forward with no backward: the next training forward must gather afresh
    return [logps[i, 1 : len(seq)].float().tolist() for i, seq in enumerate(sequences)]


def gap(engine_logps: list[list[float]], trainer: list[list[float]]) -> float:
    """Mean |engine - trainer| over every probe token."""
    diffs = [abs(a - b) for e, t in zip(engine_logps, trainer) for a, b in zip(e, t)]
    return sum(diffs) / max(1, len(diffs))


def check_sync(engine, policy: torch.nn.Module, sequences: list[list[int]], *, pad_id: int, tol: float, step: int
               ) -> float:
    """The probe's mean |log-prob gap| (the largest over ranks); ``SyncMismatch`` above ``tol``."""
    was_training = policy.training
    policy.eval()
    try:
        mine = gap(engine.score_tokens(sequences), trainer_logps(policy, sequences, pad_id))
    finally:
        policy.train(was_training)
    worst = float(distributed.all_reduce_max(torch.tensor([mine], dtype=torch.float64)).item())
    if worst > tol:
        raise SyncMismatch(f"the {type(engine).__name__} engine does not hold the trainer's weights after the sync of "
                           f"step {step}: mean |log-prob gap| on the probe {worst:.3g} > rollout.sync_check_tol={tol:g} "
                           "(a LoRA adapter or a layer that never reached the engine?)")
    return worst
