"""SFT warm start, then GRPO, on reasoning-gym's chain_sum; held-out accuracy before and after.

    PYTHONPATH=. python bench/rg_learning.py OUT --model tiny:shallow --sft-steps 300 --rl-steps 40 --rl-lr 1e-4

1. the training problems: ``task.name=reasoning_gym``, chain_sum with 3 one-digit terms,
   ``task.rg.size`` of them from the run's seed (``relign.envs.reasoning_gym``);
2. SFT on them: the worked steps and the tagged answer (``4+5=9, 9-3=6. <answer>6</answer>``),
   or, a ``--direct-frac`` share, the tagged answer alone;
3. ``relign eval`` of the SFT checkpoint on the held-out problems (``eval_seed(seed)``, minus the
   training questions), ``--eval-n`` samples per problem at temperature 1;
4. GRPO from the SFT checkpoint (``examples/rg_chain_sum.yaml``'s settings, ``--rl-steps`` steps);
5. the same eval of the GRPO checkpoint.

Prints one JSON line: the accuracies, the held-out count and the seconds of each stage.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from relign.config import load_config
from relign.envs.tasks import get_task
from relign.recipes import eval as eval_recipe
from relign.recipes import rl, sft

CONFIG = {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}
LOG = ["logging.tensorboard=false", "logging.progress=false"]


def worked(expression: str) -> str:
    """``4 + 5 - 3`` -> ``4+5=9, 9-3=6. <answer>6</answer>`` (one operation per step)."""
    t = expression.split()
    total, steps = int(t[0]), []
    for op, n in zip(t[1::2], t[2::2]):
        new = total + int(n) if op == "+" else total - int(n)
        steps.append(f"{total}{op}{n}={new}")
        total = new
    return ", ".join(steps) + f". <answer>{total}</answer>"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="tiny:shallow")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=2000, help="training problems (task.rg.size)")
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--direct-frac", type=float, default=0.0)
    p.add_argument("--rl-steps", type=int, default=40)
    p.add_argument("--rl-lr", type=float, default=1e-4)
    p.add_argument("--eval-rows", type=int, default=100)
    p.add_argument("--eval-n", type=int, default=4)
    a = p.parse_args(argv)
    rg = ["task.name=reasoning_gym", "task.chat=false", "task.rg.system_prompt=''", f"task.rg.size={a.train}",
          "task.reward_workers=0", f"task.rg.config={{chain_sum: {json.dumps(CONFIG)}}}", f"seed={a.seed}"]
    task = get_task("reasoning_gym", chat=False, rg={"system_prompt": "", "size": a.train, "config": {"chain_sum": CONFIG}})
    rng = random.Random(a.seed)
    rows = []
    for r in task.load(seed=a.seed):
        expression = r["prompt"].split(": ", 1)[1].rstrip(" =")
        answer = f"<answer>{r['extra_info']['answer']}</answer>"
        rows.append({"prompt": r["prompt"], "response": answer if rng.random() < a.direct_frac else worked(expression)})
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    times = {}

    def evaluate(model: Path, name: str) -> dict:
        t0 = time.perf_counter()
        cfg = load_config(eval_recipe.Config, None, [f"model.path={model}", *rg, f"task.max_rows={a.eval_rows}",
                                                     f"n={a.eval_n}", "temperature=1.0", "max_new_tokens=32",
                                                     f"run_dir={a.out / name}", "logging.progress=false"])
        eval_recipe.train(cfg)
        times[name] = time.perf_counter() - t0
        return json.loads((a.out / name / "eval.json").read_text())["metrics"]

    t0 = time.perf_counter()
    sft.train(load_config(sft.Config, None, [f"model.path={a.model}", f"data.path={a.out / 'sft.jsonl'}",
                                             "data.chat_template=false", f"max_steps={a.sft_steps}", "batch_size=32",
                                             "micro_batch_size=32", f"optim.lr={a.sft_lr}", f"seed={a.seed}",
                                             f"run_dir={a.out / 'sft'}", *LOG]))
    times["sft"] = time.perf_counter() - t0
    warm = a.out / "sft" / "checkpoints" / f"step_{a.sft_steps}"
    before = evaluate(warm, "eval_sft")
    t0 = time.perf_counter()
    rl.train(load_config(rl.Config, None, [f"model.path={warm}", *rg, "rollout.n=8", "rollout.max_new_tokens=32",
                                           "rollout.temperature=1.0", "prompts_per_step=16", f"max_steps={a.rl_steps}",
                                           f"optim.lr={a.rl_lr}", "optim.schedule=constant", "eval.every=0",
                                           "traces_per_step=0", f"run_dir={a.out / 'rl'}", *LOG]))
    times["rl"] = time.perf_counter() - t0
    after = evaluate(a.out / "rl" / "checkpoints" / f"step_{a.rl_steps}", "eval_rl")
    print(json.dumps({"accuracy_sft": before["accuracy"], "accuracy_rl": after["accuracy"],
                      "heldout_problems": before["num_problems"], "seconds": {k: round(v, 1) for k, v in times.items()},
                      "args": {k: str(v) for k, v in vars(a).items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
