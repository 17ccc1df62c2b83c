"""Does sampling the next batch while this one trains (rollout.overlap=thread) pay on this machine?

    python bench/async_overlap.py            # 3 runs (relign s=1 in turn, relign s=1 overlapped, TRL) x 2 repeats x 10 steps
    python bench/async_overlap.py --quick    # 1 repeat x 4 steps, a smoke test

The GRPO bench's shape and harness (bench/grpo_step.py: 4 prompts x G=8 x exactly 128 new
tokens, k3 KL to a frozen reference with beta 0.04, the 10.4M-parameter tiny "small" Qwen2, fp32,
CPU; every run a fresh process, interleaved, each timed step's fastest repeat), with relign run
twice at rollout.max_staleness=1 (algorithm.tis_cap=2, tis_mode=mask):

  stale   rollout.overlap=none: step k samples batch k+1, then trains on batch k, in turn
  async   rollout.overlap=thread: batch k+1 is sampled in a background thread, on the engine's
          own weight copy, while the main thread trains on batch k (joined before the sync)

Both do the same work and give the same numbers (tests/recipes/test_offpolicy.py checks it
bitwise), so the step time ratio is the overlap's gain. Against TRL's GRPOTrainer (synchronous:
it has no overlap on one process without a vLLM server) the usual checks apply: same prompts
each step, same generated-token count. Output: a table on stdout, bench/results/async_overlap.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_step  # noqa: E402
from sft_throughput import _median  # noqa: E402

RESULTS = grpo_step.REPO / "bench" / "results" / "async_overlap.json"


def _spread(values: list[float]) -> str:
    return f"{_median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--wait-quiet", type=float, default=60.0)
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    args = ["--engines", "stale,async", "--out", a.out, "--wait-quiet", str(a.wait_quiet)]
    args += ["--quick"] if a.quick else ["--steps", str(a.steps), "--repeats", str(a.repeats)]
    grpo_step.main(args)  # prints grpo_step's table (relign-stale is its headline column)

    res = json.loads(Path(a.out).read_text())
    runs = res["runs"]
    stale, overlapped, trl = runs["relign-stale"], runs["relign-async"], runs["trl"]

    def stage(run, key):
        return [st["relign_stage_seconds"].get(f"time/{key}_s", 0.0) for st in run["kept_steps"]]

    steps = {name: [st["step"] for st in run["kept_steps"]] for name, run in (("stale", stale), ("async", overlapped),
                                                                              ("trl", trl))}
    gain = _median(steps["stale"]) / _median(steps["async"])
    vs_trl = _median(steps["trl"]) / _median(steps["async"])
    lines = ["", "## overlap: relign s=1, overlap=thread vs overlap=none (and TRL GRPOTrainer)", "",
             "| | step s, median (range) | sampling in the main thread s | update s | waiting for the thread s |",
             "|---|---:|---:|---:|---:|"]
    for name, run in (("relign s=1 overlap=none", stale), ("relign s=1 overlap=thread", overlapped)):
        sampled = [x + y for x, y in zip(stage(run, "rollout"), stage(run, "reward"))]
        lines.append(f"| {name} | {_spread([st['step'] for st in run['kept_steps']])} | {_median(sampled):.3f} | "
                     f"{_median(stage(run, 'update')):.3f} | {_median(stage(run, 'rollout_wait')):.3f} |")
    lines.append(f"| TRL GRPOTrainer | {_spread(steps['trl'])} | | | |")
    lines += ["", f"overlap gain (step time none / thread): {gain:.2f}x (goal >= 1.3x); relign overlapped vs TRL: "
              f"{vs_trl:.2f}x (goal >= 2.5x)"]
    res["overlap"] = {"gain_none_over_thread": gain, "speedup_vs_trl": vs_trl}
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
