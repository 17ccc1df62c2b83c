"""Section env of ``bench/gpu_ab.py``: what the device has, and the two behaviours of torch's
varlen attention that P1 (``specs/gpu_speed.md``) relies on and only a GPU can show.

* versions: Python, torch (+ CUDA, cuDNN), transformers, peft, Triton, the driver, the device;
* ``varlen_attn``'s signature (2.10 documents ``window_size``; 2.12 adds ``enable_gqa``: 2.11 is
  not documented), and whether it takes Hkv = 2 key-value heads for Hq = 14 query heads as they
  are (no repeat), against an fp32 reference with repeated heads;
* its causal alignment when a sequence has fewer queries than keys (a continuation of a prompt):
  bottom-right (query i sees keys up to k - q + i: the whole prefix, then its own keys causally)
  or top-left (up to i), whichever the output matches;
* Triton importable, and ``torch.compile`` (inductor on CUDA) of a small function, timed.

Only the reference arithmetic runs on a CPU (``varlen_attn`` is CUDA's flash kernel).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import platform
import time

import torch
import torch.nn.functional as F

from bench import gpu_checks


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(device: str) -> dict:
    cuda = torch.device(device).type == "cuda"
    return {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        **{pkg: _version(pkg) for pkg in ("transformers", "peft", "triton", "omegaconf", "liger-kernel", "flash-attn")},
        "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
        "triton_importable": importlib.util.find_spec("triton") is not None,
        "driver": gpu_checks.driver_version() if cuda else None,
    }


def reference(q, k, v, lens_q: list[int], lens_k: list[int], *, bottom_right: bool) -> torch.Tensor:
    """Causal attention per sequence in fp32, key-value heads repeated: q [Tq, Hq, D], k/v [Tk, Hkv, D]
    -> [Tq, Hq, D]. Query i of a sequence with q queries and k keys sees keys up to i + (k - q)
    when ``bottom_right``, else up to i."""
    rep = q.shape[1] // k.shape[1]
    out, a, b = [], 0, 0
    for nq, nk in zip(lens_q, lens_k):
        qi = q[a:a + nq].float().transpose(0, 1)                                       # [H, nq, D]
        ki = k[b:b + nk].float().repeat_interleave(rep, dim=1).transpose(0, 1)          # [H, nk, D]
        vi = v[b:b + nk].float().repeat_interleave(rep, dim=1).transpose(0, 1)
        shift = nk - nq if bottom_right else 0
        mask = torch.arange(nk, device=q.device)[None, :] <= torch.arange(nq, device=q.device)[:, None] + shift
        out.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask).transpose(0, 1))
        a, b = a + nq, b + nk
    return torch.cat(out)


def _varlen_call(fn, q, k, v, lens_q, lens_k) -> torch.Tensor:
    """``varlen_attn`` causal, with whichever keywords this torch's signature has."""
    params = inspect.signature(fn).parameters
    def cu(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)

    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params and q.shape[1] != k.shape[1]:
        kw["enable_gqa"] = True
    return fn(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), **kw)


def varlen_checks(device: str, smoke: bool) -> dict:
    """GQA as given and the causal alignment of q < k, against the fp32 references."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        return {"available": False, "why": str(e)}
    out: dict = {"available": True, "signature": str(inspect.signature(varlen_attn))}
    g = torch.Generator(device="cpu").manual_seed(0)
    Hq, Hkv, D = (4, 2, 16) if smoke else (14, 2, 64)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32

    def qkv(tq: int, tk: int):
        make = lambda t, h: torch.randn(t, h, D, generator=g).to(device=device, dtype=dtype)  # noqa: E731
        return make(tq, Hq), make(tk, Hkv), make(tk, Hkv)

    # 1. packed rows (queries = keys), Hkv = 2 as given
    lens = [5, 9, 3] if smoke else [256, 1024, 768]
    q, k, v = qkv(sum(lens), sum(lens))
    want = reference(q, k, v, lens, lens, bottom_right=False)
    # 2. continuations: fewer queries than keys (a response after its prompt's keys)
    lq, lk = ([2, 4], [6, 7]) if smoke else ([128, 300], [640, 700])
    cq, ck, cv = qkv(sum(lq), sum(lk))
    bottom, top = (reference(cq, ck, cv, lq, lk, bottom_right=b) for b in (True, False))
    out["reference_gap_bottom_vs_top"] = float((bottom - top).abs().max())  # the check can tell them apart
    if torch.device(device).type != "cuda":
        out["kernel"] = "skipped: varlen_attn is CUDA's flash kernel"
        return out
    try:
        got = _varlen_call(varlen_attn, q, k, v, lens, lens)
        out["gqa_direct"] = {"ok": True, "max_abs_diff": float((got.float() - want).abs().max())}
    except Exception as e:  # the answer to "does it take 2 key-value heads": record the refusal
        out["gqa_direct"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        rep = Hq // Hkv  # the fallback: repeated heads
        got = _varlen_call(varlen_attn, q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), lens, lens)
        out["gqa_repeated"] = {"max_abs_diff": float((got.float() - want).abs().max())}
    rep = 1 if out["gqa_direct"]["ok"] else Hq // Hkv
    got = _varlen_call(varlen_attn, cq, ck.repeat_interleave(rep, 1), cv.repeat_interleave(rep, 1), lq, lk).float()
    d_bottom, d_top = float((got - bottom).abs().max()), float((got - top).abs().max())
    out["causal_q_lt_k"] = {"max_abs_diff_bottom_right": d_bottom, "max_abs_diff_top_left": d_top,
                            "alignment": "bottom-right" if d_bottom < 2e-2 <= d_top else "top-left" if d_top < 2e-2 <= d_bottom
                            else "neither"}
    return out


def compile_check(device: str) -> dict:
    """torch.compile of a small function (inductor on CUDA; dynamo alone on a CPU, where inductor
    would need a C++ build in the suite): seconds to the first result, and the same numbers."""
    backend = "inductor" if torch.device(device).type == "cuda" else "eager"
    x = torch.randn(64, 64, device=device)

    def f(a):
        return (a.sin() * a + 1).softmax(-1).sum()

    t = time.perf_counter()
    y = torch.compile(f, backend=backend, dynamic=True)(x)
    seconds = time.perf_counter() - t
    return {"backend": backend, "first_call_s": seconds, "max_abs_diff": float((y - f(x)).abs())}


def run(smoke: bool, device: str, budget_s: float) -> dict:
    return {"versions": versions(device), "varlen_attn": varlen_checks(device, smoke), "compile": compile_check(device)}
