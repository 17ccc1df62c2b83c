"""Which training set a standalone relign eval keeps its generated held-out problems apart from
(recipes/eval.py ``_training_set``): the keys, else the config.yaml of the run that wrote the
model, else the eval's own seed with a note saying so. The whole path through the CLI is in
tests/e2e/test_cli_environments.py."""

from __future__ import annotations

import pytest
import yaml

from relign.recipes import eval as eval_recipe


def _cfg(model_path: str, **kw) -> eval_recipe.Config:
    cfg = eval_recipe.Config()
    cfg.model.path, cfg.task.name, cfg.seed = model_path, "calibration", 7
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def _run(tmp_path, task: dict, seed: int = 3):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_40").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "task": task}))
    return run


def test_a_checkpoint_of_a_run_is_checked_against_that_runs_training_set(tmp_path):
    run = _run(tmp_path, {"name": "calibration", "path": "", "max_rows": 256})
    for model in (run / "checkpoints" / "step_40", run):  # a checkpoint, or the run's folder itself
        seed, rows, what = eval_recipe._training_set(_cfg(str(model)))
        assert (seed, rows) == (3, 256) and what == f"the run {run} (seed 3, its config.yaml)"


def test_keys_win_over_the_run(tmp_path):
    run = _run(tmp_path, {"name": "calibration", "path": "", "max_rows": 256})
    assert eval_recipe._training_set(_cfg(str(run), train_seed=11, train_rows=50))[:2] == (11, 50)
    # train_rows alone narrows the run's own seed
    assert eval_recipe._training_set(_cfg(str(run), train_rows=50))[:2] == (3, 50)


@pytest.mark.parametrize("task, why", [
    ({"name": "gsm8k", "path": "", "max_rows": 9}, "did not train on generated calibration problems"),
    ({"name": "calibration", "path": "rows.jsonl", "max_rows": 9}, "did not train on generated calibration problems"),
])
def test_a_run_of_another_task_or_of_a_file_is_not_taken(tmp_path, task, why):
    run = _run(tmp_path, task)
    seed, rows, what = eval_recipe._training_set(_cfg(str(run / "checkpoints" / "step_40")))
    assert (seed, rows) == (7, 0) and why in what and "set train_seed and train_rows" in what


def test_a_model_with_no_run_uses_the_eval_seed_and_says_so(tmp_path):
    (tmp_path / "model").mkdir()
    for model in (str(tmp_path / "model"), "tiny:micro"):
        seed, rows, what = eval_recipe._training_set(_cfg(model))
        assert (seed, rows) == (7, 0)
        assert what.startswith("seed 7 (no run's config.yaml beside model.path; set train_seed and train_rows")
