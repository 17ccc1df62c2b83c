"""The built-in HF engine: its own decode step (``rollout.fast_decode=true``) vs the model's forward,
and both against the engine as it was when issue 15 was filed (``--baseline``).

    python bench/hf_engine.py                 # GRPO bench shape: 4 prompts x G=8 x 128 tokens, 7 repeats
    python bench/hf_engine.py --prompts 64    # a large batch: 512 rows at once
    python bench/hf_engine.py --baseline none # only the two current modes
    python bench/hf_engine.py --baseline 58c3ee1 --modes fast,static --threads 1 --clock process
                                              # issue 46: today's engine against the one before it (and its
                                              # GPU shapes on the CPU), in CPU seconds on a shared machine

Both sides are built as the RL recipe builds its engine (``relign.recipes.build.engine_for``,
public API) on the same tiny random Qwen2 model (``relign.models.tiny``, "small", 10.4M
parameters, fp32, CPU), one with ``fast_decode=True`` (the default) and one with
``fast_decode=False`` (transformers' forward at every decode step, relign's preallocated KV
cache on both), and called as the recipe calls them: ``generate`` with one seed per prompt,
G = 8, exactly ``--max-new-tokens`` tokens (``ignore_eos``), temperature 1. The two engines
live in one process and take turns (A B B A ...), each call on the next ``--prompts`` GSM8K
training questions, so both see the same machine state; one untimed call each first. Checked
every round: exactly the forced number of tokens on both sides, and how much of each row is
identical (the same seeds; a row parts only where a uniform falls within float rounding of a
step of the CDF, after which its continuation differs).

The baseline (``--baseline REV``, default ``c54633a``, the last commit before the RL-core work
and issue 15's engine changes): that commit's ``relign/rollout/engine.py`` and
``hf_engine.py``, read with ``git show`` into a scratch package and driven through that
version's own public ``HFEngine.generate`` on the same model object, in the same rotation.
That engine ran transformers' forward at every token over a stock ``DynamicCache`` (which
concatenates the whole cache at every token) under ``no_grad``; it took one seed per call
(per-prompt seeds came later), so its tokens are not compared with the others', only counted.
A later revision's engine (one whose ``generate`` takes ``seeds``) gets the same per-prompt seeds,
and its tokens are checked equal to today's in every row. The revision's own rollout modules are
loaded (engine, hf_engine, fast_decode, prefix_cache); what they import from the rest of relign is
today's.
Reported: median and range of tokens/s over the repeats, and the ratio of the medians.
Output: a markdown table on stdout and bench/results/hf_engine.json. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_throughput import _median  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
GSM8K = REPO / "relign" / "envs" / "data" / "gsm8k_train_512.jsonl"
RESULTS = REPO / "bench" / "results" / "hf_engine.json"
BASELINE = "c54633a"  # the engine when issue 15 was filed: model forward + DynamicCache at every token


def engine_at(rev: str):
    """The ``HFEngine`` and ``SamplingParams`` classes of revision ``rev``, loaded from ``git show``
    into a scratch package (``relign_at_<rev>.rollout``), so they run beside today's. The engine's
    own rollout modules come from ``rev`` (those it had); what they import from the rest of relign
    (``from ..models ...``) is today's."""
    import importlib
    import subprocess

    pkg = Path(tempfile.mkdtemp(prefix="hf-engine-baseline-")) / f"relign_at_{rev}"
    (pkg / "rollout").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "rollout" / "__init__.py").write_text("")
    for name in ("engine.py", "hf_engine.py", "fast_decode.py", "prefix_cache.py"):
        got = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:relign/rollout/{name}"], capture_output=True, text=True)
        if got.returncode == 0:
            (pkg / "rollout" / name).write_text(got.stdout.replace("from ..", "from relign."))
    sys.path.insert(0, str(pkg.parent))
    hf = importlib.import_module(f"{pkg.name}.rollout.hf_engine")
    return hf.HFEngine, importlib.import_module(f"{pkg.name}.rollout.engine").SamplingParams


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--baseline", default=BASELINE, help="a git revision whose HF engine joins the rotation, or 'none'")
    p.add_argument("--clock", choices=("wall", "process"), default="wall",
                   help="process: this process's CPU seconds (time.process_time), steadier than wall seconds on a "
                        "shared machine; with --threads 1 they are the work done")
    p.add_argument("--modes", default="fast,forward", help="today's engines in the rotation: fast (its own decode "
                   "step), forward (the model's forward at every step), static (its own step under the GPU's static "
                   "shapes, eager)")
    a = p.parse_args(argv)

    import torch
    import transformers

    import relign
    from relign.config import ModelConfig
    from relign.models.loading import load_causal_lm, load_tokenizer
    from relign.models.tiny import build_tiny_model
    from relign.recipes.build import engine_for
    from relign.rollout.engine import SamplingParams, derive_seed
    from relign.rollout.fast_decode import DecodePlan

    torch.set_num_threads(a.threads)
    model_dir = os.path.join(tempfile.mkdtemp(prefix="hf-engine-bench-"), "model")
    build_tiny_model(model_dir, arch="qwen2", size="small")
    tok, policy = load_tokenizer(model_dir), load_causal_lm(model_dir)
    questions = [json.loads(line)["question"] for line in open(GSM8K)]
    prompts = [tok(q)["input_ids"] for q in questions]
    engines = {mode: engine_for("hf", policy, tok, max_batch_rows=256, seed=0, m=ModelConfig(path=model_dir),
                                fast_decode=(mode != "forward")) for mode in a.modes.split(",")}
    if "static" in engines:  # the GPU's static shapes (buckets, whole-capacity attention, a read every 16), eager
        engines["static"].plan = dataclasses.replace(DecodePlan.for_device("cuda"), capture="none")
    params = SamplingParams(n=a.group, temperature=1.0, max_new_tokens=a.max_new_tokens, ignore_eos=True)
    base = None
    if a.baseline != "none":
        BaseEngine, BaseParams = engine_at(a.baseline)
        base = BaseEngine(policy, tok, max_batch_rows=256, seed=0)

    per_prompt = base is not None and "seeds" in inspect.signature(base.generate).parameters

    def generate(mode: str, batch: list[list[int]], seeds: list[int]):
        if mode == "baseline":
            bp = BaseParams(n=a.group, temperature=1.0, max_new_tokens=a.max_new_tokens, ignore_eos=True)
            if per_prompt:
                return base.generate(batch, bp, seeds=seeds)
            bp.seed = seeds[0]  # a version before per-prompt seeds took one seed per call
            return base.generate(batch, bp)
        return engines[mode].generate(batch, params, seeds=seeds)

    modes = [*engines, *(["baseline"] if base is not None else [])]
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    tokens = a.prompts * a.group * a.max_new_tokens
    times: dict[str, list[float]] = {m: [] for m in modes}
    agree: list[float] = []
    same_base: list[bool] = []
    for rnd in range(a.repeats + 1):  # round 0: untimed warm-up
        start = (rnd * a.prompts) % (len(prompts) - a.prompts)
        batch = prompts[start : start + a.prompts]
        seeds = [derive_seed(rnd, i) for i in range(len(batch))]
        outs = {}
        for mode in modes[rnd % len(modes):] + modes[: rnd % len(modes)]:  # each mode takes each place in turn
            t0 = clock()
            outs[mode] = generate(mode, batch, seeds)
            if rnd:
                times[mode].append(clock() - t0)
        ids = {m: [c.token_ids for g in o for c in g] for m, o in outs.items()}
        assert all(sum(map(len, v)) == tokens for v in ids.values())
        # same seeds: a row stays identical until a uniform lands within float rounding of a CDF step
        if "forward" in ids:
            same_prefix = [next((i for i, (x, y) in enumerate(zip(r, q)) if x != y), len(r)) for r, q in zip(ids["fast"], ids["forward"])]
            agree.append(sum(same_prefix) / tokens)
        if per_prompt:  # the same seeds per prompt: the baseline's tokens too
            same_base.append(ids["fast"] == ids["baseline"])
        print(f"[{rnd}/{a.repeats}] " + "  ".join(f"{m} {times[m][-1]:.3f} s" for m in times if rnd), file=sys.stderr,
              flush=True)
    tps = {m: [tokens / t for t in v] for m, v in times.items()}
    med = {m: _median(v) for m, v in tps.items()}
    out = {
        "benchmark": "hf_engine", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", "bench/hf_engine.py", *(argv if argv is not None else sys.argv[1:])]),
        "setup": {"model": "relign.models.tiny.build_tiny_model(arch='qwen2', size='small')", "prompts": a.prompts,
                  "group": a.group, "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "dtype": "fp32",
                  "threads": a.threads, "clock": a.clock},
        "env": {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
                "torch": torch.__version__, "transformers": transformers.__version__, "relign": relign.__version__,
                "load_avg_after": os.getloadavg()},
        "seconds": times, "tokens_per_s": tps, "median_tokens_per_s": med,
        "speedup_fast_over_forward": med["fast"] / med["forward"] if "forward" in med else None,
        "baseline": None if a.baseline == "none" else a.baseline,
        "speedup_fast_over_baseline": med["fast"] / med["baseline"] if "baseline" in med else None,
        # the same round's calls ran on the same prompts and machine state: their ratio is the least noisy
        "per_round_fast_over_baseline": [b / f for f, b in zip(times["fast"], times["baseline"])] if "baseline" in med else None,
        "tokens_before_first_difference_share": agree,
        "baseline_tokens_identical": all(same_base) if per_prompt else None,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nHF engine: {a.prompts} prompts x G={a.group} x {a.max_new_tokens} tokens, tiny qwen2 'small' fp32, "
          f"{a.threads} threads, {a.repeats} alternating repeats, {a.clock} seconds, median (range)\n")
    print("| decode step | tokens/s |\n|---|---:|")
    rows = [("baseline", f"the engine at {a.baseline}" + (" (issue 15 filed): model forward, `DynamicCache`"
                                                            if a.baseline == BASELINE else "")),
            ("forward", "the model's forward (`rollout.fast_decode=false`)"), ("fast", "relign's own step (default)"),
            ("static", "relign's own step under the GPU's static shapes, eager")]
    for m, label in rows:
        if m not in med:
            continue
        print(f"| {label} | {med[m]:,.0f} ({min(tps[m]):,.0f}–{max(tps[m]):,.0f}) |")
    if "forward" in med:
        print(f"\nfast / forward: {out['speedup_fast_over_forward']:.2f}x; tokens sampled identically before a row's first "
              f"difference: {100 * min(agree):.1f}-{100 * max(agree):.1f}% (float rounding at a CDF step)")
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if "baseline" in med:
        paired = out["per_round_fast_over_baseline"]
        print(f"fast / the engine at {a.baseline}: {out['speedup_fast_over_baseline']:.2f}x (per round: median "
              f"{_median(paired):.2f}x, {min(paired):.2f}-{max(paired):.2f}x)"
              + (f"; the same tokens as it in every row of every round: {all(same_base)}" if per_prompt else ""))


if __name__ == "__main__":
    main()
