"""Regional compile (``model.compile``, relign.models.loading.compile_layers): each decoder layer's
forward compiled once for all layers and lengths, with no graph breaks, and the same numbers as
eager. CPU backends only (eager / aot_eager / a counting backend): inductor's code generation is
for the GPU run (bench/gpu_ab.py, section compile)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from transformers import AutoModelForCausalLM, Qwen2Config

from relign.config import ConfigError, ModelConfig, load_config
from relign.models import lean, varlen
from relign.models.loading import COMPILE_AUTO, compile_enabled, compile_layers, compiled, decoder_layers
from relign.recipes import build, sft
from relign.recipes.rl_update import Layout, forward_logps
from relign.rollout.batch import build_batch
from relign.rollout.multiturn import Episode

from ..conftest import torch_threads

V = 512


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test counts its own compiles
    with torch_threads(1):
        yield
    torch._dynamo.reset()


def tiny(layers: int = 2) -> torch.nn.Module:
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=V, max_position_embeddings=256)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).train()


def padded(T: int, B: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(T)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - 3:] = 0  # a shorter row: a real padding mask reaches the layers
    return {"input_ids": torch.randint(0, V, (B, T), generator=g), "attention_mask": mask}


def layer_inputs(model, run) -> tuple[tuple, dict]:
    """The arguments the first decoder layer receives when ``run(model)`` runs."""
    seen = []
    hook = decoder_layers(model)[0].register_forward_pre_hook(lambda m, a, k: seen.append((a, dict(k))), with_kwargs=True)
    try:
        with torch.no_grad():
            run(model)
    finally:
        hook.remove()
    return seen[0]


def graph_breaks(model, run) -> list[str]:
    args, kwargs = layer_inputs(model, run)
    layer = decoder_layers(model)[0]
    out = torch._dynamo.explain(type(layer).forward)(layer, *args, **kwargs)
    return [b.reason for b in out.break_reasons] + ([] if out.graph_break_count == 0 else [f"{out.graph_break_count} breaks"])


def continuation_batch(G: int = 3):
    """Two groups of G rows sharing their prompt (the RL shared-prompt rows), as the packed layout runs them."""
    rng = random.Random(0)
    eps = []
    for P in (5, 7):
        prompt = [rng.randrange(V) for _ in range(P)]
        for _ in range(G):
            R = rng.randint(2, 6)
            eps.append(Episode(prompt_ids=prompt, response_ids=[rng.randrange(V) for _ in range(R)], response_mask=[1] * R,
                               sampling_logps=[0.0] * R, token_rewards=[0.0] * R))
    return build_batch(eps, 0, "cpu", group_size=G)


def test_padded_rows_no_graph_break():
    model = tiny()
    assert graph_breaks(model, lambda m: m(**padded(9), use_cache=False)) == []
    # rows without padding: transformers passes no mask, SDPA runs causal
    assert graph_breaks(model, lambda m: m(input_ids=padded(9)["input_ids"], use_cache=False)) == []


# The packed and continuation rows reach the layers through relign's varlen attention, which today
# reads the sequence bounds on the host (position_ids.diff().any(), .tolist()) inside every layer:
# each read is a graph break. Issue 45's first item (varlen with no host syncs) removes them; then
# these two pass and the marks go (strict: an unexpected pass fails, so it is seen).
NEEDS_SYNC_FREE_VARLEN = pytest.mark.xfail(strict=True, reason="varlen attention reads bounds on the host (issue 45 item 1)")


@NEEDS_SYNC_FREE_VARLEN
def test_packed_rows_no_graph_break(tokenizer):
    from relign.data.sft import SFTExample

    model = tiny()
    assert varlen.enable(model)
    rng = random.Random(1)
    examples = []
    for n, p in ((7, 3), (5, 2), (9, 4)):
        ids = [rng.randrange(V) for _ in range(n)]
        examples.append(SFTExample(input_ids=ids, loss_mask=[0] * p + [1] * (n - p)))
    mb = sft._collate(examples, True, 0, "cpu")
    assert graph_breaks(model, lambda m: sft._forward(m, mb)) == []


@NEEDS_SYNC_FREE_VARLEN
def test_continuation_rows_no_graph_break():
    model = tiny()
    assert varlen.enable(model)
    batch = continuation_batch()
    rows = torch.arange(batch.size)
    assert graph_breaks(model, lambda m: forward_logps(m, batch, rows, Layout("packed", group_size=3), temperature=1.0)) == []


def test_one_graph_for_all_layers_and_five_lengths():
    """Four layers, five lengths, with and without gradients: one graph each (at most one recompile
    over the lengths is the promise; with the length symbolic from the first call there is none)."""
    model = tiny(layers=4)
    counter = CompileCounter()
    assert compile_layers(model, backend=counter) == 4
    for T in (5, 9, 13, 17, 21):
        model(**padded(T), use_cache=False).logits.sum().backward()
    assert counter.frame_count == 1  # one compile: every layer and every length share it
    with torch.no_grad():
        for T in (5, 9, 13, 17, 21):
            model(**padded(T), use_cache=False)
    assert counter.frame_count == 2  # the forward without autograd is its own graph, once
    # a KV cache (generation, the HF engine's prefill) runs eagerly: no compile per decode step
    model.eval().generate(padded(6)["input_ids"][:1], max_new_tokens=3, do_sample=False)
    assert counter.frame_count == 2


def test_aot_eager_equals_eager_fp32():
    """Values and gradients of the compiled layers (AOT autograd's traced forward and backward) equal
    eager to 1e-6 in fp32, on padded rows. Static shapes here: a symbolic length changes which
    graph serves which length (the test above), not the ops in it, and tracing it symbolically
    costs 6-10 s more on this CPU."""
    model = tiny()
    ref = copy.deepcopy(model)
    compile_layers(model, backend="aot_eager", dynamic=False)
    for T in (7,):
        batch = padded(T)
        out = model(**batch, use_cache=False).logits
        want = ref(**batch, use_cache=False).logits
        m = batch["attention_mask"].bool()
        assert (out - want)[m].abs().max() <= 1e-6
        ((out * m[..., None]) ** 2).mean().backward()
        ((want * m[..., None]) ** 2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-6 * max(1.0, q.grad.abs().max().item()), name


def test_compiled_layers_follow_a_deepcopy():
    model = tiny()
    compile_layers(model, backend="eager")
    twin = copy.deepcopy(model)
    for layer in decoder_layers(twin):
        assert layer.forward.__self__ is layer  # an engine's replica runs its own weights
    assert model.state_dict().keys() == tiny().state_dict().keys()  # checkpoints load either way


def test_model_compile_key(tiny_model_dir):
    cfg = load_config(sft.Config, None, [f"model.path={tiny_model_dir}", "model.compile=true"])
    assert cfg.model.compile == "True"  # YAML true into a string field
    model = build.load_policy(cfg.model, "cpu")
    assert compiled(model) and len(decoder_layers(model)) == model.config.num_hidden_layers
    assert not any(getattr(m, lean._ATTR, False) for m in model.modules())  # lean is off under compile
    eager = build.load_policy(ModelConfig(path=str(tiny_model_dir)), "cpu")  # auto: off on CPU
    assert not compiled(eager) and any(getattr(m, lean._ATTR, False) for m in eager.modules())
    assert COMPILE_AUTO["cpu"] is False and compile_enabled("auto", "cpu") is False
    with pytest.raises(ConfigError, match="model.compile"):
        compile_enabled("yes", "cpu")
    with pytest.raises(ConfigError, match="'model.compile'"):
        sft._check(load_config(sft.Config, None, [f"model.path={tiny_model_dir}", "data.path=x.jsonl", "model.compile=maybe"]))
