"""model.dtype=bf16-mixed through the real CLI: each training recipe runs, learns, and saves fp32
weights; pure bf16 training warns."""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file

from relign.tracking import read_metrics

from ..conftest import REPO, run_cli, write_jsonl
from ..rl_toy import toy_overrides
from .test_cli_preference import FAST


def _fp32_checkpoint(path) -> None:
    weights = load_file(str(path / "model.safetensors"))
    assert weights and {str(w.dtype) for w in weights.values()} == {"torch.float32"}


def test_sft_memorizes_in_bf16_mixed_and_saves_fp32(tiny_model_dir, tmp_path):
    from .test_cli_sft import FACTS

    data = write_jsonl(tmp_path / "facts.jsonl", [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in FACTS])
    run = tmp_path / "run"
    proc = run_cli("sft", str(REPO / "examples" / "sft_tiny.yaml"), f"model.path={tiny_model_dir}", f"data.path={data}",
                   f"run_dir={run}", "model.dtype=bf16-mixed", "data.eval_fraction=0", "data.max_length=64", "max_steps=40",
                   "batch_size=8", "micro_batch_size=4", "optim.lr=5e-3", "optim.warmup_ratio=0", "optim.schedule=constant",
                   "eval_every=0", "checkpoint.save_every=0", "checkpoint.keep_last=0", "logging.tensorboard=false")
    assert "bf16-mixed" in proc.stdout  # the start banner names it
    losses = [r["train/loss"] for r in read_metrics(run) if "train/loss" in r]
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    assert losses[0] > 5 and losses[-1] < 0.5  # chance level to memorized, as in fp32 (test_cli_sft)
    _fp32_checkpoint(run / "checkpoints" / "step_40")


def test_ppo_with_critic_and_reference_in_bf16_mixed(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    run_cli("rl", str(REPO / "examples" / "ppo.yaml"), f"run_dir={run}", "model.dtype=bf16-mixed", "max_steps=2",
            "prompts_per_step=2", "logging.tensorboard=false", "optim.lr=1e-3", "task.reward_workers=0",
            *toy_overrides(tiny_model_dir, tmp_path, fn="graded"))
    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("actor/loss", "actor/kl", "critic/value_loss", "actor/logp_mismatch", "actor/grad_norm"):
            assert math.isfinite(r[key]), (key, r)
        # the engine samples in bf16 as the trainer scores: bf16 rounding, not the fp32/bf16 gap
        assert r["actor/logp_mismatch"] < 0.02
    _fp32_checkpoint(run / "checkpoints" / "step_2")


@pytest.mark.parametrize("recipe", ["dpo", "rm"])
def test_preference_recipes_fall_in_bf16_mixed(recipe, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    run_cli(recipe, str(REPO / "examples" / f"{recipe}.yaml"), f"model.path={tiny_model_dir}", f"run_dir={run}",
            "model.dtype=bf16-mixed", *FAST)
    losses = [r["train/loss"] for r in read_metrics(run) if "train/loss" in r]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert (losses[-1] + losses[-2]) / 2 < (losses[0] + losses[1]) / 2, losses
    _fp32_checkpoint(run / "checkpoints" / "step_6")


def test_pure_bf16_training_warns_and_points_to_bf16_mixed(tiny_model_dir, tmp_path):
    proc = run_cli("sft", str(REPO / "examples" / "sft_tiny.yaml"), f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'r'}",
                   "model.dtype=bf16", "--dry-run")
    assert "model.dtype=bf16 trains bf16 weights" in proc.stderr and "bf16-mixed" in proc.stderr
