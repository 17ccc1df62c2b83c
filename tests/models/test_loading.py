"""Model options: gradient checkpointing gives the same gradients; bf16 runs; LoRA trains only adapters."""

from __future__ import annotations

import pytest
import torch

from relign.config import ConfigError
from relign.models.loading import apply_lora, load_causal_lm, load_tokenizer, resolve_model_path, trainable_parameters
from relign.models.logprobs import token_logps


def _grads(model, ids):
    logps, _ = token_logps(model, ids)
    (-logps.sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_same_gradients(tiny_model_dir):
    ids = torch.tensor([[5, 17, 300, 42, 8, 9, 1000, 77]])
    plain = _grads(load_causal_lm(str(tiny_model_dir)), ids)
    ckpt_model = load_causal_lm(str(tiny_model_dir), gradient_checkpointing=True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in ckpt_model.modules())
    ckpt = _grads(ckpt_model, ids)
    assert plain.keys() == ckpt.keys()
    for k in plain:
        torch.testing.assert_close(plain[k], ckpt[k], atol=1e-6, rtol=1e-5)


def test_bf16_model(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir), dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    logps, ent = token_logps(model, torch.tensor([[5, 17, 300, 42]]), with_entropy=True)
    assert logps.dtype == torch.float32 and torch.isfinite(logps).all() and (ent[:, 1:] > 0).all()


def test_lora_with_gradient_checkpointing_trains_only_adapters(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir), gradient_checkpointing=True)
    model = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    params = trainable_parameters(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert params and all("lora_" in n for n in names)
    logps, _ = token_logps(model, torch.tensor([[5, 17, 300, 42]]))
    (-logps.sum()).backward()
    assert all(p.grad is not None for p in params)


def test_bad_model_inputs(tmp_path):
    with pytest.raises(ConfigError, match="missing value for 'model.path'"):
        load_causal_lm("")
    with pytest.raises(ConfigError, match="not a model folder"):
        load_causal_lm(str(tmp_path))
    with pytest.raises(ConfigError, match="model.dtype"):
        from relign.models.loading import resolve_dtype

        resolve_dtype("fp8")
    with pytest.raises(ConfigError, match="tiny:SIZE"):
        resolve_model_path("tiny:huge")


def test_tiny_scheme_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RELIGN_CACHE", str(tmp_path))
    path = resolve_model_path("tiny:micro:llama")
    assert path == str(tmp_path / "tiny" / "llama-micro")
    mtime = (tmp_path / "tiny" / "llama-micro" / "config.json").stat().st_mtime
    assert resolve_model_path("tiny:micro:llama") == path
    assert (tmp_path / "tiny" / "llama-micro" / "config.json").stat().st_mtime == mtime
    tok = load_tokenizer("tiny:micro:llama")
    assert tok.pad_token_id is not None and tok.chat_template
