"""A run's life through the real CLI (issue 14): bad settings stop it at start with one line, it
opens with a banner (model, parameters, dtype, device, data, steps, run dir) and closes with a
summary whose resume command really resumes it, ``--dry-run`` works on every recipe and leaves
nothing behind, and each progress bar says what it is counting."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from relign.banner import count_parameters, human_count
from relign.checkpoint import list_checkpoints
from relign.tracking import read_metrics

from ..conftest import REPO, run_cli, write_jsonl
from ..rl_toy import toy_overrides

PRESETS = REPO / "examples"

def dry_run_cli(*args: str) -> subprocess.CompletedProcess:
    """`relign ... --dry-run` through the real CLI; it must exit 0."""
    return run_cli(*args, "--dry-run")


@pytest.fixture(scope="module")
def tiny_params(tiny_model_dir) -> str:
    from transformers import AutoModelForCausalLM

    total, _ = count_parameters(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    return f"{human_count(total)} (all trainable)"


def _sft_rows(tmp: Path, n: int = 8) -> Path:
    return write_jsonl(tmp / "qa.jsonl", [{"prompt": f"Question {i}?", "response": f" Answer {i}."} for i in range(n)])


def _pairs(tmp: Path, n: int = 8) -> Path:
    return write_jsonl(tmp / "pairs.jsonl", [{"prompt": f"Pick {i}:", "chosen": f" yes {i}", "rejected": f" no {i}"}
                                             for i in range(n)])


def _graded(tmp: Path) -> Path:
    return write_jsonl(tmp / "graded.jsonl", [{"problem": f"What is {i} + 1?", "response": f"{i + 1 - (i % 2)}",
                                               "correct": i % 2 == 0} for i in range(8)])


# --------------------------------------------------------------------------- config errors at start


@pytest.mark.parametrize("recipe, preset, override, message", [
    ("sft", "sft_tiny", "batch_size=0", "bad value for 'batch_size': 0; it must be >= 1"),
    ("sft", "sft_tiny", "micro_batch_size=0", "bad value for 'micro_batch_size': 0; it must be >= 1"),
    ("sft", "sft_tiny", "max_steps=-1", "bad value for 'max_steps': -1; it must be >= 0"),
    ("dpo", "dpo", "batch_size=0", "bad value for 'batch_size': 0; it must be >= 1"),
    ("rm", "rm", "batch_size=0", "bad value for 'batch_size': 0; it must be >= 1"),
    ("rl", "grpo", "rollout.n=0", "bad value for 'rollout.n': 0; it must be >= 1"),
    ("sft", "sft_tiny", "logging.wandb=true", "logging.wandb=true needs Weights & Biases, which is not installed: "
                                              "pip install 'relign[wandb]' (or set logging.wandb=false)"),
])
def test_a_bad_setting_stops_the_run_at_start_with_one_line(recipe, preset, override, message, tmp_path):
    if override.startswith("logging.wandb"):
        import importlib.util

        if importlib.util.find_spec("wandb") is not None:
            pytest.skip("wandb is installed here")
    run = tmp_path / "run"
    proc = run_cli(recipe, str(PRESETS / f"{preset}.yaml"), override, f"run_dir={run}", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"relign {recipe}: error: {message}"]
    assert not run.exists()  # stopped before the run directory, the data and the model


# --------------------------------------------------------------------------- banner, summary, resume


def test_sft_banner_summary_and_its_resume_command_resumes(tiny_model_dir, tiny_params, tmp_path):
    run = tmp_path / "run"
    args = ["sft", str(PRESETS / "sft_tiny.yaml"), f"model.path={tiny_model_dir}", f"data.path={_sft_rows(tmp_path)}",
            "data.eval_fraction=0", "data.max_length=64", "batch_size=4", "micro_batch_size=2", "max_steps=2",
            "eval_every=0", "checkpoint.save_every=0", "logging.tensorboard=false"]
    proc = run_cli(*args, f"run_dir={run}")
    banner = proc.stderr[proc.stderr.index("relign sft\n"):].splitlines()[:8]
    assert banner[1:3] == [f"  model      {tiny_model_dir}", f"  parameters {tiny_params}"]
    assert banner[3] == "  dtype      fp32" and banner[4].startswith("  device     cpu (") and banner[4].endswith(" CPU threads")
    assert banner[5:] == ["  data       8 rows read, 8 used", "  steps      2 (max_steps) x 4 examples",
                          f"  run dir    {run}"]
    summary = proc.stdout[proc.stdout.index("relign sft: done in"):].splitlines()
    assert summary[1].startswith("  metrics    train/loss ")
    assert summary[2:5] == [f"  run dir    {run}", f"  checkpoint {run / 'checkpoints' / 'step_2'}",
                            f"  report     {run / 'report.html'}"]
    resume = summary[5].removeprefix("  resume     ")
    assert resume == shlex.join(["relign", *args, f"run_dir={run}", "resume=auto"])

    # the printed command resumes the run (here, one step longer)
    proc = run_cli(*shlex.split(resume)[1:], "max_steps=3")
    assert "resumed from" in proc.stderr
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == [1, 2, 3]

    # a dry run on a directory that holds a run leaves the run as it was
    before = sorted(p.name for p in run.iterdir())
    dry = dry_run_cli(*shlex.split(resume)[1:], "max_steps=3")
    assert f"the resolved config is in {run / 'config.yaml'}" in dry.stdout
    assert sorted(p.name for p in run.iterdir()) == before and [s for s, _ in list_checkpoints(run)] == [2, 3]


def test_dpo_shows_the_reference_precompute_and_its_summary(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    proc = run_cli("dpo", str(PRESETS / "dpo.yaml"), f"model.path={tiny_model_dir}", f"data.path={_pairs(tmp_path)}",
                   "data.eval_fraction=0", "data.max_length=64", "batch_size=4", "micro_batch_size=2", "max_steps=1",
                   "eval_every=0", "checkpoint.save_every=0", "logging.tensorboard=false", f"run_dir={run}")
    assert "  data       8 rows read, 8 used\n  steps      1 (max_steps) x 4 pairs\n" in proc.stderr
    assert "dpo reference (train): 100%" in proc.stderr  # the pass over the data before step 1 shows progress
    summary = proc.stdout[proc.stdout.index("relign dpo: done in"):].splitlines()
    assert summary[1].startswith("  metrics    train/loss 0.6931")  # step 1: the policy is the reference, loss = log 2
    assert f"  checkpoint {run / 'checkpoints' / 'step_1'}" in summary


def test_verifier_progress_bar_and_banner_say_verifier(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    proc = run_cli("verifier", f"model.path={tiny_model_dir}", f"data.path={_graded(tmp_path)}", "data.eval_fraction=0",
                   "data.max_length=128", "batch_size=2", "micro_batch_size=2", "max_steps=1", "logging.tensorboard=false",
                   f"run_dir={run}")
    assert "verifier: 100%" in proc.stderr and "sft:" not in proc.stderr
    assert "relign verifier\n" in proc.stderr and "relign sft" not in proc.stderr + proc.stdout  # one banner, the run's
    assert "  data       8 graded samples read -> 8 verifier rows\n" in proc.stderr
    assert "relign verifier: done in" in proc.stdout


# --------------------------------------------------------------------------- --dry-run on every recipe


def _dry_cases(model: Path, tmp: Path) -> dict[str, tuple[list[str], str, str]]:
    """recipe -> (arguments, the data line, the steps line)."""
    toy = toy_overrides(model, tmp)
    return {
        "sft": (["sft", str(PRESETS / "sft_tiny.yaml"), f"model.path={model}", f"data.path={_sft_rows(tmp)}",
                 "data.eval_fraction=0.25", "batch_size=2", "micro_batch_size=2", "max_steps=0", "epochs=2"],
                "8 rows read, 8 used (6 train, 2 eval)", "6 (2 epochs x 3 steps per epoch) x 2 examples"),
        "dpo": (["dpo", str(PRESETS / "kto.yaml"), f"model.path={model}", f"data.path={_pairs(tmp)}",
                 "data.eval_fraction=0", "batch_size=4", "micro_batch_size=2", "max_steps=3"],
                "8 rows read -> 16 examples", "3 (max_steps) x 4 examples"),  # KTO: each pair -> two rows
        "rm": (["rm", str(PRESETS / "rm.yaml"), f"model.path={model}", f"data.path={_pairs(tmp)}", "data.eval_fraction=0",
                "batch_size=4", "micro_batch_size=2"], "8 rows read, 8 used", "16 (max_steps) x 4 pairs"),
        "rl": (["rl", str(PRESETS / "grpo.yaml"), *toy, "max_steps=5", "prompts_per_step=2"],
               "64 prompts read, 64 used", "5 x 2 prompts x 4 samples"),
        "eval": (["eval", str(PRESETS / "eval_gsm8k.yaml"), f"model.path={model}", "task.max_rows=5"],
                 "5 problems (gsm8k: ", "4 sample(s) per problem at temperature 0.6"),
        "rest": (["rest", *toy, "val.size=8", "iterations=2", "prompts_per_iteration=16", "epochs=1"],
                 "56 training prompts, 8 validation (8 training prompts held out (seed 0))",
                 "2 iterations x 16 prompts x 8 samples, then 1 SFT epoch(s) on the kept ones"),
        "verifier": (["verifier", f"model.path={model}", f"data.path={_graded(tmp)}", "data.eval_fraction=0", "batch_size=2",
                      "micro_batch_size=2"], "8 graded samples read -> 8 verifier rows",
                     "4 (1 epoch x 4 steps per epoch) x 2 rows"),
    }


@pytest.mark.parametrize("recipe", ["sft", "dpo", "rm", "rl", "eval", "rest", "verifier"])
def test_dry_run_prints_the_plan_and_leaves_nothing(recipe, tiny_model_dir, tiny_params, tmp_path):
    args, data, steps = _dry_cases(tiny_model_dir, tmp_path)[recipe]
    run = tmp_path / "run"
    proc = dry_run_cli(*args, f"run_dir={run}")
    out = proc.stdout
    assert out.startswith(f"# relign {recipe} --dry-run: the resolved config\n")
    assert f"run_dir: {run}" in out and "seed: 0" in out  # the resolved config, as YAML
    # counted from the model's config, not its weights; eval's model only infers
    params = tiny_params.removesuffix(" (all trainable)") if recipe == "eval" else tiny_params
    assert f"  parameters {params}\n" in out
    assert f"  data       {data}" in out and f"  steps      {steps}\n" in out
    assert out.rstrip().endswith("dry run: nothing trained, no checkpoint written; no run directory kept")
    assert not run.exists()


def test_dry_run_of_the_demo(tmp_path):
    run = tmp_path / "demo"
    proc = dry_run_cli("demo", "demo.model_size=micro", "demo.steps=7", "demo.sft_steps=5", f"run_dir={run}")
    assert "  model      tiny:micro\n" in proc.stdout
    assert "  data       arith: 4,000 training problems, 200 held-out\n" in proc.stdout
    assert "  steps      SFT 5 x 32 demonstrations, GRPO 7 x 16 problems x 8 samples\n" in proc.stdout
    assert "[1/6]" not in proc.stderr and not run.exists()  # no stage started
