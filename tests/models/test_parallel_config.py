"""relign.models.tp and models.cp without ranks: which plan applies, and the one-line errors for what cannot split."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from relign.errors import ConfigError
from relign.models.tp import PLAN, apply_tp, check_heads, plan_of


def test_heads_that_do_not_split_name_the_key():
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2)
    check_heads(config, 2)  # 2 heads and 1 kv head per rank
    check_heads(config, 1, 2)
    with pytest.raises(ConfigError, match=r"^parallel.tp_size=4 does not divide the model's 2 key-value heads \(num_key_value_heads\)$"):
        check_heads(config, 4)
    with pytest.raises(ConfigError, match=r"^parallel.tp_size=3 does not divide the model's 4 attention heads \(num_attention_heads\)$"):
        check_heads(config, 3)
    with pytest.raises(ConfigError, match=r"^parallel.cp_size=4 does not divide the model's 2 key-value heads"):
        check_heads(config, 1, 4)
    with pytest.raises(ConfigError, match=r"^parallel.tp_size x parallel.cp_size = 4 does not divide the model's 2 key-value"):
        check_heads(config, 2, 2)


class _Stack(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])


def test_the_plan_is_the_models_own_decoder_entries_else_relign_table():
    qwen3 = plan_of(_Stack(Qwen3Config()))
    assert qwen3["layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert qwen3["layers.*.mlp.down_proj"] == "rowwise" and all(k.startswith("layers.") for k in qwen3)

    class Bare:  # a config with no plan of its own
        base_model_tp_plan = None

    assert plan_of(_Stack(Bare())) == PLAN
    assert PLAN["layers.*.self_attn.q_proj"] == "colwise" and PLAN["layers.*.self_attn.o_proj"] == "rowwise"

    class Odd:
        num_attention_heads, num_key_value_heads = 4, 2
        base_model_tp_plan = {"layers.*.mlp.experts": "grouped_gemm"}

    class Mesh:
        def size(self):
            return 2

    with pytest.raises(ConfigError, match=r"^parallel.tp_size: the model's tensor-parallel plan splits layers.\*.mlp.experts as 'grouped_gemm'"):
        apply_tp(_Stack(Odd()), Mesh())


def test_context_parallel_refuses_an_attention_it_cannot_wrap(tiny_model_dir):
    """Ulysses wraps relign's varlen SDPA (it reads the packed row's sequences from the gathered
    position ids); flash-attention or plain SDPA with its dense mask is refused, naming the key."""
    from transformers import AutoModelForCausalLM

    from relign.models import varlen
    from relign.models.cp import NAME, enable_ulysses

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match=r"^parallel.cp_size=2 wraps relign's varlen SDPA attention \(model.attn_implementation=sdpa, "
                                          r"packing on, a qwen2/qwen3/llama/mistral model\); it cannot wrap 'flash_attention_2'$"):
        enable_ulysses(model, 2)
    model.config._attn_implementation = "sdpa"
    assert varlen.enable(model)
    kv = model.config.num_key_value_heads  # with tp too, each of the tp x cp ranks needs whole key-value heads
    with pytest.raises(ConfigError, match=rf"^parallel.tp_size x parallel.cp_size = {2 * kv} does not divide"):
        enable_ulysses(model, 2, tp_size=kv)
    enable_ulysses(model, 2)
    assert model.config._attn_implementation == NAME
