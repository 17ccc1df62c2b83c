"""Every RL preset through the real CLI: finite losses, parameters change, traces, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relign.checkpoint import list_checkpoints
from relign.tracking import read_metrics

from ..conftest import REPO, run_cli
from ..rl_toy import make_toy, toy_overrides

PRESETS = ["dr_grpo", "grpo", "dapo", "ppo", "rloo", "reinforce_pp", "gspo", "vineppo", "trpo", "calculator_tool",
           "grpo_async"]
KL_PRESETS = ("grpo", "ppo", "rloo", "reinforce_pp", "vineppo", "grpo_async")
STAGES = ("rollout", "reward", "reference", "old_logps", "values", "update", "sync", "step")


def _changed(a_dir: Path, b_dir: Path) -> int:
    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    return sum(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_runs_learns_and_resumes(preset, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    args = ["rl", str(REPO / "examples" / f"{preset}.yaml"), f"run_dir={run}", f"model.path={tiny_model_dir}",
            "max_steps=2", "prompts_per_step=2", "checkpoint.save_every=1", "checkpoint.keep_last=0",
            "logging.tensorboard=false", "optim.lr=1e-3"]
    if preset == "calculator_tool":
        # the environment's reward is ~never hit by a random model: an entropy bonus still moves it
        args += ["task.max_rows=8", "rollout.max_new_tokens=6", "algorithm.entropy_coef=0.01"]
    else:
        args += [a for a in toy_overrides(tiny_model_dir, tmp_path, fn="graded") if not a.startswith("model.path")]
        args += ["task.reward_workers=1"]  # through the worker pool once per preset
    if preset == "dapo":
        args += ["algorithm.overlong_cache=2"]
    # step 1, then the process is SIGKILLed right after its checkpoint lands; resume finishes
    killed = run_cli(*args, env={"RELIGN_FAULT": "checkpoint-saved:1"}, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    proc = run_cli(*args, "resume=auto")
    assert "resumed from" in proc.stderr

    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        keys = ["reward/std", "reward/score", "response/length_mean", "response/length_max", "response/truncated_frac",
                "perf/tokens_per_s", "actor/grad_norm", *(f"time/{s}_s" for s in STAGES)]
        if preset == "trpo":  # no optimizer, no clipped loss: the trust region's own figures
            keys += ["trpo/kl", "trpo/backtracks", "trpo/accepted", "trpo/surrogate_gain"]
        else:
            keys += ["actor/loss", "actor/entropy", "actor/clip_frac", "actor/logp_mismatch", "actor/lr"]
        if preset in KL_PRESETS:
            keys.append("actor/kl")
        for key in keys:
            assert key in r and math.isfinite(r[key]), (key, r)
        if preset == "grpo_async":  # step 2 trains on step 1's weights' samples: the gap is the policy's drift
            assert r["rollout/staleness"] == r["step"] - 1 and 0 <= r["actor/behav_is_masked_frac"] <= 1
            assert r["rollout/sync_gap"] < 1e-4  # the engine's own copy holds the trainer's weights after each sync
        if preset == "trpo":
            assert r["trpo/kl"] <= 0.01 * 1.05 and r["trpo/accepted"] in (0.0, 1.0)
        elif preset != "grpo_async" or r["step"] == 1:
            assert r["actor/logp_mismatch"] < 1e-4  # engine and trainer agree on the sampled tokens
    if preset == "ppo":
        assert "critic/value_loss" in rows[-1]
    if preset == "vineppo":  # Monte-Carlo values: no critic, the estimate's cost logged beside the policy's
        for key in ("vine/mc_tokens", "vine/policy_tokens", "vine/value_mean", "vine/steps_mean", "vine/unique_states"):
            assert all(math.isfinite(r[key]) for r in rows), key
        assert all(r["vine/mc_tokens"] > 0 and "critic/value_loss" not in r for r in rows)
    assert [s for s, _ in list_checkpoints(run)] == [1, 2]
    assert _changed(Path(tiny_model_dir), run / "checkpoints" / "step_2") > 0
    if preset == "ppo":
        assert (run / "checkpoints" / "step_2" / "critic" / "value_head.safetensors").is_file()
    traces = [json.loads(line) for line in (run / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    assert traces and {"prompt", "response", "reward", "components", "advantage", "tokens", "logps"} <= traces[0].keys()


def test_failing_rewards_score_zero_and_the_run_goes_on(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text(
        "import time\n"
        "def reward(prompt, response, extra_info):\n"
        "    if response.startswith(' '):\n"
        "        raise RuntimeError('boom')\n"
        "    if 'e' in response:\n"
        "        time.sleep(60)\n"
        "    return 1.0\n"
    )
    prompts, _ = make_toy(tmp_path)
    run = tmp_path / "run"
    run_cli("rl", f"model.path={tiny_model_dir}", "task.name=custom", f"task.path={prompts}", f"task.reward_fn={bad}",
            "task.chat=false", "task.reward_workers=2", "task.reward_timeout=1", "rollout.max_new_tokens=4", "rollout.n=4",
            "prompts_per_step=2", "max_steps=2", f"run_dir={run}", "logging.tensorboard=false")
    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    assert len(rows) == 2
    assert sum(r["reward/errors"] for r in rows) > 0 and sum(r["reward/timeouts"] for r in rows) > 0


def test_nan_guard_skips_and_stops_with_last_good_checkpoint(tiny_model_dir, tmp_path):
    huge = tmp_path / "huge_reward.py"
    # A reward this large overflows the float32 loss: every update is non-finite.
    huge.write_text("def reward(prompt, response, extra_info):\n    return 3e38 if response.startswith(' ') else -3e38\n")
    prompts, _ = make_toy(tmp_path)
    run = tmp_path / "run"
    run_cli("rl", f"model.path={tiny_model_dir}", "task.name=custom", f"task.path={prompts}", f"task.reward_fn={huge}",
            "task.chat=false", "task.reward_workers=0", "rollout.max_new_tokens=4", "rollout.n=4",
            "algorithm.loss_agg=seq-mean-token-sum", "prompts_per_step=4", "max_steps=10", "nan_patience=2",
            f"run_dir={run}", "logging.tensorboard=false")
    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    assert len(rows) == 2 and all(r["actor/skipped_updates"] == 1 for r in rows)
    (step, ckpt), = list_checkpoints(run)
    assert step == 2 and _changed(Path(tiny_model_dir), ckpt) == 0  # the last good weights = the initial ones


def test_vine_needs_a_step_delimiter(tiny_model_dir, tmp_path):
    # a custom task has no step delimiter: the error names the option to set
    proc = run_cli("rl", *toy_overrides(tiny_model_dir, tmp_path), "algorithm.advantage=vine", "max_steps=1",
                   f"run_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 2 and "set vine.delimiter" in proc.stderr, proc.stderr[-2000:]


def test_trpo_errors_and_unused_settings(tiny_model_dir, tmp_path):
    base = [*toy_overrides(tiny_model_dir, tmp_path), "update=trpo", "max_steps=1", "rollout.n=2", "prompts_per_step=2",
            f"run_dir={tmp_path / 'run'}"]
    proc = run_cli("rl", *base, "algorithm.kl=loss", "algorithm.kl_coef=0.1", check=False)
    assert proc.returncode == 2 and "use algorithm.kl=reward" in proc.stderr
    proc = run_cli("rl", *base, "algorithm.ppo_epochs=2", check=False)
    assert proc.returncode == 2 and "algorithm.ppo_epochs=1" in proc.stderr
    proc = run_cli("rl", *base, "optim.schedule=cosine", "optim.lr=0.1")  # runs, and says what it ignores
    assert "optim.lr, optim.schedule unused" in proc.stderr
    rows = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert {"trpo/kl", "trpo/accepted", "trpo/backtracks", "trpo/surrogate_gain"} <= rows[0].keys()
    assert rows[0]["trpo/kl"] <= 0.01 * 1.05 or rows[0]["trpo/accepted"] == 0


def test_max_seconds_stops_after_the_step_and_saves_it(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    proc = run_cli("rl", *toy_overrides(tiny_model_dir, tmp_path), "max_steps=50", "max_seconds=0.001", "rollout.n=2",
                   "prompts_per_step=2", f"run_dir={run}")
    assert "stopped: max_seconds=0.001 after step 1" in proc.stderr + proc.stdout
    assert [s for s, _ in list_checkpoints(run)] == [1]
    assert [r["step"] for r in read_metrics(run) if "reward/mean" in r] == [1]
