"""rollout.engine=vllm through the real command line: a preset, learning, torchrun, eval, generate."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from relign.tracking import read_metrics

from ..conftest import REPO, run_cli, write_jsonl
from ..e2e.test_distributed import _torchrun
from ..rl_toy import toy_overrides

pytestmark = pytest.mark.slow  # the longest end-to-end runs: `pytest -m "not slow"` leaves them out

QUIET = ["logging.progress=false", "logging.tensorboard=false"]


def _rows(run_dir, key: str = "reward/mean") -> list[dict]:
    return [r for r in read_metrics(run_dir) if key in r]


def test_grpo_preset_runs_on_vllm(vllm_model_dir, tmp_path):
    """examples/grpo.yaml as it ships (tiny:tiny, gsm8k prompts), 3 steps on the vLLM engine."""
    run = tmp_path / "run"
    proc = run_cli("rl", str(REPO / "examples" / "grpo.yaml"), "rollout.engine=vllm", "max_steps=3", f"run_dir={run}", *QUIET)
    assert re.search(r"^rollout\.engine=vllm: vLLM \S+ on cpu, float32, ", proc.stderr, re.M), proc.stderr[-2000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # engine and trainer agree on the sampled tokens' log-probs (fp32)
        assert r["actor/logp_mismatch"] < 1e-5 and r["actor/logp_mismatch_max"] < 1e-4, r
        assert r["time/sync_s"] > 0 and r["response/length_mean"] > 0
    assert (run / "checkpoints" / "step_3").is_dir()


def test_grpo_in_bf16_mixed_on_vllm(vllm_model_dir, tmp_path):
    """model.dtype=bf16-mixed: the trainer keeps fp32 weights and computes in bf16; the engine is
    started in bf16 (``compute_dtype``) and casts the fp32 weights it is given."""
    run = tmp_path / "run"
    proc = run_cli("rl", str(REPO / "examples" / "grpo.yaml"), "rollout.engine=vllm", "model.dtype=bf16-mixed", "max_steps=2",
                   "algorithm.skip_zero_adv=false", f"run_dir={run}", *QUIET)
    # the line relign prints from vLLM's own model config once the engine is up: the mismatch
    # below is bf16-sized whichever side rounds
    assert re.search(r"^rollout\.engine=vllm: vLLM \S+ on cpu, bfloat16, max_model_len \d+, \d+ sequences, KV cache",
                     proc.stderr, re.M), proc.stderr[-2000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # bf16 rounding (measured 1.1e-3 mean, 6e-3 max), far above fp32's 1e-6 and far below a wrong weight
        assert 0 < r["actor/logp_mismatch"] < 0.01 and r["actor/logp_mismatch_max"] < 0.1, r


def test_grpo_learns_the_toy_task_on_vllm(vllm_model_dir, tmp_path):
    """The HF-engine learning test's budget (30 steps of 8 prompts x 8, lr 1e-2), on vLLM."""
    run = tmp_path / "run"
    run_cli("rl", *toy_overrides(vllm_model_dir, tmp_path), "rollout.engine=vllm", "rollout.n=8", "prompts_per_step=8",
            "max_steps=30", "optim.lr=1e-2", "seed=1", "traces_per_step=0", "checkpoint.save_final=false", f"run_dir={run}",
            *QUIET)
    rewards = [r["reward/mean"] for r in _rows(run)]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert first < 0.35 and last > first + 0.4, rewards


