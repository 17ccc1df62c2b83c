"""torchrun + FSDP2 (gloo on CPU): 2 ranks train like 1, and checkpoints move between world sizes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relign.checkpoint import list_checkpoints
from relign.tracking import read_metrics

from ..conftest import REPO, run_cli
from .test_cli_sft import FACTS, _args


def _torchrun(args, env=None):
    # --standalone: torchrun picks a free port itself (a port probed free here could be taken
    # by another process before torchrun binds it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "relign", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture()
def data(tmp_path):
    from ..conftest import write_jsonl

    rows = [{"prompt": q, "response": a} for q, a in FACTS]
    return write_jsonl(tmp_path / "facts.jsonl", rows)


def _losses(run):
    """(step, (loss, grad norm)) per step: equal losses alone would not show a parameter group
    whose gradient is lost (FSDP's root after a no-grad pass: see distributed.reshard)."""
    return [(r["step"], (r["train/loss"], r["train/grad_norm"])) for r in read_metrics(run) if "train/loss" in r]


def _assert_close(a, b):
    """Only the order of float sums differs between the runs. The loss agrees to 1e-5; the
    gradient norm to 1e-4 relative: AdamW's first steps move every weight by about lr whatever
    the size of its gradient, so a near-zero gradient whose sign rounding flips gives weights
    that differ by ~lr, and later gradients a little more than the losses do."""
    assert a[0] == pytest.approx(b[0], abs=1e-5)
    assert a[1] == pytest.approx(b[1], rel=1e-4)


def test_two_ranks_match_one_and_resume_across_world_sizes(tiny_model_dir, data, tmp_path):
    common = ("max_steps=4", "checkpoint.save_every=1", "batch_size=4", "micro_batch_size=1", "packing=false")
    single, multi = tmp_path / "single", tmp_path / "multi"
    run_cli(*_args(tiny_model_dir, data, single, *common))

    # 2 ranks, killed right after checkpoint 2 lands; then resumed on 1 rank.
    proc = _torchrun(_args(tiny_model_dir, data, multi, *common), env={"RELIGN_FAULT": "checkpoint-saved:2"})
    assert proc.returncode != 0
    assert [s for s, _ in list_checkpoints(multi)] == [1, 2]
    run_cli(*_args(tiny_model_dir, data, multi, *common, "resume=auto"))

    a, b = _losses(single), _losses(multi)
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3, 4]
    for (_, la), (_, lb) in zip(a, b):
        _assert_close(la, lb)


@pytest.mark.parametrize("loss", ["dpo", "kto"])
def test_preference_two_ranks_match_one(tiny_model_dir, tmp_path, loss):
    """relign dpo under torchrun: the reference log-probs are computed in shards and summed,
    KTO's reference point is reduced over ranks, and the losses equal the 1-rank run."""
    common = ["dpo", str(REPO / "examples" / "dpo.yaml"), f"model.path={tiny_model_dir}", f"loss={loss}",
              "data.max_rows=16", "data.max_length=256", "data.eval_fraction=0", "batch_size=4", "micro_batch_size=2",
              "max_steps=2", "optim.lr=1e-3", "optim.warmup_ratio=0", "eval_every=0", "checkpoint.save_every=0",
              "logging.tensorboard=false", "logging.progress=false"]
    single, multi = tmp_path / "single", tmp_path / "multi"
    run_cli(*common, f"run_dir={single}")
    proc = _torchrun([*common, f"run_dir={multi}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _losses(single), _losses(multi)
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2]
    for (_, la), (_, lb) in zip(a, b):
        _assert_close(la, lb)


def test_bf16_mixed_two_ranks_match_one(tiny_model_dir, data, tmp_path):
    """model.dtype=bf16-mixed under FSDP2: the sharded fp32 weights are gathered and the
    forward runs under autocast on each rank. 2 ranks train like 1 to bf16 rounding (the sums
    of bf16 products differ in order), and the checkpoint holds fp32 weights."""
    from safetensors.torch import load_file

    common = ("max_steps=3", "batch_size=4", "micro_batch_size=1", "packing=false", "model.dtype=bf16-mixed")
    single, multi = tmp_path / "single", tmp_path / "multi"
    run_cli(*_args(tiny_model_dir, data, single, *common))
    proc = _torchrun(_args(tiny_model_dir, data, multi, *common))
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _losses(single), _losses(multi)
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3]
    for (_, la), (_, lb) in zip(a, b):
        assert la[0] == pytest.approx(lb[0], abs=2e-3) and la[1] == pytest.approx(lb[1], rel=2e-2)
    weights = load_file(str(multi / "checkpoints" / "step_3" / "model.safetensors"))
    assert {str(w.dtype) for w in weights.values()} == {"torch.float32"}
