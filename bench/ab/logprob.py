"""Section logprob of ``bench/gpu_ab.py`` (issue 45 item 2, spec P2): the LM head and the
log-probs of 16,384 tokens x 151,936 vocabulary (Qwen2.5-0.5B's head: hidden 896, tied fp32
weight under bf16-mixed), forward + backward, on the same inputs:

* ``old``: today's path before the change: the model's head (``F.linear`` under autocast -> bf16
  logits) and the chunked ``logsumexp`` of fp32 copies, which autograd keeps (copied here as it was);
* ``stage_a``: the same bf16 logits through ``fused_ce.LogSoftmaxGather`` (keeps the logits and an
  fp32 lse per token);
* ``stage_b``: ``fused_ce.LinearLogSoftmaxGather`` from the hidden states (no logits kept; the
  backward recomputes them), at chunks of 4,096 and 1,024 tokens;
* ``stage_b_weighted``: ``fused_ce.LinearWeightedSum``, SFT's loss (gradients in the forward);
* ``liger``: ``LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=fp32)`` where ``import liger_kernel``
  works (carried as a wheel in ``.whl/``);
* the RL update's call (temperature 0.7, the entropy differentiated): old, stage a, stage b;
* ``stage_a_compiled`` / ``stage_b_compiled``: the chunk arithmetic (``fused_ce.chunk_stats``,
  ``chunk_grad``) under ``torch.compile``, if the budget leaves room (compile seconds apart).

Each: median ms of 3 timed passes after one warm-up, the CUDA allocator's peak above what the
inputs hold (GiB), and max |diff| of log p (or the loss), dL/dh and dL/dW against ``old``. The loss
is sum_t g_t log p_t (+ sum_t e_t H_t) with fixed random g, e (SFT's -1/T for the weighted sum).
``smoke=True`` runs every variant but Liger and the compiled ones at 64 tokens x 512 on the CPU.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from bench import gpu_checks
from relign.models import fused_ce


def _old_logps(logits: torch.Tensor, index: torch.Tensor, chunk: int, temperature: float) -> torch.Tensor:
    """``selective_log_softmax`` as it was (58c3ee1): fp32 copies per chunk, kept by ``logsumexp``."""
    out = []
    for s in range(0, index.numel(), chunk):
        c = logits[s : s + chunk].float()
        if temperature != 1.0:
            c = c / temperature
        out.append(c.gather(-1, index[s : s + chunk, None]).squeeze(-1) - torch.logsumexp(c, dim=-1))
    return torch.cat(out)


def _old_entropy(logits: torch.Tensor, chunk: int, temperature: float) -> torch.Tensor:
    out = []
    for s in range(0, logits.shape[0], chunk):
        c = logits[s : s + chunk].float()
        if temperature != 1.0:
            c = c / temperature
        out.append(torch.logsumexp(c, dim=-1) - (torch.softmax(c, dim=-1) * c).sum(-1))
    return torch.cat(out)


def _head(h, w, device):
    """The model's own LM head under bf16-mixed: autocast casts h and the fp32 weight to bf16."""
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        return F.linear(h, w)


def _variants(rl: bool, temperature: float):
    """name -> fn(h, w, index, g, e) returning (value to compare, loss)."""
    bf16 = torch.bfloat16
    ent = rl

    def old(h, w, idx, g, e, dev):
        logits = _head(h, w, dev)
        lp = _old_logps(logits, idx, 4096, temperature)
        loss = (lp * g).sum() + ((_old_entropy(logits, 4096, temperature) * e).sum() if ent else 0)
        return lp, loss

    def stage_a(h, w, idx, g, e, dev):
        lp, en = fused_ce.log_softmax_gather(_head(h, w, dev), idx, temperature=temperature, with_entropy=ent,
                                             entropy_grad=ent)
        return lp, (lp * g).sum() + ((en * e).sum() if ent else 0)

    def stage_b(chunk):
        def f(h, w, idx, g, e, dev):
            lp, en = fused_ce.linear_log_softmax_gather(h, w, idx, dtype=bf16, temperature=temperature,
                                                        chunk_tokens=chunk, with_entropy=ent, entropy_grad=ent)
            return lp, (lp * g).sum() + ((en * e).sum() if ent else 0)
        return f

    out = {"old": old, "stage_a": stage_a, "stage_b": stage_b(4096)}
    if not rl:
        out["stage_b_chunk1024"] = stage_b(1024)

        def weighted(h, w, idx, g, e, dev):
            s, lp = fused_ce.linear_weighted_sum(h, w, idx, g, dtype=bf16)
            return lp, s
        out["stage_b_weighted"] = weighted
    return out


