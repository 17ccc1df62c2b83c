"""An answer-less paragraph counts against calibration, not for it (issue 44, item 1).

The reference's evaluation (Band et al., ``process_eval_results.py``) scores a paragraph from which
no answer is extracted as confidence 1 and wrong, "the worst case penalty for both accuracy and
ECE". Read as confidence 0 and wrong it is a perfectly calibrated point, and abstaining pays.

The worked example of the issue: 4 paragraphs that state a wrong answer with 90% and 4 that say
"No Answer". Worked out by hand, 10 equal-width bins:
    all 8 points fall in the last bin [0.9, 1.0]: mean confidence (4 * 0.9 + 4 * 1) / 8 = 0.95,
    accuracy 0, so ECE = 8/8 * |0 - 0.95| = 0.95 (abstentions read as confidence 0: 4/8 * 0.9 = 0.45)
    Brier = (4 * 0.9^2 + 4 * 1^2) / 8 = (3.24 + 4) / 8 = 0.905
The same rows run through ``relign eval``'s calibration metrics and through RL's per-step metrics.
"""

from __future__ import annotations

import pytest

from relign.algorithms.scoring import NO_ANSWER_POINT, top_answer
from relign.envs.base import make_custom_task
from relign.envs.reader_rules import RuleReader
from relign.envs.rewards import RewardPool
from relign.data.collate import StepSampler
from relign.models.reader import ReaderScorer
from relign.recipes.eval import calibration_metrics
from relign.rollout.collect import RolloutCollector
from relign.rollout.engine import Completion, SamplingParams

from ..conftest import write_jsonl

QUESTION = "Which town is the answer?"
INFO = {"question": QUESTION, "answer": "Shorwell", "aliases": []}
PARAGRAPHS = ["Ryde with 90% likelihood."] * 4 + ["No Answer"] * 4
ECE, BRIER = 0.95, 0.905  # by hand, above


def _ece(conf, outcome, bins=10):
    # written out here (not relign.algorithms.scoring.ece): equal-width bins weighted by count
    total = 0.0
    for b in range(bins):
        idx = [i for i, c in enumerate(conf) if min(int(c * bins), bins - 1) == b]
        if idx:
            total += len(idx) / len(conf) * abs(sum(outcome[i] for i in idx) / len(idx) - sum(conf[i] for i in idx) / len(idx))
    return total


def test_top_answer_hand_values():
    assert top_answer([0.2, 0.7, 0.7], [False, True, False]) == (0.7, 1.0, True)  # the first of a tie
    assert top_answer([1.3], [False]) == (1.0, 0.0, True)  # clipped to [0, 1]
    assert top_answer([], []) == (1.0, 0.0, False) and NO_ANSWER_POINT == (1.0, 0.0)


def test_eval_scores_no_answer_as_confident_and_wrong():
    rows = [{"question": QUESTION, "response": z, "extra_info": dict(INFO)} for z in PARAGRAPHS]
    m = calibration_metrics(ReaderScorer(RuleReader()), rows)
    conf = [r["reader"]["confidence"] for r in rows]
    correct = [r["reader"]["correct"] for r in rows]
    assert conf == [0.9] * 4 + [1.0] * 4 and correct == [0.0] * 8
    assert [r["reader"]["no_answer"] for r in rows] == [False] * 4 + [True] * 4
    assert _ece(conf, correct) == pytest.approx(ECE)
    assert m["calib/ece"] == pytest.approx(ECE, abs=1e-12)
    assert m["calib/brier"] == pytest.approx(BRIER, abs=1e-12)
    assert m["calib/accuracy"] == 0.0 and m["calib/no_answer_frac"] == 0.5
    # abstaining never helps: the 4 wrong answers alone have ECE 0.9, with the 4 abstentions 0.95
    alone = calibration_metrics(ReaderScorer(RuleReader()), rows[:4])
    assert alone["calib/ece"] == pytest.approx(0.9) and m["calib/ece"] >= alone["calib/ece"]


class _Scripted:
    """Completion j of every prompt is ``texts[j]``."""

    def __init__(self, tokenizer, texts):
        self.tok, self.texts = tokenizer, texts

    def generate(self, prompts, params, *, seeds=None):
        outs = []
        for _ in prompts:
            ids = [self.tok(t, add_special_tokens=False)["input_ids"] for t in self.texts]
            outs.append([Completion(i, [-1.0] * len(i), "stop", t) for i, t in zip(ids, self.texts)])
        return outs


def test_rl_step_metrics_score_no_answer_as_confident_and_wrong(tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "Write about the town.", "extra_info": INFO}])
    (tmp_path / "rule.py").write_text("def reward(prompt, response, extra_info):\n    return 0.0\n")
    task = make_custom_task(str(data), f"{tmp_path / 'rule.py'}:reward")
    c = RolloutCollector(tokenizer, _Scripted(tokenizer, PARAGRAPHS), task.load(),
                         sampling=SamplingParams(n=len(PARAGRAPHS), max_new_tokens=16),
                         pool=RewardPool.from_task(task, num_workers=0), scorer=ReaderScorer(RuleReader()), rule_weight=0.0)
    try:
        groups = c.collect(StepSampler(1, 1, seed=0), 1, dynamic=False, max_rounds=1)
        m = c.step_metrics(groups)
    finally:
        c.close()
    assert m["calib/ece"] == pytest.approx(ECE, abs=1e-12)
    assert m["calib/no_answer_frac"] == 0.5
