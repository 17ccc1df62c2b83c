"""How much arithmetic relign and TRL do on the GRPO and DPO bench shapes (no timing).

    python bench/arithmetic.py                       # GRPO at 128 and 512 tokens, DPO
    python bench/arithmetic.py --max-new-tokens 256  # GRPO at another length

A speed ratio between two libraries that run the same torch kernels is bounded by the ratio of
the work they do: at equal FLOP/s, relign can be no more than (TRL's FLOPs / relign's) faster.
This script counts both sides' forward FLOPs on the exact token lengths the benches use
(``bench/grpo_step.py``: the first 64 GSM8K questions, 4 a step, G = 8, every completion
exactly ``--max-new-tokens`` long; ``bench/dpo_throughput.py``: the 52 Orca pairs that fit 512
tokens, 8 a step), from the model's shape (``tiny:small``):

* a token through the decoder: 2 x (its linear weights); the LM head 2 x hidden x vocab
  wherever logits are taken;
* attention: 4 x hidden per (query, key) pair the kernel computes: a causal call computes
  half its square, a call with a mask (padding, or a continuation's offset mask) all of it;
* training: forward + backward = 3 x forward.

What each side computes (from the libraries' code: relign's defaults, TRL 1.16's):

GRPO (beta 0.04: a reference pass)
  relign   prefill each prompt once; decode G rows against [prompt; tokens so far]; reference and
           update on one packed row per group (the prompt once, each response continuing it;
           logits at the response positions)
  TRL      prefill every row, left-padded to the step's longest prompt; decode against the padded
           cache; reference and update on every row padded to longest prompt + completion, masked
           attention, logits at the completion positions (``logits_to_keep``)
DPO (reference precomputed on both sides: the training step only)
  relign   one packed row per micro-batch: prompt + chosen causal, the rejected response
           continuing the prompt; logits at the response positions
  TRL      chosen and rejected rows padded to the micro-batch's longest, masked attention, log-probs
           at every position (its fused LM head)

Output: the FLOP ratio of each shape (TRL / relign), which is the speed ratio relign would reach
at TRL's FLOP/s, and the positions ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from relign.models.flops import ModelFlops  # noqa: E402  (after the path above)

GSM8K = REPO / "relign" / "envs" / "data" / "gsm8k_train_512.jsonl"
ORCA = REPO / "relign" / "data" / "samples" / "orca_dpo_pairs.jsonl"


# relign's own count (``perf/mfu`` of every run uses it too): token, head and pair FLOPs of a shape
Shape = ModelFlops


def grpo(m: Shape, prompts: list[int], G: int, T: int) -> dict:
    rel = trl = 0.0
    rel_pos = trl_pos = 0
    for i in range(0, len(prompts), 4):
        step = prompts[i : i + 4]
        L = max(step)
        for P in step:
            # relign: prefill once (logits at its last position), G decode rows
            rel += P * m.token + m.causal(P) + m.head
            rel += G * sum(m.token + m.full(1, P + t + 1) + m.head for t in range(T - 1))
            # reference + update (x3): [prompt, y_1] causal, then G - 1 continuations [prompt[-1], y_j]
            # against the first P - 1 prompt keys and their own
            packed = (P + T) * m.token + m.causal(P + T) \
                + (G - 1) * ((T + 1) * m.token + m.full(T + 1, P - 1 + T + 1)) + G * T * m.head
            rel += 4 * packed
            rel_pos += P + T + (G - 1) * (T + 1)
            # TRL: every row prefilled at the padded length (masked), decoded against the padded cache
            row = L * m.token + m.full(L, L) + m.head
            row += sum(m.token + m.full(1, L + t + 1) + m.head for t in range(T - 1))
            trl += G * row
            row = (L + T) * m.token + m.full(L + T, L + T) + (T + 1) * m.head
            trl += 4 * G * row
            trl_pos += G * (L + T)
    return {"relign_gflop_per_step": rel / 1e9 / (len(prompts) / 4), "trl_gflop_per_step": trl / 1e9 / (len(prompts) / 4),
            "flop_ratio_trl_over_relign": trl / rel, "positions_ratio_trl_over_relign": trl_pos / rel_pos}


def dpo(m: Shape, pairs: list[tuple[int, int, int]], micro: int) -> dict:
    rel = trl = 0.0
    rel_pos = trl_pos = 0
    # the micro-batches as each library forms them: relign orders a step's pairs by positions,
    # TRL takes them in order; every row of this bench reaches 512 tokens in either order
    for i in range(0, len(pairs), micro):
        mb = pairs[i : i + micro]
        L = max(P + max(C, R) for P, C, R in mb)
        for P, C, R in mb:
            rel += 3 * ((P + C + R + 1) * m.token + m.causal(P + C) + m.full(R + 1, P - 1 + R + 1) + (C + R) * m.head)
            rel_pos += P + C + R + 1
            trl += 3 * 2 * (L * m.token + m.full(L, L) + L * m.head)
            trl_pos += 2 * L
    return {"relign_gflop": rel / 1e9, "trl_gflop": trl / 1e9, "flop_ratio_trl_over_relign": trl / rel,
            "positions_ratio_trl_over_relign": trl_pos / rel_pos}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-new-tokens", type=int, nargs="*", default=[128, 512])
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--n-prompts", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4, help="DPO pairs per micro-batch (the bench's 4)")
    a = p.parse_args(argv)

    from transformers import AutoConfig, AutoTokenizer

    from relign.data.preference import build_pair_examples
    from relign.models.loading import resolve_model_path

    path = resolve_model_path("tiny:small")
    tok = AutoTokenizer.from_pretrained(path)
    m = Shape(AutoConfig.from_pretrained(path))
    with open(GSM8K) as f:
        questions = [json.loads(line)["question"] for line in f if line.strip()][: a.n_prompts]
    prompts = [len(tok(q, add_special_tokens=True)["input_ids"]) for q in questions]
    examples, _ = build_pair_examples(str(ORCA), tok, max_length=512, chat_template=False)
    pairs = [(q.prompt_len, len(q.chosen_ids) - q.prompt_len, len(q.rejected_ids) - q.prompt_len) for q in examples]
    out = {"model": "tiny:small", "prompt_tokens_mean": sum(prompts) / len(prompts), "pairs": len(pairs)}
    print(f"tiny:small; GRPO: {len(prompts)} GSM8K prompts (mean {out['prompt_tokens_mean']:.1f} tokens), 4 a step, "
          f"G = {a.group}; DPO: {len(pairs)} Orca pairs, micro-batches of {a.micro_batch_size}\n")
    print("| shape | relign GFLOP | TRL GFLOP | TRL / relign (FLOPs) | TRL / relign (positions) |\n|---|---:|---:|---:|---:|")
    for T in a.max_new_tokens:
        r = out[f"grpo_{T}"] = grpo(m, prompts, a.group, T)
        print(f"| GRPO step, {T} tokens | {r['relign_gflop_per_step']:.0f} | {r['trl_gflop_per_step']:.0f} | "
              f"{r['flop_ratio_trl_over_relign']:.2f}x | {r['positions_ratio_trl_over_relign']:.2f}x |")
    r = out["dpo"] = dpo(m, pairs, a.micro_batch_size)
    print(f"| DPO, {len(pairs)} pairs, training | {r['relign_gflop']:.0f} | {r['trl_gflop']:.0f} | "
          f"{r['flop_ratio_trl_over_relign']:.2f}x | {r['positions_ratio_trl_over_relign']:.2f}x |")
    print("\n" + json.dumps(out))


if __name__ == "__main__":
    main()
