"""Training tokens/s of the RL update: packed vs padded vs shared-prompt micro-batches.

    python bench/rl_packing.py              # 3 repeats, ~3 min on 2 cores
    python bench/rl_packing.py --quick      # 1 repeat

One rollout batch of mixed lengths, the way RL produces them: 8 GSM8K prompts (the shipped
train slice, raw text) x G = 8 responses whose lengths are drawn from 8..384 tokens (a
long-tailed mix: most short, a few near the limit). The same batch is trained with
``relign.recipes.rl_update.update_policy`` (one PPO-clip update, GRPO advantages, the public
function the recipe calls) in each layout, on a fresh copy of the same model each time:

* padded  rows right-padded to the longest row of their micro-batch;
* packed       each micro-batch's whole groups in one row with per-sequence position ids,
               attention run sequence by sequence (``relign.models.varlen``, as ``rl.train``
               sets it up with packing=true): each group's prompt once, its other responses
               continuing it in the row;
* packed-rows  the same, but every sequence whole (its prompt again; what flash-attention's
               varlen kernel can run, and packing with share_prompt=false);
* shared       padded rows, each group's prompt computed once (relign's CPU default).

Micro-batches are formed by ``max_tokens_per_micro`` (Karmarkar–Karp over the items) for all
four. "tokens/s" counts real tokens (prompt + response of every sequence, no padding) over
the update's wall time; the update's loss is checked equal across layouts (1e-5). Each
layout's time is its fastest repeat (the repeats do the same work; a shared VM's CPU comes
and goes). Output: a markdown table and bench/results/rl_packing.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = REPO / "bench" / "results" / "rl_packing.json"
GSM8K = REPO / "relign" / "envs" / "data" / "gsm8k_train_512.jsonl"
LAYOUTS = ("padded", "packed", "packed-rows", "shared")


def _batch(tok, n_prompts: int, G: int, min_len: int, max_len: int, seed: int):
    from relign.rollout.batch import build_batch
    from relign.rollout.multiturn import Episode

    rng = random.Random(seed)
    qs = [json.loads(line)["question"] for line in open(GSM8K)][:n_prompts]
    eps = []
    for q in qs:
        p = tok(q)["input_ids"]
        for _ in range(G):
            # long-tailed: an exponential length, clipped to [min_len, max_len]
            n = int(min(max_len, max(min_len, rng.expovariate(1 / 96))))
            ids = [rng.randrange(5, len(tok) - 5) for _ in range(n)]
            eps.append(Episode(prompt_ids=p, response_ids=ids, response_mask=[1] * n, sampling_logps=[0.0] * n,
                               token_rewards=[0.0] * n, reward=rng.random()))
    return build_batch(eps, tok.pad_token_id, "cpu", G), eps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="tiny model size (default small, ~10M parameters)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--max-tokens-per-micro", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    if a.quick:
        a.repeats = 1

    import torch
    import transformers

    from relign.algorithms.advantages import group_advantages
    from relign.models.loading import load_causal_lm, resolve_model_path
    from relign.models.varlen import packed_attention
    from relign.recipes.rl_update import ActorLoss, Layout, update_policy
    from transformers import AutoTokenizer

    path = resolve_model_path(f"tiny:{a.size}")
    tok = AutoTokenizer.from_pretrained(path)
    base = load_causal_lm(path)
    batch, eps = _batch(tok, a.prompts, a.group, a.min_len, a.max_len, a.seed)
    adv = group_advantages(torch.tensor([e.reward for e in eps]), a.group, scale="std").unsqueeze(-1) * batch.response_mask
    real_tokens = int(batch.seq_lens.sum())
    rows = torch.arange(batch.size)

    class NoStep:  # the update's forward + backward + clip, without moving the weights
        param_groups: list = []

        def step(self):
            pass

        def zero_grad(self, set_to_none=True):
            for q in model.parameters():
                q.grad = None

    loss_fn = ActorLoss(agg="token-mean")
    times: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    losses: dict[str, float] = {}
    for rep in range(a.repeats):
        for kind in (LAYOUTS if rep % 2 == 0 else LAYOUTS[::-1]):
            model = copy.deepcopy(base)
            if kind.startswith("packed"):  # as rl.train does with packing=true: sequence by sequence, no block mask
                packed_attention(model, "sdpa")
            layout = Layout(kind.split("-")[0], group_size=1 if kind == "packed-rows" else a.group,
                            max_tokens=a.max_tokens_per_micro)
            t0 = time.perf_counter()
            stats, _ = update_policy(model, NoStep(), None, list(model.parameters()), batch, [rows], layout, loss_fn,
                                     advantages=adv, max_grad_norm=0.0)
            times[kind].append(time.perf_counter() - t0)
            losses[kind] = stats.reduce()["actor/loss"]
    best = {k: min(v) for k, v in times.items()}
    assert all(abs(losses[k] - losses["padded"]) < 1e-5 for k in LAYOUTS), losses
    lens = (batch.seq_lens - batch.prompt_lens).tolist()
    out = {
        "benchmark": "rl_packing",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", "bench/rl_packing.py", *(argv if argv is not None else sys.argv[1:])]),
        "setup": {"model": f"tiny:{a.size}", "parameters": sum(q.numel() for q in base.parameters()),
                  "sequences": batch.size, "group_size": a.group, "real_tokens": real_tokens,
                  "response_tokens": {"min": min(lens), "max": max(lens), "mean": sum(lens) / len(lens)},
                  "prompt_tokens_mean": float(batch.prompt_lens.float().mean()),
                  "padded_width": int(batch.input_ids.shape[1]), "max_tokens_per_micro": a.max_tokens_per_micro,
                  "repeats": a.repeats, "dtype": "fp32", "attn_implementation": "sdpa"},
        "env": {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
                "torch": torch.__version__, "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
                "load_average": os.getloadavg()},
        "seconds": times, "best_seconds": best, "tokens_per_s": {k: real_tokens / v for k, v in best.items()},
        "loss": losses,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"RL update, {batch.size} sequences ({a.prompts} prompts x G={a.group}), responses {min(lens)}-{max(lens)} tokens "
          f"(mean {sum(lens) / len(lens):.0f}), {real_tokens} real tokens, tiny:{a.size}, fp32, CPU, "
          f"{torch.get_num_threads()} threads, max_tokens_per_micro {a.max_tokens_per_micro}; best of {a.repeats}")
    print("\n| layout | update s | training tokens/s | vs padded |\n|---|---:|---:|---:|")
    for k in LAYOUTS:
        print(f"| {k} | {best[k]:.2f} | {real_tokens / best[k]:,.0f} | {best['padded'] / best[k]:.2f}x |")
    print(f"\nJSON: {os.path.relpath(a.out, REPO)}")


if __name__ == "__main__":
    main()
