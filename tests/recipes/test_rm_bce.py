"""relign rm loss=bce: pointwise rows train a forecaster; its checkpoint is a plain sequence
classifier that the reader reads as sigma(logit)."""

from __future__ import annotations

import json

import pytest
import torch

from relign.models.reader import Forecaster

from ..conftest import run_cli, write_jsonl

FRUITS = ["apple", "pear", "plum", "grape", "lemon", "lime", "peach", "mango"]
OTHER = ["stone", "chair", "river", "cloud", "table", "glass", "paper", "brick"]


def _rows():
    rows = []
    for w in FRUITS + OTHER:
        for q in ("What is it?", "Name the thing."):
            rows.append({"prompt": f"{q} {w}", "response": "", "label": 0.9 if w in FRUITS else 0.1})
    return rows  # 32 rows


def _hf_sigmoid(ckpt, rows):
    """sigma(logit) straight from transformers' AutoModelForSequenceClassification, one row at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from relign.data.preference import encode_prompt_response

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForSequenceClassification.from_pretrained(ckpt).eval()
    # one unpadded row at a time: the head reads its last token (transformers would otherwise look
    # for the first pad token, which is also the chat template's end-of-turn token here)
    model.config.pad_token_id = None
    out = []
    with torch.no_grad():
        for r in rows:
            ids, _, _ = encode_prompt_response(tok, r["prompt"], r["response"], chat_template=True)
            out.append(torch.sigmoid(model(torch.tensor([ids])).logits[0, 0]).item())
    return out


@pytest.mark.slow  # 40 optimizer steps through the CLI: a learning test
def test_rm_bce_lowers_the_loss_moves_forecasts_to_labels_and_loads_as_forecaster(tiny_model_dir, tmp_path):
    rows = _rows()
    data = write_jsonl(tmp_path / "forecast.jsonl", rows)
    run = tmp_path / "run"
    run_cli("rm", f"model.path={tiny_model_dir}", f"data.path={data}", f"run_dir={run}", "loss=bce", "max_steps=40",
            "batch_size=8", "micro_batch_size=8", "optim.lr=1e-2", "optim.schedule=constant", "data.eval_fraction=0", "eval_every=0",
            "logging.progress=false", "logging.tensorboard=false")
    hist = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [h["train/loss"] for h in hist if "train/loss" in h]
    # a new head starts at 0: sigma = 1/2, BCE = -(0.9 log 0.5 + 0.1 log 0.5) = log 2 for every row
    assert losses[0] == pytest.approx(0.6931, abs=1e-3)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.1, losses  # the floor is H(0.9) = 0.325
    ckpt = run / "checkpoints" / "step_40"
    assert json.loads((ckpt / "config.json").read_text())["architectures"][0].endswith("ForSequenceClassification")
    p = _hf_sigmoid(ckpt, rows)
    labels = [r["label"] for r in rows]
    err = sum(abs(a - b) for a, b in zip(p, labels)) / len(rows)
    assert err < 0.3, err  # 0.4 before training (every forecast 1/2)
    fruit = [x for x, r in zip(p, rows) if r["label"] > 0.5]
    other = [x for x, r in zip(p, rows) if r["label"] < 0.5]
    assert sum(fruit) / len(fruit) - sum(other) / len(other) > 0.2, (fruit, other)
    # the reader's forecaster reads the same checkpoint as sigma(logit)
    f = Forecaster(str(ckpt))
    assert f([r["prompt"] for r in rows]) == pytest.approx(p, abs=1e-5)
    # a causal LM is not a forecaster: one line naming the key
    with pytest.raises(ValueError, match=r"reward.model=.* is not a sequence-classification checkpoint"):
        Forecaster(str(tiny_model_dir))


@pytest.mark.parametrize("label, why", [(1.5, "1.5 is outside [0, 1]"), ("high", "expected a number in [0, 1], got 'high'"),
                                        (True, "expected a number in [0, 1], got bool")])
def test_rm_bce_bad_label_is_one_line_naming_file_row_and_field(tiny_model_dir, tmp_path, label, why):
    rows = _rows()[:4]
    rows[2]["label"] = label
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    proc = run_cli("rm", f"model.path={tiny_model_dir}", f"data.path={data}", f"run_dir={tmp_path / 'run'}", "loss=bce",
                   "max_steps=1", "batch_size=2", "micro_batch_size=2", "data.eval_fraction=0", check=False)
    assert proc.returncode != 0
    err = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert any("bad.jsonl" in line and "row 3" in line and "label" in line and why in line for line in err), proc.stderr[-2000:]
