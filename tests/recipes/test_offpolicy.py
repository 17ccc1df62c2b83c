"""Off-policy rollout (rollout.max_staleness, rollout.overlap) and the checks that watch it.

Each test states what the run promises and measures it from outside: the batches the update
really received (a spy on ``rl._update`` that only records its arguments), log-probs computed
here with plain transformers forwards of the saved weights, and the logged metrics.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from relign.config import ConfigError, load_config
from relign.errors import SyncMismatch
from relign.recipes import rl, rl_update
from relign.tracking import read_metrics

from ..conftest import run_cli
from ..rl_toy import toy_overrides

CAP = 2.0


def _cfg(model_dir, tmp, *extra):
    return load_config(rl.Config, None, [
        *toy_overrides(model_dir, tmp, fn="graded"), f"run_dir={tmp / 'run'}", "traces_per_step=0", "rollout.n=4",
        "prompts_per_step=4", "max_steps=3", "optim.lr=1e-2", "optim.warmup_steps=0", *extra])


def _spy(monkeypatch) -> list[dict]:
    """Record (a copy of) what each step's update received."""
    seen: list[dict] = []
    real = rl._update

    def spy(run, cfg, step, batch, advantages, returns, old_logps, ref_logps, values):
        seen.append({"step": step, "input_ids": batch.input_ids.clone(), "attention_mask": batch.attention_mask.clone(),
                     "mask": batch.response_mask.clone(), "sampling": batch.sampling_logps.clone(),
                     "old": old_logps.clone() if old_logps is not None else None})
        return real(run, cfg, step, batch, advantages, returns, old_logps, ref_logps, values)

    monkeypatch.setattr(rl, "_update", spy)
    return seen


def _logps(model_dir, rec: dict) -> torch.Tensor:
    """log pi(x_t | x_<t) of the recorded batch under the weights in ``model_dir`` (plain HF forward, fp32)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=rec["input_ids"], attention_mask=rec["attention_mask"]).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, rec["input_ids"][:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0)) * rec["mask"]


def _masked_mean(x, m):
    return float((x * m).sum() / m.sum())


def test_staleness_one_samples_with_the_weights_one_update_old(tiny_model_dir, tmp_path, monkeypatch):
    """s = 1: step 2 trains on tokens sampled by the initial weights theta_0, clips against theta_1
    (pi_prox), and weighs each token by min(pi_prox / pi_behav, C); the logged statistics are the
    test's own recomputation from the saved weights."""
    seen = _spy(monkeypatch)
    cfg = _cfg(tiny_model_dir, tmp_path, "rollout.max_staleness=1", f"algorithm.tis_cap={CAP}",
               "checkpoint.save_every=1")
    rows = [r for r in rl.train(cfg).history if r.get("step", 0) > 0]
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert not any(k.startswith("rollout/staleness_") for r in rows for k in r)  # one batch, one version: one key

    step2 = seen[1]
    theta0 = _logps(tiny_model_dir, step2)
    theta1 = _logps(tmp_path / "run" / "checkpoints" / "step_1", step2)
    m = step2["mask"]
    assert (step2["sampling"] - theta0).abs().max() < 1e-5  # sampled by theta_0 ...
    assert (step2["sampling"] - theta1).abs().max() > 1e-3  # ... not by theta_1
    assert (step2["old"] - theta1).abs().max() < 1e-5  # pi_prox: the weights before step 2's update
    w = torch.exp(theta1 - theta0)
    assert rows[1]["actor/behav_is_mean"] == pytest.approx(_masked_mean(w.clamp(max=CAP), m), abs=1e-5)
    wc = w.clamp(max=CAP).double()
    std = _masked_mean((wc - _masked_mean(wc, m)) ** 2, m) ** 0.5
    assert std > 1e-3 and rows[1]["actor/behav_is_std"] == pytest.approx(std, rel=1e-3, abs=1e-5)
    assert rows[1]["actor/behav_is_capped_frac"] == pytest.approx(_masked_mean((w > CAP).float(), m), abs=1e-6)
    assert rows[1]["actor/behav_kl"] == pytest.approx(_masked_mean(theta0 - theta1, m), abs=1e-5)
    assert rows[1]["actor/logp_mismatch"] == pytest.approx(_masked_mean((theta0 - theta1).abs(), m), abs=1e-5)
    assert rows[0]["actor/behav_is_std"] < 1e-5  # step 1 is not stale: its weights are 1 up to rounding


