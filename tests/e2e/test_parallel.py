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
    names, shapes and dtypes): the tp run's step-1 checkpoint is read on one rank bit for bit,
    and resumes there to its step 2 (within 1e-5 of the tp run's: tp sums in another order).

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
    _reread_on_one_rank_is_bitwise(_args(tiny_model_dir, data, tmp_path / "reread", *common), tp / "checkpoints" / "step_1")
    run_cli(*_args(tiny_model_dir, data, resumed, *common, f"resume={tp / 'checkpoints' / 'step_1'}"))
    (_, a), = _steps(tp, keys)[1:]
    (_, b), = [s for s in _steps(resumed, keys) if s[0] == 2]
    assert a == pytest.approx(b, abs=1e-5, rel=1e-5)
    _same_tensors(_state(tp / "checkpoints" / "step_2"), _state(resumed / "checkpoints" / "step_2"))


def _reread_on_one_rank_is_bitwise(args: list[str], ckpt) -> None:
    """The tp checkpoint ``ckpt`` read on one process by sft's own resume path (``frame.trainable``),
    then written again by its saver (``frame.saver``): the same weights, AdamW moments and step
    counts, schedule and data position, bit for bit. What the tp run held is what a one-rank
    run resumes from."""
    import json

    from relign.checkpoint import STATE_FILE
    from relign.config import load_config
    from relign.models.loading import load_model_tokenizer
    from relign.recipes import build, frame, sft

    cfg = load_config(sft.Config, args[1], [*args[2:], f"resume={ckpt}"])
    run = frame.open(cfg, "sft")
    t = frame.trainable(run, build.load_policy(cfg.model, run.device), ckpt=frame.checkpoint_to_resume(run), rows=len(FACTS),
                        batch_size=cfg.batch_size, total_steps=cfg.max_steps)
    assert t.start == 1
    frame.saver(run, t, load_model_tokenizer(cfg.model))(1)
    again = run.run_dir / "checkpoints" / "step_1"
    _same_tensors(_state(ckpt), _state(again), tol=0.0)
    a, b = (torch.load(c / "trainer_state.pt", weights_only=True) for c in (ckpt, again))
    assert [s["step"] for s in a["optimizer"]["state"].values()] == [s["step"] for s in b["optimizer"]["state"].values()]
    assert a["scheduler"] == b["scheduler"]
    state = [json.loads((c / STATE_FILE).read_text()) for c in (ckpt, again)]
    assert state[0]["sampler"] == state[1]["sampler"]


def test_tensor_parallel_on_one_process_is_a_clear_error(tiny_model_dir, data, tmp_path):
    proc = run_cli(*_args(tiny_model_dir, data, tmp_path / "run", "parallel.tp_size=2"), check=False)
    assert proc.returncode != 0
    assert "parallel.tp_size x parallel.cp_size = 2 x 1 does not divide the world size 1" in proc.stderr


def test_context_parallel_in_rm_is_a_clear_error(tiny_model_dir, tmp_path):
    proc = run_cli("rm", str(REPO / "examples" / "rm.yaml"), f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'rm'}",
                   "parallel.cp_size=2", check=False)
    assert proc.returncode != 0
    assert "parallel.cp_size=2: context parallel trains sft, dpo and rl in this version (relign rm runs tensor" in proc.stderr


def _rl_args(preset, tiny_model_dir, tmp_path, *extra):
    return ["rl", str(REPO / "examples" / f"{preset}.yaml"), *toy_overrides(tiny_model_dir, tmp_path, fn="graded"),
            "rollout.max_new_tokens=6", "optim.lr=1e-3", "prompts_per_step=4", "traces_per_step=0",
            "checkpoint.save_final=false", *extra]


@pytest.mark.parametrize("preset", ["grpo", "ppo"])
def test_rl_tensor_and_context_parallel_match_one_process(preset, tiny_model_dir, tmp_path):
    """relign rl with the grpo preset (policy and frozen reference, KL in the loss) and the ppo
    preset (policy, reference and critic; 2 epochs x 2 mini-batches), packed rows, 2 steps on 2
    ranks at parallel.tp_size=2 (every model's heads and MLP split) and at parallel.cp_size=2
    (every packed micro-batch row split in two chunks, Ulysses attention; the critic too), against
    one process: the rollouts come from the engine's whole replica, so the rewards are the same
    samples'; loss, KL, entropy, grad norms (and the value loss) within 1e-5."""
    extra = ("critic.lr=1e-3",) if preset == "ppo" else ()
    args = _rl_args(preset, tiny_model_dir, tmp_path, "max_steps=2", "packing=true", *extra)
    keys = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy", "actor/kl")
    keys += ("critic/value_loss", "critic/grad_norm") if preset == "ppo" else ()
    run_cli(*args, f"run_dir={tmp_path / 'one'}")
    one = _steps(tmp_path / "one", keys)
    assert one[1][1][keys.index("actor/kl")] != 0  # the KL term is really there
    for key in ("parallel.tp_size=2", "parallel.cp_size=2"):
        run = tmp_path / key.split(".")[1]
        proc = run_relign([*args, f"run_dir={run}", key], ranks=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _close(one, _steps(run, keys), 2)


def test_rl_context_parallel_needs_packed_rows(tiny_model_dir, tmp_path):
    proc = run_cli(*_rl_args("grpo", tiny_model_dir, tmp_path, "parallel.cp_size=2", f"run_dir={tmp_path / 'run'}"),
                   check=False)
    assert proc.returncode != 0
    assert "parallel.cp_size=2 splits packed rows over the cp ranks: set packing=true" in proc.stderr


def test_dpo_tensor_and_context_parallel_match_one_process(tiny_model_dir, tmp_path):
    """relign dpo (reference log-probs precomputed, pairs packed with the prompt once) on 2 ranks at
    parallel.tp_size=2 and at parallel.cp_size=2 against one process, 2 steps: loss, grad norm and
    reward margin within 1e-5. Not the reward accuracy (the share of margins > 0): at step 1 the
    policy is the reference, every margin is 0 up to rounding, and rounding noise of 1e-6 decides
    the share (0.25 on one side, 0 on the other on an AMX Xeon). A discontinuous function of
    rounding noise is no invariance; the margins it thresholds are compared.

    lr 3e-4, for the reason the SFT test above gives (AdamW moves a weight whose gradient is ~0 by
    lr x its noise): at 1e-3 the step-2 grad norm differed by 1.4e-5 relative on an AMX Xeon."""
    args = ["dpo", str(REPO / "examples" / "dpo.yaml"), f"model.path={tiny_model_dir}", "data.max_rows=16",
            "data.max_length=256", "data.eval_fraction=0", "batch_size=4", "micro_batch_size=2", "max_steps=2",
            "optim.lr=3e-4", "optim.warmup_ratio=0", "eval_every=0", "checkpoint.save_every=0", "packing=true",
            "logging.tensorboard=false", "logging.progress=false"]
    keys = ("train/loss", "train/grad_norm", "train/rewards/margins")
    run_cli(*args, f"run_dir={tmp_path / 'one'}")
    one = _steps(tmp_path / "one", keys)
    assert one[1][1][2] != 0  # the policy moved away from the reference
    for key in ("parallel.tp_size=2", "parallel.cp_size=2"):
        run = tmp_path / key.split(".")[1]
        proc = run_relign([*args, f"run_dir={run}", key], ranks=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _close(one, _steps(run, keys), 2)
