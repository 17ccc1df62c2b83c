"""The recipe frame (relign.recipes.frame) resumes exactly: a 3-step run killed right after its
step-2 checkpoint lands, then resumed with ``resume=auto``, equals the straight run, number for
number and weight for weight, for the three trainers that use it (sft, dpo, rl; rl also with a
batch in flight, rollout.max_staleness=1).

What the frame promises, measured from outside through the real CLI: the weights, optimizer,
schedule, data position and random streams of the checkpoint are restored (the step-3 metrics
and the final weights are those of the run that never stopped), and the resumed run says where
it resumed from. Every number is compared exactly: one process, one thread, the same code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relign.checkpoint import list_checkpoints
from relign.tracking import read_metrics

from ..conftest import REPO, run_cli, write_jsonl
from ..rl_toy import toy_overrides

STEPS = 3
KILL_AT = 2


def _sft(model_dir, tmp: Path) -> list[str]:
    rows = [{"prompt": f"Q{i}: what is {i} + {i}?", "response": f" {2 * i}"} for i in range(12)]
    data = write_jsonl(tmp / "sft.jsonl", rows)
    return ["sft", str(REPO / "examples" / "sft_tiny.yaml"), f"model.path={model_dir}", f"data.path={data}",
            "data.eval_fraction=0.25", "eval_every=1", "batch_size=4", "micro_batch_size=2", "optim.lr=3e-3",
            "optim.warmup_steps=1"]


def _dpo(model_dir, tmp: Path) -> list[str]:
    return ["dpo", str(REPO / "examples" / "dpo.yaml"), f"model.path={model_dir}", "data.max_rows=16",
            "data.max_length=384", "data.eval_fraction=0.25", "eval_every=1", "batch_size=4", "micro_batch_size=2",
            "optim.lr=1e-3", "optim.warmup_steps=1"]


def _rl(model_dir, tmp: Path) -> list[str]:
    # a critic (GAE), a KL term in the reward with its frozen reference, and several updates per
    # step from shuffled mini-batches: every piece of state a resume has to bring back
    return ["rl", *toy_overrides(model_dir, tmp, fn="graded"), "algorithm.advantage=gae", "algorithm.kl=reward",
            "algorithm.kl_coef=0.05", "algorithm.mini_batches=2", "algorithm.ppo_epochs=2", "rollout.n=2",
            "prompts_per_step=4", "optim.lr=1e-3", "critic.lr=1e-3"]


def _rl_stale(model_dir, tmp: Path) -> list[str]:
    # rollout.max_staleness=1: the checkpoint also holds the batch sampled ahead (in flight), which
    # the resumed run trains on at step 3 instead of sampling it again
    return ["rl", *toy_overrides(model_dir, tmp, fn="graded"), "rollout.max_staleness=1", "algorithm.tis_cap=2",
            "algorithm.tis_mode=mask", "rollout.n=4", "prompts_per_step=4", "optim.lr=1e-2"]


RECIPES = {"sft": _sft, "dpo": _dpo, "rl": _rl, "rl_stale": _rl_stale}


def _rows(run: Path) -> list[dict]:
    """Every logged row without what depends on the clock."""
    def timeless(key: str) -> bool:
        return key != "time" and not key.startswith(("time/", "perf/"))

    return [{k: v for k, v in r.items() if timeless(k)} for r in read_metrics(run)]


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.rglob("*.safetensors")):
        out.update({f"{f.relative_to(ckpt)}/{k}": v for k, v in load_file(str(f)).items()})
    return out


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_killed_after_step_2_and_resumed_equals_the_straight_run(recipe, tiny_model_dir, tmp_path):
    args = [*RECIPES[recipe](tiny_model_dir, tmp_path), f"max_steps={STEPS}", "checkpoint.save_every=1",
            "logging.tensorboard=false", "logging.progress=false"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_cli(*args, f"run_dir={straight}")
    killed = run_cli(*args, f"run_dir={resumed}", env={"RELIGN_FAULT": f"checkpoint-saved:{KILL_AT}"}, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [s for s, _ in list_checkpoints(resumed)] == list(range(1, KILL_AT + 1))
    proc = run_cli(*args, f"run_dir={resumed}", "resume=auto")
    assert f"at step {KILL_AT}" in proc.stderr and "resumed from" in proc.stderr

    a, b = _rows(straight), _rows(resumed)
    steps = [r["step"] for r in a if r["step"] > 0]
    assert steps == list(range(1, STEPS + 1))
    # the resumed run logs the steps it ran; the straight run's rows of those steps are the same numbers
    after = [r for r in b if r["step"] > KILL_AT]
    assert [r["step"] for r in after] == list(range(KILL_AT + 1, STEPS + 1))
    assert after == [r for r in a if r["step"] > KILL_AT]
    assert [r for r in b if r["step"] <= KILL_AT] == [r for r in a if r["step"] <= KILL_AT]  # the killed run's rows stay
    if recipe in ("sft", "dpo"):
        assert "eval/loss" in after[-1]  # the held-out set, scored by the resumed weights
    if recipe == "rl":
        assert "critic/value_loss" in after[-1] and "actor/kl" in after[-1]
    if recipe == "rl_stale":
        assert after[-1]["rollout/staleness"] == 1.0 and "actor/behav_is_masked_frac" in after[-1]
    wa, wb = _weights(straight / "checkpoints" / f"step_{STEPS}"), _weights(resumed / "checkpoints" / f"step_{STEPS}")
    assert wa.keys() == wb.keys() and wa
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []
