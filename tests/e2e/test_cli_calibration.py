"""Linguistic calibration through the real CLI: the shipped presets (shrunk), relign eval with the
reader scorer, the lc task with tiny extractor and forecaster models, and the bad inputs."""

from __future__ import annotations

import json

import pytest

from ..conftest import REPO, run_cli, write_jsonl
from ..recipes.test_calibration_learning import _ece  # the ECE written out independently

QUIET = ["logging.progress=false", "logging.tensorboard=false"]

LC_ROWS = [  # shaped like the hub's joined rows; made up here (relign ships no LC data)
    {"paragraph_generation_prompt": "Write a paragraph about the author of Hamlet.", "question": "Who wrote Hamlet?",
     "answer": {"value": "William Shakespeare", "aliases": ["Shakespeare", "The Bard"]}},
    {"paragraph_generation_prompt": "Write a paragraph about the capital of France.",
     "question": "What is the capital of France?", "answer": "Paris", "aliases": ["Paris, France"]},
    {"prompt": "Write a paragraph about the red planet.", "question": "Which planet is called red?", "answer": "Mars"},
    {"paragraph_generation_prompt": "Write a paragraph about the largest ocean.", "question": "Which ocean is largest?",
     "answer": {"value": "Pacific", "aliases": ["Pacific Ocean"]}},
    {"paragraph_generation_prompt": "Write a paragraph about the first man on the moon.",
     "question": "Who first walked on the moon?", "answer": "Neil Armstrong"},
    {"paragraph_generation_prompt": "Write a paragraph about the tallest mountain.", "question": "Which mountain is tallest?",
     "answer": "Everest", "aliases": ["Mount Everest"]},
]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def forecaster_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("forecaster")
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def test_calibration_presets_and_reader_eval(tiny_model_dir, tmp_path):
    warm = tmp_path / "warm"
    run_cli("sft", str(REPO / "examples" / "calibration_warm.yaml"), f"model.path={tiny_model_dir}", f"run_dir={warm}",
            "max_steps=20", *QUIET)
    rl_run = tmp_path / "rl"
    run_cli("rl", str(REPO / "examples" / "calibration.yaml"), f"model.path={warm / 'checkpoints' / 'step_20'}",
            f"run_dir={rl_run}", "max_steps=2", "prompts_per_step=4", *QUIET)
    last = [m for m in _metrics(rl_run) if "reward/mean" in m][-1]
    for key in ("reward/lc_log", "reward/lc_norm_penalty", "reward/model", "reward/lc_forecast", "calib/ece"):
        assert key in last, sorted(last)
    # rule_weight 0: the reward is the reader's alone, log score - penalty + offset
    assert last["reward/mean"] == pytest.approx(last["reward/lc_log"] - last["reward/lc_norm_penalty"] + 5.0
                                                - 6.0 * last["reward/lc_unfinished"], abs=1e-5)
    ev = tmp_path / "eval"
    run_cli("eval", f"model.path={rl_run / 'checkpoints' / 'step_2'}", "task.name=calibration", "task.features={room: 0.2}",
            "task.chat=false", "task.max_rows=20", "task.reward_workers=0", "scorer=reader", "temperature=1.0",
            "max_new_tokens=8", f"run_dir={ev}", *QUIET)
    result = json.loads((ev / "eval.json").read_text())["metrics"]
    rows = [json.loads(line) for line in (ev / "samples.jsonl").read_text().splitlines()]
    # recompute from the samples: accuracy = the top answer is right; ECE over 10 equal-width bins
    conf = [r["reader"]["confidence"] for r in rows]
    correct = [r["reader"]["correct"] for r in rows]
    assert result["calib/accuracy"] == pytest.approx(sum(correct) / len(rows))
    assert result["calib/brier"] == pytest.approx(sum((c - o) ** 2 for c, o in zip(conf, correct)) / len(rows))
    assert result["calib/ece"] == pytest.approx(_ece(conf, correct), abs=1e-9)
    # a sample with no answer is confidence 1 and wrong (the reference's worst case)
    assert all((r["reader"]["confidence"], r["reader"]["correct"]) == (1.0, 0.0) for r in rows if r["reader"]["no_answer"])
    assert result["calib/no_answer_frac"] == pytest.approx(sum(r["reader"]["no_answer"] for r in rows) / len(rows))
    assert (ev / "reliability.svg").read_text().startswith("<svg xmlns=")
    page = (ev / "report.html").read_text()
    assert page[page.index("<main>") + 6:].startswith('<section id="reliability">')  # the report opens with the diagram


def test_lc_two_step_rl_with_tiny_extractor_and_forecaster(tiny_model_dir, forecaster_dir, tmp_path):
    data = write_jsonl(tmp_path / "lc.jsonl", LC_ROWS)
    run = tmp_path / "lc"
    run_cli("rl", str(REPO / "examples" / "lc_grpo.yaml"), f"model.path={tiny_model_dir}", f"task.path={data}",
            f"reward.model={forecaster_dir}", f"reward.reader.extractor={tiny_model_dir}", "reward.reader.extractor_max_tokens=8",
            "rollout.max_new_tokens=6", "rollout.n=2", "prompts_per_step=2", "max_steps=2", f"run_dir={run}",
            "traces_per_step=4", "checkpoint.save_final=false", *QUIET)
    last = [m for m in _metrics(run) if "reward/mean" in m][-1]
    for key in ("reward/lc_log", "reward/lc_norm_penalty", "reward/model", "reward/lc_unfinished"):
        assert key in last, sorted(last)
    traces = [json.loads(line) for line in (run / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    for t in traces:  # a response cut at the length limit gets unfinished_reward (-1), whatever it says
        if t["finish_reason"] == "length":
            assert t["reward"] == -1.0 and t["components"]["lc_unfinished"] == 1.0
        else:
            assert t["reward"] == pytest.approx(t["components"]["lc_log"] - t["components"]["lc_norm_penalty"] + 5.0)
    assert any(t["finish_reason"] == "length" for t in traces)


def test_bad_inputs_are_one_line(tiny_model_dir, forecaster_dir, tmp_path):
    rows = [dict(r) for r in LC_ROWS]
    del rows[3]["answer"]
    data = write_jsonl(tmp_path / "lc_bad.jsonl", rows)
    common = [f"model.path={tiny_model_dir}", "task.name=lc", "reward.kind=reader", "max_steps=1", *QUIET]
    proc = run_cli("rl", *common, f"task.path={data}", f"reward.model={forecaster_dir}", f"run_dir={tmp_path / 'a'}",
                   check=False)
    assert proc.returncode != 0 and "lc_bad.jsonl" in proc.stderr and "row 4" in proc.stderr and "answer" in proc.stderr
    good = write_jsonl(tmp_path / "lc.jsonl", LC_ROWS)
    proc = run_cli("rl", *common, f"task.path={good}", f"reward.model={tiny_model_dir}", f"run_dir={tmp_path / 'b'}",
                   check=False)
    assert proc.returncode != 0 and "is not a sequence-classification checkpoint" in proc.stderr, proc.stderr[-1500:]
    proc = run_cli("rl", *common, f"task.path={good}", f"run_dir={tmp_path / 'c'}", check=False)
    assert proc.returncode != 0 and "reward.kind=reader needs reward.model" in proc.stderr
