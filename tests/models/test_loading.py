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


# ---------------------------------------------------------------- dropout is off


def _dropout_qwen2(src, out):
    """The tiny Qwen2 (built by ``build_tiny_model``) saved with attention_dropout=0.5: a float
    that Qwen2 attention hands to the SDPA kernel in train mode (no nn.Dropout module)."""
    import shutil

    from transformers import AutoConfig

    shutil.copytree(src, out)
    cfg = AutoConfig.from_pretrained(out)
    cfg.attention_dropout = 0.5
    cfg.save_pretrained(out)
    return out


def _dropout_gpt2(out):
    """A tiny random GPT2 whose dropouts are real nn.Dropout modules (and pdrop config fields)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.5, embd_pdrop=0.5,
                     attn_pdrop=0.5, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


IDS = torch.tensor([[5, 17, 30, 42, 8, 9, 10, 7], [1, 2, 3, 4, 5, 6, 7, 8]])


def _assert_deterministic_in_train_mode(model):
    assert model.training  # still train mode: HF gradient checkpointing only runs there
    with torch.no_grad():
        a, b = model(IDS).logits, model(IDS).logits
        model.eval()
        c = model(IDS).logits
        model.train()
    assert torch.equal(a, b)
    torch.testing.assert_close(a, c, atol=0.0, rtol=0.0)


def _live_dropout_changes_logits(path):
    """The control: loaded plainly, the same model in train mode is not deterministic."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").train()
    with torch.no_grad():
        return not torch.equal(model(IDS).logits, model(IDS).logits)


def test_load_causal_lm_disables_attention_dropout(tiny_model_dir, tmp_path):
    path = _dropout_qwen2(tiny_model_dir, tmp_path / "qwen2-dropout")
    assert _live_dropout_changes_logits(path)
    model = load_causal_lm(str(path))
    assert model.config.attention_dropout == 0.0
    floats = [m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")]
    assert floats and all(p == 0.0 for p in floats)
    _assert_deterministic_in_train_mode(model)


def test_load_causal_lm_disables_dropout_modules_and_config(tmp_path):
    import json

    path = _dropout_gpt2(tmp_path / "gpt2-dropout")
    assert _live_dropout_changes_logits(path)
    model = load_causal_lm(str(path))
    ps = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(ps) >= 7 and all(p == 0.0 for p in ps)  # embd, 2 x (attn, resid, mlp)
    _assert_deterministic_in_train_mode(model)
    model.save_pretrained(tmp_path / "saved")  # a saved copy reloads dropout-free
    cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert cfg["resid_pdrop"] == cfg["embd_pdrop"] == cfg["attn_pdrop"] == 0.0


def test_lora_dropout_stays_as_asked(tmp_path):
    model = load_causal_lm(str(_dropout_gpt2(tmp_path / "gpt2-dropout")))
    model = apply_lora(model, r=4, alpha=8, dropout=0.25, target_modules=["c_attn"])
    lora = [m.p for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in n]
    base = [m.p for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" not in n]
    assert lora and all(p == 0.25 for p in lora)
    assert base and all(p == 0.0 for p in base)


def test_reward_model_dropout_off_in_train_mode(tiny_model_dir, tmp_path):
    from relign.models.reward import _backbone, load_reward_model

    model = load_reward_model(str(_dropout_qwen2(tiny_model_dir, tmp_path / "qwen2-dropout")))
    assert model.training and model.config.attention_dropout == 0.0
    assert all(m.attention_dropout == 0.0 for m in model.modules() if hasattr(m, "attention_dropout"))
    with torch.no_grad():
        a, b = _backbone(model)(IDS).last_hidden_state, _backbone(model)(IDS).last_hidden_state
    assert torch.equal(a, b)


def test_a_model_placed_on_a_gpu_keeps_sdpa_off_cudnn(tiny_model_dir, monkeypatch):
    """On a GPU, relign's attention shapes change at nearly every call, and cuDNN's attention
    builds a graph per shape (BENCHMARKS.md, the H200 run: packed SFT 4.4x faster without it).
    Both loaders, asked for a CUDA device, leave SDPA's cuDNN kernel off; here ``Module.to``
    records the device instead of moving (no GPU on this machine)."""
    from relign.models.reward import load_reward_model

    moved = []
    real_to = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(a[0]) or self if a and str(a[0]).startswith("cuda")
                        else real_to(self, *a, **k))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for load in (load_causal_lm, load_reward_model):
            torch.backends.cuda.enable_cudnn_sdp(True)
            load(str(tiny_model_dir), device="cpu")
            assert torch.backends.cuda.cudnn_sdp_enabled()  # a CPU run changes nothing
            load(str(tiny_model_dir), device="cuda")
            assert not torch.backends.cuda.cudnn_sdp_enabled(), load.__name__
        assert moved == ["cuda", "cuda"]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
