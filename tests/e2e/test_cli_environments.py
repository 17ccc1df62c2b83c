"""relign rl / relign eval on task.name=reasoning_gym and task.name=gem, through the real CLI."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from relign.tracking import read_metrics

from ..conftest import REPO, run_cli

COMMON = ["logging.tensorboard=false", "logging.progress=false", "checkpoint.save_final=false"]
# a small problem space (9 x 9 x 2 one-digit sums): held-out draws do repeat training questions
SMALL = "task.rg.config={chain_sum: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}"


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_rl_on_reasoning_gym_never_evaluates_on_a_training_problem(tiny_model_dir, tmp_path):
    """Neither inside the run (eval.every) nor afterwards: a standalone relign eval of the run's
    checkpoint, at its own seed, drops the problems of the run's training set (seed 3, 100 rows,
    read from the run's config.yaml), not of a training set of its own seed."""
    rg = pytest.importorskip("reasoning_gym")
    run = tmp_path / "run"
    proc = run_cli("rl", f"model.path={tiny_model_dir}", "task.name=reasoning_gym", "task.rg.datasets={chain_sum: 1}",
                   SMALL, "task.max_rows=100", "task.reward_workers=0", "rollout.n=2", "rollout.max_new_tokens=6",
                   "prompts_per_step=2", "max_steps=2", "eval.every=2", "eval.max_rows=30", "eval.max_new_tokens=6",
                   "seed=3", f"run_dir={run}", *COMMON, "checkpoint.save_final=true")
    dropped = int(re.search(r"30 held-out problems generated, (\d+) dropped", proc.stderr).group(1))
    # the training problems, built here by reasoning-gym itself (seed 3, the run's)
    train = {rg.create_dataset("chain_sum", seed=3, size=100, min_terms=2, max_terms=2, min_digits=1,
                               max_digits=1)[i]["question"] for i in range(100)}
    samples = _jsonl(run / "eval" / "step_2.jsonl")
    assert dropped > 0 and len(samples) == 30 - dropped  # eval.n=1: one sample per held-out problem
    assert {s["question"] for s in samples}.isdisjoint(train)
    rows = {r["step"]: r for r in read_metrics(run)}
    assert rows[2]["eval/num_problems"] == 30 - dropped and "reward/mean" in rows[1]
    trained = {json.loads(line)["problem"] for line in (run / "rollouts" / "step_1.jsonl").read_text().splitlines()}
    assert trained <= train  # the rollouts' prompts are training problems

    out = tmp_path / "eval"
    proc = run_cli("eval", f"model.path={run / 'checkpoints' / 'step_2'}", "task.name=reasoning_gym",
                   "task.rg.datasets={chain_sum: 1}", SMALL, "task.max_rows=40", "max_new_tokens=4", f"run_dir={out}",
                   "logging.progress=false")
    assert re.search(rf"40 held-out problems generated, \d+ dropped \(their question is one of the 100 training problems "
                     rf"of the run {re.escape(str(run))} \(seed 3", proc.stderr), proc.stderr[-2000:]
    questions = [json.loads(line)["question"] for line in (out / "samples.jsonl").read_text().splitlines()]
    assert questions and set(questions).isdisjoint(train)


def test_eval_on_reasoning_gym(tiny_model_dir, tmp_path):
    pytest.importorskip("reasoning_gym")
    run = tmp_path / "eval"
    run_cli("eval", f"model.path={tiny_model_dir}", "task.name=reasoning_gym",
            "task.rg.datasets={chain_sum: 1, leg_counting: 1}", "task.max_rows=4", "n=2", "temperature=1.0",
            "max_new_tokens=6", f"run_dir={run}", "logging.progress=false")
    summary = json.loads((run / "eval.json").read_text())["metrics"]
    assert summary["num_problems"] == 4 and summary["num_samples"] == 8
    for key in ("accuracy", "pass@2", "maj@2", "reward_mean"):
        assert 0.0 <= summary[key] <= 1.0
    datasets = {json.loads(line)["question"][:20] for line in (run / "samples.jsonl").read_text().splitlines()}
    assert len(datasets) >= 1


def test_rl_on_a_gem_game_with_a_turn_limit(tiny_model_dir, tmp_path):
    pytest.importorskip("gem")
    run = tmp_path / "run"
    run_cli("rl", f"model.path={tiny_model_dir}", "task.name=gem", "task.gem.env_id=game:GuessTheNumber-v0-easy",
            "task.chat=false", "rollout.max_turns=4", "max_steps=2", "task.max_rows=4", "rollout.n=2",
            "rollout.max_new_tokens=8", "prompts_per_step=2", f"run_dir={run}", *COMMON)
    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    traces = _jsonl(run / "rollouts" / "step_1.jsonl")
    assert len(traces) == 4
    for t in traces:
        assert t["problem"].startswith("You are playing Guess The Number.")
        assert t["finish_reason"] in ("stop", "max_turns", "length")
        assert -0.1 - 1e-9 <= t["reward"] <= 1.0


