"""Forward + backward time of preference pairs' log-probs in each layout (relign only).

    python bench/pair_layouts.py                # 64 Orca pairs, micro-batches of 4, 3 repeats, ~5 min on 2 cores
    python bench/pair_layouts.py --pairs 16     # a quicker look

The public function ``relign.recipes.pairs.sequence_logps`` (what ``relign dpo`` calls for the
policy and the reference) over the shipped Orca DPO pairs (``orca_dpo_pairs.jsonl``, raw text,
prompts of ~207 tokens, responses of ~270), on the tiny random Qwen2 "small" model (fp32, CPU,
sdpa), in micro-batches of ``--micro-batch-size`` pairs ordered by length as the recipe orders
them. Each layout computes the same summed log-probs (checked to 1e-5 relative here; the tests
check 1e-5 absolute on a smaller model, and the gradients):

* packed        one padding-free row per micro-batch, each pair's rejected response continuing
                its prompt (the prompt once; ``share_prompt=true`` where relign's varlen
                attention applies: the default);
* shared        padded rows, each pair's prompt once as a KV cache (``share_prompt=true``
                where varlen does not apply);
* packed-rows   one padding-free row, every row whole (``packing=true share_prompt=false``: the
                prompt twice);
* padded        every row whole, right-padded (``share_prompt=false``).

The layouts run in turn, in alternating order, each on its own copy of the model; a layout's
time is its fastest repeat. Output: a markdown table and bench/results/pair_layouts.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = REPO / "bench" / "results" / "pair_layouts.json"
ORCA = REPO / "relign" / "data" / "samples" / "orca_dpo_pairs.jsonl"
# layout -> (model runs relign's varlen attention, sequence_logps keywords)
LAYOUTS = {"packed": (True, dict(share_prompt=True, packed=True)), "shared": (False, dict(share_prompt=True)),
           "packed-rows": (True, dict(share_prompt=False, packed=True)), "padded": (False, dict(share_prompt=False))}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--size", default="small", help="relign.models.tiny size (default small)")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoTokenizer

    from relign.data.preference import build_pair_examples
    from relign.models import varlen
    from relign.models.loading import load_causal_lm, resolve_model_path
    from relign.recipes.pairs import by_positions, collate_pairs, sequence_logps

    torch.set_num_threads(a.threads)
    path = resolve_model_path(f"tiny:{a.size}")
    tok = AutoTokenizer.from_pretrained(path)
    pairs, _ = build_pair_examples(str(ORCA), tok, max_length=a.max_length, chat_template=False)
    pairs = pairs[: a.pairs]
    base = load_causal_lm(path)
    by_seq = copy.deepcopy(base)
    assert varlen.enable(by_seq)
    order = {k: by_positions(pairs, range(len(pairs)), share_prompt=k == "shared") for k in LAYOUTS}
    times: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    sums: dict[str, torch.Tensor] = {}
    names = list(LAYOUTS)
    for rep in range(a.repeats):
        for k in (names if rep % 2 == 0 else names[::-1]):
            uses_varlen, kw = LAYOUTS[k]
            model = copy.deepcopy(by_seq if uses_varlen else base)
            got = torch.zeros(2 * len(pairs))
            t0 = time.perf_counter()
            for i in range(0, len(pairs), a.micro_batch_size):
                idx = order[k][i : i + a.micro_batch_size]
                s, _ = sequence_logps(model, collate_pairs([pairs[j] for j in idx], tok.pad_token_id, "cpu"), **kw)
                s.sum().backward()
                rows = torch.tensor([2 * j + c for j in idx for c in (0, 1)])
                got[rows] = s.detach()
            times[k].append(time.perf_counter() - t0)
            sums[k] = got
    # summed log-probs of ~500 tokens reach ~-4,000: fp32 sums in another order differ by ~1e-4
    gap = {k: float(((sums[k] - sums["padded"]).abs() / sums["padded"].abs().clamp_min(1.0)).max()) for k in LAYOUTS}
    best = {k: min(v) for k, v in times.items()}
    tokens = sum(len(q.chosen_ids) + len(q.rejected_ids) for q in pairs)
    out = {
        "benchmark": "pair_layouts",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", "bench/pair_layouts.py", *(argv if argv is not None else sys.argv[1:])]),
        "setup": {"model": f"tiny:{a.size}", "pairs": len(pairs), "micro_batch_size": a.micro_batch_size,
                  "row_tokens": tokens, "prompt_tokens_mean": sum(q.prompt_len for q in pairs) / len(pairs),
                  "repeats": a.repeats, "dtype": "fp32", "attn_implementation": "sdpa"},
        "env": {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
                "torch": torch.__version__, "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
                "load_average": os.getloadavg()},
        "seconds": times, "best_seconds": best, "pairs_per_s": {k: len(pairs) / v for k, v in best.items()},
        "max_relative_logp_gap_vs_padded": gap,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"pair log-probs, forward + backward: {len(pairs)} Orca pairs ({tokens} tokens as full rows), micro-batches of "
          f"{a.micro_batch_size}, tiny:{a.size}, fp32, CPU, {torch.get_num_threads()} threads; best of {a.repeats}")
    print("\n| layout | s | pairs/s | vs shared |\n|---|---:|---:|---:|")
    for k in LAYOUTS:
        print(f"| {k} | {best[k]:.2f} | {len(pairs) / best[k]:.2f} | {best['shared'] / best[k]:.2f}x |")
    print(f"\nlargest relative gap of a summed log-prob to the padded layout's: {max(gap.values()):.1e}")
    print(f"JSON: {os.path.relpath(a.out, REPO)}")
    if max(gap.values()) > 1e-5:
        raise SystemExit(f"the layouts disagree: {gap}")


if __name__ == "__main__":
    main()
