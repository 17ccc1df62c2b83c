"""Checkpoint integrity: the manifest written last, verification on resume, fallback to the
previous valid checkpoint with a warning, one-line errors naming the file and the step, checks
for checkpoints written before manifests, and the cleanup of a killed save's temp folders."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from relign import checkpoint as ck
from relign.checkpoint import (
    MANIFEST_FILE,
    list_checkpoints,
    load_checkpoint,
    load_model_weights,
    remove_stale_temps,
    resolve_resume,
    save_checkpoint,
    verify_checkpoint,
)
from relign.config import ConfigError
from relign.tracking import read_metrics

from .conftest import run_cli, write_jsonl


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def _save(run: Path, step: int, model) -> Path:
    return save_checkpoint(run, step, model=model, tensors={"optimizer": {"w": torch.full((4,), float(step))}},
                           state={"sampler": {"epoch": 0, "position": step}})


@pytest.fixture()
def run(tmp_path, model) -> Path:
    run = tmp_path / "run"
    _save(run, 1, model)
    _save(run, 2, model)
    return run


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step}"


def test_manifest_lists_every_file_with_its_size_and_sha256(run):
    step2 = _ckpt(run, 2)
    manifest = json.loads((step2 / MANIFEST_FILE).read_text())
    on_disk = {p.relative_to(step2).as_posix() for p in step2.rglob("*") if p.is_file()} - {MANIFEST_FILE}
    assert manifest["step"] == 2
    assert set(manifest["files"]) == on_disk and {"model.safetensors", "trainer_state.pt", "relign_state.json"} <= on_disk
    for rel, info in manifest["files"].items():
        data = (step2 / rel).read_bytes()
        assert info == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(step2) is None and resolve_resume("auto", run) == step2


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage(f: Path) -> None:  # same size, other bytes: only the hash can tell
    f.write_bytes(bytes(255 - b for b in f.read_bytes()))


def _empty(f: Path) -> None:
    f.write_bytes(b"")


@pytest.mark.parametrize("name, damage, why", [
    ("model.safetensors", _truncate, "bytes where manifest.json says"),
    ("model.safetensors", _garbage, "contents differ from manifest.json (sha256 mismatch: damaged or overwritten)"),
    ("model.safetensors", _empty, "0 bytes where manifest.json says"),
    ("trainer_state.pt", _garbage, "contents differ from manifest.json (sha256 mismatch: damaged or overwritten)"),
    ("relign_state.json", _truncate, "bytes where manifest.json says"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(run, name, damage, why, capsys):
    bad = _ckpt(run, 2) / name
    size = bad.stat().st_size
    damage(bad)
    assert why in verify_checkpoint(_ckpt(run, 2))
    assert resolve_resume("auto", run) == _ckpt(run, 1)
    aside = run / "checkpoints" / "damaged-step_2"
    err = capsys.readouterr().err
    assert err.startswith(f"warning: checkpoint step_2 is damaged ({bad}: ") and why in err
    assert f"moved it to {aside} and resuming from step_1" in err
    if damage is _truncate:
        assert f"{size // 2} bytes where manifest.json says {size} (truncated or overwritten)" in err
    # set aside, kept for inspection, and out of every later listing (the final save's check included)
    assert (aside / name).is_file() and [s for s, _ in list_checkpoints(run)] == [1]
    tensors, state = load_checkpoint(_ckpt(run, 1))
    assert state["step"] == 1 and tensors["optimizer"]["w"].tolist() == [1.0] * 4


def test_no_valid_checkpoint_left_is_one_line_naming_the_file_and_the_step(run):
    _empty(_ckpt(run, 2) / "model.safetensors")
    _truncate(_ckpt(run, 1) / "trainer_state.pt")
    with pytest.raises(ConfigError) as e:
        resolve_resume("auto", run)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"resume=auto: checkpoint step_2 is damaged: {_ckpt(run, 2) / 'model.safetensors'}: 0 bytes where "
                          "manifest.json says ")
    assert f"; the 1 older checkpoint(s) are damaged too; no valid checkpoint is left in {run / 'checkpoints'}" in msg
    assert [s for s, _ in list_checkpoints(run)] == [1, 2]  # nothing is moved when there is nothing to resume


def test_resume_path_to_a_damaged_checkpoint_names_the_file(run):
    path = _ckpt(run, 2)
    assert resolve_resume(str(path), run) == path
    _garbage(path / "trainer_state.pt")
    with pytest.raises(ConfigError, match="^resume=.*step_2: damaged checkpoint: .*step_2/trainer_state.pt: contents "
                                          r"differ from manifest.json \(sha256 mismatch"):
        resolve_resume(str(path), run)
    assert list_checkpoints(run)[-1] == (2, path)  # an explicit path is never moved


def test_checkpoints_without_a_manifest_get_the_structural_checks(run):
    """Runs saved before manifests existed resume as before; what can be checked without one is."""
    for step in (1, 2):
        (_ckpt(run, step) / MANIFEST_FILE).unlink()
    step2 = _ckpt(run, 2)
    assert verify_checkpoint(step2) is None and resolve_resume("auto", run) == step2
    weights = step2 / "model.safetensors"
    good = weights.read_bytes()
    header = 8 + int.from_bytes(good[:8], "little")

    weights.write_bytes(good[:-100])  # truncated inside the tensors
    assert verify_checkpoint(step2) == f"{weights}: {len(good) - 100} bytes where its header describes {len(good)} (truncated or padded)"
    weights.write_bytes(good[: header - 10])  # truncated inside the header
    assert verify_checkpoint(step2) == (f"{weights}: its header claims {header - 8} bytes but the file has {header - 10} "
                                        "(truncated, or not safetensors)")
    weights.write_bytes(b"")
    assert verify_checkpoint(step2) == f"{weights}: 0 bytes, too short for a safetensors file"
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!" + b"\x00" * 64)
    assert verify_checkpoint(step2) == f"{weights}: unreadable header (JSONDecodeError), not a safetensors file"
    weights.write_bytes(good)

    state = step2 / "trainer_state.pt"
    data = state.read_bytes()
    state.write_bytes(b"")
    assert verify_checkpoint(step2).startswith(f"{state}: not a readable torch.save file (File is not a zip file")
    at = data.index(torch.full((4,), 2.0).numpy().tobytes())  # the optimizer tensor's stored bytes
    flipped = bytearray(data)
    flipped[at] ^= 0xFF  # a flipped bit in a tensor: the zip's CRC tells
    state.write_bytes(bytes(flipped))
    assert verify_checkpoint(step2).startswith(f"{state}: damaged (its member ")
    state.write_bytes(data)

    (step2 / "relign_state.json").write_text("{")
    assert verify_checkpoint(step2).startswith(f"{step2 / 'relign_state.json'}: unreadable (JSONDecodeError")
    assert resolve_resume("auto", run) == _ckpt(run, 1)


def test_loading_a_damaged_file_names_it(run, model):
    """Files read without a verification first (a model folder given by hand) still fail in one line."""
    path = _ckpt(run, 2)
    _truncate(path / "model.safetensors")
    with pytest.raises(ConfigError, match=f"^{path / 'model.safetensors'}: cannot be loaded \\(SafetensorError: "):
        load_model_weights(model, path)
    (path / "trainer_state.pt").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=f"^{path / 'trainer_state.pt'}: cannot be loaded \\("):
        load_checkpoint(path)


def test_stale_temp_folders_of_a_killed_save_are_removed(run, model):
    root = run / "checkpoints"
    other = os.getpid() + 1  # another process's: a killed run's
    stale = [root / f".tmp-step_3-{other}", root / f".old-step_2-{other}", root / f".tmp-step_4-{os.getpid()}"]
    for d in stale:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    old = ck._PROCESS_START - 60  # ours by pid, but older than this process: a reused pid
    os.utime(stale[2], (old, old))
    live = root / f".tmp-step_5-{os.getpid()}"  # this process's, being written now
    live.mkdir()
    keep = [root / "damaged-step_9", root / "notes"]
    for d in keep:
        d.mkdir()
    _save(run, 3, model)
    assert not any(d.exists() for d in stale) and live.is_dir() and all(d.is_dir() for d in keep)
    assert [s for s, _ in list_checkpoints(run)] == [1, 2, 3]
    assert remove_stale_temps(run) == [] and remove_stale_temps(run / "nothing-here") == []


def test_cli_sft_resume_skips_a_truncated_checkpoint(tiny_model_dir, tmp_path):
    """Through the real CLI: the newest checkpoint's weights are truncated; resume=auto warns,
    naming the file, resumes from the one before and saves a good final checkpoint."""
    from relign.cli import main

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(8)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    run = tmp_path / "run"
    args = ["sft", f"model.path={tiny_model_dir}", f"data.path={data}", f"run_dir={run}", "data.eval_fraction=0",
            "data.max_length=64", "batch_size=4", "micro_batch_size=4", "max_steps=2", "checkpoint.save_every=1",
            "eval_every=0", "logging.tensorboard=false", "logging.progress=false"]
    assert main(args) == 0  # the first run in this process: only the resume needs the real command line
    bad = _ckpt(run, 2) / "model.safetensors"
    size = bad.stat().st_size
    _truncate(bad)
    proc = run_cli(*args, "resume=auto")
    assert f"warning: checkpoint step_2 is damaged ({bad}: " in proc.stderr, proc.stderr[-2000:]
    assert f"resumed from {_ckpt(run, 1)} at step 1" in proc.stderr
    assert [s for s, _ in list_checkpoints(run)] == [1, 2] and verify_checkpoint(_ckpt(run, 2)) is None
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == [1, 2]
    assert (run / "checkpoints" / "damaged-step_2" / "model.safetensors").stat().st_size == size // 2  # kept to look at