def test_two_ranks_with_one_engine_each_match_one_rank(vllm_model_dir, tmp_path):
    """torchrun, 2 ranks, each with its own engine sampling its share of the prompts (seeded by
    draw index): the same samples and, to vLLM's float rounding, the same step as 1 rank. The
    2-rank run checks each engine's weights after every sync (an FSDP forward with no backward,
    which must leave the root's parameters resharded, else the next step's gradients are lost)."""
    args = ["rl", str(REPO / "examples" / "grpo.yaml"), *toy_overrides(vllm_model_dir, tmp_path, fn="graded"),
            "rollout.engine=vllm", "rollout.max_new_tokens=6", "optim.lr=1e-3", "prompts_per_step=4", "max_steps=2",
            "traces_per_step=0", "checkpoint.save_final=false"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_cli(*args, f"run_dir={one}")
    proc = _torchrun([*args, f"run_dir={two}"], real=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _rows(one, "actor/loss"), _rows(two, "actor/loss")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b):
        assert x["reward/mean"] == y["reward/mean"] and x["response/length_mean"] == y["response/length_mean"]
        for k in ("actor/loss", "actor/grad_norm", "actor/kl", "actor/entropy"):
            assert x[k] == pytest.approx(y[k], abs=1e-5, rel=1e-4), k


def test_eval_greedy_on_vllm_matches_the_hf_engine(vllm_sharp_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "q.jsonl", [{"prompt": f"Count to {i}:", "answer": str(i)} for i in range(6)])
    reward = tmp_path / "r.py"
    reward.write_text("def reward(prompt, response, extra_info):\n    return float(extra_info['answer'] in response)\n")
    common = ["eval", f"model.path={vllm_sharp_model_dir}", "task.name=custom", f"task.path={prompts}", f"task.reward_fn={reward}:reward",
              "task.chat=false", "temperature=0", "max_new_tokens=8", *QUIET]
    run_cli(*common, "engine=vllm", f"run_dir={tmp_path / 'v'}")
    run_cli(*common, "engine=hf", f"run_dir={tmp_path / 'h'}")
    texts = [[json.loads(line)["response"] for line in (tmp_path / d / "samples.jsonl").read_text().splitlines()] for d in "vh"]
    assert texts[0] == texts[1] and len(texts[0]) == 6
    assert len(set(texts[0])) > 1  # the prompts lead to different answers: the check has teeth


def test_generate_command_on_vllm(vllm_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Tell me about {w}"} for w in ("cats", "dogs", "rain")])
    args = ["generate", str(vllm_model_dir), str(prompts), "--engine", "vllm", "--n", "2", "--max-new-tokens", "6", "--out", "-"]
    a = run_cli(*args, "--batch-size", "1").stdout
    b = run_cli(*args, "--batch-size", "3").stdout
    rows = [json.loads(line) for line in a.splitlines()]
    assert a == b and len(rows) == 6  # seeded per prompt: batching changes nothing
    assert all(r["num_tokens"] > 0 for r in rows)


def test_demo_runs_on_vllm(tmp_path):
    """The demo's whole pipeline with demo.engine=vllm (GRPO rollouts and both evals), shortened."""
    run = tmp_path / "demo"
    proc = run_cli("demo", "demo.engine=vllm", "demo.sft_steps=20", "demo.steps=2", "demo.train_problems=64",
                   "demo.test_problems=8", "demo.eval_samples=2", "demo.eval_every=0", "demo.prompts_per_step=4",
                   "demo.group_size=4", f"run_dir={run}", *QUIET,
                   # every group trains, so the last step measures the engine/trainer mismatch even when
                   # all its groups are solved (or all failed) and the update would skip them
                   "demo.rl_overrides=[algorithm.skip_zero_adv=false]")
    summary = json.loads((run / "demo.json").read_text())
    assert summary["engine"] == "vllm", summary
    assert _rows(run / "rl")[-1]["actor/logp_mismatch_max"] < 1e-4
    assert "accuracy" in proc.stdout


def test_truncated_importance_sampling_runs_on_vllm(vllm_model_dir, tmp_path):
    """algorithm.tis_cap: the old log-probs are computed, the engine's are the sampling ones."""
    run = tmp_path / "run"
    run_cli("rl", *toy_overrides(vllm_model_dir, tmp_path), "rollout.engine=vllm", "algorithm.tis_cap=2.0", "max_steps=2",
            "prompts_per_step=4", "rollout.n=4", "traces_per_step=0", "checkpoint.save_final=false", f"run_dir={run}")
    rows = _rows(run, "actor/loss")
    assert len(rows) == 2 and all(r["actor/logp_mismatch_max"] < 1e-4 for r in rows), rows


def test_a_shape_vllm_cannot_run_is_one_line(tiny_model_dir, tmp_path):
    """The suite's micro model has 16-dim heads, below what vLLM's CPU attention takes."""
    proc = run_cli("rl", "grpo", f"model.path={tiny_model_dir}", "rollout.engine=vllm", "max_steps=1",
                   f"run_dir={tmp_path / 'run'}", *QUIET, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "rollout.engine=vllm: vLLM's CPU attention does not support the shape of" in lines[-1], lines[-1]


def test_an_architecture_vllm_lacks_is_named(vllm_model_dir, tmp_path):
    import shutil

    from relign.config import ConfigError
    from relign.rollout.vllm_engine import check_architecture

    odd = tmp_path / "odd"
    shutil.copytree(vllm_model_dir, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="vLLM does not support the architecture NoSuchModelForCausalLM"):
        check_architecture(str(odd))


def test_search_runs_on_vllm(vllm_model_dir, tmp_path):
    """A tree search (step beam, rule scorer) and a sampling strategy through eval on the vLLM engine."""
    for strategy in (["strategy=step_beam", "scorer=rule", "search.beam.beams=2", "search.width=2", "budget.max_simulations=2"],
                     ["strategy=majority", "budget.max_samples=4"]):
        run = tmp_path / strategy[0].split("=")[1]
        run_cli("eval", f"model.path={vllm_model_dir}", "task.name=countdown", "task.max_rows=2", "engine=vllm", *strategy,
                "max_new_tokens=24", "search.step_max_tokens=8", "search.max_depth=4", "task.reward_workers=0",
                f"run_dir={run}", *QUIET)
        rows = [json.loads(line) for line in (run / "search.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and all(r["cost"]["generated_tokens"] > 0 for r in rows), rows
