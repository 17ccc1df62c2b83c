"""Linguistic calibration learns: GRPO with the rule reader's log score moves a model that states
random confidences to the true probability (the synthetic ``calibration`` task)."""

from __future__ import annotations

import json
import random
import re

import pytest

from relign.config import load_config
from relign.envs.calibration import TEMPLATE, make_records
from relign.recipes import rl, sft

from ..conftest import torch_threads

CONF = re.compile(r"conf:\s*(\d+)")  # the reader also reads "conf:7"


def _stated(model_dir, q: float, seed: int = 123, n: int = 200):
    """Stated P(left) and whether the answer was left, for the samples that state one, on n
    held-out records with fresh draws (another seed), sampled at temperature 1; read here with a
    regex, not the reader under test. A sample that states nothing is left out, not read as 0.5:
    a model that stopped stating confidences would otherwise score a near-zero ECE."""
    from transformers import AutoTokenizer

    from relign.models.loading import load_causal_lm
    from relign.rollout.engine import SamplingParams
    from relign.rollout.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine(load_causal_lm(str(model_dir)).eval(), tok, seed=seed)
    recs = make_records(n, seed=seed, features={"room": q})
    outs = engine.generate([tok(r["prompt"])["input_ids"] for r in recs], SamplingParams(temperature=1.0, max_new_tokens=8),
                           seeds=list(range(n)))
    conf, left = [], []
    for r, o in zip(recs, outs):
        m = CONF.fullmatch(o[0].text.strip())
        if m and int(m[1]) <= 10:  # a response that states nothing is left out, and counted by the caller
            conf.append(int(m[1]) / 10)
            left.append(float(r["extra_info"]["answer"] == "left"))
    return conf, left


def _ece(conf, outcome, bins=10):
    # written out here (not relign.algorithms.scoring.ece): equal-width bins weighted by count
    total = 0.0
    for b in range(bins):
        idx = [i for i, c in enumerate(conf) if min(int(c * bins), bins - 1) == b]
        if idx:
            total += len(idx) / len(conf) * abs(sum(outcome[i] for i in idx) / len(idx) - sum(conf[i] for i in idx) / len(idx))
    return total


@pytest.mark.slow(seconds=50)  # started first (conftest): the longest single tests
def test_grpo_with_the_reader_reward_calibrates_stated_confidence(tiny_model_dir, tmp_path):
    rng = random.Random(0)
    rows = [{"prompt": TEMPLATE.replace("{feature}", "room"), "response": f"conf: {rng.randint(1, 9)}"} for _ in range(256)]
    (tmp_path / "warm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["logging.progress=false", "logging.tensorboard=false"]
    with torch_threads(1):
        warm = sft.train(load_config(sft.Config, None, [
            f"model.path={tiny_model_dir}", f"data.path={tmp_path / 'warm.jsonl'}", f"run_dir={tmp_path / 'sft'}",
            "max_steps=150", "batch_size=16", "micro_batch_size=16", "optim.lr=3e-3", "data.eval_fraction=0", *common]))
        means = {}
        for q, rule in ((0.2, "log"), (0.8, "log"), (0.8, "brier")):  # the Brier rule: the same outcome
            conf0, left0 = _stated(warm.checkpoint, q)
            run = tmp_path / f"rl_{q}_{rule}"
            result = rl.train(load_config(rl.Config, None, [
                f"model.path={warm.checkpoint}", "task.name=calibration", f"task.features={{room: {q}}}", "task.chat=false",
                "task.reward_workers=0", "reward.kind=reader", "reward.reader.rule=true", f"reward.reader.scoring={rule}", "reward.rule_weight=0",
                f"run_dir={run}", "rollout.n=8", "prompts_per_step=16", "rollout.max_new_tokens=8", "optim.lr=3e-3",
                "max_steps=40", "traces_per_step=0", "seed=1", *common]))
            conf1, left1 = _stated(run / "checkpoints" / "step_40", q)
            rewards = [r["reward/mean"] for r in result.history if "reward/mean" in r]
            # silence is no calibration: nearly every sample must state a confidence, before and after
            assert len(conf0) >= 180 and len(conf1) >= 180, (q, rule, len(conf0), len(conf1))
            before, after = _ece(conf0, left0), _ece(conf1, left1)
            means[q, rule] = sum(conf1) / len(conf1)
            print(q, rule, "ECE", before, "->", after, "mean p", sum(conf0) / len(conf0), "->", means[q, rule])
            assert after < before / 2, (q, rule, before, after)
            assert abs(means[q, rule] - q) <= 0.12, (q, rule, means[q, rule])
            assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5, rewards
    assert means[0.2, "log"] < means[0.8, "log"]
