"""GRPO learns on a reasoning-gym dataset: from a short SFT warm start it raises the accuracy on
held-out problems (generated from the eval seed, none of them a training question) by >= 15 points.

The dataset is reasoning-gym's ``aiw`` ("Alice in Wonderland") restricted to its siblings
questions: "Susan has 5 sisters and she also has 3 brothers. How many sisters does James's brother
have?" (answer: the sisters and Susan, 6). The warm start learns from 225 steps of 32 worked
answers ``" 5+1=6. <answer>6</answer>"``: its greedy answer is nearly always right, its samples at
temperature 1 about 60% of the time; 100 steps of GRPO (reasoning-gym's own grader as the reward)
make them right about 95% of the time on questions it never saw. Accuracy here is measured by this file's own code: the last ``<answer>...</answer>`` of
each sample against the number of sisters read from the question plus one.
"""

from __future__ import annotations

import json
import re

import pytest

from relign.config import load_config
from relign.recipes import rl, sft

from ..conftest import torch_threads

SIBLINGS = {"task_types": ["siblings"], "task_type_weights": [1.0]}
TRAIN, HELDOUT, SEED = 1000, 400, 1
SFT_STEPS, RL_STEPS = 225, 100
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
SISTERS = re.compile(r"(\d+) sisters\b")


def truth(question: str) -> int:
    """How many sisters the brother has: the girl's sisters, and the girl herself."""
    (n,) = SISTERS.findall(question)
    return int(n) + 1


def worked(question: str) -> str:
    n = truth(question)
    return f" {n - 1}+1={n}. <answer>{n}</answer>"


def rg_overrides(train: int) -> list[str]:
    """The reasoning-gym task of this test as ``relign rl`` overrides: aiw siblings, ``train`` problems."""
    return ["task.name=reasoning_gym", "task.chat=false", "task.rg.system_prompt=''", f"task.rg.size={train}",
            "task.reward_workers=0", "task.rg.datasets={aiw: 1}", f"task.rg.config={{aiw: {json.dumps(SIBLINGS)}}}"]


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """The mean per-question gain and its paired standard error."""
    gain = [a - b for a, b in zip(after, before)]
    mean = sum(gain) / len(gain)
    return mean, (sum((g - mean) ** 2 for g in gain) / (len(gain) - 1) / len(gain)) ** 0.5


def accuracy(model_dir, questions: list[str], samples: int = 4, temperature: float = 1.0) -> list[float]:
    """Per question, the share of ``samples`` answers at ``temperature`` that are right (fixed seeds)."""
    from transformers import AutoTokenizer

    from relign.models.loading import load_causal_lm
    from relign.rollout.engine import SamplingParams
    from relign.rollout.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine(load_causal_lm(str(model_dir)).eval(), tok, seed=123)
    outs = engine.generate([tok(q)["input_ids"] for q in questions],
                           SamplingParams(n=samples, temperature=temperature, max_new_tokens=16), seeds=list(range(len(questions))))
    right = []
    for q, group in zip(questions, outs):
        said = [ANSWER.findall(c.text) for c in group]
        right.append(sum(bool(a) and a[-1].strip() == str(truth(q)) for a in said) / samples)
    return right


@pytest.mark.slow(seconds=60)  # started first (conftest): the longest single tests
def test_grpo_raises_heldout_accuracy_on_reasoning_gym(tiny_model_dir, tmp_path):
    pytest.importorskip("reasoning_gym")
    from relign.envs.tasks import get_task

    opts = {"system_prompt": "", "size": TRAIN, "eval_size": HELDOUT, "datasets": {"aiw": 1.0}, "config": {"aiw": SIBLINGS}}
    task = get_task("reasoning_gym", chat=False, rg=opts)
    train = task.load(seed=SEED)
    heldout, dropped = task.load_heldout(seed=SEED, train_rows=TRAIN)
    questions = [r["prompt"] for r in heldout]
    assert {r["prompt"] for r in train}.isdisjoint(questions) and len(questions) + dropped == HELDOUT
    assert len(questions) >= 200 and all(str(truth(q)) == r["extra_info"]["answer"] for q, r in zip(questions, heldout))

    (tmp_path / "warm.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "response": worked(r["prompt"])}) + "\n"
                                                 for r in train))
    common = ["logging.progress=false", "logging.tensorboard=false", f"seed={SEED}"]
    with torch_threads(1):
        warm = sft.train(load_config(sft.Config, None, [
            f"model.path={tiny_model_dir}", f"data.path={tmp_path / 'warm.jsonl'}", f"run_dir={tmp_path / 'sft'}",
            f"max_steps={SFT_STEPS}", "batch_size=32", "micro_batch_size=32", "optim.lr=3e-3", "data.eval_fraction=0", *common]))
        before = accuracy(warm.checkpoint, questions)
        run = tmp_path / "rl"
        rl.train(load_config(rl.Config, None, [
            f"model.path={warm.checkpoint}", *rg_overrides(TRAIN), "rollout.n=8", "prompts_per_step=16", "rollout.max_new_tokens=16",
            "rollout.temperature=1.0", "algorithm.scale_rewards=std", "optim.lr=1e-3", "optim.schedule=constant",
            f"max_steps={RL_STEPS}", "traces_per_step=0", f"run_dir={run}", *common]))
        after = accuracy(run / "checkpoints" / f"step_{RL_STEPS}", questions)
    _, se = paired_gain(before, after)
    acc0, acc1 = sum(before) / len(before), sum(after) / len(after)
    print(f"held-out accuracy {acc0:.3f} -> {acc1:.3f} on {len(questions)} questions x 4 samples (paired SE {se:.3f})")
    assert 0.3 <= acc0 <= 0.8, acc0  # the warm start leaves room, and its groups hold right and wrong samples
    assert acc1 - acc0 >= 0.15, (acc0, acc1)
