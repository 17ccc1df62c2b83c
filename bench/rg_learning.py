"""SFT warm start, then GRPO, on reasoning-gym's aiw (siblings); held-out accuracy before and after.

    PYTHONPATH=. python bench/rg_learning.py OUT --seed 1

The setup of ``tests/recipes/test_rg_learning.py``, with every knob an option:

1. the problems: ``task.name=reasoning_gym``, ``aiw`` restricted to its siblings questions
   ("Susan has 5 sisters and she also has 3 brothers. How many sisters does James's brother
   have?", answer 6), ``--train`` of them from ``--seed``, the held-out ones from ``eval_seed(seed)``
   minus every training question (``Task.load_heldout``);
2. SFT on the training problems' worked answers (``" 5+1=6. <answer>6</answer>"``; a
   ``--direct-frac`` share gives the tagged answer alone), ``--sft-steps`` x 32;
3. held-out accuracy of the warm start: ``--eval-n`` samples per problem at temperature 1 (and one
   greedy), read by this file (the last ``<answer>`` against the sisters in the question plus one);
4. GRPO from the warm start, reasoning-gym's grader as the reward, ``--rl-steps`` steps of
   16 prompts x 8 samples;
5. the same held-out accuracy after.

Prints one JSON line: the accuracies, the paired standard error of the gain, the held-out count
and the seconds of each stage. ``--model`` defaults to the suite's ``tiny:micro`` (built in
``OUT/model``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from relign.config import load_config
from relign.envs.tasks import get_task
from relign.recipes import rl, sft

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.recipes.test_rg_learning import SIBLINGS, accuracy, paired_gain, rg_overrides, truth, worked  # noqa: E402

LOG = ["logging.tensorboard=false", "logging.progress=false"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="", help="a model folder (default: tiny:micro built in OUT/model)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--train", type=int, default=1000, help="training problems (task.rg.size)")
    p.add_argument("--heldout", type=int, default=400, help="held-out problems generated (before dropping)")
    p.add_argument("--sft-steps", type=int, default=225)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--sft-schedule", default="cosine")
    p.add_argument("--direct-frac", type=float, default=0.0)
    p.add_argument("--rl-steps", type=int, default=100)
    p.add_argument("--rl-lr", type=float, default=1e-3)
    p.add_argument("--rl-warmup", type=int, default=0)
    p.add_argument("--eval-n", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    model = a.model
    if not model:
        from relign.models.tiny import build_tiny_model

        model = str(a.out / "model")
        build_tiny_model(model, arch="qwen2", size="micro", seed=0)
    opts = {"system_prompt": "", "size": a.train, "eval_size": a.heldout, "datasets": {"aiw": 1.0}, "config": {"aiw": SIBLINGS}}
    task = get_task("reasoning_gym", chat=False, rg=opts)
    train = task.load(seed=a.seed)
    heldout, dropped = task.load_heldout(seed=a.seed, train_rows=a.train)
    questions = [r["prompt"] for r in heldout]
    rng = random.Random(a.seed)
    rows = [{"prompt": r["prompt"], "response": f" <answer>{truth(r['prompt'])}</answer>" if rng.random() < a.direct_frac
             else worked(r["prompt"])} for r in train]
    (a.out / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [f"seed={a.seed}", *LOG]
    times = {}
    t0 = time.perf_counter()
    warm = sft.train(load_config(sft.Config, None, [
        f"model.path={model}", f"data.path={a.out / 'sft.jsonl'}", f"run_dir={a.out / 'sft'}", f"max_steps={a.sft_steps}",
        "batch_size=32", "micro_batch_size=32", f"optim.lr={a.sft_lr}", f"optim.schedule={a.sft_schedule}", "data.eval_fraction=0", *common]))
    times["sft"] = time.perf_counter() - t0

    def measure(path) -> tuple[list[float], float]:
        t0 = time.perf_counter()
        sampled = accuracy(path, questions, a.eval_n)
        greedy = accuracy(path, questions, samples=1, temperature=0.0)  # what sharpening at temperature 1 can reach
        greedy_ok = sum(greedy) / len(greedy)
        times.setdefault("eval", 0.0)
        times["eval"] += time.perf_counter() - t0
        return sampled, greedy_ok

    before, greedy_before = measure(warm.checkpoint)
    t0 = time.perf_counter()
    rl.train(load_config(rl.Config, None, [
        f"model.path={warm.checkpoint}", *rg_overrides(a.train), "rollout.n=8", "prompts_per_step=16", "rollout.max_new_tokens=16",
        "rollout.temperature=1.0", "algorithm.scale_rewards=std", f"optim.lr={a.rl_lr}", "optim.schedule=constant",
        f"optim.warmup_steps={a.rl_warmup}", f"max_steps={a.rl_steps}", "traces_per_step=0", f"run_dir={a.out / 'rl'}",
        *common]))
    times["rl"] = time.perf_counter() - t0
    after, greedy_after = measure(a.out / "rl" / "checkpoints" / f"step_{a.rl_steps}")
    _, se = paired_gain(before, after)
    print(json.dumps({"accuracy_sft": round(sum(before) / len(before), 4), "accuracy_rl": round(sum(after) / len(after), 4),
                      "greedy_sft": round(greedy_before, 4), "greedy_rl": round(greedy_after, 4), "gain_se": round(se, 4),
                      "heldout_problems": len(questions), "dropped": dropped,
                      "seconds": {k: round(v, 1) for k, v in times.items()},
                      "args": {k: str(v) for k, v in vars(a).items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
