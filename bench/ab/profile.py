"""Section profile of ``bench/gpu_ab.py``: where the device time of padded SFT goes, by kind of kernel.

``torch.profiler`` over 2 padded SFT micro-steps (forward, log-probs, backward; ``model.dtype=bf16-mixed``,
SDPA, relign's default model path: lean activations, eager) of rows shaped as ``bench/gpu_checks.py``'s
SFT check, after one untimed step. Kernel time is grouped by name (``KINDS``, first match wins); idle is
the wall time of the profiled steps minus the kernels' busy time, so a host-bound pass shows as idle.
This checks §1 of ``specs/gpu_speed.md`` (≈20 µs of kernels per token, 40-50 kernels per layer) before
the bigger work. On a CPU the same grouping runs over the CPU ops (there are no kernels), to keep the
code path alive in the suite.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

import torch

from . import common

# first match wins: attention before GEMM (fmha_cutlass*), copies (casts too) before elementwise
KINDS = [
    ("attention", r"flash|fmha|attention|sdpa"),
    ("gemm", r"gemm|cutlass|xmma|cublas|nvjet|addmm|\bmm\b|bmm|matmul|linear"),
    ("triton", r"triton"),
    ("copy", r"copy|memcpy|memset|\bcat\b|catarray|contiguous|index|gather|scatter|fill"),
    ("reduction", r"reduce|softmax|logsumexp|norm|\bsum\b|mean"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|mul|add|silu|neg|exp|rsqrt|pow|cos|sin|where"),
]


def kind_of(name: str) -> str:
    n = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, n)), "other")


def sft_step(model, examples, device: str) -> float:
    """One padded SFT micro-step as ``relign sft packing=false`` runs it; returns its tokens."""
    from relign.recipes import sft

    mb = sft._collate(sorted(examples, key=len), False, 0, device)
    logps = sft._forward(model, mb)
    mask = mb["loss_mask"]
    (-(logps * mask).sum() / mask.sum()).backward()
    return float(sum(len(e) for e in examples))


def run(smoke: bool, device: str, budget_s: float) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from relign.models.loading import load_causal_lm

    path, n_params = common.model_dir(smoke)
    shape = common.shape(smoke)
    rows, max_len = (2, 32) if smoke else (8, 2048)
    model = load_causal_lm(str(path), dtype="bf16-mixed", device=device)
    batches = [common.sft_examples(rows, max_len, shape["vocab_size"], seed=s) for s in range(3)]
    sft_step(model, batches[0], device)  # warm-up: allocator, cuBLAS handles, autotuning
    model.zero_grad(set_to_none=True)
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    common.sync(device)
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        tokens = sum(sft_step(model, b, device) for b in batches[1:])
        common.sync(device)
    wall = time.perf_counter() - t
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    count = 0
    for e in prof.events():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.device_time  # a kernel's own time
        else:
            if not e.name.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        by_kind[kind_of(e.name)] += us / 1e6
        by_name[e.name] += us / 1e6
        count += 1
    busy = sum(by_kind.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {
        "rows": rows, "max_len": max_len, "tokens": tokens, "parameters": n_params, "steps": len(batches) - 1,
        "wall_s": wall, "busy_s": busy, "idle_s": max(0.0, wall - busy), "us_per_token_busy": busy / tokens * 1e6,
        "events": count, "events_per_step_per_layer": count / (len(batches) - 1) / shape["num_hidden_layers"],
        "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "share": {k: v / busy for k, v in by_kind.items()} if busy else {},
        "top": [{"name": n[:120], "s": s} for n, s in top],
        "what": "kernels (CUDA) or aten ops' self time (CPU)",
    }
