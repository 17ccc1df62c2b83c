"""The shipped calibration example at every single-room q: held-out ECE after the warm start and after GRPO.

    PYTHONPATH=. python bench/calibration_table.py OUT [--qs 0.1,0.2,0.3,0.7,0.8,0.9] [--rl k=v ...] [--sft k=v ...]

The pipeline of docs/calibration.md, through the real command line, one process at a time with one
thread (OMP_NUM_THREADS=1):

    relign sft examples/calibration_warm.yaml                                   once (it does not see q)
    relign rl examples/calibration.yaml task.features='{room: q}'               per q
    relign eval MODEL task.name=calibration task.features='{room: q}' task.chat=false task.max_rows=200
        task.reward_workers=0 scorer=reader temperature=1.0 max_new_tokens=8 seed=123      warm start and after, per q

Only ``task.features`` changes between the rows (``--rl`` / ``--sft`` add overrides to every run, to
try settings before they go into the presets). Per q it prints ``calib/ece`` before and after (the
reader's top answer; no answer counts as confidence 1 and wrong), the mean stated P(left) of the
samples that state one (``conf: N`` read with a regex here), ``calib/no_answer_frac`` after, and the
seconds of each stage, start-up included; ``OUT/table.json`` keeps the rows and the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QS = (0.1, 0.2, 0.3, 0.7, 0.8, 0.9)
CONF = re.compile(r"conf:\s*(\d+)")
QUIET = ["logging.progress=false", "logging.tensorboard=false"]


def relign(*args: str) -> float:
    """Run ``python -m relign ARGS`` in a fresh process with one thread; returns its wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "relign", *args], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"relign {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def newest_checkpoint(run: Path) -> Path:
    return max((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def evaluate(model: Path, q: float, out: Path) -> dict:
    seconds = relign("eval", f"model.path={model}", "task.name=calibration", f"task.features={{room: {q}}}", "task.chat=false",
                     "task.max_rows=200", "task.reward_workers=0", "scorer=reader", "temperature=1.0", "max_new_tokens=8",
                     "seed=123", f"run_dir={out}", *QUIET)
    metrics = json.loads((out / "eval.json").read_text())["metrics"]
    stated = []
    for line in (out / "samples.jsonl").read_text().splitlines():
        m = CONF.fullmatch(json.loads(line)["response"].strip())
        if m and int(m[1]) <= 10:
            stated.append(int(m[1]) / 10)
    return {"ece": metrics["calib/ece"], "brier": metrics["calib/brier"], "accuracy": metrics["calib/accuracy"],
            "no_answer_frac": metrics["calib/no_answer_frac"], "stated": len(stated),
            "mean_p_left": sum(stated) / len(stated) if stated else float("nan"), "eval_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--qs", default=",".join(map(str, QS)))
    ap.add_argument("--rl", nargs="*", default=[], help="extra overrides of every relign rl run")
    ap.add_argument("--sft", nargs="*", default=[], help="extra overrides of the warm start")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    warm_run = out / "warm"
    sft_s = relign("sft", "examples/calibration_warm.yaml", f"run_dir={warm_run}", *args.sft, *QUIET)
    warm = newest_checkpoint(warm_run)
    rows = []
    print(f"warm start: {sft_s:.1f}s ({warm})")
    print(f"{'q':>4} {'ECE before':>10} {'ECE after':>9} {'ratio':>6} {'P(left) before':>14} {'after':>6} "
          f"{'no answer':>9} {'rl s':>6} {'pipeline s':>10}", flush=True)
    for q in [float(x) for x in args.qs.split(",")]:
        before = evaluate(warm, q, out / f"eval_warm_{q}")
        run = out / f"rl_{q}"
        rl_s = relign("rl", "examples/calibration.yaml", f"model.path={warm}", f"task.features={{room: {q}}}", f"run_dir={run}",
                      *args.rl, *QUIET)
        after = evaluate(newest_checkpoint(run), q, out / f"eval_{q}")
        row = {"q": q, "before": before, "after": after, "sft_s": sft_s, "rl_s": rl_s,
               "pipeline_s": sft_s + rl_s + after["eval_s"]}
        rows.append(row)
        print(f"{q:>4} {before['ece']:>10.3f} {after['ece']:>9.3f} {after['ece'] / before['ece']:>6.2f} "
              f"{before['mean_p_left']:>14.3f} {after['mean_p_left']:>6.3f} {after['no_answer_frac']:>9.3f} {rl_s:>6.1f} "
              f"{row['pipeline_s']:>10.1f}", flush=True)
    (out / "table.json").write_text(json.dumps({"rl": args.rl, "sft": args.sft, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
