"""relign rest through the real CLI: the preset as it is, the kept-nothing stop, kill + resume, the report."""

from __future__ import annotations

import json

from relign.checkpoint import list_checkpoints
from relign.models.loading import load_causal_lm
from relign.tracking import read_metrics

from ..conftest import REPO, run_cli
from ..recipes.test_rest_em import toy_args

PRESET = str(REPO / "examples" / "rest_em.yaml")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # two shared cores: one thread each is faster and the same everywhere


def test_preset_runs_as_is_and_stops_cleanly_when_nothing_is_kept(tiny_model_dir, tmp_path):
    # The preset's own task (GSM8K), shrunk: a random model solves none, and never ends a completion
    # by itself, so iteration 1 keeps nothing; the run says so in one line and exits 0.
    run = tmp_path / "run"
    proc = run_cli("rest", PRESET, f"model.path={tiny_model_dir}", f"run_dir={run}", "task.max_rows=12", "val.size=4",
                   "rollout.n=2", "rollout.max_new_tokens=8", "logging.tensorboard=false", env=ONE_THREAD)
    message = ("iteration 1 kept 0 of 16 completions (threshold 1.0; truncated completions count as failed): "
               f"nothing to fine-tune on; the last good checkpoint is the base model {tiny_model_dir}")
    assert message in proc.stderr, proc.stderr[-2000:]
    assert f"run directory: {run}" in proc.stdout
    log = json.loads((run / "rest.json").read_text())
    assert log["status"] == f"stopped: {message}" and log["iterations"] == []
    assert not (run / "rest_state.json").exists()  # nothing completed: resume=auto starts over
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1] and rows[0]["rest/val_accuracy"] == 0.0 and rows[1]["rest/kept"] == 0
    filt = json.loads((run / "iter_1" / "filter.json").read_text())
    assert filt["sampled"] == 16 and filt["kept"] == 0


def test_preset_on_the_toy_task_is_killed_after_an_iteration_and_resumes(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    args = ["rest", PRESET, *toy_args(tiny_model_dir, tmp_path), "task.max_rows=0", "rollout.n=4", "epochs=2",
            f"run_dir={run}"]
    killed = run_cli(*args, env={**ONE_THREAD, "RELIGN_FAULT": "rest-iteration:1"}, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert json.loads((run / "rest_state.json").read_text())["iteration"] == 1
    proc = run_cli(*args, "resume=auto", env=ONE_THREAD)
    assert "resumed after iteration 1" in proc.stderr

    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["rest/kept"] > 0 and 0 < r["rest/correct_frac"] < 1 and 0 <= r["rest/val_accuracy"] <= 1
    log = json.loads((run / "rest.json").read_text())
    assert log["status"] == "completed" and [it["iteration"] for it in log["iterations"]] == [1, 2]
    for k in (1, 2):
        assert [s for s, _ in list_checkpoints(run / f"iter_{k}" / "sft")]  # one per epoch
        assert len(list_checkpoints(run / f"iter_{k}" / "sft")) == 2
    chosen = run / json.loads((run / "rest_state.json").read_text())["checkpoint"]
    load_causal_lm(str(chosen))  # the result reloads as a plain HF model

    # relign report renders validation accuracy per iteration as a chart
    report = run_cli("report", str(run))
    html = (run / "report.html").read_text()
    assert "report.html" in report.stdout and 'data-metric="rest/val_accuracy"' in html and "<svg" in html
