"""Does ``torch.compile`` pay for a training step on this machine? A probe, not a side-by-side.

    python bench/compile_probe.py --size tiny      # the demo's model, its SFT batch (32 rows of 30-70 tokens)
    python bench/compile_probe.py --size small --rows 8 --min-len 400 --max-len 520

One forward + backward + fused AdamW step of a tiny random Qwen2 (``relign.models.tiny``) on
random right-padded batches of varying length, three ways in three fresh processes: eager,
each decoder layer compiled (``layer.compile(dynamic=True)``), the whole model compiled
(``model.compile(dynamic=True)``). Prints the time of the first three steps (compile included)
and the mean of the next ``--steps``.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time


def worker(a: argparse.Namespace) -> None:
    import torch

    from relign.models.tiny import build_tiny_model

    torch.set_num_threads(a.threads)
    model, _ = build_tiny_model(size=a.size, vocab_size=2300)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    t0 = time.perf_counter()
    if a.worker == "layers":
        for layer in model.model.layers:
            layer.compile(dynamic=True)
    elif a.worker == "model":
        model.compile(dynamic=True)
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        T = int(torch.randint(a.min_len, a.max_len, (1,), generator=g))
        ids = torch.randint(10, 2000, (a.rows, T), generator=g)
        mask = torch.ones(a.rows, T, dtype=torch.long)
        mask[: a.rows // 2, T - 5 :] = 0  # half the rows padded
        loss = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    first = time.perf_counter() - t0
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    per = (time.perf_counter() - t) / a.steps
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"| {a.worker} | {first:.1f} | {per:.4f} | {rss:,.0f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--min-len", type=int, default=30)
    p.add_argument("--max-len", type=int, default=70)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", choices=("eager", "layers", "model"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    print(f"tiny:{a.size}, {a.rows} rows x {a.min_len}-{a.max_len} tokens, {a.threads} threads\n")
    print("| compiled | first 3 steps s (compile included) | s/step after | peak RSS MB |\n|---|---:|---:|---:|", flush=True)
    for w in ("eager", "layers", "model"):
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--worker", w], check=True)


if __name__ == "__main__":
    main()
