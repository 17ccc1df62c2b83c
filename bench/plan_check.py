"""relign plan against the measured peak on the CPU (issue 47): the shipped SFT, DPO, PPO and GRPO presets
at two model sizes and two micro-batch sizes, predicted beside measured.

    python bench/plan_check.py                 # the table of BENCHMARKS.md (16 runs, ~1 min on 2 cores)
    python bench/plan_check.py --only grpo     # one preset

How the peak is measured: the run goes through the real command line in this process
(``relign.cli.main``) under ``torch.profiler.profile(profile_memory=True)``. Torch's CPU allocator then
reports every allocation and free to the profiler (c10's ``ProfiledCPUMemoryReporter``); the peak is
the maximum of their running sum. The profiler starts after the imports, before the run reads its
config, so the interpreter, torch and the libraries (the baseline) are left out, and so is any tensor
made before it (its frees are dropped, not subtracted). What it counts is exactly what the plan
predicts and what ``torch.cuda.max_memory_allocated`` counts on a GPU: tensors, not the heap of the
interpreter or oneDNN's scratch space. Peak RSS would add those and the pages of torch's code that
the first backward faults in (tens of MB), which drown a model of a few MB.

What each run is: the preset's own settings with a tiny Qwen2-shaped model of a real-size vocabulary
(``MODELS``: the logits weigh as they do on real models) and data that reaches the plan's worst
case: SFT and DPO rows longer than ``data.max_length`` with 4-token prompts (cut to the limit), RL
prompts of exactly ``task.max_prompt_length`` tokens (a custom task, reward by parity) and responses
of exactly their budget (``rollout.min_new_tokens``); 2 steps (AdamW's state, and PPO's critic's, exist in the second);
no eval, no checkpoints (the plan has an eval stage; these runs skip it to stay short).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Two Qwen2 shapes: hidden, layers, heads, kv heads, MLP width, vocabulary (tied embeddings)
MODELS = {"A": (64, 2, 4, 2, 192, 4096), "B": (128, 4, 4, 2, 384, 8192)}
PROMPT = 32  # RL prompts, tokens
WORDS = ("alpha", "beta", "gamma", "delta", "sum", "of", "the", "and", "seven", "nine")


def _common(run_dir: Path) -> list[str]:
    return ["max_steps=2", "logging.progress=false", "logging.tensorboard=false", "checkpoint.save_every=0",
            "checkpoint.save_final=false", f"run_dir={run_dir}"]


# preset -> (recipe, its micro-batch key, the two sizes, overrides given the data folder)
CASES = {
    "sft_tiny": ("sft", "micro_batch_size", (2, 4), lambda d: [
        f"data.path={d / 'sft.jsonl'}", "data.chat_template=false", "data.max_length=128", "data.eval_fraction=0",
        "eval_every=0"]),
    "dpo": ("dpo", "micro_batch_size", (1, 2), lambda d: [
        f"data.path={d / 'dpo.jsonl'}", "data.chat_template=false", "data.max_length=128", "data.eval_fraction=0",
        "eval_every=0", "eval_batch_size=4"]),
    "ppo": ("rl", "micro_batch_size", (2, 4), lambda d: _rl(d)),
    "grpo": ("rl", "micro_batch_size", (4, 8), lambda d: _rl(d)),
}


def _rl(d: Path) -> list[str]:
    return [f"task.name=custom", f"task.path={d / 'prompts.jsonl'}", f"task.reward_fn={d / 'reward.py'}:reward",
            "task.chat=false", "task.reward_workers=0", f"task.max_prompt_length={PROMPT}", "rollout.max_new_tokens=16",
            "rollout.min_new_tokens=16", "traces_per_step=0"]


def build(out: Path, tokenizer: str | Path | None = None) -> dict[str, Path]:
    """The models (one folder each, with a tiny tokenizer: its ids are a subset of every vocabulary;
    ``tokenizer``: a folder to take it from, else one is trained) and the data files, in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from relign.models.tiny import build_tokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer) if tokenizer else build_tokenizer(4096, seed=0)
    dirs = {}
    for name, (d, layers, heads, kv, inter, vocab) in MODELS.items():
        cfg = Qwen2Config(vocab_size=vocab, hidden_size=d, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
                          max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=None,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        dirs[name] = out / f"model-{name}"
        AutoModelForCausalLM.from_config(cfg).save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    rng = random.Random(0)

    def text(n: int) -> str:
        return tok.decode(tok.encode(" ".join(rng.choice(WORDS) for _ in range(n)))[:n])

    def exact(n: int) -> str:  # a text of exactly n tokens once encoded again
        while True:
            t = text(n + 8)
            ids = tok.encode(t)[:n]
            if len(tok.encode(tok.decode(ids))) == n:
                return tok.decode(ids)

    data = out / "data"
    data.mkdir(exist_ok=True)
    (data / "sft.jsonl").write_text("".join(json.dumps({"prompt": text(4), "response": text(200)}) + "\n" for _ in range(16)))
    (data / "dpo.jsonl").write_text("".join(json.dumps({"prompt": text(4), "chosen": text(200), "rejected": text(200)}) + "\n"
                                            for _ in range(8)))
    (data / "prompts.jsonl").write_text("".join(json.dumps({"prompt": exact(PROMPT), "answer": "0"}) + "\n" for _ in range(16)))
    (data / "reward.py").write_text("def reward(prompt, response, extra_info):\n    return float(sum(map(ord, response)) % 2)\n")
    dirs["data"] = data
    return dirs


def args_of(preset: str, model: Path, micro: int, data: Path, run_dir: Path) -> list[str]:
    recipe, key, _, overrides = CASES[preset]
    return [recipe, preset, f"model.path={model}", f"{key}={micro}", f"batch_size={2 * micro}" if recipe != "rl" else
            "prompts_per_step=4", *overrides(data), *_common(run_dir)]


def allocation_peak(result) -> int:
    """The maximum over time of the bytes allocated during the profile and not yet freed: the
    allocator's events (address, signed size) in time order. A free of a block this profile did not
    see allocated (made before it, by an earlier run of this process) is left out, as the block was."""
    from torch._C._profiler import _EventType

    events, stack = [], list(result.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
        stack.extend(node.children)
    live: dict[int, int] = {}
    total = peak = 0
    for _, size, ptr in sorted(events):
        if size > 0:
            live[ptr] = size
            total += size
            peak = max(peak, total)
        elif ptr in live:
            total -= live.pop(ptr)
    return peak


def measure(argv: list[str]):
    """(the peak of torch's CPU allocations of ``relign ARGV`` run in this process from its start, the
    plan that run checked itself against at its start: ``recipes.memory.check`` in ``frame.open``)."""
    import gc
    import warnings

    from torch.profiler import ProfilerActivity, profile

    from relign import cli
    from relign.recipes import memory

    plans = []
    check = memory.check

    def keep(*a, **k):
        plans.append(check(*a, **k))
        return plans[-1]

    gc.collect()  # an earlier run's objects go now, not during this one
    memory.check = keep
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(open(os.devnull, "w")):
            warnings.simplefilter("ignore")
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                rc = cli.main(argv)
    finally:
        memory.check = check
    if rc != 0:
        raise RuntimeError(f"relign {' '.join(argv)} exited {rc}")
    return allocation_peak(prof.profiler.kineto_results), plans[0]


def predict(argv: list[str]):
    """The plan of ``relign ARGV`` as ``relign plan`` makes it, on a CPU with room to spare."""
    from relign.cli import split_args
    from relign.commands.presets import resolve_config_arg
    from relign.config import load_config
    from relign.devices import Device
    from relign.recipes import RECIPES, memory

    recipe = argv[0]
    path, overrides = split_args(resolve_config_arg(recipe, argv[1:]))
    cfg = load_config(importlib.import_module(RECIPES[recipe][0]).Config, path, overrides)
    return memory.plan_for(cfg, recipe, Device("cpu", "cpu", 1 << 40, 1 << 40), search=False)


def run(out: Path, presets: list[str], sizes: list[str] | None = None, tokenizer: str | Path | None = None) -> list[dict]:
    import torch

    dirs = build(out, tokenizer)
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a fixed, small thread count: these models are tiny
    try:
        for preset in presets:
            for size in sizes or list(MODELS):
                for micro in CASES[preset][2]:
                    argv = args_of(preset, dirs[size], micro, dirs["data"], out / "runs" / f"{preset}-{size}-{micro}")
                    t0 = time.perf_counter()
                    measured, plan = measure(argv)
                    rows.append({"preset": preset, "model": size, "micro": micro, "measured": measured,
                                 "predicted": plan.peak.total, "stage": plan.peak.name,
                                 "ratio": plan.peak.total / measured, "seconds": time.perf_counter() - t0})
    finally:
        torch.set_num_threads(threads)
    return rows


def table(rows: list[dict]) -> str:
    from relign.plan import Shape

    sizes = {k: Shape(d=v[0], layers=v[1], heads=v[2], kv_heads=v[3], head_dim=v[0] // v[2], intermediate=v[4], vocab=v[5],
                      qkv_bias=True, model_type="qwen2").params for k, v in MODELS.items()}
    lines = ["| preset | model | micro-batch | measured peak | predicted peak (stage) | predicted / measured |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['model']} ({sizes[r['model']] / 1e6:.2f}M) | {r['micro']} | "
                     f"{r['measured'] / 2**20:.1f} MiB | {r['predicted'] / 2**20:.1f} MiB ({r['stage']}) | {r['ratio']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument("--out", default="", help="also write the rows as JSON here")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="relign-plan-check-") as tmp:
        rows = run(Path(tmp), a.only)
    print(table(rows))
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"\nlargest |predicted / measured - 1|: {worst:.1%}; {sum(r['seconds'] for r in rows):.0f} s in all")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
