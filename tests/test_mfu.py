"""perf/mfu (relign.models.flops): the FLOP count against hand counts, one formula for the benches
and the runs, and the metric in a run's rows and progress bar when a peak is known (absent, not 0,
when none is: tests/e2e/test_cli_sft.py's listener runs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from relign.data.sft import SFTExample
from relign.models.flops import ModelFlops, mfu, model_flops, peak_flops
from relign.recipes import preference, reward_model, rl_stages, sft
from relign.recipes.rl_update import Layout
from relign.tracking import read_metrics

from .conftest import load_script, write_jsonl

# hidden 4, 2 heads of 2, 1 K/V head, MLP 8, one layer, vocabulary 10:
# q 4x4, k and v 4x2 each, o 4x4, gate/up/down 3 x 4x8 = 144 weights, 2 FLOPs each = 288 per token;
# the head 2 x 4 x 10 = 80 per position; 4 x 2 x 2 x 1 = 16 per (query, key) pair
TOY = SimpleNamespace(hidden_size=4, num_attention_heads=2, num_key_value_heads=1, head_dim=2, intermediate_size=8,
                      num_hidden_layers=1, vocab_size=10)


def test_counts_by_hand():
    f = ModelFlops(TOY)
    assert (f.token, f.head, f.pair) == (288, 80, 16)
    # 5 tokens causal (15 pairs), the head at 2 of them
    assert f.sequence(5, 2) == 5 * 288 + 2 * 80 + 15 * 16
    # 2 tokens continuing a 3-token prefix: 3 causal pairs of their own + 2 x 3 with the prefix
    assert f.sequence(2, 2, prefix=3) == 2 * 288 + 2 * 80 + (3 + 6) * 16
    # a prompt of 3 with responses of 2 and 1: shared = the prompt once (6 pairs), each response
    # against the prompt and itself; not shared = rows of 5 and 4 on their own
    assert f.group(3, (2, 1), shared=True) == 3 * 288 + 6 * 16 + (2 * 288 + 2 * 80 + 9 * 16) + (288 + 80 + 4 * 16)
    assert f.group(3, (2, 1), shared=False) == (5 * 288 + 2 * 80 + 15 * 16) + (4 * 288 + 80 + 10 * 16)
    assert f.group(3, (2, 1), shared=False, head=False) == (5 * 288 + 15 * 16) + (4 * 288 + 10 * 16)


def test_the_recipes_counts_by_hand():
    f = ModelFlops(TOY)
    ex = SFTExample(input_ids=[0] * 5, loss_mask=[0, 0, 0, 1, 1])  # prompt 3, response 2: the head at 2 positions
    assert sft.train_flops(f, [ex]) == 3 * (5 * 288 + 2 * 80 + 15 * 16)  # forward + backward
    pair = SimpleNamespace(prompt_len=3, chosen_ids=[0] * 5, rejected_ids=[0] * 4)
    sets = {"train": [pair]}
    assert preference.step_flops(f, sets, [0], kto=False, share=True) == 3 * f.group(3, (2, 1), shared=True)
    assert preference.step_flops(f, sets, [0], kto=False, share=False) == 3 * f.group(3, (2, 1), shared=False)
    # a reward model: both full rows, no LM head
    assert reward_model.step_flops(f, [pair]) == 3 * ((5 * 288 + 15 * 16) + (4 * 288 + 10 * 16))
    # RL: one group of 2 (prompt 3, responses 2 and 1); shared where the layout packs the group
    batch = SimpleNamespace(prompt_lens=torch.tensor([3, 3]), seq_lens=torch.tensor([5, 4]))
    assert rl_stages.batch_flops(f, batch, Layout("packed", group_size=2)) == f.group(3, (2, 1), shared=True)
    assert rl_stages.batch_flops(f, batch, Layout("padded", group_size=2)) == f.group(3, (2, 1), shared=False)


def test_mfu_needs_a_peak():
    assert mfu(2e12, 2.0, 1e12) == {"perf/mfu": 1.0}
    assert mfu(2e12, 2.0, 1e12, devices=2) == {"perf/mfu": 0.5}
    assert mfu(2e12, 2.0, None) == {}  # no peak: no metric, not a 0
    assert peak_flops("cpu") is None and peak_flops("cpu", 2.5) == 2.5e12


def test_bench_and_runs_share_the_formula():
    arith = load_script("bench/arithmetic.py", "bench_arithmetic_mfu")
    assert arith.Shape is ModelFlops
    # bench/gpu_checks.py reports the run's own perf/mfu, weighted by each step's seconds:
    # (0.1 x 1 + 0.4 x 3) / 4 = 0.325
    checks = load_script("bench/gpu_checks.py", "gpu_checks_mfu")
    rows = [{"perf/mfu": 0.1, "perf/step_seconds": 1.0}, {"perf/mfu": 0.4, "perf/step_seconds": 3.0}]
    assert checks.run_mfu(rows) == pytest.approx(0.325)
    assert checks.run_mfu([{"perf/step_seconds": 1.0}]) is None


def test_sft_run_logs_mfu_and_shows_it(tiny_model_dir, tokenizer, tmp_path, capfd):
    """Every row the same text, so every step trains the same 4 examples: its FLOPs by hand from
    the model's shape and one example's length and targets."""
    from relign.cli import main
    from relign.data.sft import build_sft_examples

    data = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "What is 7 times 6?", "response": "42, and that is all."}] * 8)
    peak_tflops = 1e-3  # a CPU has no peak of its own: the key gives one
    assert main(["sft", f"model.path={tiny_model_dir}", f"data.path={data}", f"run_dir={tmp_path / 'run'}", "max_steps=2",
                 "batch_size=4", "micro_batch_size=2", "data.eval_fraction=0", "eval_every=0", "checkpoint.save_final=false",
                 "logging.tensorboard=false", "logging.progress=true", f"logging.peak_tflops={peak_tflops}"]) in (0, None)
    (e, *_), _ = build_sft_examples(str(data), tokenizer)
    L, K = len(e.input_ids), sum(e.loss_mask[1:])
    c = json_config(tiny_model_dir)
    h, n, kv, layers = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["num_hidden_layers"]
    d = h // n
    linear = h * n * d + 2 * h * kv * d + n * d * h + 3 * h * c["intermediate_size"]
    per_example = 3 * (2 * linear * layers * L + 2 * h * c["vocab_size"] * K + L * (L + 1) / 2 * 4 * n * d * layers)
    rows = [r for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["perf/mfu"] * r["perf/step_seconds"] * peak_tflops * 1e12 == pytest.approx(4 * per_example, rel=1e-9)
    assert "mfu=" in capfd.readouterr().err  # the progress bar shows it


def json_config(model_dir) -> dict:
    import json

    return json.loads((model_dir / "config.json").read_text())


def test_model_flops_reads_wrapped_models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from relign.models.value import ValueModel

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model_flops(lm).token == model_flops(ValueModel(lm)).token > 0
    assert model_flops(torch.nn.Linear(2, 2)) is None
