"""The tiny model builder: local tokenizer, chat template, reload through transformers' Auto classes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relign.models.tiny import build_tiny_model, num_parameters

TEXT = "Janet has 1,234 apples.  She gives 5 away: 1234 - 5 = 1229. \\boxed{1229} <answer>(3+4)*2</answer>\nhé 😀"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_build_save_reload(tmp_path, arch):
    model, tok = build_tiny_model(tmp_path / arch, arch=arch, size="micro")
    reloaded_tok = AutoTokenizer.from_pretrained(tmp_path / arch)
    # AutoTokenizer may rebuild the tokenizer from config.json's model type: same ids anyway
    assert reloaded_tok(TEXT)["input_ids"] == tok(TEXT)["input_ids"]
    assert reloaded_tok.decode(tok(TEXT)["input_ids"]) == TEXT  # byte-level: lossless
    assert reloaded_tok.eos_token == "<|im_end|>" and reloaded_tok.pad_token == "<|endoftext|>"
    chat = reloaded_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / arch)
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_deterministic_and_sized(tmp_path):
    m1, t1 = build_tiny_model(size="micro", seed=3)
    m2, t2 = build_tiny_model(size="micro", seed=3)
    assert t1.get_vocab() == t2.get_vocab()
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    small, _ = build_tiny_model(size="small")
    assert 9e6 < num_parameters(small) < 12e6  # "about 10M", the benchmark size
    # the demo's model: tiny's width and heads, half its layers
    shallow, tiny = build_tiny_model(size="shallow")[0].config, build_tiny_model(size="tiny")[0].config
    assert (shallow.num_hidden_layers, tiny.num_hidden_layers) == (2, 4)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(shallow, key) == getattr(tiny, key), key


def test_cli_tiny_model(tmp_path):
    from ..conftest import run_cli

    out = run_cli("tiny-model", str(tmp_path / "m"), "--arch", "llama", "--size", "micro").stdout
    assert "llama model" in out and (tmp_path / "m" / "model.safetensors").is_file()
