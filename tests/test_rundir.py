"""Run directories: a re-run never writes into an earlier run; resume continues a run only with
its own settings, and a mismatch names each differing key with both values."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from relign.config import ConfigError, load_config
from relign.rundir import RESUMABLE, choose_run_dir, config_differences, format_differences, holds_run, open_run

from .conftest import run_cli, write_jsonl

SAVED = {"seed": 0, "max_steps": 10, "run_dir": "runs/x", "resume": "none", "device": "cpu",
         "optim": {"lr": 1e-3, "betas": [0.9, 0.95]}, "logging": {"progress": True}, "checkpoint": {"save_every": 5}}


def _holding_a_run(path: Path, config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(config or SAVED), path / "config.yaml")
    return path


def test_empty_run_dir_is_a_timestamped_directory_under_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, note = choose_run_dir("", "sft", resume="none", new_config=SAVED)
    assert re.fullmatch(r"runs/sft-\d{8}-\d{6}", path.as_posix()) and path.is_dir() and note == ""


def test_a_new_or_runless_directory_is_used_as_it_is(tmp_path):
    new = tmp_path / "a" / "b"
    assert choose_run_dir(str(new), "sft", resume="none", new_config=SAVED) == (new, "")
    assert new.is_dir()
    data = tmp_path / "data"  # files, but no run: no config, metrics or checkpoints
    data.mkdir()
    (data / "train.jsonl").write_text("{}\n")
    assert choose_run_dir(str(data), "sft", resume="auto", new_config=SAVED) == (data, "")
    assert not holds_run(data) and holds_run(_holding_a_run(tmp_path / "r"))


def test_a_rerun_gets_a_fresh_sibling_and_never_touches_the_earlier_run(tmp_path):
    run = _holding_a_run(tmp_path / "grpo")
    before = sorted(p.name for p in run.iterdir())
    path, note = choose_run_dir(str(run), "rl", resume="none", new_config=SAVED)
    assert path == tmp_path / "grpo-2" and path.is_dir()
    assert note == f"run_dir={run} holds an earlier run (resume=auto would continue that one): this run writes to {path}"
    (tmp_path / "grpo-3").write_text("taken by something else")  # a name in use is skipped, whatever it is
    assert choose_run_dir(str(run), "rl", resume="", new_config=SAVED)[0] == tmp_path / "grpo-4"
    # a recipe with no resume (eval, demo) gets a sibling too, and no hint about resuming
    path, note = choose_run_dir(str(run), "eval", resume=None, new_config={})
    assert path == tmp_path / "grpo-5" and note == f"run_dir={run} holds an earlier run: this run writes to {path}"
    assert sorted(p.name for p in run.iterdir()) == before


def test_resume_continues_a_run_whose_settings_match(tmp_path):
    run = _holding_a_run(tmp_path / "run")
    # only keys a resume may change differ: more steps, other logging / saving / device, the paths
    new = {**SAVED, "max_steps": 20, "run_dir": "elsewhere", "resume": "auto", "device": "cuda",
           "logging": {"progress": False}, "checkpoint": {"save_every": 1}}
    assert choose_run_dir(str(run), "sft", resume="auto", new_config=new) == (run, "")
    assert choose_run_dir(str(run), "sft", resume=str(run / "checkpoints" / "step_5"), new_config=new) == (run, "")
    assert {"resume", "run_dir", "max_steps", "logging", "checkpoint"} <= set(RESUMABLE)


def test_resume_into_a_run_with_other_settings_names_each_key_with_both_values(tmp_path):
    run = _holding_a_run(tmp_path / "grpo")
    new = {**SAVED, "seed": 1, "optim": {"lr": 2e-3, "betas": [0.9, 0.99]}}
    with pytest.raises(ConfigError) as e:
        choose_run_dir(str(run), "rl", resume="auto", new_config=new)
    assert str(e.value) == (
        f"run_dir={run} holds a run with different settings: optim.betas [0.9, 0.95] -> [0.9, 0.99], optim.lr 0.001 -> "
        "0.002, seed 0 -> 1; resume=auto continues a run only with its own settings: set them back, drop resume= for a "
        "fresh directory beside it, or start a new run_dir from its checkpoint (run_dir=NEW resume=PATH)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grpo"]  # nothing created


def test_resume_into_a_run_whose_config_cannot_be_read_is_an_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("optim: [unclosed\n")
    with pytest.raises(ConfigError, match=re.escape(f"run_dir={run}: cannot read its config.yaml to check it is the same "
                                                    "run (") + r"\w+\); drop resume= for a fresh directory beside it$"):
        choose_run_dir(str(run), "sft", resume="auto", new_config=SAVED)


def test_config_differences_ignore_resumable_keys_and_show_missing_ones():
    saved = {"a": 1, "b": {"c": "x", "d": ""}, "logging": {"wandb": False}, "old": 3}
    new = {"a": 1, "b": {"c": "y z", "d": "w"}, "logging": {"wandb": True}, "fresh": 4}
    diffs = config_differences(saved, new)
    assert [k for k, _, _ in diffs] == ["b.c", "b.d", "fresh", "old"]
    assert format_differences(diffs) == "b.c x -> 'y z', b.d '' -> w, fresh (absent) -> 4, old 3 -> (absent)"
    # a key an older relign did not write is no difference while the new run leaves it at its default
    assert config_differences({"a": 1}, {"a": 1, "new": 2}, defaults={"new": 2}) == []
    assert format_differences(config_differences({"a": 1}, {"a": 2, "new": 3}, defaults={"new": 2})) == "a 1 -> 2, new (absent) -> 3"
    many = [(f"k{i}", i, i + 1) for i in range(10)]
    assert format_differences(many).endswith("k7 7 -> 8 and 2 more")


def _sft_config(tmp_path: Path, *overrides: str):
    from relign.recipes import sft

    return load_config(sft.Config, None, ["model.path=m", "data.path=d.jsonl", f"run_dir={tmp_path / 'run'}", *overrides])


def test_open_run_records_the_directory_it_chose_and_cleans_a_killed_save(tmp_path, capsys):
    first = open_run(_sft_config(tmp_path), "sft")
    assert first == tmp_path / "run"
    assert OmegaConf.load(first / "config.yaml").run_dir == str(first)
    second = open_run(_sft_config(tmp_path, "optim.lr=0.5"), "sft")  # no resume asked: beside it
    assert second == tmp_path / "run-2" and OmegaConf.load(second / "config.yaml").run_dir == str(second)
    assert f"this run writes to {second}" in capsys.readouterr().err
    assert OmegaConf.load(first / "config.yaml").optim.lr != 0.5  # the earlier run's config is untouched
    killed = first / "checkpoints" / f".tmp-step_3-{os.getpid() + 1}"  # what a kill mid-save leaves
    killed.mkdir(parents=True)
    assert open_run(_sft_config(tmp_path, "resume=auto", "max_steps=99"), "sft") == first
    assert not killed.exists() and OmegaConf.load(first / "config.yaml").max_steps == 99


def test_demo_rerun_goes_beside_the_earlier_demo(tmp_path, capsys):
    """The demo's stages (sft/, rl/) live inside its directory, so a fresh demo directory is
    what keeps a re-run's stages from picking up the earlier run's checkpoints."""
    from relign.recipes import demo

    cfg = load_config(demo.Config, None, [f"run_dir={tmp_path / 'demo'}"])
    run = open_run(cfg, "demo")
    (run / "sft" / "checkpoints" / "step_5").mkdir(parents=True)
    again = open_run(cfg, "demo")
    assert again == tmp_path / "demo-2" and not (again / "sft").exists()
    assert capsys.readouterr().err.strip() == f"run_dir={run} holds an earlier run: this run writes to {again}"


def test_cli_rerun_of_the_same_command_writes_beside_the_first(tiny_model_dir, tmp_path, capsys):
    """The preset case through the real command line: the same command twice gives two runs; a
    resume with other settings stops at once with the keys."""
    from relign.cli import main

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(4)])
    run = tmp_path / "run"
    args = ["sft", f"model.path={tiny_model_dir}", f"data.path={data}", f"run_dir={run}", "data.eval_fraction=0",
            "batch_size=4", "micro_batch_size=4", "max_steps=1", "eval_every=0", "logging.tensorboard=false",
            "logging.progress=false", "optim.lr=0.001", "seed=0"]
    assert main(args) == 0
    metrics = (run / "metrics.jsonl").read_bytes()
    proc = run_cli(*args)
    again = tmp_path / "run-2"
    assert f"run_dir={run} holds an earlier run (resume=auto would continue that one): this run writes to {again}" in proc.stderr
    assert f"run directory: {again}" in proc.stdout
    assert (again / "checkpoints" / "step_1").is_dir() and (run / "metrics.jsonl").read_bytes() == metrics
    capsys.readouterr()
    assert main([*args, "resume=auto", "optim.lr=0.5", "seed=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"relign sft: error: run_dir={run} holds a run with different settings: optim.lr 0.001 -> 0.5, "
                          "seed 0 -> 3; resume=auto continues a run only with its own settings"), err
    assert not (tmp_path / "run-3").exists()


class _Weights:
    """The one method ``save_checkpoint`` needs from a model."""

    def save_pretrained(self, path, safe_serialization=True, state_dict=None):
        import torch
        from safetensors.torch import save_file

        save_file({"w": torch.arange(6.0)}, str(Path(path) / "model.safetensors"))


def _two_rank_worker(rank: int, store: str, run_dir: str, out) -> None:
    import torch.distributed as dist

    from relign import checkpoint
    from relign.recipes import sft

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        args = ["model.path=m", "data.path=d.jsonl", f"run_dir={run_dir}"]
        fresh = open_run(load_config(sft.Config, None, args), "sft")
        ckpt = checkpoint.resolve_resume("auto", run_dir)
        try:
            open_run(load_config(sft.Config, None, [*args, "resume=auto"]), "sft")
            error = ""
        except ConfigError as e:
            error = str(e)
        out.put((rank, str(fresh), str(ckpt), error))
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_rank_0s_directory_checkpoint_and_error(tmp_path):
    """Under torchrun rank 0 decides and broadcasts: one sibling for both ranks (not one each),
    the same fallback checkpoint (the damaged one moved aside once), the same error."""
    import multiprocessing

    from relign.checkpoint import save_checkpoint

    run = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(run, step, model=_Weights())
    (run / "config.yaml").write_text("seed: 5\n")  # an earlier run with other settings
    (run / "checkpoints" / "step_2" / "model.safetensors").write_bytes(b"")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_two_rank_worker, args=(r, str(tmp_path / "store"), str(run), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    (_, fresh0, ckpt0, err0), (_, fresh1, ckpt1, err1) = sorted(out.get(timeout=5) for _ in procs)
    assert fresh0 == fresh1 == str(tmp_path / "run-2") and not (tmp_path / "run-3").exists()
    assert ckpt0 == ckpt1 == str(run / "checkpoints" / "step_1") and (run / "checkpoints" / "damaged-step_2").is_dir()
    assert err0 == err1 and err0.startswith(f"run_dir={run} holds a run with different settings: seed 5 -> 0, ")