def test_behaviour_weight_spread_of_weights_near_one():
    """Weights within 5e-7 of 1 (a fresh batch: engine and trainer differ by rounding only) have a
    spread of about 3e-7; E[w^2] - E[w]^2 in float32 made it 3e-4 (or 0), rounding noise."""
    from types import SimpleNamespace

    from relign.recipes.rl_update import Stats

    g = torch.Generator().manual_seed(0)
    w = 1.0 + (torch.rand(8, 40, generator=g) - 0.5) * 1e-6
    m = (torch.rand(8, 40, generator=g) > 0.3).float()
    stats = Stats()
    batch = SimpleNamespace(response_mask=m, sampling_logps=torch.zeros(8, 40))
    rl_update.behaviour_stats(stats, w, torch.zeros_like(w, dtype=torch.bool), torch.zeros(8, 40), batch, mode="truncate")
    out = stats.reduce()
    rl_update.behaviour_spread(out)
    wd = w.double()
    want = _masked_mean((wd - _masked_mean(wd, m)) ** 2, m) ** 0.5
    assert out["actor/behav_is_std"] == pytest.approx(want, rel=1e-3)


def test_mask_mode_drops_the_tokens_above_the_cap_and_counts_them(tiny_model_dir, tmp_path, monkeypatch):
    """tis_mode=mask with a cap of 1: every token whose pi_prox / pi_behav exceeds 1 leaves the
    loss (weight 0), and the masked fraction is the count of those tokens."""
    seen = _spy(monkeypatch)
    cfg = _cfg(tiny_model_dir, tmp_path, "rollout.max_staleness=1", "algorithm.tis_cap=1", "algorithm.tis_mode=mask",
               "max_steps=2")
    rows = [r for r in rl.train(cfg).history if r.get("step", 0) > 0]
    rec, m = seen[1], seen[1]["mask"]
    w = torch.exp(rec["old"] - rec["sampling"])
    over = _masked_mean((w > 1.0).float(), m)
    assert 0.05 < over < 0.95  # the cap bites on a real share of the tokens
    assert rows[1]["actor/behav_is_masked_frac"] == pytest.approx(over, abs=1e-6)
    assert rows[1]["actor/behav_is_mean"] == pytest.approx(_masked_mean(torch.where(w > 1.0, 0.0, w), m), abs=1e-6)


def test_learning_rate_zero_leaves_every_ratio_at_one(tiny_model_dir, tmp_path):
    """A learning rate of (in effect) 0 with s = 1: pi_theta = pi_prox at every update, so every PPO
    ratio is exactly 1 and nothing is clipped, at every step (the decoupled loss adds no spurious
    ratio). optim.lr must be > 0; 1e-30 moves no weight by more than 1e-29 (checked)."""
    from safetensors.torch import load_file

    cfg = _cfg(tiny_model_dir, tmp_path, "rollout.max_staleness=1", f"algorithm.tis_cap={CAP}", "optim.lr=1e-30",
               "algorithm.mini_batches=2", "optim.weight_decay=0")
    rows = [r for r in rl.train(cfg).history if r.get("step", 0) > 0]
    assert len(rows) == 3
    for r in rows:
        assert r["actor/ratio_min"] == 1.0 and r["actor/ratio_max"] == 1.0 and r["actor/clip_frac"] == 0.0, r
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "checkpoints" / "step_3" / "model.safetensors"))
    assert all(torch.allclose(before[k], after[k], rtol=0, atol=1e-29) for k in after)


def _timeless(run) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "perf/"))} for r in read_metrics(run)]


