"""After every weight sync: does the engine sample from the weights the trainer holds?

The field's most common silent failure is an engine that samples from other weights than the
trainer's: a LoRA adapter never merged, a layer whose name did not match, a skipped
``load_weights``, a dtype cast gone wrong. The rollout's own log-prob mismatch does not catch
it until the next step, and then only as a drift. So after each sync two checks run, and
either stops the run with one line naming the engine and the step (``SyncMismatch``):

1. **The weight fingerprint** (``fingerprint.py``): sums over a fixed slice of every weight,
   after the engine's own cast, taken from what the engine computes with and from the
   trainer's weights. They must agree to float64 rounding. Kernels add no noise to this, so
   it sees one missed update at any learning rate and in any dtype (at lr 1e-6 in bf16 too).
2. **The probe**: engine and trainer score the same fixed sequences (a few of the task's
   prompts); the mean absolute gap of their log-probs must stay under
   ``rollout.sync_check_tol``. It sees what the fingerprint cannot (right numbers in the wrong
   place, a kernel or a config that computes something else) when the gap is that large, and
   cannot see a missed update: an engine that kept step 1's weights at lr 1e-4 drifted from the
   trainer by 0.009 nats after one step and 0.04 after seven, within the room a bf16 engine's
   kernel noise needs.

An engine that holds the trainer's own tensors (the HF engine in one process without overlap)
has nothing to check: nothing was copied. An engine whose ``weight_fingerprint`` is None
(``Engine``'s default) gets the probe only; one whose ``score_tokens`` is None (the default too)
the fingerprint only.
"""

from __future__ import annotations

import torch

from .. import distributed
from ..errors import SyncMismatch
from ..models.logprobs import right_pad, token_logps
from .fingerprint import describe, differing, fingerprint, output_head
from .weights import checkpoint_weights

__all__ = ["SyncMismatch", "can_check", "check_sync", "probe_sequences", "trainer_fingerprint"]


def can_check(engine, policy: torch.nn.Module) -> bool:
    """Whether the sync check applies: the engine holds weights of its own."""
    return not engine.shares_policy(policy)


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


def trainer_fingerprint(policy: torch.nn.Module, weight_format: str, dtype: torch.dtype | None) -> dict:
    """The fingerprint of the weights the engine should hold, from the trainer's own parameters (not from
    the stream the sync sent: a sync that leaves tensors out must not also leave them out here). Every
    rank runs it: each full tensor is gathered from the FSDP shards."""
    if weight_format == "checkpoint":  # every parameter under its checkpoint name, LoRA merged
        head, tied = output_head(policy, checkpoint_names=True)
        transposed = _conv1d_weights(policy)
        named = ((n, t.T if n in transposed else t) for n, t in checkpoint_weights(policy))
    else:  # the HF engine's replica: every parameter under the trainer's own names
        head, tied = output_head(policy)
        named = ((n, distributed.full_tensor(p.detach())) for n, p in policy.named_parameters())
    return fingerprint(named, dtype=dtype, head=head, tied=tied)


def _conv1d_weights(model: torch.nn.Module) -> set[str]:
    """Checkpoint names of GPT-2-style Conv1D weights, stored [in, out]: an engine that loads them into a
    Linear holds their transpose (vLLM does)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {f"{name}.weight" for name, m in base.named_modules()
            if type(getattr(m, "base_layer", m)).__name__ == "Conv1D"}


def check_sync(engine, policy: torch.nn.Module, sequences: list[list[int]], *, pad_id: int, tol: float, step: int
               ) -> float:
    """The weight fingerprint, then the probe's mean |log-prob gap| (the largest over ranks, returned);
    ``SyncMismatch`` when the fingerprints differ on any rank or the gap exceeds ``tol``."""
    name = type(engine).__name__
    mismatch = ""
    fp = engine.weight_fingerprint()
    if fp is not None:
        mine = trainer_fingerprint(policy, engine.weight_format, fp.dtype)
        groups = differing(fp.groups, mine)
        if groups:
            mismatch = describe(groups, fp.groups, mine)
    mine_gap = 0.0
    scored = engine.score_tokens(sequences) if sequences else None
    if scored is not None:
        was_training = policy.training
        policy.eval()
        try:
            mine_gap = gap(scored, trainer_logps(policy, sequences, pad_id))
        finally:
            policy.train(was_training)
    worst = distributed.all_reduce_max(torch.tensor([float(bool(mismatch)), mine_gap], dtype=torch.float64))
    bad, worst_gap = bool(worst[0].item()), float(worst[1].item())
    head = f"the {name} engine does not hold the trainer's weights after the sync of step {step}"
    if bad:
        where = f"the weight fingerprints differ in {mismatch}" if mismatch else "on another rank, the weight fingerprints differ"
        raise SyncMismatch(f"{head}: {where}; a skipped load_weights, a layer that never reached the engine, a LoRA "
                           "adapter left out or a wrong cast?")
    if worst_gap > tol:
        why = ("a LoRA adapter or a layer that never reached the engine?" if fp is None else
               "the weight fingerprints agree: a weight in the wrong place, or a kernel or model config that differs?")
        raise SyncMismatch(f"{head}: mean |log-prob gap| on the probe {worst_gap:.3g} > rollout.sync_check_tol={tol:g} "
                           f"({why})")
    return worst_gap
