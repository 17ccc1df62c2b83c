"""`relign eval` through the real CLI on the shipped benchmark files, and `eval.every` inside `relign rl`."""

from __future__ import annotations

import json
import math

import pytest

from relign.cli import main
from relign.tracking import read_metrics

from ..conftest import REPO, run_cli, write_jsonl

SAMPLE_KEYS = {"problem", "sample", "prompt", "response", "extracted", "reward", "score", "correct", "components",
               "reward_error", "finish_reason", "length", "extra_info", "vote", "votes", "majority", "majority_correct"}
SUMMARY_KEYS = {"accuracy", "pass@1", "pass@2", "maj@1", "maj@2", "reward_mean", "length_mean", "length_max",
                "truncated_frac", "num_problems", "num_samples"}


@pytest.fixture(scope="module")
def relign_cache(tmp_path_factory):
    """`tiny:micro` is built offline once into this cache and reused by the tests of this module."""
    return tmp_path_factory.mktemp("relign_cache")


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("task", ["gsm8k", "math500", "countdown"])
def test_eval_on_shipped_benchmarks(task, relign_cache, tmp_path):
    run = tmp_path / "run"
    args = ["eval", "model.path=tiny:micro", f"task.name={task}", "task.max_rows=4", "n=2", "temperature=1.0",
            "max_new_tokens=16", f"run_dir={run}", "logging.tensorboard=false", "logging.progress=false",
            # math-verify goes through a worker process once; the others score in-process
            f"task.reward_workers={1 if task == 'math500' else 0}"]
    proc = run_cli(*args, env={"RELIGN_CACHE": str(relign_cache)})
    assert "accuracy" in proc.stdout and "run directory" in proc.stdout

    result = json.loads((run / "eval.json").read_text())
    assert result["task"] == ("math" if task == "math500" else task) and result["model"] == "tiny:micro"
    assert (result["n"], result["k"], result["ks"], result["greedy"]) == (2, 2, [1, 2], False)
    assert result["data"].endswith(".jsonl") and "relign/envs/data" in result["data"]
    m = result["metrics"]
    assert SUMMARY_KEYS <= m.keys() and all(math.isfinite(v) for v in m.values())
    assert (m["num_problems"], m["num_samples"]) == (4, 8) and 0 <= m["accuracy"] <= 1
    assert m["length_max"] <= 16 and 0 <= m["truncated_frac"] <= 1 and result["notes"] == []

    rows = _read_jsonl(run / "samples.jsonl")
    assert len(rows) == 8 and all(SAMPLE_KEYS <= r.keys() for r in rows)
    assert [(r["problem"], r["sample"]) for r in rows] == [(p, s) for p in range(4) for s in range(2)]
    assert sum(r["score"] for r in rows) / 8 == pytest.approx(m["accuracy"])
    assert all(r["length"] <= 16 and r["finish_reason"] in ("stop", "length") for r in rows)
    assert all(isinstance(r["votes"], dict) for r in rows)  # built-in tasks vote
    assert rows[0]["prompt"].startswith("<|im_start|>")  # chat template, as relign rl renders prompts
    assert read_metrics(run)[0]["eval/accuracy"] == m["accuracy"]  # also in metrics.jsonl for the report


# The tests below call the same CLI entry point in-process (no second interpreter start).


def test_example_preset_runs(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    # the preset as shipped, made smaller (its model is tiny:tiny; here the session's micro model)
    assert main(["eval", str(REPO / "examples" / "eval_gsm8k.yaml"), f"model.path={tiny_model_dir}", "task.max_rows=2",
                 "max_new_tokens=8", f"run_dir={run}", "logging.tensorboard=false", "task.reward_workers=0"]) == 0
    m = json.loads((run / "eval.json").read_text())["metrics"]
    assert {"pass@1", "pass@4", "maj@4"} <= m.keys() and m["num_samples"] == 8


def test_custom_task_without_extractor_notes_missing_maj(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Say {i}:", "answer": str(i)} for i in range(3)])
    reward = tmp_path / "r.py"
    reward.write_text("def reward(prompt, response, extra_info):\n    return float(extra_info['answer'] in response)\n")
    run = tmp_path / "run"
    assert main(["eval", f"model.path={tiny_model_dir}", "task.name=custom", f"task.path={data}", f"task.reward_fn={reward}",
                 "task.chat=false", "task.reward_workers=0", "max_new_tokens=4", f"run_dir={run}",
                 "logging.tensorboard=false", "logging.progress=false"]) == 0
    result = json.loads((run / "eval.json").read_text())
    assert result["greedy"] is True and result["ks"] == [1]
    assert "pass@1" in result["metrics"] and not any(k.startswith("maj@") for k in result["metrics"])
    assert any("maj@k omitted" in note for note in result["notes"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["n=4"], "greedy decoding"),
        (["n=2", "temperature=1.0", "k=3"], "k=3 must lie in"),
        (["task.name=custom"], "task.reward_fn"),
        (["task.nam=gsm8k"], "did you mean 'task.name'"),
    ],
)
def test_config_errors_are_one_line(args, message, tiny_model_dir, tmp_path, capsys):
    assert main(["eval", f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_help_lists_fields(capsys):
    assert main(["eval", "--help"]) == 0
    out = capsys.readouterr().out
    assert "task.extract_fn" in out and "Samples per problem." in out


def test_rl_eval_every_logs_eval_metrics(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    run_cli("rl", f"model.path={tiny_model_dir}", "task.name=gsm8k", "task.path=relign/envs/data/gsm8k_train_512.jsonl",
            "task.max_rows=4", "task.reward_workers=0", "rollout.n=2", "rollout.max_new_tokens=4", "prompts_per_step=2",
            "max_steps=2", "eval.every=1", "eval.max_rows=3", "eval.n=2", "eval.temperature=1.0", "eval.max_new_tokens=6",
            f"run_dir={run}", "logging.tensorboard=false", "logging.progress=false", "checkpoint.save_final=false")
    rows = {r["step"]: r for r in read_metrics(run)}
    assert [s for s in sorted(rows) if "eval/accuracy" in rows[s]] == [1, 2]
    for s in (1, 2):
        r = rows[s]
        for key in ("eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/maj@2", "eval/length_mean", "eval/truncated_frac",
                    "time/eval_s"):
            assert key in r and math.isfinite(r[key]), (key, r)
        assert r["eval/num_problems"] == 3 and r["eval/num_samples"] == 6 and r["eval/length_max"] <= 6
        assert "reward/mean" in r  # merged into the step's training metrics
    samples = _read_jsonl(run / "eval" / "step_2.jsonl")
    assert len(samples) == 6 and SAMPLE_KEYS <= samples[0].keys()
    # the eval problems are the task's shipped test set, not the training file
    test_first = json.loads((REPO / "relign/envs/data/gsm8k_test.jsonl").read_text().splitlines()[0])["question"]
    assert test_first[:40] in samples[0]["prompt"]
    # fixed eval seeds: the same problems and random numbers at each eval (only the weights changed)
    assert [r["problem"] for r in _read_jsonl(run / "eval" / "step_1.jsonl")] == [r["problem"] for r in samples]
