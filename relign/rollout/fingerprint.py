"""A fingerprint of a model's weights: what the sync check compares between an engine and the trainer.

Why the weights and not only log-probs: one update at the learning rates RL uses (1e-6 to 1e-4)
moves the probe's log-probs by about as much as a bf16 engine's kernels blur them, so no
log-prob tolerance separates a skipped sync from rounding. The weights themselves carry no
such noise. After the engine's own cast, a synced engine holds exactly the numbers the
trainer's weights round to, and float64 sums of them agree to float64 rounding (measured 0 to
3e-16 relative, vLLM against the trainer); one AdamW step the engine missed moves them by far
more (at lr 1e-6, each group's sum by >= 2e-8 of its sum of |x| in fp32; in bf16 by 3e-7, as a
share of the weights crosses to the next bf16 value).

The fingerprint, per group (each decoder layer; the output head; everything else): float64
count, sum, sum of |x| and sum of squares over a fixed slice of every parameter, the first
``COLUMNS`` input columns of a matrix ([out, in], the layout of ``nn.Linear`` and
``nn.Embedding``; the last dimension of any tensor of 2 or more) and all of a vector. These
statistics do not depend on the order of the elements, so an engine that fuses q, k and v
into one matrix, or keeps a matrix packed in its kernel's layout (vLLM), has the fingerprint of
the trainer's separate tensors. The head is its own group also when it is tied to the input
embedding (then that tensor counts in both): vLLM multiplies by its own packed copy of a tied
head, which a sync can leave stale while the embedding is fresh.

What it cannot see: a change confined to the columns past the slice, and a tensor moved to
another place within its group (q's weights loaded into k). The sync check's probe
(``sync_check.py``) scores what the engine computes for those.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

COLUMNS = 32
"""Input columns of each matrix in the fingerprint: every weight of them, for a cost of a forward of 32
tokens where the engine's kernels must be asked (vLLM on CPU)."""

RTOL = 1e-12
"""Two fingerprints of the same numbers, summed in different orders, differ by float64 rounding:
~log2(n) x 1.1e-16 of a group's sum of |x| (2e-15 for a layer of a 7B model). One weight of the
tests' micro model moved by one float32 step (0.07 -> its next float) is 2e-11 of its layer's."""

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|decoder_layers)\.(\d+)\.")

STATS = ("count", "sum", "sum |x|", "sum x^2")
HEAD, OTHER = "output head", "other weights"
"""The groups besides the decoder layers: the output head's weight, and the rest (embeddings, final norm, biases
of a head)."""


@dataclass
class Fingerprint:
    """An engine's fingerprint: ``groups`` -> (count, sum, sum |x|, sum x^2), and the dtype it holds its weights in."""

    groups: dict[str, tuple[float, float, float, float]]
    dtype: torch.dtype | None = None
    """The trainer's weights are cast to this before their statistics, as the engine cast what it was sent
    (None: as they are; the HF engine holds a replica in the policy's own dtypes)."""


def group_of(name: str) -> str:
    """'decoder layer 3' for a parameter of decoder layer 3 (under any prefix: vLLM's and a peft model's names
    too), else 'other weights'."""
    m = _LAYER.search(name)
    return f"decoder layer {m.group(1)}" if m else OTHER


def weight_slice(t: torch.Tensor) -> torch.Tensor:
    """The part of a parameter the fingerprint reads: the first COLUMNS of its last dimension (a matrix's input columns)."""
    return t[..., :COLUMNS] if t.dim() >= 2 else t


def tensor_stats(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[4] float64: count, sum, sum |x|, sum x^2 of ``t``'s slice, after casting it to ``dtype``."""
    x = weight_slice(t.detach())
    if dtype is not None:
        x = x.to(dtype)
    x = x.double()
    return torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device), x.sum(), x.abs().sum(),
                        (x * x).sum()]).cpu()


