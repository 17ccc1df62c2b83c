"""End to end through the real CLI: learning, checkpoints, atomicity (exact resume after a kill: tests/recipes/test_frame.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relign.checkpoint import list_checkpoints, resolve_resume
from relign.tracking import read_metrics

from ..conftest import run_cli, write_jsonl

FACTS = [
    ("What is the capital of France?", "Paris"),
    ("What is 7 times 6?", "42"),
    ("Spell cat backwards.", "tac"),
    ("What color is the sky?", "blue"),
    ("What comes after Monday?", "Tuesday"),
    ("How many legs does a spider have?", "eight"),
    ("What is 10 minus 3?", "7"),
    ("Opposite of hot?", "cold"),
]


@pytest.fixture()
def memorize_data(tmp_path) -> Path:
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in FACTS]
    return write_jsonl(tmp_path / "facts.jsonl", rows)


def _args(model_dir, data, run_dir, *extra):
    return [
        "sft", str(Path(__file__).parents[2] / "examples" / "sft_tiny.yaml"),
        f"model.path={model_dir}", f"data.path={data}", f"run_dir={run_dir}",
        "data.eval_fraction=0", "data.max_length=64", "batch_size=4", "micro_batch_size=2", "optim.lr=3e-3",
        "optim.warmup_ratio=0", "eval_every=0", "checkpoint.save_every=0", "checkpoint.keep_last=0",
        "logging.tensorboard=false", *extra,
    ]


def _weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


@pytest.mark.slow
def test_sft_learns_and_checkpoint_reloads(tiny_model_dir, memorize_data, tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*_args(
        tiny_model_dir, memorize_data, run, "max_steps=40", f"data.eval_path={memorize_data}", "eval_every=10",
        "batch_size=8", "micro_batch_size=4", "optim.lr=5e-3", "optim.schedule=constant",
    ))
    assert f"run directory: {run}" in proc.stdout
    assert "sft: 100%" in proc.stderr  # the progress bar ran to the end
    rows = read_metrics(run)
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 40 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[0] > 5 and losses[-1] < 0.5  # from chance level to memorized
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert len(evals) == 4 and evals[-1] < evals[0]
    for key in ("train/lr", "train/grad_norm", "perf/tokens_per_s"):
        assert key in rows[-1]
    assert (run / "config.yaml").is_file() and "lr: 0.005" in (run / "config.yaml").read_text()

    (step, ckpt), = list_checkpoints(run)
    assert step == 40
    before, after = _weights(tiny_model_dir), _weights(ckpt)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)  # every trainable tensor moved

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    for name, p in model.state_dict().items():
        if name in after:
            assert torch.equal(p, after[name])
    # the reloaded model answers a training question
    prompt = tok.apply_chat_template([{"role": "user", "content": FACTS[0][0]}], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_token_id)
    assert tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == "Paris"


def test_interrupted_checkpoint_is_never_resumed(tiny_model_dir, memorize_data, tmp_path):
    run = tmp_path / "run"
    args = _args(tiny_model_dir, memorize_data, run, "max_steps=4", "checkpoint.save_every=1")
    killed = run_cli(*args, env={"RELIGN_FAULT": "checkpoint-mid-write:2"}, check=False)
    assert killed.returncode == -9
    ckdir = run / "checkpoints"
    leftovers = [p.name for p in ckdir.iterdir() if p.name.startswith(".tmp-step_2")]
    assert leftovers and (ckdir / leftovers[0] / "model.safetensors").is_file()  # half written
    # A folder that *looks* like a checkpoint but was never completed is ignored too.
    (ckdir / "step_3").mkdir()
    (ckdir / "step_3" / "model.safetensors").write_bytes(b"partial")
    assert [s for s, _ in list_checkpoints(run)] == [1]
    assert resolve_resume("auto", run) == ckdir / "step_1"
    proc = run_cli(*args, "resume=auto")
    assert "at step 1" in proc.stderr
    steps = [r["step"] for r in read_metrics(run) if "train/loss" in r]
    assert steps == [1, 2, 3, 4]


def test_keep_last_prunes(tiny_model_dir, memorize_data, tmp_path):
    run = tmp_path / "run"
    run_cli(*_args(tiny_model_dir, memorize_data, run, "max_steps=5", "checkpoint.save_every=1", "checkpoint.keep_last=2"))
    assert [s for s, _ in list_checkpoints(run)] == [4, 5]
    state = json.loads((run / "checkpoints" / "step_5" / "relign_state.json").read_text())
    assert state["step"] == 5 and state["sampler"] == {"epoch": 2, "position": 4}


def test_lora_saves_only_the_adapter(tiny_model_dir, memorize_data, tmp_path):
    run = tmp_path / "run"
    run_cli(*_args(tiny_model_dir, memorize_data, run, "max_steps=8", "model.lora.enabled=true", "model.lora.r=4", "optim.lr=1e-2", "packing=false"))
    (_, ckpt), = list_checkpoints(run)
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    adapter = load_file(str(ckpt / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())  # B starts at 0
    losses = [r["train/loss"] for r in read_metrics(run) if "train/loss" in r]
    assert losses[-1] < losses[0]

    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(ckpt)
    assert model.peft_config["default"].r == 4


def test_listeners_see_every_logged_row_in_process(tiny_model_dir, memorize_data, tmp_path):
    """relign.tracking.add_listener: the in-process hook (what the benchmarks time with)."""
    from relign.cli import main
    from relign.tracking import add_listener

    seen: list[tuple[int, dict]] = []
    remove = add_listener(lambda step, metrics: seen.append((step, dict(metrics))))
    try:
        assert main(_args(tiny_model_dir, memorize_data, tmp_path / "a", "max_steps=3", "logging.progress=false")) in (0, None)
    finally:
        remove()
    rows = read_metrics(tmp_path / "a")
    assert [s for s, _ in seen] == [r["step"] for r in rows] and len(rows) >= 3
    assert all("perf/mfu" not in r for r in rows)  # a CPU and no logging.peak_tflops: no MFU, not a 0
    assert all(m == {k: v for k, v in r.items() if k not in ("step", "time")} for (_, m), r in zip(seen, rows))
    assert main(_args(tiny_model_dir, memorize_data, tmp_path / "b", "max_steps=1", "logging.progress=false")) in (0, None)
    assert len(seen) == len(rows)  # removed: the second run is not seen
