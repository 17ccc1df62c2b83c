"""relign under torchrun on a (dp, cp, tp) mesh (gloo on CPU, docs/parallel.md): tensor and context
parallel runs train like one process, print their mesh, and write checkpoints that resume on one rank."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from relign.tracking import read_metrics

from ..conftest import REPO, run_cli, run_relign
from ..rl_toy import toy_overrides
from .test_cli_sft import FACTS, _args

pytestmark = pytest.mark.slow  # runs on 2 ranks


@pytest.fixture()
def data(tmp_path):
    from ..conftest import write_jsonl

    return write_jsonl(tmp_path / "facts.jsonl", [{"prompt": q, "response": a} for q, a in FACTS])


def _steps(run, keys):
    return [(r["step"], [r[k] for k in keys]) for r in read_metrics(run) if keys[0] in r]


def _close(a, b, n_steps, tol=1e-5):
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, n_steps + 1))
    for (_, x), (_, y) in zip(a, b):
        assert x == pytest.approx(y, abs=tol, rel=tol)


def _state(ckpt):
    """A checkpoint's weights and AdamW moments by parameter name, as saved."""
    weights = load_file(str(ckpt / "model.safetensors"))
    optim = torch.load(ckpt / "trainer_state.pt", weights_only=True)["optimizer"]["state"]
    moments = {f"{n}/{k}": v for n, s in optim.items() for k, v in s.items() if k != "step"}
    return {**weights, **moments}


def _same_tensors(a: dict, b: dict, tol=1e-5):
    """The same tensors by name, shape and dtype, values within ``tol``. A run whose FSDP shards
    over 2 ranks writes the tiny model's tied LM head as its own tensor too (plain dp runs do
    the same), which must then be the embeddings."""
    for x in (a, b):
        if "lm_head.weight" in x and "lm_head.weight" not in (b if x is a else a):
            assert torch.equal(x.pop("lm_head.weight"), x["model.embed_tokens.weight"])
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        assert (a[k] - b[k]).abs().max().item() <= tol, (k, (a[k] - b[k]).abs().max().item())


def test_sft_tensor_context_and_2d_parallel_match_one_process_and_resume_on_one_rank(tiny_model_dir, data, tmp_path):
    """relign sft on 2 ranks with parallel.tp_size=2 (dp 1 x cp 1 x tp 2), with parallel.cp_size=2
    (Ulysses: each packed micro-batch row split in two chunks), and on 4 ranks with tp_size=2
    (dp 2 x tp 2: each replica trains on half of each step's rows), against one process on the
    same global batch, 2 steps: loss and grad norm per step, the updated weights and the AdamW
    moments within 1e-5. The tp checkpoints hold the whole tensors (the 1-process
    names, shapes and dtypes): the tp run's step-1 checkpoint resumes on one rank to its step 2.

    lr 3e-4: AdamW moves a weight by about lr x g / (|g| + eps) whatever the size of g, so a
    gradient entry near 0 (5e-9 here, a difference of large partial sums) whose last bits differ
    by 2% between the two summation orders moves its weight by 2% of that: 1.2e-5 at the
    preset's lr of 3e-3, 1.2e-6 at 3e-4. The losses and grad norms agree to 1e-6 either way."""
    common = ("max_steps=2", "checkpoint.save_every=1", "batch_size=4", "micro_batch_size=2", "optim.lr=3e-4")
    one, tp, cp, resumed = tmp_path / "one", tmp_path / "tp", tmp_path / "cp", tmp_path / "resumed"
    dry = run_relign([*_args(tiny_model_dir, data, tmp_path / "dry", *common), "parallel.tp_size=2", "--dry-run"], ranks=2)
    assert dry.returncode == 0 and "2 ranks as mesh dp 1 x cp 1 x tp 2" in dry.stderr + dry.stdout, dry.stderr[-2000:]
    run_cli(*_args(tiny_model_dir, data, one, *common))
    two_d = tmp_path / "two_d"
    for run, key, ranks in ((tp, "parallel.tp_size=2", 2), (cp, "parallel.cp_size=2", 2), (two_d, "parallel.tp_size=2", 4)):
        proc = run_relign([*_args(tiny_model_dir, data, run, *common), key], ranks=ranks)
        assert proc.returncode == 0, proc.stderr[-3000:]
    keys = ("train/loss", "train/grad_norm")
    for run in (tp, cp, two_d):
        _close(_steps(one, keys), _steps(run, keys), 2)
        for step in (1, 2):
            _same_tensors(_state(one / "checkpoints" / f"step_{step}"), _state(run / "checkpoints" / f"step_{step}"))
    run_cli(*_args(tiny_model_dir, data, resumed, *common, f"resume={tp / 'checkpoints' / 'step_1'}"))
    (_, a), = _steps(tp, keys)[1:]
    (_, b), = [s for s in _steps(resumed, keys) if s[0] == 2]
    assert a == pytest.approx(b, abs=1e-5, rel=1e-5)
    _same_tensors(_state(tp / "checkpoints" / "step_2"), _state(resumed / "checkpoints" / "step_2"))


def test_tensor_parallel_on_one_process_is_a_clear_error(tiny_model_dir, data, tmp_path):
    proc = run_cli(*_args(tiny_model_dir, data, tmp_path / "run", "parallel.tp_size=2"), check=False)
    assert proc.returncode != 0
    assert "parallel.tp_size x parallel.cp_size = 2 x 1 does not divide the world size 1" in proc.stderr


def _rl_args(preset, tiny_model_dir, tmp_path, *extra):
    return ["rl", str(REPO / "examples" / f"{preset}.yaml"), *toy_overrides(tiny_model_dir, tmp_path, fn="graded"),
            "rollout.max_new_tokens=6", "optim.lr=1e-3", "prompts_per_step=4", "traces_per_step=0",
            "checkpoint.save_final=false", *extra]


def test_rl_ppo_tensor_parallel_matches_one_process(tiny_model_dir, tmp_path):
    """relign rl with ppo.yaml (policy, frozen reference and critic all split over tp = 2; 2
    epochs x 2 mini-batches) against one process, 2 steps: the rollouts come from the engine's
    whole replica, so the rewards are the same samples'; loss, KL, entropy, grad norms and the
    value loss within 1e-5."""
    args = _rl_args("ppo", tiny_model_dir, tmp_path, "max_steps=2", "critic.lr=1e-3")
    keys = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy", "actor/kl", "critic/value_loss",
            "critic/grad_norm")
    run_cli(*args, f"run_dir={tmp_path / 'one'}")
    proc = run_relign([*args, f"run_dir={tmp_path / 'tp'}", "parallel.tp_size=2"], ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _steps(tmp_path / "one", keys), _steps(tmp_path / "tp", keys)
    _close(a, b, 2)
    assert a[1][1][keys.index("actor/kl")] != 0  # the KL term is really there