def add(groups: dict[str, torch.Tensor], name: str, stats: torch.Tensor) -> None:
    """Accumulate ``stats`` into the group of the parameter ``name``."""
    add_to(groups, group_of(name), stats)


def fingerprint(named: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None = None, head: str | None = None,
                tied: bool = False) -> dict[str, tuple[float, float, float, float]]:
    """The fingerprint of ``(name, tensor)`` pairs. ``head``: the name of the output head's weight, which is
    its own group (HEAD); ``tied``: that name is the input embedding's too, which then also counts in its group."""
    groups: dict[str, torch.Tensor] = {}
    for name, t in named:
        s = tensor_stats(t, dtype)
        if name == head:
            add_to(groups, HEAD, s)
            if not tied:
                continue
        add(groups, name, s)
    return finish(groups)


def add_to(groups: dict[str, torch.Tensor], group: str, stats: torch.Tensor) -> None:
    groups[group] = groups[group] + stats if group in groups else stats


def finish(groups: dict[str, torch.Tensor]) -> dict[str, tuple[float, float, float, float]]:
    return {g: tuple(float(v) for v in s.tolist()) for g, s in groups.items()}


def output_head(model: torch.nn.Module, *, checkpoint_names: bool = False) -> tuple[str | None, bool]:
    """(the name of ``model``'s output head weight, whether it is the input embedding's tensor); (None, False)
    without a head. ``checkpoint_names``: under the base model's names (a peft model's wrapped LM), as
    ``checkpoint_weights`` yields them."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_out = getattr(base, "get_output_embeddings", None)
    out = get_out() if get_out is not None else None
    weight = getattr(out, "weight", None)
    if weight is None:
        return None, False
    inp = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    owner = base if checkpoint_names else model
    # named_parameters lists a tied tensor once, under its first name (the embedding's)
    name = next((n for n, p in owner.named_parameters() if p is weight), None)
    return name, inp is not None and getattr(inp, "weight", None) is weight


def differing(engine: dict, trainer: dict, rtol: float = RTOL) -> list[str]:
    """The groups whose statistics differ by more than float64 rounding, or that only one side has, in the
    trainer's order. An engine without a HEAD group computes its logits with the input embedding (which
    OTHER compares)."""
    out = []
    for g in [*trainer, *(g for g in engine if g not in trainer)]:
        e, t = engine.get(g), trainer.get(g)
        if g == HEAD and e is None:
            continue
        if e is None or t is None or e[0] != t[0]:
            out.append(g)
            continue
        scale = max(abs(e[2]), abs(t[2]))  # sum |x|: the size of the sums' rounding
        sq = max(abs(e[3]), abs(t[3]))
        if abs(e[1] - t[1]) > rtol * scale or abs(e[2] - t[2]) > rtol * scale or abs(e[3] - t[3]) > rtol * sq:
            out.append(g)
    return out


def describe(groups: list[str], engine: dict, trainer: dict) -> str:
    """'decoder layer 0, decoder layer 1, decoder layer 2 and 2 more (decoder layer 0: sum x^2 4.1234567 in the
    engine, 4.1234612 in the trainer)'."""
    first = groups[0]
    e, t = engine.get(first), trainer.get(first)
    names = ", ".join(groups[:3]) + (f" and {len(groups) - 3} more" if len(groups) > 3 else "")
    if e is None or t is None:
        detail = f"{first}: {'not in the engine' if e is None else 'not in the trainer'}"
    elif e[0] != t[0]:
        detail = f"{first}: {e[0]:.0f} numbers in the engine, {t[0]:.0f} in the trainer"
    else:  # the statistic that moved the most, relative to its size
        i = max((1, 2, 3), key=lambda i: abs(e[i] - t[i]) / max(abs(e[i]), abs(t[i]), 1e-300))
        detail = f"{first}: {STATS[i]} {e[i]:.12g} in the engine, {t[i]:.12g} in the trainer"
    return f"{names} ({detail})"
