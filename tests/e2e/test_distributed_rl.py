"""relign rl under torchrun (2 ranks, gloo on CPU): the same numbers as 1 rank, and checkpoints
that move between world sizes.

Sampling is seeded by each prompt's draw index, so both runs sample the same tokens; the
groups are gathered and the losses normalized by counts over all ranks, so the per-step
loss, gradient norm, KL and reward agree to float rounding (1e-5).
"""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoModelForCausalLM

from relign.checkpoint import list_checkpoints
from relign.tracking import read_metrics

from ..conftest import REPO, run_cli
from ..rl_toy import toy_overrides
from .test_distributed import _torchrun

pytestmark = pytest.mark.slow  # the longest end-to-end runs: `pytest -m "not slow"` leaves them out

KEYS = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy")


def _args(preset, tiny_model_dir, tmp_path, *extra):
    toy = [a for a in toy_overrides(tiny_model_dir, tmp_path, fn="graded")]
    return ["rl", str(REPO / "examples" / f"{preset}.yaml"), *toy, "rollout.max_new_tokens=6", "optim.lr=1e-3",
            "prompts_per_step=4", "traces_per_step=0", *extra]


def _rows(run, keys):
    return [(r["step"], [r[k] for k in keys]) for r in read_metrics(run) if "actor/loss" in r]


def _assert_same(a, b, n_steps):
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, n_steps + 1))
    for (_, x), (_, y) in zip(a, b):
        assert x == pytest.approx(y, abs=1e-5, rel=1e-5)


def test_grpo_two_ranks_match_one(tiny_model_dir, tmp_path):
    """grpo.yaml (KL in the loss, k3) with 2 mini-batches (old log-probs, shuffled groups)."""
    args = _args("grpo", tiny_model_dir, tmp_path, "max_steps=3", "algorithm.mini_batches=2", "checkpoint.save_final=false")
    one, two = tmp_path / "one", tmp_path / "two"
    run_cli(*args, f"run_dir={one}")
    proc = _torchrun([*args, f"run_dir={two}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys = (*KEYS, "actor/kl")
    a, b = _rows(one, keys), _rows(two, keys)
    _assert_same(a, b, 3)
    assert a[-1][1][keys.index("actor/kl")] > 0  # the KL term is really there


def test_ppo_on_two_ranks_resumes_on_two_and_on_one(tiny_model_dir, tmp_path):
    """ppo.yaml (critic, KL in the reward, 2 epochs x 2 mini-batches) on 2 ranks is killed after
    its step-2 checkpoint; it resumes on 2 ranks, and a copy resumes on 1 rank: both give the
    uninterrupted 1-rank run's numbers. The final model is a plain HF folder."""
    args = _args("ppo", tiny_model_dir, tmp_path, "max_steps=4", "checkpoint.save_every=1", "critic.lr=1e-3")
    keys = (*KEYS, "actor/kl", "critic/value_loss", "critic/grad_norm")
    straight, resumed2 = tmp_path / "straight", tmp_path / "resumed2"
    run_cli(*args, f"run_dir={straight}")
    killed = _torchrun([*args, f"run_dir={resumed2}"], env={"RELIGN_FAULT": "checkpoint-saved:2"})
    assert killed.returncode != 0
    assert [s for s, _ in list_checkpoints(resumed2)] == [1, 2]
    resumed1 = tmp_path / "resumed1"
    shutil.copytree(resumed2, resumed1)
    proc = _torchrun([*args, f"run_dir={resumed2}", "resume=auto"])
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-3000:]
    run_cli(*args, f"run_dir={resumed1}", "resume=auto")
    a = _rows(straight, keys)
    _assert_same(a, _rows(resumed2, keys), 4)
    _assert_same(a, _rows(resumed1, keys), 4)
    final = resumed2 / "checkpoints" / "step_4"
    model = AutoModelForCausalLM.from_pretrained(final)  # plain HF weights, no relign code needed
    assert model.config.hidden_size > 0 and (final / "critic" / "value_head.safetensors").is_file()


def test_uneven_prompts_across_ranks_is_a_clear_error(tiny_model_dir, tmp_path):
    proc = _torchrun([*_args("dr_grpo", tiny_model_dir, tmp_path, "prompts_per_step=3", "max_steps=1"),
                      f"run_dir={tmp_path / 'run'}"])
    assert proc.returncode != 0
    assert "prompts_per_step=3 does not divide across 2 ranks" in proc.stderr


def test_ppo_in_bf16_mixed_two_ranks_match_one(tiny_model_dir, tmp_path):
    """ppo.yaml (policy, frozen reference, critic; 2 epochs x 2 mini-batches) with
    model.dtype=bf16-mixed: under FSDP2 the three models' linear weights are gathered in bf16
    (distributed.wrap_fsdp), one rank rounds them under autocast. The first step samples the
    same completions; its numbers agree as far as bf16 sums in another order allow (measured:
    grad norm 8e-5 relative, loss and KL 1e-4 absolute; gathering the norms' weights in bf16
    too gave a grad norm 1.5% off), and the checkpoint's weights are fp32."""
    from safetensors.torch import load_file

    args = _args("ppo", tiny_model_dir, tmp_path, "max_steps=1", "critic.lr=1e-3", "model.dtype=bf16-mixed")
    keys = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/kl", "critic/value_loss")
    one, two = tmp_path / "one", tmp_path / "two"
    run_cli(*args, f"run_dir={one}")
    proc = _torchrun([*args, f"run_dir={two}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (_, a), = _rows(one, keys)
    (_, b), = _rows(two, keys)
    assert a[0] == b[0]  # the same samples and rewards
    for x, y in zip(a[1:], b[1:]):
        assert x == pytest.approx(y, rel=2e-3, abs=5e-4)
    weights = load_file(str(two / "checkpoints" / "step_1" / "model.safetensors"))
    assert {str(w.dtype) for w in weights.values()} == {"torch.float32"}
