"""Linguistic calibration learns: GRPO with the rule reader's log score moves a model that states
random confidences to the true probability (the synthetic ``calibration`` task)."""

from __future__ import annotations

import re

import pytest

from relign.config import load_config
from relign.envs.calibration import make_records
from relign.recipes import rl, sft

from ..conftest import REPO, torch_threads
from .test_calibration_abstention import _ece  # written out there, not relign's

CONF = re.compile(r"conf:\s*(\d+)")  # the reader also reads "conf:7"


def _sample(model_dir, seed: int = 123, n: int = 200) -> list[str]:
    """The responses to n held-out records (another seed than training), sampled at temperature 1.
    Every record of the one room has the same prompt and record i is sampled with seed i, so the
    texts do not depend on q: only the hidden answers do (``_points``)."""
    from transformers import AutoTokenizer

    from relign.models.loading import load_causal_lm
    from relign.rollout.engine import SamplingParams
    from relign.rollout.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine(load_causal_lm(str(model_dir)).eval(), tok, seed=seed)
    recs = make_records(n, seed=seed, features={"room": 0.5})
    outs = engine.generate([tok(r["prompt"])["input_ids"] for r in recs], SamplingParams(temperature=1.0, max_new_tokens=8),
                           seeds=list(range(n)))
    return [o[0].text for o in outs]


def _points(texts: list[str], q: float, seed: int = 123):
    """The stated P(left) of the samples that state one, and every sample as ``relign eval
    scorer=reader`` scores it against the hidden answers of room q (fresh draws, ``seed``): the
    reader's top answer, its confidence and whether it is right. Read here with a regex, not the
    reader under test: ``conf: N`` states left N/10 and right 1 - N/10, the top answer is the
    likelier (left on a tie, as it is stated first); a sample that states nothing is confidence 1
    and wrong, so a model that stopped stating confidences cannot score a low ECE."""
    recs = make_records(len(texts), seed=seed, features={"room": q})
    p_left, points = [], []
    for r, text in zip(recs, texts):
        left = r["extra_info"]["answer"] == "left"
        m = CONF.fullmatch(text.strip())
        if m and int(m[1]) <= 10:
            p = int(m[1]) / 10
            p_left.append(p)
            points.append((p, float(left)) if p >= 0.5 else (1 - p, float(not left)))
        else:
            points.append((1.0, 0.0))
    return p_left, points


RUNS = ((0.3, "brier"), (0.9, "log"))
"""Two q of the six the preset is tuned for, one on each side of 0.5, and both scoring rules: the log
score (the preset's) at one and the Brier score at the other (each run is the preset's 120 steps,
so two runs rather than three keep the test near its former 45 s). At RL seed 3 (``SEED``): there the
preset of 40 steps at lr 3e-3 left q 0.9 at ECE 0.373 -> 0.220, stating 0.70 (bench/calibration_table.py)."""
SEED = 3


@pytest.mark.slow(seconds=55)  # started first (conftest): the longest single tests
def test_grpo_with_the_reader_reward_calibrates_stated_confidence(tiny_model_dir, tmp_path):
    """The shipped pipeline (examples/calibration_warm.yaml, then examples/calibration.yaml), only
    task.features and the rule changed: held-out ECE of the reader's top answer halves."""
    common = ["logging.progress=false", "logging.tensorboard=false"]
    with torch_threads(1):
        warm = sft.train(load_config(sft.Config, REPO / "examples" / "calibration_warm.yaml", [
            f"model.path={tiny_model_dir}", f"data.path={REPO / 'relign' / 'data' / 'samples' / 'calibration_warm.jsonl'}",
            f"run_dir={tmp_path / 'sft'}", *common]))
        means, warm_texts = {}, _sample(warm.checkpoint)
        for q, rule in RUNS:
            p0, points0 = _points(warm_texts, q)
            run = tmp_path / f"rl_{q}_{rule}"
            cfg = load_config(rl.Config, REPO / "examples" / "calibration.yaml", [
                f"model.path={warm.checkpoint}", f"task.features={{room: {q}}}", f"reward.reader.scoring={rule}",
                f"run_dir={run}", "traces_per_step=0", f"seed={SEED}", *common])
            result = rl.train(cfg)
            p1, points1 = _points(_sample(run / "checkpoints" / f"step_{cfg.max_steps}"), q)
            rewards = [r["reward/mean"] for r in result.history if "reward/mean" in r]
            # silence is no calibration: nearly every sample must state a confidence, before and after
            assert len(p0) >= 180 and len(p1) >= 180, (q, rule, len(p0), len(p1))
            before, after = _ece(*zip(*points0)), _ece(*zip(*points1))
            means[q, rule] = sum(p1) / len(p1)
            print(q, rule, "ECE", before, "->", after, "mean p", sum(p0) / len(p0), "->", means[q, rule])
            assert after < before / 2, (q, rule, before, after)
            assert abs(means[q, rule] - q) <= 0.12, (q, rule, means[q, rule])
            assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5, rewards
    assert means[RUNS[0]] < means[RUNS[1]]