@pytest.mark.parametrize("preset, package, extra", [
    ("rg_aiw", "reasoning_gym", ["prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8", "eval.every=1",
                                       "eval.max_rows=4", "eval.n=1", "eval.max_new_tokens=8", "task.rg.size=16"]),
    ("gem_guess_number", "gem", ["prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8", "task.max_rows=4"]),
])
def test_presets_run_as_shipped(preset, package, extra, tiny_model_dir, tmp_path):
    """The shipped presets, shrunk to two steps of a micro model."""
    pytest.importorskip(package)
    run = tmp_path / "run"
    run_cli("rl", str(REPO / "examples" / f"{preset}.yaml"), f"model.path={tiny_model_dir}", "max_steps=2", *extra,
            f"run_dir={run}", *COMMON)
    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]


def test_rl_on_gem_with_max_turns_0_plays_to_the_games_own_limit(tiny_model_dir, tmp_path):
    """rollout.max_turns=0 takes the game's own max_turns (here set to 3 through task.gem.kwargs, the
    preset's game having 4): a model taught to answer with a boxed guess plays every game it does not
    win to exactly that many turns, where GEM truncates it (finish_reason max_turns)."""
    pytest.importorskip("gem")
    from relign.config import load_config
    from relign.envs.tasks import get_task
    from relign.recipes import sft

    from ..conftest import torch_threads

    game = ["task.name=gem", "task.gem.env_id=game:GuessTheNumber-v0-easy", "task.gem.kwargs={max_turns: 3}"]
    records = get_task("gem", chat=False, gem={"env_id": "game:GuessTheNumber-v0-easy", "kwargs": {"max_turns": 3}}).load(
        max_rows=8, seed=0)
    rows = [{"prompt": r["prompt"], "response": f"\\boxed{{{g}}}"} for r in records for g in (1, 2)]
    (tmp_path / "guesses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with torch_threads(1):  # a warm start that answers in the game's format (a random model never boxes a number)
        warm = sft.train(load_config(sft.Config, None, [
            f"model.path={tiny_model_dir}", f"data.path={tmp_path / 'guesses.jsonl'}", f"run_dir={tmp_path / 'sft'}",
            "max_steps=60", "batch_size=8", "micro_batch_size=8", "optim.lr=1e-2", "data.eval_fraction=0",
            "logging.progress=false", "logging.tensorboard=false"]))
    run = tmp_path / "run"
    proc = run_cli("rl", f"model.path={warm.checkpoint}", *game, "task.chat=false", "rollout.max_turns=0",
                   "rollout.stop=['}']", "rollout.max_new_tokens=8", "rollout.max_response_tokens=400", "max_steps=1", "task.max_rows=4", "rollout.n=4",
                   "prompts_per_step=2", "traces_per_step=8", f"run_dir={run}", *COMMON)
    assert "rollout.max_turns=0: the environment's own limit, 3 turns" in proc.stderr
    # settled in frame.open, before the run directory: its config.yaml records the turns the run played
    assert yaml.safe_load((run / "config.yaml").read_text())["rollout"]["max_turns"] == 3
    traces = _jsonl(run / "rollouts" / "step_1.jsonl")
    assert len(traces) == 8
    # every episode ends by the game: a win (reward 1) before the limit, or GEM's truncation at turn 3
    limit = [t for t in traces if t["finish_reason"] == "max_turns"]
    assert limit and all(t["response"].count("\\boxed{") == 3 for t in limit), [t["response"] for t in traces]
    assert all(t["finish_reason"] == "max_turns" or t["reward"] == 1.0 for t in traces), traces


def test_max_turns_0_needs_an_environment_with_a_turn_limit(tiny_model_dir, tmp_path):
    pytest.importorskip("gem")
    for task in (["task.name=gem", "task.gem.env_id=game:GuessTheNumber-v0-random"],  # a limit drawn per game
                 ["task.name=countdown"]):  # single-turn: no environment at all
        proc = run_cli("rl", f"model.path={tiny_model_dir}", *task, "rollout.max_turns=0", "max_steps=1",
                       f"run_dir={tmp_path / 'run'}", *COMMON, check=False)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode != 0 and "rollout.max_turns=0" in last and "set rollout.max_turns >= 1" in last, proc.stderr
        assert not (tmp_path / "run").exists()  # refused before the run directory opens
