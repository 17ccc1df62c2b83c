"""Every preference loss, the reward model and the verifier through the real CLI, on the
shipped samples: the loss is finite and falls, the checkpoint reloads, a learned reward
drives `relign rl`, bad rows stop with the file, row and field."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relign.tracking import read_metrics

from ..conftest import REPO, run_cli, write_jsonl
from ..rl_toy import toy_overrides

LOSSES = ["dpo", "ipo", "dpop", "simpo", "orpo", "kto", "sdpo"]
FAST = ["data.max_rows=16", "data.max_length=192", "data.eval_fraction=0.25", "batch_size=4", "micro_batch_size=2",
        "optim.lr=1e-3", "optim.warmup_ratio=0", "optim.schedule=constant", "max_steps=6", "eval_every=0",
        "checkpoint.save_every=0", "logging.tensorboard=false"]


def _changed(a_dir: Path, b_dir: Path) -> int:
    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    return sum(not torch.equal(a[k], b[k]) for k in a if k in b)


@pytest.mark.parametrize("loss", LOSSES)
def test_preference_loss_runs_falls_and_reloads(loss, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    preset = "dpo" if loss == "dpo" else loss
    run = tmp_path / "run"
    run_cli("dpo", str(REPO / "examples" / f"{preset}.yaml"), f"model.path={tiny_model_dir}", f"run_dir={run}", *FAST)
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    losses = [r["train/loss"] for r in rows]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), losses
    assert (losses[-1] + losses[-2]) / 2 < (losses[0] + losses[1]) / 2, losses
    assert "eval/loss" in rows[-1] and math.isfinite(rows[-1]["eval/loss"])
    if loss == "kto":
        assert rows[0]["train/kl"] >= 0.0
    else:
        assert {"train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins", "train/rewards/accuracy"} <= set(rows[-1])
    ckpt = run / "checkpoints" / "step_6"
    state = json.loads((ckpt / "relign_state.json").read_text())
    assert state["recipe"] == "dpo" and state["loss"] == loss
    AutoModelForCausalLM.from_pretrained(ckpt)  # a plain HF checkpoint
    assert _changed(Path(tiny_model_dir), ckpt) > 0
    if loss not in ("simpo", "orpo"):  # reference log-probs were computed once and cached
        assert (run / "reference_logps.safetensors").is_file()


def test_reward_model_cli_and_learned_reward_in_rl(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    rm_run = tmp_path / "rm"
    run_cli("rm", str(REPO / "examples" / "rm.yaml"), f"model.path={tiny_model_dir}", f"run_dir={rm_run}", *FAST)
    rows = [r for r in read_metrics(rm_run) if "train/loss" in r]
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    assert {"eval/accuracy", "eval/rewards/margins"} <= set(rows[-1])
    ckpt = rm_run / "checkpoints" / "step_6"
    model = AutoModelForSequenceClassification.from_pretrained(ckpt)
    assert model.config.num_labels == 1

    # the RM as a learned reward next to the rule reward, weighted
    rl_run = tmp_path / "rl"
    args = ["rl", f"run_dir={rl_run}", "max_steps=1", "prompts_per_step=2", "rollout.n=2", "logging.tensorboard=false",
            f"reward.model={ckpt}", "reward.weight=0.5", "reward.rule_weight=1.0", "task.reward_workers=0",
            *toy_overrides(tiny_model_dir, tmp_path, fn="graded")]
    run_cli(*args)
    step = [r for r in read_metrics(rl_run) if "reward/mean" in r][-1]
    assert "reward/model" in step and "reward/rule" in step
    assert step["reward/mean"] == pytest.approx(step["reward/rule"] + 0.5 * step["reward/model"], abs=1e-5)
    trace = json.loads((rl_run / "rollouts" / "step_1.jsonl").read_text().splitlines()[0])
    assert set(trace["components"]) >= {"rule", "model"} and trace["problem"]


def test_verifier_cli_builds_data_trains_and_scores(tiny_model_dir, tmp_path):
    """Graded RL traces -> verifier rows -> SFT -> P(Yes) on held-out problems; then as a reward."""
    # graded samples in the shape relign rl writes them (rollouts/step_N.jsonl)
    src = tmp_path / "graded_run"
    rows = []
    for i in range(24):
        q = f"What is {i} + {i + 1}?"
        rows.append({"problem": q, "prompt": f"<chat>{q}</chat>", "response": f"{2 * i + 1}", "score": 1.0})
        rows.append({"problem": q, "prompt": f"<chat>{q}</chat>", "response": f"{2 * i + 3}", "score": 0.0})
    write_jsonl(src / "rollouts" / "step_1.jsonl", rows)
    run = tmp_path / "verifier"
    run_cli("verifier", str(REPO / "examples" / "verifier.yaml"), f"model.path={tiny_model_dir}", f"run_dir={run}",
            f"data.rollouts=[{src}]", "data.path=''", "data.eval_fraction=0.25", "max_steps=4", "batch_size=8",
            "micro_batch_size=4", "logging.tensorboard=false")
    data = [json.loads(x) for x in (run / "verifier_data.jsonl").read_text().splitlines()]
    assert data and {d["messages"][-1]["content"] for d in data} == {"Yes", "No"}
    assert sum(d["correct"] for d in data) * 2 == len(data)  # balanced
    held = [json.loads(x) for x in (run / "verifier_eval_data.jsonl").read_text().splitlines()]
    assert not {d["problem"] for d in held} & {d["problem"] for d in data}  # split by problem
    summary = json.loads((run / "verifier_eval.json").read_text())
    assert 0.0 <= summary["p_yes_correct"] <= 1.0 and summary["rows"] == len(held)
    from relign.models.reward import load_scorer, scorer_kind

    ckpt = run / "checkpoints" / "step_4"
    assert scorer_kind(str(ckpt)) == "verifier"
    p = load_scorer(str(ckpt)).score(["What is 1 + 2?"], ["3"])
    assert 0.0 < p[0] < 1.0


def test_bad_preference_row_names_file_row_and_field(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "a", "chosen": "b", "rejected": "c"},
        {"prompt": "a", "chosen": "b"},
    ])
    proc = run_cli("dpo", f"model.path={tiny_model_dir}", f"data.path={data}", f"run_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 2
    assert f"{data}, row 2, field 'rejected': missing" in proc.stderr
    assert "Traceback" not in proc.stderr
    kto = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "a", "completion": "b", "label": "yes"}])
    proc = run_cli("dpo", "loss=kto", f"model.path={tiny_model_dir}", f"data.path={kto}", f"run_dir={tmp_path / 'k'}", check=False)
    assert proc.returncode == 2 and "row 1, field 'label': expected true or false" in proc.stderr
