"""GRPO vs PPO vs VinePPO vs TRPO on the demo's arithmetic task, at equal wall-clock.

    python bench/credit_compare.py [--seconds 150] [--seeds 0] [--out bench/results/credit_compare.json]

1. ``relign demo`` builds the tiny model, the arithmetic problems and the SFT warm start once
   (``demo.steps=1``: its own GRPO stage is a single step and is not used).
2. Each method trains from that SFT checkpoint with the demo's RL settings (16 problems x 8
   samples per step, one torch thread) until ``max_seconds`` of training, then its last
   checkpoint is evaluated on the 200 held-out problems (8 samples each at T = 1: pass@1)
   with ``relign eval`` — all through the CLI.
3. The table: held-out accuracy at equal wall-clock, steps done, the final training reward,
   the Monte-Carlo tokens per step relative to the policy's (VinePPO), and the share of the
   step spent estimating values (``time/values_s``). Reward curves against wall-clock are
   written to the JSON (and each method's run has its report.html).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "credit_compare.json"

METHODS = {  # name -> relign rl overrides on top of the demo's RL config
    "grpo": [],
    "ppo": ["algorithm.advantage=gae", "algorithm.loss_agg=token-mean", "critic.lr=1e-4", "algorithm.ppo_epochs=2",
            "algorithm.mini_batches=2", "algorithm.lam=0.95"],
    "vineppo": ["algorithm.advantage=vine", "algorithm.loss_agg=token-mean", "vine.k=4", "vine.max_steps=2"],
    "trpo": ["update=trpo", "algorithm.scale_rewards=std", "trpo.max_kl=0.001", "trpo.damping=0.01", "trpo.fvp_subsample=2",
             "optim.schedule=constant", "optim.warmup_steps=0", "optim.lr=1e-6"],
}


def relign(*args: str, log: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "relign", *args], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"relign {args[0]} failed (exit {proc.returncode}); see {log}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_method(name: str, base: Path, seed: int, seconds: float) -> dict:
    out = base / f"{name}_seed{seed}"
    sft = sorted((base / "sft" / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    t0 = time.perf_counter()
    relign("rl", str(base / "rl" / "config.yaml"), f"model.path={sft}", f"run_dir={out}", f"seed={seed}", "max_steps=100000",
           f"max_seconds={seconds}", "eval.every=0", "logging.progress=false", "logging.tensorboard=false",
           "traces_per_step=0", *METHODS[name], log=base / f"{name}_seed{seed}.log")
    wall = time.perf_counter() - t0
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    ckpt = sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    ev = out / "eval"
    relign("eval", f"model.path={ckpt}", "task.name=relign.envs.arith:task", f"task.path={base / 'data' / 'test.jsonl'}",
           "task.reward_workers=0", "n=8", "temperature=1.0", "max_new_tokens=64", f"seed={seed}", f"run_dir={ev}",
           "logging.progress=false", "logging.tensorboard=false", log=base / f"{name}_seed{seed}_eval.log")
    m = json.loads((ev / "eval.json").read_text())["metrics"]
    t_first = rows[0]["time"] - rows[0].get("time/step_s", 0.0)
    step_s = sum(r["time/step_s"] for r in rows)
    out_row = {
        "method": name, "seed": seed, "steps": len(rows), "train_s": step_s, "wall_s": wall,
        "heldout_pass@1": m["accuracy"], "heldout_maj@8": m.get("maj@8"), "final_reward": rows[-1]["reward/mean"],
        "reward_last5": sum(r["reward/mean"] for r in rows[-5:]) / min(5, len(rows)),
        "curve": [[round(r["time"] - t_first, 2), r["reward/mean"]] for r in rows],
    }
    if name == "vineppo":
        mc = sum(r["vine/mc_tokens"] for r in rows)
        out_row["mc_tokens_per_policy_token"] = mc / max(1.0, sum(r["vine/policy_tokens"] for r in rows))
        out_row["values_share"] = sum(r["time/values_s"] for r in rows) / step_s
    return out_row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=150.0, help="training wall-clock per method")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--sft-steps", type=int, default=1000)
    ap.add_argument("--work", default="runs/credit_compare", help="where the runs go")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    base = REPO / a.work
    load0 = os.getloadavg()
    if not (base / "sft" / "checkpoints").is_dir():
        base.mkdir(parents=True, exist_ok=True)
        relign("demo", f"run_dir={base}", "demo.steps=1", "demo.eval_every=0", f"demo.sft_steps={a.sft_steps}",
               "logging.progress=false", "logging.tensorboard=false", log=base.parent / f"{base.name}_demo.log")
    rows = [run_method(m, base, s, a.seconds) for s in a.seeds for m in a.methods]
    # rows of other methods or seeds already in --out are kept (a method re-run replaces its own)
    done = {(r["method"], r["seed"]) for r in rows}
    if Path(a.out).is_file():
        rows = [r for r in json.loads(Path(a.out).read_text())["rows"] if (r["method"], r["seed"]) not in done] + rows
    print(f"| method | seed | steps in {a.seconds:.0f} s | held-out pass@1 | maj@8 | train reward (last 5) | MC / policy tokens | value share |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['seed']} | {r['steps']} | {r['heldout_pass@1']:.3f} | {r['heldout_maj@8'] or 0:.3f} | "
              f"{r['reward_last5']:.3f} | {r.get('mc_tokens_per_policy_token', 0):.1f} | {r.get('values_share', 0):.0%} |")
    for r in rows:
        r.setdefault("date", datetime.now(timezone.utc).isoformat(timespec="seconds"))
        r.setdefault("load", [load0, os.getloadavg()])
        r.setdefault("overrides", METHODS[r["method"]])
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
              "cpus": os.cpu_count(), "load_before": load0, "load_after": os.getloadavg(),
              "command": " ".join(["python", "bench/credit_compare.py", *sys.argv[1:]]), "seconds": a.seconds,
              "methods": METHODS, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
