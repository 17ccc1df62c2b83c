"""Reward functions through the real CLI: a TRL-style batched function trains, a broken one stops
the run with one line."""

from __future__ import annotations

import json

from relign.tracking import read_metrics

from ..conftest import REPO, run_cli, write_jsonl

# TRL's signature: the batch as lists, the dataset's other columns (here "answer") as keyword lists.
TRL_REWARD = '''
import os


def reward(prompts, completions, completion_ids, answer, **kwargs):
    assert len(prompts) == len(completions) == len(completion_ids) == len(answer)
    assert all(isinstance(a, str) for a in answer), answer
    with open(os.environ["CALLS_LOG"], "a") as f:
        f.write(f"{len(completions)}\\n")
    return [len(ids) / 4 for ids in completion_ids]  # 1..4 tokens: 0.25..1, never 0
'''


def _args(tiny_model_dir, tmp_path, reward_spec: str) -> list[str]:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Write something {i}:", "answer": str(i)} for i in range(16)])
    return ["rl", str(REPO / "examples" / "grpo.yaml"), f"model.path={tiny_model_dir}", "task.name=custom",
            f"task.path={prompts}", f"task.reward_fn={reward_spec}", "task.chat=false", "task.format_weight=0",
            "rollout.n=2", "rollout.max_new_tokens=4", "prompts_per_step=2", "max_steps=2", f"run_dir={tmp_path / 'run'}",
            "logging.tensorboard=false", "logging.progress=false", "checkpoint.save_every=0"]


def test_trl_batched_reward_trains(tiny_model_dir, tmp_path):
    spec = tmp_path / "trl_reward.py"
    spec.write_text(TRL_REWARD)
    calls = tmp_path / "calls.log"
    run_cli(*_args(tiny_model_dir, tmp_path, f"{spec}:reward"), "task.reward_workers=1", env={"CALLS_LOG": str(calls)})
    rows = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward/errors"] == 0 and r["reward/timeouts"] == 0 for r in rows)
    assert all(0.25 <= r["reward/mean"] <= 1.0 for r in rows)
    # one call per step with the whole batch (2 prompts x 2 samples), in the worker
    assert calls.read_text().split() == ["4", "4"]
    # each completion's reward is its token count / 4, as the function computed it
    traces = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    assert traces and all(t["reward"] == t["length"] / 4 for t in traces)


def test_a_reward_that_always_fails_stops_at_the_first_step(tiny_model_dir, tmp_path):
    spec = tmp_path / "bad_reward.py"
    spec.write_text("def reward(prompts, completions, **kwargs):\n    raise KeyError('solution')\n")
    proc = run_cli(*_args(tiny_model_dir, tmp_path, f"{spec}:reward"), "task.reward_workers=0", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("relign rl: error:")]
    assert f"task.reward_fn={spec}:reward: every reward of the first step failed" in line
    assert line.endswith("first error: KeyError: 'solution'")
    assert "Traceback" not in proc.stderr
    assert not [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]


def test_a_reward_file_with_a_syntax_error_is_one_line(tiny_model_dir, tmp_path):
    spec = tmp_path / "typo_reward.py"
    spec.write_text("def reward(prompts, completions, **kwargs)\n    return [1.0] * len(completions)\n")
    proc = run_cli(*_args(tiny_model_dir, tmp_path, f"{spec}:reward"), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("relign rl: error:")]
    assert f"{spec}:reward" in line and "SyntaxError" in line and "(line 1)" in line
