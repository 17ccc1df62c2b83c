"""CPU speed of varlen attention from the collator's layout: two checkouts of relign, A/B, interleaved.

    python bench/varlen_cpu_ab.py --old /path/to/main --new .            # 4 rounds, ~5 min on a quiet core
    python bench/varlen_cpu_ab.py --old ../main --new . --rounds 2 --threads 1

Each round runs one worker process per checkout (``PYTHONPATH`` set to it, order alternating),
so both see the same machine load. A worker, on ``tiny:small`` (fp32, SDPA, relign's varlen
attention enabled as the recipes enable it), times:

  sft      one packed SFT step (``sft.accumulate_gradients``): 16 examples of 64 .. 700 tokens
           (uniform, seeded), micro_batch_size 8, token-mean, forward + backward; tokens/s.
  rl       one RL update (``rl_update.update_policy``, PPO-clip, no optimizer step) of 8 prompts x
           G = 8 responses of 8 .. 384 tokens (long-tailed, as bench/rl_packing.py), at
           max_tokens_per_micro 4096, in the packed layout with each prompt once (continuations)
           and with whole rows; seconds.

Every figure is the worker's CPU time (``time.process_time``, one thread: the work itself, not
the waits of a shared VM whose CPU comes and goes), the best of ``--repeats`` inside a worker,
then the best over the rounds (the same work each time); wall seconds are kept in the JSON too.
Output: a table and JSON at --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def worker(a) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    from relign.algorithms.advantages import group_advantages
    from relign.data.sft import SFTExample
    from relign.models.loading import load_causal_lm, resolve_model_path
    from relign.models.varlen import enable
    from relign.recipes.rl_update import ActorLoss, Layout, update_policy
    from relign.recipes.sft import accumulate_gradients
    from relign.rollout.batch import build_batch
    from relign.rollout.multiturn import Episode

    import relign

    path = resolve_model_path("tiny:small")
    torch.manual_seed(0)
    model = load_causal_lm(path)
    assert enable(model)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    out: dict = {"relign": str(Path(relign.__file__).parent)}

    # ---- sft: one packed step
    exs = []
    for _ in range(16):
        n = rng.randint(64, 700)
        p = rng.randint(8, n // 2)
        exs.append(SFTExample([rng.randrange(5, vocab - 5) for _ in range(n)], [0] * p + [1] * (n - p)))
    tokens = sum(len(e.input_ids) for e in exs)
    times, walls = [], []
    for _ in range(a.repeats):
        model.zero_grad(set_to_none=True)
        t0, w0 = time.process_time(), time.perf_counter()
        accumulate_gradients(model, exs, micro_batch_size=8, packing=True, loss_agg="token-mean", pad_id=0, device="cpu")
        times.append(time.process_time() - t0)
        walls.append(time.perf_counter() - w0)
    out["sft_tokens"] = tokens
    out["sft_seconds"], out["sft_wall"] = min(times), min(walls)

    # ---- rl: one update, packed with continuations and whole rows
    G, eps = 8, []
    for _ in range(8):
        prompt = [rng.randrange(5, vocab - 5) for _ in range(rng.randint(40, 120))]
        for _ in range(G):
            n = int(min(384, max(8, rng.expovariate(1 / 96))))
            eps.append(Episode(prompt_ids=prompt, response_ids=[rng.randrange(5, vocab - 5) for _ in range(n)],
                               response_mask=[1] * n, sampling_logps=[0.0] * n, token_rewards=[0.0] * n, reward=rng.random()))
    batch = build_batch(eps, 0, "cpu", G)
    adv = group_advantages(torch.tensor([e.reward for e in eps]), G, scale="std").unsqueeze(-1) * batch.response_mask

    class NoStep:  # forward + backward + clip, the weights unchanged
        param_groups: list = []

        def step(self):
            pass

        def zero_grad(self, set_to_none=True):
            model.zero_grad(set_to_none=True)

    rows = torch.arange(batch.size)
    for name, layout in (("rl_continuations", Layout("packed", group_size=G, max_tokens=4096)),
                         ("rl_rows", Layout("packed", group_size=1, max_tokens=4096))):
        times, walls = [], []
        for _ in range(a.repeats):
            t0, w0 = time.process_time(), time.perf_counter()
            stats, _ = update_policy(model, NoStep(), None, list(model.parameters()), batch, [rows], layout,
                                     ActorLoss(agg="token-mean"), advantages=adv, max_grad_norm=0.0)
            times.append(time.process_time() - t0)
            walls.append(time.perf_counter() - w0)
        out[name + "_seconds"], out[name + "_wall"] = min(times), min(walls)
        out[name + "_loss"] = stats.reduce()["actor/loss"]
    out["rl_tokens"] = int(batch.seq_lens.sum())
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="checkout of the baseline (its root: PYTHONPATH)")
    p.add_argument("--new", required=True, help="checkout with the change")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(HERE.parent / "results" / "varlen_cpu_ab.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(a.rounds):
        for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
            root = str(Path(getattr(a, side)).resolve())
            env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": str(a.threads), "HF_HUB_OFFLINE": "1"}
            cmd = [sys.executable, str(HERE), "--worker", "--old", a.old, "--new", a.new, "--repeats", str(a.repeats),
                   "--threads", str(a.threads)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root, check=True)
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {side}: {runs[side][-1]}", file=sys.stderr)
    best = {side: {k: min(x[k] for x in v) for k in v[0] if k.endswith("_seconds")} for side, v in runs.items()}
    tok_sft, tok_rl = runs["old"][0]["sft_tokens"], runs["old"][0]["rl_tokens"]
    out = {"benchmark": "varlen_cpu_ab", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": " ".join(["python", "bench/varlen_cpu_ab.py", *(argv if argv is not None else sys.argv[1:])]),
           "threads": a.threads, "rounds": a.rounds, "repeats": a.repeats, "load_average": os.getloadavg(),
           "best_seconds": best, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"tiny:small fp32 CPU, {a.threads} thread(s), CPU seconds, best of {a.rounds} rounds x {a.repeats}\n")
    print("| measure | old | new | new / old |\n|---|---:|---:|---:|")
    print(f"| sft packed tokens per CPU s ({tok_sft} tokens) | {tok_sft / best['old']['sft_seconds']:,.0f} | "
          f"{tok_sft / best['new']['sft_seconds']:,.0f} | {best['old']['sft_seconds'] / best['new']['sft_seconds']:.3f} |")
    for k in ("rl_continuations", "rl_rows"):
        o, n = best["old"][k + "_seconds"], best["new"][k + "_seconds"]
        print(f"| {k} update, CPU s ({tok_rl} tokens) | {o:.3f} | {n:.3f} | {n / o:.3f} |")


if __name__ == "__main__":
    main()
