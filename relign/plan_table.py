"""A memory plan as text: the table ``relign plan`` and ``--dry-run`` print (GiB per rank, one column
per stage), the fits its searches found, and the one-line refusal ``frame.open`` stops with."""

from __future__ import annotations

import math

from .devices import GiB
from .plan import Plan


def count(n: int) -> str:
    """494,032,768 -> 494M, 1,084,032 -> 1.08M (three significant digits)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def gib(n: float) -> str:
    """Bytes as GiB: 0.37 GiB, 12.4 GiB, 141 GiB."""
    v = n / GiB
    return f"{v:.2f} GiB" if v < 10 else f"{v:.1f} GiB" if v < 100 else f"{v:.0f} GiB"


def _cell(n: int) -> str:
    if not n:
        return "-"
    v = n / GiB
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def format_plan(plan: Plan) -> str:
    """The plan as a table, GiB per rank: one row per term, one column per stage, the peak, what fits
    and the arithmetic step time."""
    dev = plan.device
    head = f"relign plan {plan.recipe} on {dev.name}: {gib(dev.available)} available"
    if dev.tflops:
        head += f", bf16 {dev.tflops:g} TFLOP/s, {dev.tbs:g} TB/s"
    lines = [head] + [f"  {f}" for f in plan.facts] + [""]
    terms: list[str] = []
    for st in plan.stages:
        terms += [t for t, v in st.terms.items() if t not in terms and v]
    width = max(len(t) for t in [*terms, "total"]) + 2
    cols = [max(9, len(st.name) + 1) for st in plan.stages]
    lines.append(f"{'GiB per rank':<{width}}" + "".join(f"{st.name:>{w}}" for st, w in zip(plan.stages, cols)))
    for t in terms:
        lines.append(f"{t:<{width}}" + "".join(f"{_cell(st.terms.get(t, 0)):>{w}}" for st, w in zip(plan.stages, cols)))
    lines.append(f"{'total':<{width}}" + "".join(f"{_cell(st.total):>{w}}" for st, w in zip(plan.stages, cols)))
    peak = plan.peak
    share = plan.need / dev.available if dev.available else math.inf
    ranks = f" x {plan.ranks} ranks on this machine = {gib(plan.need)}" if plan.ranks > 1 else ""
    lines += ["", f"peak: {gib(peak.total)} in {peak.name}{ranks}, {share:.0%} of {gib(dev.available)}: "
                  + ("fits" if plan.fits_device else f"does not fit: {change(plan)}")]
    lines += [f"fits: {f}" for f in plan.fits]
    timed = [st for st in plan.stages if st.seconds is not None]
    if timed:
        lines.append("step time (arithmetic bound at the device's peak): " + ", ".join(
            f"{st.name} {format_seconds(st.seconds)}" for st in timed) + f"; total {format_seconds(sum(st.seconds for st in timed))}")
    return "\n".join(lines)


def format_seconds(s: float) -> str:
    """0.42 ms, 12.3 ms, 1.25 s (three significant digits)."""
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


STATES = ("weights", "gradients", "AdamW state", "reference", "critic")
"""The terms no micro-batch size changes."""


def change(plan: Plan) -> str:
    """What to change when the plan does not fit: the key that sizes the peak stage, with the largest value
    that fits (the stage's own key first; e.g. micro_batch_size splits the RL groups a token budget
    cannot), or, when the model's states alone do not fit, fewer trainable weights or more ranks."""
    peak, dev = plan.peak, plan.device
    found = sorted((f for f in plan.fits if peak.name in f.stages and f.value), key=lambda f: f.key != peak.key)
    states = sum(v for k, v in peak.terms.items() if k in STATES) * plan.ranks
    if found:
        f = found[0]
        return f"lower {f.key} to {f.value:,} or less ({f.now_text})"
    if states > dev.available:
        return (f"its weights, gradients and AdamW state alone take {gib(states)}: train fewer weights "
                "(model.lora.enabled=true) or shard them over more GPUs (torchrun: FSDP)")
    return f"lower {peak.key}"


def refusal(plan: Plan) -> str | None:
    """One line when the plan does not fit its device (else None): the stage, the predicted and
    available bytes, and the key to change (``change``)."""
    if plan.fits_device:
        return None
    peak, dev = plan.peak, plan.device
    ranks = f" x {plan.ranks} ranks on this machine" if plan.ranks > 1 else ""
    return (f"plan: the {peak.name} stage needs {gib(peak.total)} per rank{ranks}, more than the {gib(dev.available)} "
            f"available on {dev.name}; {change(plan)}, or set plan.check=false to start anyway")
