"""Learning-rate schedules by hand; the tracker's files, resume truncation and W&B hook."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from relign.optim import build_optimizer, build_scheduler, lr_factor, warmup_steps_of
from relign.tracking import Tracker, read_metrics


def test_warmup_then_cosine_by_hand():
    f = lambda s: lr_factor(s, total_steps=10, warmup_steps=2, schedule="cosine")  # noqa: E731
    assert f(0) == pytest.approx(0.5) and f(1) == pytest.approx(1.0)  # (s+1)/2
    assert f(2) == pytest.approx(1.0)  # cosine starts at the peak
    # halfway through the 8 decay steps: 0.5 * (1 + cos(pi/2)) = 0.5
    assert f(6) == pytest.approx(0.5)
    assert f(10) == pytest.approx(0.0, abs=1e-12)
    g = lambda s: lr_factor(s, total_steps=10, warmup_steps=0, schedule="cosine", min_lr_ratio=0.1)  # noqa: E731
    assert g(10) == pytest.approx(0.1) and g(5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(7, total_steps=10, warmup_steps=2, schedule="constant") == 1.0
    assert warmup_steps_of(100, 0, 0.05) == 5 and warmup_steps_of(100, 3, 0.5) == 3


def test_scheduler_drives_optimizer_and_no_decay_on_1d():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    opt = build_optimizer(model, lr=1.0, weight_decay=0.1)
    decays = sorted((g["weight_decay"], len(g["params"])) for g in opt.param_groups)
    assert decays == [(0.0, 3), (0.1, 1)]  # bias, norm weight, norm bias undecayed; one matrix decayed
    sched = build_scheduler(opt, total_steps=4, warmup_steps=2, schedule="cosine")
    lrs = []
    for _ in range(4):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 0.5])


def test_tracker_writes_jsonl_and_tensorboard(tmp_path):
    t = Tracker(tmp_path, total_steps=3, progress=False, tensorboard=True)
    for step in (1, 2, 3):
        t.log(step, {"train/loss": 1.0 / step, "perf/tokens_per_s": torch.tensor(10.0 * step)})
    t.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["perf/tokens_per_s"] == 30.0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_tracker_resume_drops_steps_after_checkpoint(tmp_path):
    t = Tracker(tmp_path, total_steps=5, progress=False, tensorboard=False)
    for step in range(1, 6):
        t.log(step, {"train/loss": float(step)})
    t.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train/lo')  # a line cut by a crash
    t = Tracker(tmp_path, total_steps=5, start_step=3, progress=False, tensorboard=False)
    t.log(4, {"train/loss": 40.0})
    t.close()
    assert [(r["step"], r["train/loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_tracker_wandb(tmp_path, monkeypatch):
    logged = []
    run = types.SimpleNamespace(log=lambda d, step: logged.append((step, d)), finish=lambda: logged.append("finish"))
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    t = Tracker(tmp_path, total_steps=1, progress=False, tensorboard=False, wandb=True)
    t.log(1, {"train/loss": 0.5})
    t.close()
    assert logged == [(1, {"train/loss": 0.5}), "finish"]


def test_tracker_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    from relign.config import ConfigError

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="pip install 'relign\\[wandb\\]'"):
        Tracker(tmp_path, total_steps=1, progress=False, tensorboard=False, wandb=True)


def test_progress_bar_shows_the_watched_metrics(tmp_path, capsys):
    t = Tracker(tmp_path, total_steps=2, progress=True, tensorboard=False,
                bar_keys=("train/loss", "train/lr", "perf/tokens_per_s", "eval/loss"))
    t.log(1, {"train/loss": 2.5, "train/lr": 1e-4, "perf/tokens_per_s": 1234.0, "eval/loss": 3.0})
    t.log(2, {"train/loss": 2.0, "train/lr": 1e-4, "perf/tokens_per_s": 1234.0})
    t.close()
    err = capsys.readouterr().err
    for needle in ("2/2", "loss=2", "lr=1.00e-04", "tokens_per_s=1234", "eval_loss=3"):
        assert needle in err, needle