def test_thread_overlap_equals_sampling_in_turn(tiny_model_dir, tmp_path):
    """overlap=thread samples batch k+1 in a background thread on the engine's own copy while
    batch k trains: the same tokens, metrics and final weights as sampling it in turn."""
    from safetensors.torch import load_file

    runs = {}
    for overlap in ("none", "thread"):
        cfg = _cfg(tiny_model_dir, tmp_path / overlap, "rollout.max_staleness=1", f"algorithm.tis_cap={CAP}",
                   "algorithm.tis_mode=mask", f"rollout.overlap={overlap}", "traces_per_step=16")
        rl.train(cfg)
        runs[overlap] = tmp_path / overlap / "run"
    a, b = _timeless(runs["none"]), _timeless(runs["thread"])
    b_sync = [r.pop("rollout/sync_gap", None) for r in b]  # the thread's engine holds a copy: it is checked
    assert a == b and [r["step"] for r in a] == [1, 2, 3]
    assert b_sync == [0.0, 0.0, 0.0]
    for step in (1, 2, 3):
        assert (runs["none"] / "rollouts" / f"step_{step}.jsonl").read_text() == \
            (runs["thread"] / "rollouts" / f"step_{step}.jsonl").read_text()
    # the report's mismatch panel sits right after the reward curve, with the off-policy charts
    import re

    from relign.report import write_report

    page = write_report(runs["thread"]).read_text()
    ids = re.findall(r'<figure class="chart" id="chart-([a-z0-9-]+)"', page)
    assert ids[:4] == ["reward", "mismatch", "behaviour-weights", "staleness"], ids
    panel = page[page.index('id="chart-mismatch"'):page.index('id="chart-behaviour-weights"')]
    assert "actor/behav_kl" in panel and "rollout/sync_gap" in panel and "actor/logp_mismatch" in panel
    wa = load_file(str(runs["none"] / "checkpoints" / "step_3" / "model.safetensors"))
    wb = load_file(str(runs["thread"] / "checkpoints" / "step_3" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize(("extra", "says"), [
    (["rollout.max_staleness=1"], "algorithm.tis_cap"),
    (["rollout.max_staleness=1", "algorithm.tis_cap=2", "update=trpo"], "update=trpo"),
    (["rollout.max_staleness=2", "algorithm.tis_cap=2", "algorithm.advantage=vine"], "advantage=vine"),
    (["rollout.overlap=thread"], "max_staleness >= 1"),
    (["rollout.max_staleness=1", "algorithm.tis_cap=2", "algorithm.tis_mode=clip"], "algorithm.tis_mode"),
])
def test_off_policy_settings_that_cannot_work_are_one_line_errors(extra, says, tiny_model_dir, tmp_path):
    proc = run_cli("rl", *toy_overrides(tiny_model_dir, tmp_path), f"run_dir={tmp_path / 'run'}", *extra, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], proc.stderr


def test_thread_overlap_is_refused_under_torchrun(tiny_model_dir, tmp_path, monkeypatch):
    """The check runs after the process group exists; with two ranks, overlap=thread is refused
    with the reason (a rollout gather in a thread racing FSDP's collectives)."""
    from relign import distributed

    cfg = _cfg(tiny_model_dir, tmp_path, "rollout.max_staleness=1", "algorithm.tis_cap=2", "rollout.overlap=thread")
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    with pytest.raises(ConfigError, match="one process.*deadlock"):
        rl._check(cfg)


# An engine that keeps the step-1 weights: the reward file (loaded in the run's own process, task.reward_workers=0)
# makes every HFEngine.load_weights after the first copy nothing
SKIP_AFTER_STEP_1 = """
from relign.rollout.hf_engine import HFEngine

_real, _calls = HFEngine.load_weights, []


def _skip_after_step_1(self, named):
    _calls.append(1)
    return _real(self, named) if len(_calls) == 1 else 0


HFEngine.load_weights = _skip_after_step_1
"""


def _sync_run(model_dir, tmp, *, skip: bool) -> tuple:
    """rollout.overlap=thread (the HF engine holds its own copy) at lr 1e-5, the default sync_check_tol."""
    args = [*toy_overrides(model_dir, tmp, fn="graded"), "rollout.n=4", "prompts_per_step=4", "max_steps=3",
            "optim.lr=1e-5", "optim.warmup_steps=0", "traces_per_step=0", "checkpoint.save_final=false",
            "rollout.max_staleness=1", "algorithm.tis_cap=2", "rollout.overlap=thread", f"run_dir={tmp / 'run'}"]
    if skip:
        reward = tmp / "skipping_reward.py"
        reward.write_text(SKIP_AFTER_STEP_1 + (tmp / "toy_reward.py").read_text())
        args = [a if not a.startswith("task.reward_fn=") else f"task.reward_fn={reward}:graded" for a in args]
    proc = run_cli("rl", *args, check=False)
    return proc, [r for r in read_metrics(tmp / "run") if r.get("step", 0) > 0]


def test_the_sync_check_stops_a_skipped_sync_at_lr_1e5_with_one_line(tiny_model_dir, tmp_path):
    """Step 2's sync copies nothing: the run stops in step 2's sync check (exit status 3, a run-time
    failure, not a config error), with the one line docs/rl.md shows; step 1 is logged and exact."""
    proc, rows = _sync_run(tiny_model_dir, tmp_path, skip=True)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("relign rl: error:")]
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("relign rl: error: the HFEngine engine does not hold the trainer's weights after the sync "
                               "of step 2: the weight fingerprints differ in "), lines[0]
    assert "a skipped load_weights" in lines[0]
    assert [r["step"] for r in rows] == [1] and rows[0]["rollout/sync_gap"] < 1e-6


def test_a_healthy_run_at_the_same_settings_never_stops(tiny_model_dir, tmp_path):
    proc, rows = _sync_run(tiny_model_dir, tmp_path, skip=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/sync_gap"] < 1e-6 for r in rows)  # the engine's copy is the trainer's, to the bit


def test_the_sync_check_catches_a_lora_adapter_that_never_reached_the_engine(tiny_model_dir, tmp_path, monkeypatch):
    """A weight sync that leaves out the LoRA tensors: the engine keeps the adapter it started with
    (B = 0) while the trainer's has learned; the first sync's probe stops the run."""
    from relign.rollout import weights

    real = weights.trainer_weights
    monkeypatch.setattr(weights, "trainer_weights", lambda model: ((n, t) for n, t in real(model) if "lora_" not in n))
    cfg = _cfg(tiny_model_dir, tmp_path, "rollout.max_staleness=1", "algorithm.tis_cap=2", "rollout.overlap=thread",
               "model.lora.enabled=true", "model.lora.r=4", "optim.lr=5e-2", "max_steps=2")
    with pytest.raises(SyncMismatch, match="sync of step 1: the weight fingerprints differ in decoder layer 0, decoder layer 1 "):
        rl.train(cfg)


def test_a_reward_that_never_returns_ends_the_run_with_the_stacks_and_one_line(tiny_model_dir, tmp_path):
    """A reward function stuck forever, in a pool whose own per-call timeout is longer than the
    run's wait_timeout: the watchdog stops the process (status 124) within the deadline, with
    every thread's stack in the run directory and one line naming the wait."""
    stuck = tmp_path / "stuck_reward.py"
    stuck.write_text("import time\n\ndef reward(prompt, response, extra_info):\n    time.sleep(3600)\n")
    args = [*toy_overrides(tiny_model_dir, tmp_path), f"task.reward_fn={stuck}:reward", "task.reward_workers=1",
            "task.reward_timeout=600", "rollout.wait_timeout=3", "max_steps=2", "rollout.n=2", "prompts_per_step=2",
            f"run_dir={tmp_path / 'run'}"]
    proc = run_cli("rl", *args, check=False)
    assert proc.returncode == 124, proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.startswith("relign:")]
    assert len(last) == 1 and "waited 3 s for the reward pool" in last[0] and "rollout.wait_timeout" in last[0], proc.stderr
    dump = (tmp_path / "run" / "hang_rank0.txt").read_text()
    assert dump.startswith("timed out after 3 s waiting for the reward pool")
    assert 'Thread "MainThread"' in dump and "rewards.py" in dump  # the main thread, waiting on the pool


def test_a_collective_that_never_completes_ends_with_the_stacks_and_one_line(tmp_path):
    """Two gloo ranks; rank 1 never joins the gather. Rank 0 exits 124 after its wait_timeout,
    with its stacks written and one line naming the collective."""
    import os
    import socket
    import subprocess
    import sys
    import time

    script = tmp_path / "hang.py"
    script.write_text(
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from relign import distributed, watchdog\n"
        "distributed.init()\n"
        "watchdog.configure(2, Path(sys.argv[1]), key='rollout.wait_timeout')\n"
        "if distributed.rank() == 1:\n"
        "    time.sleep(60)\n"
        "distributed.all_gather_object({'rank': distributed.rank()})\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank),
               "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stderr=subprocess.PIPE,
                                      text=True))
    t0 = time.monotonic()
    try:
        err = procs[0].communicate(timeout=60)[1]
        took = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 124, err
    assert took < 30
    lines = [line for line in err.splitlines() if line.startswith("relign:")]
    assert len(lines) == 1 and "rank 0 waited 2 s for a collective (all_gather_object)" in lines[0], err
    assert "all_gather_object" in (tmp_path / "hang_rank0.txt").read_text()


@pytest.mark.slow
def test_dr_grpo_still_learns_one_update_stale(tiny_model_dir, tmp_path):
    """The learning test of the synchronous loop (tests/recipes/test_rl_learning.py's thresholds), at s = 1."""
    import numpy as np

    cfg = load_config(rl.Config, None, [
        *toy_overrides(tiny_model_dir, tmp_path), f"run_dir={tmp_path / 'run'}", "checkpoint.save_final=false",
        "traces_per_step=0", "rollout.n=8", "prompts_per_step=8", "max_steps=30", "optim.lr=1e-2", "seed=1",
        "rollout.max_staleness=1", "algorithm.tis_cap=2", "algorithm.tis_mode=mask"])
    rewards = [r["reward/mean"] for r in rl.train(cfg).history if "reward/mean" in r]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert first < 0.35 and last > first + 0.4, json.dumps(rewards)