def _liger():
    try:
        import liger_kernel
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError as e:
        return None, f"absent ({e})"
    import importlib.metadata

    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(liger_kernel, "__version__", "unknown")
    # gradients summed in fp32, as fused_ce sums its chunks' products
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=torch.float32)

    def liger(h, w, idx, g, e, dev):  # CE summed = -sum log p: the SFT loss with g = -1 (scaled below)
        loss = loss_fn(w.to(torch.bfloat16), h.to(torch.bfloat16), idx) * (-g[0])
        return None, loss
    return liger, version


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _measure(fn, inputs, device, reps, ref=None):
    h, w, idx, g, e = inputs
    cuda = torch.device(device).type == "cuda"
    times, lp, peak = [], None, None
    for k in range(1 + reps):
        h.grad = w.grad = None
        if cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        _sync(device)
        t = time.perf_counter()
        lp, loss = fn(h, w, idx, g, e, device)
        loss.backward()
        _sync(device)
        if k:
            times.append(time.perf_counter() - t)
        if cuda and k == 1:
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    res = {"ms": 1e3 * statistics.median(times), "peak_gib": peak,
           "loss": float(loss.detach()), "lp": lp.detach() if lp is not None else None,
           "dh": h.grad.detach().clone(), "dw": w.grad.detach().clone()}
    if ref is not None:
        res["max_abs_diff"] = {
            "logp": float((res["lp"] - ref["lp"]).abs().max()) if res["lp"] is not None else None,
            "loss": abs(res["loss"] - ref["loss"]),
            "dh": float((res["dh"] - ref["dh"]).abs().max()), "dw": float((res["dw"] - ref["dw"]).abs().max()),
            "dh_ref_max": float(ref["dh"].abs().max()), "dw_ref_max": float(ref["dw"].abs().max()),
        }
    return res


def _public(res):
    return {k: v for k, v in res.items() if k not in ("lp", "dh", "dw")}


def _compiled():
    """Swap the chunk arithmetic for compiled versions; returns the undo."""
    eager = fused_ce.chunk_stats, fused_ce.chunk_grad
    fused_ce.chunk_stats = torch.compile(eager[0], dynamic=False)
    fused_ce.chunk_grad = torch.compile(eager[1], dynamic=False)

    def undo():
        fused_ce.chunk_stats, fused_ce.chunk_grad = eager
    return undo


def run(smoke: bool, device: str, budget_s: float) -> dict:
    t_start = time.perf_counter()
    shape = gpu_checks.SMOKE if smoke else gpu_checks.QWEN05
    T, V, d = (64, 512, 32) if smoke else (16384, shape["vocab_size"], shape["hidden_size"])
    reps = 1 if smoke else 3
    gen = torch.Generator(device=device).manual_seed(0)
    # the final norm's output is fp32 under autocast; the tied embedding's fp32 master weight, at
    # Qwen's init scale (std 0.02) with unit-scale hidden states: logits of std ~0.6
    h = torch.randn(T, d, device=device, generator=gen).requires_grad_(True)
    w = (0.02 * torch.randn(V, d, device=device, generator=gen)).requires_grad_(True)
    idx = torch.randint(0, V, (T,), device=device, generator=gen)
    e = torch.randn(T, device=device, generator=gen) / T
    out: dict = {"tokens": T, "vocab": V, "hidden": d, "device": device, "reps": reps, "sft": {}, "rl": {}}

    def left():
        return budget_s - (time.perf_counter() - t_start)

    upstream = {"sft": torch.full((T,), -1.0 / T, device=device),  # dL/dlog p of SFT's token-mean
                "rl": -torch.rand(T, device=device, generator=gen) / T}
    for part, rl in (("sft", False), ("rl", True)):
        g = upstream[part]
        inputs = (h, w, idx, g, e)
        variants = _variants(rl, 0.7 if rl else 1.0)
        if not rl and not smoke:
            liger, version = _liger()
            out["liger_kernel"] = version
            if liger is not None:
                variants["liger"] = liger
        ref = None
        for name, fn in variants.items():
            if left() < 5:
                out[part][name] = {"skipped": "budget"}
                continue
            if name == "liger":  # a third-party kernel on this device: its failure is a result, not the section's end
                try:
                    out[part][name] = _public(_measure(fn, inputs, device, reps, ref))
                except Exception as err:  # noqa: BLE001
                    out[part][name] = {"error": repr(err)[:500]}
                continue
            res = _measure(fn, inputs, device, reps, ref)
            ref = ref or res
            out[part][name] = _public(res)
        if not smoke and left() > 30:  # the chunk arithmetic compiled (inductor): the first pass compiles
            undo = _compiled()
            try:
                for name in ("stage_a", "stage_b"):
                    if left() < 20:
                        out[part][f"{name}_compiled"] = {"skipped": "budget"}
                        continue
                    t0 = time.perf_counter()
                    res = _measure(variants[name], inputs, device, reps, ref)
                    out[part][f"{name}_compiled"] = {**_public(res), "first_call_and_timed_s": time.perf_counter() - t0}
            finally:
                undo()
        del ref
    out["seconds"] = time.perf_counter() - t_start
    return out
