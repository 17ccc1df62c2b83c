"""The demo's GRPO stage in the two prompt-once layouts: packed (the default where varlen
applies) against padded rows over the prompt's KV cache.

    relign demo run_dir=/tmp/demo_s0                      # once: its rl/config.yaml and SFT checkpoint
    python bench/demo_rl_layouts.py /tmp/demo_s0 --steps 120

Runs ``rl.train`` from the demo's own GRPO config (its warm start, task and settings) for
``--steps`` steps, once per layout, one after the other in fresh processes, no evaluation and no
checkpoints, and sums the recipe's stage timers (``time/step_s``, ``time/rollout_s``,
``time/update_s``) over the steps after ``--skip``. The KV-cache layout is forced by making
``relign.models.varlen.supported`` report every model unsupported, which is what ``rl.train``
does for a model varlen does not cover.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEYS = ("time/step_s", "time/rollout_s", "time/update_s")


def _worker(demo_dir: str, layout: str, steps: int, out: str) -> None:
    sys.path.insert(0, str(REPO))
    import relign.models.varlen as varlen
    from relign.config import load_config
    from relign.recipes import rl

    if layout == "kv-cache":
        varlen.supported = lambda model: "forced off by bench/demo_rl_layouts.py"
    cfg = load_config(rl.Config, str(Path(demo_dir) / "rl" / "config.yaml"),
                      [f"run_dir={out}", f"max_steps={steps}", "eval.every=0", "checkpoint.save_final=false",
                       "checkpoint.save_every=0", "logging.progress=false", "resume=none"])
    rl.train(cfg)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("demo_dir", help="a finished `relign demo` run directory")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--skip", type=int, default=20, help="first steps left out of the sums (default 20)")
    p.add_argument("--worker", choices=("packed", "kv-cache"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(a.demo_dir, a.worker, a.steps, a.out)
        return
    print(f"load average before: {os.getloadavg()}")
    for layout in ("packed", "kv-cache"):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, __file__, a.demo_dir, "--steps", str(a.steps), "--worker", layout, "--out", tmp],
                           check=True, capture_output=True)
            rows = [json.loads(line) for line in open(Path(tmp) / "metrics.jsonl")]
        rows = [r for r in rows if "time/step_s" in r][a.skip:]
        sums = {k: round(sum(r[k] for r in rows), 1) for k in KEYS}
        print(layout, sums, "mean reward", round(sum(r["reward/mean"] for r in rows) / len(rows), 4))


if __name__ == "__main__":
    main()
