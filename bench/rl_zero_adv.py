"""The RL update with and without skipping zero-advantage groups (``algorithm.skip_zero_adv``).

    relign demo run_dir=runs/demo-bench                                   # any demo run: its rl/config.yaml
    python bench/rl_zero_adv.py --config runs/demo-bench/rl/config.yaml   # 2 repeats x 2 settings, ~12 min

Runs ``relign rl CONFIG`` through the CLI (fresh process each, settings alternating: on, off,
off, on, ...) from the demo's SFT checkpoint for ``--steps`` GRPO steps, held-out eval and
the final checkpoint off, and reads each run's ``metrics.jsonl``: the update's seconds
(``time/update_s``), the whole step's, and the share of rows whose group had zero advantage
(``actor/zero_adv_frac``). The first step must give the same loss and gradient norm both ways
(the skipped rows add exactly nothing); later steps drift apart by float rounding, which
changes sampled tokens. Output: a table and bench/results/rl_zero_adv.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "rl_zero_adv.json"


def _run(config: str, skip: bool, steps: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "relign", "rl", config, f"max_steps={steps}", f"algorithm.skip_zero_adv={str(skip).lower()}",
           "eval.every=0", "checkpoint.save_final=false", "logging.progress=false", "logging.tensorboard=false",
           f"run_dir={run_dir}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    rows = [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "time/update_s" in r]
    return {
        "skip": skip, "wall_s": wall, "load_avg": os.getloadavg()[0],
        "update_s": sum(r["time/update_s"] for r in rows), "step_s": sum(r["time/step_s"] for r in rows),
        "rollout_s": sum(r["time/rollout_s"] for r in rows),
        "zero_adv_frac": sum(r["actor/zero_adv_frac"] for r in rows) / len(rows),
        "first": {k: rows[0][k] for k in ("actor/loss", "actor/grad_norm", "reward/mean")},
        "steps": len(rows),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a demo run's rl/config.yaml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="zero-adv-") as tmp:
        for rep in range(a.repeats):
            order = (True, False) if rep % 2 == 0 else (False, True)
            for skip in order:
                r = _run(a.config, skip, a.steps, Path(tmp) / f"{rep}-{skip}")
                runs.append(r)
                print(f"repeat {rep} skip={skip}: update {r['update_s']:.1f} s, step {r['step_s']:.1f} s, "
                      f"zero-adv rows {r['zero_adv_frac']:.2f}, first loss {r['first']['actor/loss']:.8f}", flush=True)
    on = [r for r in runs if r["skip"]]
    off = [r for r in runs if not r["skip"]]
    for a_, b_ in zip(on, off):
        for k in ("actor/loss", "actor/grad_norm"):
            if abs(a_["first"][k] - b_["first"][k]) > 1e-5 * max(1.0, abs(b_["first"][k])):
                raise SystemExit(f"first-step {k} differs: {a_['first'][k]} vs {b_['first'][k]}")

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "command": "python bench/rl_zero_adv.py " + " ".join(argv if argv is not None else sys.argv[1:]), "runs": runs,
        "update_s": {"skip": med([r["update_s"] for r in on]), "no_skip": med([r["update_s"] for r in off])},
        "step_s": {"skip": med([r["step_s"] for r in on]), "no_skip": med([r["step_s"] for r in off])},
    }
    RESULTS.write_text(json.dumps(out, indent=1))
    u, s = out["update_s"], out["step_s"]
    print(f"\n| {a.steps} GRPO steps | skip_zero_adv=true | false | ratio |\n|---|---:|---:|---:|\n"
          f"| update seconds (median of {a.repeats}) | {u['skip']:.1f} | {u['no_skip']:.1f} | {u['no_skip'] / u['skip']:.2f}x |\n"
          f"| step seconds | {s['skip']:.1f} | {s['no_skip']:.1f} | {s['no_skip'] / s['skip']:.2f}x |\n"
          f"zero-advantage rows: {sum(r['zero_adv_frac'] for r in runs) / len(runs):.2f} of the batch on average; "
          f"first-step loss and grad norm equal both ways. {RESULTS}")


if __name__ == "__main__":
    main()
