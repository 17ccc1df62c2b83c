"""The HF engine's own decode step (relign/rollout/fast_decode.py) against transformers' forward.

The step replaces the model's forward for one-token decode steps only, so every test
here compares it with the path it replaces: the same engine with ``fast_decode=False``.
"""

from __future__ import annotations

import pytest
import torch

from relign.rollout.engine import SamplingParams
from relign.rollout.fast_decode import unsupported_reason
from relign.rollout.hf_engine import HFEngine

from .conftest import trainer_logps


def _model(arch: str, *, bias_head: bool = False):
    """A tiny random decoder of each covered architecture: Qwen2 (q/k/v biases), Llama (none),
    Qwen3 (per-head q/k norms), with 3 query heads per key/value head."""
    import transformers

    common = dict(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=not bias_head)
    cfg = {"qwen2": lambda: transformers.Qwen2Config(**common),
           "llama": lambda: transformers.LlamaConfig(**common, rope_scaling={"rope_type": "linear", "factor": 2.0}),
           "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=32)}[arch]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # sharper distributions than the default init (varied greedy text)
        for p in model.parameters():
            p.mul_(4.0) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    return model


class _Tok:
    """Just what the engine asks of a tokenizer: ids in, text out."""

    eos_token_id = pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


PROMPTS = [[5, 17, 33, 2, 9], [101, 7], [250, 251, 3, 3, 3, 3, 3, 4, 80], [42]]


def _assert_trainer_logps(model, groups, temperature: float) -> None:
    """The engine's sampled log-probs equal what the trainer recomputes for the same tokens (1e-4)."""
    prompts = [p for p, g in zip(PROMPTS, groups) for _ in g]
    flat = [c for g in groups for c in g]
    ref = trainer_logps(model, prompts, [c.token_ids for c in flat], temperature)
    for c, r in zip(flat, ref):
        torch.testing.assert_close(torch.tensor(c.logps), torch.tensor(r), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_fast_decode_equals_the_models_forward(arch):
    model = _model(arch)
    assert unsupported_reason(model) is None
    fast, plain = HFEngine(model, _Tok(), seed=3), HFEngine(model, _Tok(), seed=3, fast_decode=False)
    assert fast.fast is not None and plain.fast is None
    # greedy: the same tokens (the logits agree to float rounding, so the argmax does)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=20, ignore_eos=True)
    a, b = fast.generate(PROMPTS, greedy), plain.generate(PROMPTS, greedy)
    assert [g[0].token_ids for g in a] == [g[0].token_ids for g in b]
    assert len({tuple(g[0].token_ids) for g in a}) == len(PROMPTS)  # varied text, not one repeated token
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x[0].logps), torch.tensor(y[0].logps), atol=1e-5, rtol=0)
    # sampled with per-prompt seeds (groups of 3 sharing a prefill, rows leaving the batch):
    # the same tokens, and log-probs equal to the trainer's recomputation
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=24, stop_token_ids=[7, 11])
    a = fast.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    b = plain.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    assert {c.finish_reason for g in a for c in g} == {"stop", "length"}
    _assert_trainer_logps(model, a, 0.8)


def test_engine_follows_in_place_updates_of_a_fused_adamw():
    """The engine shares the trainer's module: the next rollout samples from the updated weights.
    (A fused AdamW step does not bump the parameters' version counters: nothing may be cached on them.)"""
    model = _model("qwen2")
    engine = HFEngine(model, _Tok(), seed=0)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True)
    before = engine.generate(PROMPTS, params, seeds=[0, 1, 2, 3])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    ids = torch.tensor([PROMPTS[0] + [1, 2, 3]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    out = engine.generate(PROMPTS, params, seeds=[0, 1, 2, 3])
    assert [[c.token_ids for c in g] for g in out] != [[c.token_ids for c in g] for g in before]  # the update mattered
    _assert_trainer_logps(model, out, 1.0)


def test_bf16_fast_decode_close_to_forward():
    model = _model("qwen2").to(torch.bfloat16)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8, ignore_eos=True)
    a = HFEngine(model, _Tok()).generate(PROMPTS, greedy)
    b = HFEngine(model, _Tok(), fast_decode=False).generate(PROMPTS, greedy)
    # bf16: the attention's matmul and softmax round differently from SDPA's: the first token's log-prob, loosely
    for x, y in zip(a, b):
        assert abs(x[0].logps[0] - y[0].logps[0]) < 0.05


def test_models_it_does_not_cover_keep_the_models_forward():
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(_model("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert "LoRA" in unsupported_reason(lora.base_model.model)
    assert HFEngine(lora.base_model.model, _Tok()).fast is None
    gpt2 = __import__("transformers").GPT2LMHeadModel(__import__("transformers").GPT2Config(n_layer=1, n_embd=32, n_head=2))
    assert "gpt2" in unsupported_reason(gpt2)

