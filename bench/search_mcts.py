"""MCTS nodes/s and generated tokens/s on the HF engine: lockstep batching vs one problem at a time.

    python bench/search_mcts.py               # 64 GSM8K problems, S=8, 2 repeats, a few minutes on 2 cores
    python bench/search_mcts.py --problems 16 --repeats 1      # a smoke test

The same MCTS (``make_strategy("mcts", ...)``: width 4, steps of at most 16 tokens cut at "\\n",
max_depth 4, the last step up to 64 tokens, ``Budget(max_simulations=S)``) searches the same
problems (the shipped GSM8K test set, ``build_task("gsm8k")`` with the tiny tokenizer's ChatML
template, ``encode_problems``) in two ways:

* lockstep    all problems in ONE ``strategy.search`` call: every round selects a leaf in every
              tree and expands them all in one batched ``engine.generate`` call;
* sequential  one ``strategy.search`` call per problem (the engine sees 1 prefix x width rows).

Model: a random tiny Qwen2 (``relign.models.tiny``, fp32, sdpa), ``HFEngine`` through
``engine_for("hf", ...)``, ``--threads`` torch threads (default 1, so a busy shared machine
slows both modes alike rather than the thread count deciding the ratio). The model's text is
random, so the task's answer marker ("####") almost never appears and paths end at max_depth.
Leaves are scored by ``HashScorer`` below, a deterministic stand-in (a hash of the step texts
mapped to [0, 1], no model): the benchmark measures search + generation, not a scorer.

Seeds derive from (problem id, node, attempt), never from the batch, so both modes build the
same trees up to fp32 rounding: left padding in a batch can move logits in the last bits and
flip a sampled token now and then. Node and token totals of the two modes are compared and
the difference reported (not an error). Each mode runs ``--repeats`` times, interleaved
(alternating which goes first), after one untimed warm-up search per mode; the table shows
medians. Peak RSS is VmHWM, reset before each run (``/proc/self/clear_refs``), else the
process's ``ru_maxrss``. Output: a table on stdout and bench/results/search_mcts.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = REPO / "bench" / "results" / "search_mcts.json"
MODES = ("lockstep", "sequential")


class HashScorer:
    """A stand-in outcome scorer: blake2b of the step texts -> one score in [0, 1). Batched, cheap, deterministic."""

    needs_reference = False

    def score(self, problems, steps, extra_infos=None):
        out = []
        for p, st in zip(problems, steps):
            h = hashlib.blake2b("\x1f".join([p, *st]).encode(), digest_size=8).digest()
            out.append([int.from_bytes(h, "little") / 2.0**64])
        return out


class CountingEngine:
    """The engine, with its ``generate`` calls counted (every other attribute passes through)."""

    def __init__(self, engine):
        self.engine, self.calls, self.rows = engine, 0, 0

    def generate(self, prompts, params, **kw):
        self.calls += 1
        self.rows += len(prompts) * max(1, params.n)
        return self.engine.generate(prompts, params, **kw)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux >= 4.0)
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_mode(mode: str, strategy, engine: CountingEngine, task, problems, budget, scorer, seed: int) -> dict:
    """One timed search of every problem: all at once (lockstep) or one ``search`` call each."""
    engine.calls = engine.rows = 0
    if engine.prefix_cache is not None:  # each run starts cold: no keys/values from the run before
        engine.prefix_cache.clear()
    _reset_peak()
    c0, t0 = time.process_time(), time.perf_counter()
    if mode == "lockstep":
        results = strategy.search(engine, task, problems, budget=budget, scorer=scorer, seed=seed)
    else:
        results = [r for p in problems for r in strategy.search(engine, task, [p], budget=budget, scorer=scorer, seed=seed)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    nodes = [len(r.tree) - 1 for r in results]
    tokens = [r.cost.generated_tokens for r in results]
    trees = [hashlib.sha1(json.dumps([(n["parent"], n["text"]) for n in r.tree]).encode()).hexdigest() for r in results]
    return {"wall_s": wall, "cpu_s": cpu, "nodes": sum(nodes), "generated_tokens": sum(tokens),
            "nodes_per_s": sum(nodes) / wall, "tokens_per_s": sum(tokens) / wall, "engine_calls": engine.calls,
            "engine_rows": engine.rows, "peak_rss_mb": _peak_rss_mb(), "per_problem_nodes": nodes,
            "per_problem_tokens": tokens, "tree_hashes": trees, "errors": sum(r.error is not None for r in results)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", help="tiny model size (micro, tiny, small, base; default tiny)")
    p.add_argument("--problems", type=int, default=64)
    p.add_argument("--simulations", "-S", type=int, default=8, help="MCTS rounds per tree (Budget.max_simulations)")
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--max-depth", type=int, default=4)
    p.add_argument("--step-max-tokens", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-batch-rows", type=int, default=256, help="HFEngine rows per forward chunk")
    p.add_argument("--prefix-cache-mb", type=int, default=512,
                   help="HFEngine prefix cache (keys/values of earlier prefixes; 0 = off), as relign eval uses it")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    command = " ".join(["python", "bench/search_mcts.py", *(argv if argv is not None else sys.argv[1:])])
    load_before = os.getloadavg()
    t_start = time.perf_counter()

    import torch
    import transformers

    from relign.envs.tasks import build_task, encode_problems
    from relign.models.tiny import build_tiny_model, num_parameters
    from relign.recipes.build import engine_for
    from relign.strategies.base import Budget
    from relign.strategies.registry import make_strategy

    torch.set_num_threads(a.threads)
    model, tok = build_tiny_model(size=a.size, seed=a.seed)
    model = model.to(a.device, torch.float32).eval()
    task = build_task("gsm8k", chat=tok.chat_template is not None)
    problems, _ = encode_problems(tok, task.load(max_rows=a.problems))
    engine = CountingEngine(engine_for("hf", model, tok, max_batch_rows=a.max_batch_rows, seed=a.seed,
                                       prefix_cache_bytes=a.prefix_cache_mb << 20))
    opts = dict(width=a.width, step_max_tokens=a.step_max_tokens, max_new_tokens=a.max_new_tokens,
                max_depth=a.max_depth, delimiter="\n")
    strategy = make_strategy("mcts", tok, **opts)
    budget, scorer = Budget(max_simulations=a.simulations), HashScorer()

    for mode in MODES:  # warm-up (first-call overheads: allocator, kernels, tokenizer caches), untimed
        run_mode(mode, strategy, engine, task, problems[:2], Budget(max_simulations=2), scorer, a.seed)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(a.repeats):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            r = run_mode(mode, strategy, engine, task, problems, budget, scorer, a.seed)
            runs[mode].append(r)
            print(f"  rep {rep} {mode:10s} {r['wall_s']:7.1f} s  {r['nodes']} nodes  {r['generated_tokens']} tokens  "
                  f"{r['engine_calls']} engine calls  cpu/wall {r['cpu_s'] / r['wall_s']:.2f}  load {os.getloadavg()[0]:.2f}",
                  flush=True)

    med = {m: {k: statistics.median(r[k] for r in runs[m])
               for k in ("wall_s", "cpu_s", "nodes_per_s", "tokens_per_s", "peak_rss_mb")} for m in MODES}
    last = {m: runs[m][-1] for m in MODES}
    for m in MODES:
        med[m].update({k: last[m][k] for k in ("nodes", "generated_tokens", "engine_calls", "engine_rows", "errors")})
    ratio = {k: med["lockstep"][k] / med["sequential"][k] for k in ("nodes_per_s", "tokens_per_s")}
    L, S = last["lockstep"], last["sequential"]
    same = {
        "nodes_diff": L["nodes"] - S["nodes"], "tokens_diff": L["generated_tokens"] - S["generated_tokens"],
        "tokens_diff_pct": 100.0 * (L["generated_tokens"] - S["generated_tokens"]) / max(1, S["generated_tokens"]),
        "identical_trees": sum(x == y for x, y in zip(L["tree_hashes"], S["tree_hashes"])),
        "problems_nodes_differ": sum(x != y for x, y in zip(L["per_problem_nodes"], S["per_problem_nodes"])),
        "problems_tokens_differ": sum(x != y for x, y in zip(L["per_problem_tokens"], S["per_problem_tokens"])),
        "repeats_deterministic": all(r["tree_hashes"] == runs[m][0]["tree_hashes"] for m in MODES for r in runs[m]),
    }
    load_after = os.getloadavg()
    runtime = time.perf_counter() - t_start

    out = {
        "benchmark": "search_mcts",
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "setup": {"model": f"tiny:{a.size}", "parameters": num_parameters(model), "dtype": "fp32", "device": a.device,
                  "torch_threads": torch.get_num_threads(), "problems": len(problems), "task": "gsm8k (shipped test set)",
                  "chat_template": tok.chat_template is not None,
                  "prompt_tokens_mean": sum(len(q.prompt_ids) for q in problems) / len(problems),
                  "mcts": opts, "simulations": a.simulations, "max_batch_rows": a.max_batch_rows, "prefix_cache_mb": a.prefix_cache_mb,
                  "scorer": "HashScorer (blake2b of the step texts -> [0,1), no model)", "repeats": a.repeats,
                  "seed": a.seed},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__},
        "load_average_before": load_before, "load_average_after": load_after, "runtime_s": runtime,
        "median": med, "ratio_lockstep_over_sequential": ratio, "agreement": same,
        "runs": {m: [{k: v for k, v in r.items() if k != "tree_hashes"} for r in runs[m]] for m in MODES},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)

    print(f"\nMCTS on HFEngine, {len(problems)} GSM8K problems, tiny:{a.size} ({num_parameters(model) / 1e6:.1f}M, fp32, "
          f"{a.device}, {torch.get_num_threads()} thread(s)), width {a.width}, S={a.simulations}, max_depth {a.max_depth}, "
          f"steps <= {a.step_max_tokens} tokens, last step <= {a.max_new_tokens}; median of {a.repeats}")
    print("\n| mode | wall s | nodes | nodes/s | gen tokens | tokens/s | engine calls | rows/call | peak RSS MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in MODES:
        r = med[m]
        print(f"| {m} | {r['wall_s']:.1f} | {r['nodes']} | {r['nodes_per_s']:.1f} | {r['generated_tokens']} | "
              f"{r['tokens_per_s']:.0f} | {r['engine_calls']} | {r['engine_rows'] / r['engine_calls']:.1f} | "
              f"{r['peak_rss_mb']:.0f} |")
    print(f"\nlockstep / sequential: nodes/s {ratio['nodes_per_s']:.2f}x, tokens/s {ratio['tokens_per_s']:.2f}x")
    print(f"agreement: nodes {L['nodes']} vs {S['nodes']} (diff {same['nodes_diff']:+d}), tokens {L['generated_tokens']} vs "
          f"{S['generated_tokens']} (diff {same['tokens_diff']:+d}, {same['tokens_diff_pct']:+.2f}%), identical trees "
          f"{same['identical_trees']}/{len(problems)}, repeats deterministic: {same['repeats_deterministic']}")
    print(f"load average before {tuple(round(x, 2) for x in load_before)}, after {tuple(round(x, 2) for x in load_after)}; "
          f"runtime {runtime:.0f} s\nJSON: {os.path.relpath(a.out, REPO)}")


if __name__ == "__main__":
    main()
