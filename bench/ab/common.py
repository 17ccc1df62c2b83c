"""What the sections of ``bench/gpu_ab.py`` share: the model (built once per process with
``bench/gpu_checks.py``'s builder), SFT-shaped batches, and timing on the device.

Any section may use these; none has to (a section builds its own inputs)."""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import gpu_checks

_models: dict[bool, tuple[Path, int]] = {}


def model_dir(smoke: bool) -> tuple[Path, int]:
    """(folder, parameters) of the random model: Qwen2.5-0.5B's shape, or ``gpu_checks.SMOKE``'s
    at ``smoke``; built once per process (0.5B parameters take ~20 s to initialize and save)."""
    if smoke not in _models:
        out = Path(tempfile.mkdtemp(prefix="relign-gpu-ab-")) / "model"
        _models[smoke] = (out, gpu_checks.build_model(out, gpu_checks.SMOKE if smoke else gpu_checks.QWEN05,
                                                      tokenizer=False))
    return _models[smoke]


def shape(smoke: bool) -> dict:
    return gpu_checks.SMOKE if smoke else gpu_checks.QWEN05


def sft_examples(n: int, max_len: int, vocab: int, seed: int = 0) -> list:
    """``n`` SFT examples of random token ids, of max_len/8 to max_len tokens (uniform), the
    first eighth prompt (not scored): the rows of ``gpu_checks``' SFT check."""
    from relign.data.sft import SFTExample

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        L = rng.randint(max(2, max_len // 8), max_len)
        p = max(1, L // 8)
        out.append(SFTExample(input_ids=[rng.randrange(4, vocab) for _ in range(L)], loss_mask=[0] * p + [1] * (L - p)))
    return out


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    """The CUDA allocator's peak since ``reset_peak``; None on a CPU."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.device(device).type == "cuda" else None


def timed(fn: Callable[[], object], device: str) -> float:
    """Seconds of one call of ``fn``, its kernels included (a CUDA synchronize on each side)."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None
