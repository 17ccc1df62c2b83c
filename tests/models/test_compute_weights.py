"""model.dtype=bf16-compute (relign.models.precision.enable_compute_weights, issue 45 item 5): fp32
weights and gradients, the forward on bf16 copies of all of them, without autocast, so the numbers
are exactly those of the model cast to bf16 and the residual stream is bf16 (under bf16-mixed it is
fp32)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from relign.checks import check_common
from relign.config import ConfigError, load_config
from relign.models.loading import compile_layers, decoder_layers, load_causal_lm
from relign.models.logprobs import token_logps
from relign.models.precision import compute_dtype, compute_weights
from relign.models.value import ValueModel
from relign.recipes import sft

from .test_precision import engine_gaps

IDS = torch.tensor([[5, 17, 300, 42, 8, 9, 1000, 77, 3, 250], [61, 2, 90, 14, 500, 33, 7, 120, 41, 19]])


def _residual_dtype(model) -> torch.dtype:
    seen = []
    layer = decoder_layers(model)[0]
    hook = layer.register_forward_hook(lambda m, i, out: seen.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            model(input_ids=IDS)
    finally:
        hook.remove()
    return seen[0].dtype


def _logps_and_grads(model):
    # the model's own LM head (fused_head=False): the fused head (models.fused_ce) sums the head's
    # weight gradient in fp32 whatever the model's dtype, so the bf16-stored model's would differ
    logps, _ = token_logps(model, IDS, fused_head=False)
    (-logps.sum()).backward()
    return logps.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_exactly_the_model_cast_to_bf16_with_fp32_weights_and_gradients(tiny_model_dir):
    ours = load_causal_lm(str(tiny_model_dir), dtype="bf16-compute")
    cast = load_causal_lm(str(tiny_model_dir), dtype="bf16")  # the same weights, stored in bf16
    assert {p.dtype for p in ours.parameters()} == {torch.float32} and compute_weights(ours)
    assert compute_dtype(ours) == torch.bfloat16
    assert _residual_dtype(ours) == torch.bfloat16 == _residual_dtype(cast)
    assert _residual_dtype(load_causal_lm(str(tiny_model_dir), dtype="bf16-mixed")) == torch.float32  # autocast's
    a, ga = _logps_and_grads(ours)
    b, gb = _logps_and_grads(cast)
    assert torch.equal(a, b)  # the same ops on the same bf16 numbers
    for n, g in ga.items():
        assert g.dtype == torch.float32 and torch.equal(g, gb[n].float()), n  # the bf16 gradient, upcast


def test_a_step_of_lr_1e_6_moves_the_fp32_weights(tiny_model_dir):
    """What the fp32 master weights are for: at lr 1e-6 an AdamW step moves every weight by about
    1e-6, below bf16's spacing at |w| ~ 0.02 (~1e-4), yet it is not lost here."""
    model = load_causal_lm(str(tiny_model_dir), dtype="bf16-compute")
    w = model.model.layers[0].mlp.down_proj.weight
    before = w.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    _logps_and_grads(model)
    opt.step()
    assert (w.detach() != before).float().mean() > 0.9


def test_value_head_and_compiled_layers(tiny_model_dir):
    critic = ValueModel(load_causal_lm(str(tiny_model_dir), dtype="bf16-compute"))
    v = critic(IDS)
    assert v.dtype == torch.float32 and v.shape == IDS.shape
    torch._dynamo.reset()
    model = load_causal_lm(str(tiny_model_dir), dtype="bf16-compute", lean_activations=False)
    counter = CompileCounter()
    compile_layers(model, backend=counter)
    for T in (6, 8, 10):  # the copies are new tensors at every forward: still one graph
        token_logps(model, IDS[:, :T])[0].sum().backward()
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_limits_name_the_keys(tiny_model_dir, monkeypatch):
    cfg = load_config(sft.Config, None, [f"model.path={tiny_model_dir}", "data.path=x.jsonl", "model.dtype=bf16-compute"])
    check_common(cfg)  # fine on one process
    cfg.model.gradient_checkpointing = True
    with pytest.raises(ConfigError, match="model.gradient_checkpointing"):
        check_common(cfg)
    cfg.model.gradient_checkpointing = False
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="one process"):
        check_common(cfg)


def test_engine_samples_with_the_trainers_log_probs(tiny_model_dir, tokenizer):
    """The HF engine's prefill runs the cast forward, its own decode step the bf16 weight copies
    under autocast (as for bf16-mixed): the log-probs it reports match the trainer's to bf16
    rounding (measured gap 0.002)."""
    from relign.rollout.engine import SamplingParams
    from relign.rollout.hf_engine import HFEngine

    model = load_causal_lm(str(tiny_model_dir), dtype="bf16-compute")
    engine = HFEngine(model, tokenizer, seed=0)
    assert engine.fast is not None
    prompts = [tokenizer.encode("Compute 7 + 5 - 3."), tokenizer.encode("Hello")]
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True), seeds=[1, 2])
    gaps = engine_gaps(model, prompts, out)
    assert len(gaps) == 4 and max(gaps) < 0.02, gaps
