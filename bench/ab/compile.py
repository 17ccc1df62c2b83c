"""Section compile of ``bench/gpu_ab.py``: one SFT micro-step, eager vs each decoder layer compiled (P4).

The same micro-batches (rows shaped as ``bench/gpu_checks.py``'s SFT check: 8 rows of 256-2,048
tokens on the GPU, the first eighth prompt; another set of lengths each step, so a graph that
does not take a symbolic length recompiles and shows it) through relign's own path
(``sft._collate`` / ``sft._forward``, forward + backward), ``model.dtype=bf16-mixed``, in modes:

  eager       today's default: eager, lean activations on
  compiled    ``models.loading.compile_layers`` (inductor on CUDA, lean off), as ``model.compile=true``
  bf16        compiled, with ``model.dtype=bf16-compute`` (P7: bf16 compute weights, no autocast),
              when this relign has it

each on padded rows, then on packed rows (the SFT default; packed rows go through
``models.varlen``'s attention, whichever version is installed). Per mode: the first step's
seconds (the compile) apart from the steady median, tokens/s and MFU of the steady steps (relign's
own count, ``models.flops``, against the device's peak), the allocator's peak, graphs and graph
breaks, and max |Δ log p| against eager on the same first batch. ``auto_should_be_on`` says
whether compiled beat eager on both layouts: what ``models.loading.COMPILE_AUTO["cuda"]`` should say.
"""

from __future__ import annotations

import gc
import time

import torch

from . import common


PARTIAL: dict = {}
"""The results so far (``bench/gpu_ab.py`` keeps them if the section runs past its cap)."""


def _modes() -> list[tuple[str, bool]]:
    """(mode, packed) in the order they run, the most useful first."""
    from relign.models.loading import DTYPES

    out = [("eager", False), ("compiled", False), ("eager", True), ("compiled", True)]
    return out + ([("bf16", False)] if "bf16-compute" in DTYPES else [])


def _load(mode: str, path: str, device: str, packed: bool):
    from relign.models.loading import compile_layers, load_causal_lm
    from relign.models.varlen import packed_attention

    dtype = "bf16-compute" if mode == "bf16" else "bf16-mixed"
    model = load_causal_lm(path, dtype=dtype, device=device, lean_activations=mode == "eager")
    if packed:  # as sft.train does: packed rows through relign's varlen attention
        packed_attention(model, "sdpa")
    if mode != "eager":
        # inductor on the GPU; on a CPU (the suite's smoke run) dynamo alone, which checks the same
        # tracing in a second where inductor's C++ build would take minutes
        compile_layers(model, backend="inductor" if torch.device(device).type == "cuda" else "eager")
    return model


def _step(model, examples, packed: bool, device: str) -> torch.Tensor:
    from relign.recipes import sft

    mb = sft._collate(examples if packed else sorted(examples, key=len), packed, 0, device)
    logps = sft._forward(model, mb)
    mask = mb["loss_mask"]
    (-(logps * mask).sum() / mask.sum()).backward()
    model.zero_grad(set_to_none=True)
    return logps.detach().float()[mask.bool()]


def measure(mode: str, packed: bool, *, path: str, batches: list, device: str, peak: float | None) -> dict:
    from torch._dynamo.utils import counters

    from relign.models.flops import model_flops
    from relign.recipes import sft

    counters.clear()
    common.reset_peak(device)
    model = _load(mode, path, device, packed)
    shape = model_flops(model)
    first_logps: list[torch.Tensor] = []
    t_first = common.timed(lambda: first_logps.append(_step(model, batches[0], packed, device)), device)
    steady, flops, tokens = [], 0.0, 0.0
    for b in batches[1:]:
        steady.append(common.timed(lambda: _step(model, b, packed, device), device))
        flops += sft.train_flops(shape, b)
        tokens += sum(len(e) for e in b)
    seconds = sum(steady)
    out = {"mode": mode, "layout": "packed" if packed else "padded", "first_step_s": t_first,
           "steady_median_s": common.median(steady), "steady_steps": len(steady), "tokens_per_s": tokens / seconds,
           "mfu": flops / seconds / peak if peak else None, "peak_gib": common.peak_gib(device),
           "graphs": counters["stats"].get("unique_graphs", 0), "graph_breaks": sum(counters["graph_break"].values())}
    del model
    gc.collect()
    return out | {"_logps": first_logps[0]}


def run(smoke: bool, device: str, budget_s: float) -> dict:
    from relign.models.flops import peak_flops

    t0 = time.perf_counter()
    path, _ = common.model_dir(smoke)
    shape = common.shape(smoke)
    rows, max_len, steps = (2, 32, 2) if smoke else (8, 2048, 5)
    batches = [common.sft_examples(rows, max_len, shape["vocab_size"], seed=s) for s in range(steps)]
    peak = peak_flops(device)
    results: list[dict] = []
    skipped: list[str] = []
    PARTIAL.clear()
    PARTIAL.update(rows=rows, max_len=max_len, steps=steps, peak_flops=peak, results=results, skipped=skipped)
    eager_logps: dict[str, torch.Tensor] = {}
    for mode, packed in _modes():
        # the suite's smoke run leaves out compiled packed rows: while varlen's attention reads the
        # sequence bounds on the host, each layer breaks the graph and every new length recompiles
        # its pieces (10 s at the smoke shape, against 2 s padded); the GPU run measures them
        smoke_skip = smoke and packed and mode != "eager"
        # a mode not started with under a fifth of the budget left (a compile takes most of one)
        if smoke_skip or time.perf_counter() - t0 > 0.8 * budget_s:
            skipped.append(f"{mode}/{'packed' if packed else 'padded'}")
            continue
        r = measure(mode, packed, path=str(path), batches=batches, device=device, peak=peak)
        lp = r.pop("_logps")
        if mode == "eager":
            eager_logps[r["layout"]] = lp
        else:
            r["max_abs_diff_logp_vs_eager"] = float((lp - eager_logps[r["layout"]]).abs().max())
        results.append(r)
    by = {(r["mode"], r["layout"]): r for r in results}
    faster = [by[("compiled", lay)]["steady_median_s"] < by[("eager", lay)]["steady_median_s"]
              for lay in ("padded", "packed") if ("compiled", lay) in by and ("eager", lay) in by]
    return dict(PARTIAL, auto_should_be_on=bool(faster) and all(faster))
