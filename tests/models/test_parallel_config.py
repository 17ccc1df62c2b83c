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


def test_check_parallel_holds_every_parallel_check_and_reads_the_heads_from_the_config(tiny_model_dir, monkeypatch):
    """recipes.frame.check_parallel, as frame.open runs it before the mesh, the data or any weight (so --dry-run
    too): sizes, the world, context parallel's recipes and packed rows, then the heads from config.json alone
    (the tiny model: 4 attention heads, 2 key-value heads), here on a pretend world of 4 ranks."""
    from types import SimpleNamespace

    from relign import distributed
    from relign.recipes.frame import check_parallel

    monkeypatch.setattr(distributed, "world_size", lambda: 4)

    def cfg(tp, cp, packing=True, path=str(tiny_model_dir)):
        return SimpleNamespace(parallel=SimpleNamespace(tp_size=tp, cp_size=cp), packing=packing,
                               model=SimpleNamespace(path=path, trust_remote_code=False))

    check_parallel(cfg(2, 1), "sft")
    check_parallel(cfg(1, 2), "rl")
    check_parallel(cfg(2, 2, path=""), "dpo")  # no model yet: the recipe's own check names model.path
    for c, recipe, message in [
            (cfg(0, 1), "sft", r"^bad value for 'parallel.tp_size': 0; it must be at least 1$"),
            (cfg(1, 3), "sft", r"^parallel.tp_size x parallel.cp_size = 1 x 3 does not divide the world size 4 "),
            (cfg(1, 2), "rm", r"^parallel.cp_size=2: context parallel trains sft, dpo and rl in this version \(relign rm"),
            (cfg(1, 2, packing=False), "sft", r"^parallel.cp_size=2 splits packed rows over the cp ranks: set packing=true$"),
            (cfg(4, 1), "sft", r"^parallel.tp_size=4 does not divide the model's 2 key-value heads"),
            (cfg(2, 2), "sft", r"^parallel.tp_size x parallel.cp_size = 4 does not divide the model's 2 key-value heads")]:
        with pytest.raises(ConfigError, match=message):
            check_parallel(c, recipe)


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
