"""model.dtype=bf16-mixed: fp32 weights and gradients, bf16 arithmetic, in every forward that
trains or samples (policy, decoder stack under the value and reward heads, LoRA, the HF
engine's own decode step); and why pure bf16 weights are not the way to train."""

from __future__ import annotations

import copy

import pytest
import torch

from relign.models.loading import apply_lora, load_causal_lm
from relign.models.logprobs import token_logps
from relign.models.precision import compute_dtype
from relign.models.reward import load_reward_model, sequence_rewards
from relign.models.value import ValueModel

IDS = torch.tensor([[5, 17, 300, 42, 8, 9, 1000, 77, 3, 250], [61, 2, 90, 14, 500, 33, 7, 120, 41, 19]])


def _linear_out_dtypes(model, run) -> set[torch.dtype]:
    """The output dtypes of every nn.Linear that ran inside ``run()``."""
    seen: set[torch.dtype] = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype)) for m in model.modules()
             if isinstance(m, torch.nn.Linear)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def _grads(model) -> dict[str, torch.Tensor]:
    logps, _ = token_logps(model, IDS)
    (-logps.sum()).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_fp32_weights_and_gradients_with_bf16_matmuls(tiny_model_dir):
    fp32 = load_causal_lm(str(tiny_model_dir))
    mixed = load_causal_lm(str(tiny_model_dir), dtype="bf16-mixed")
    assert {p.dtype for p in mixed.parameters()} == {torch.float32}
    assert compute_dtype(mixed) == torch.bfloat16 and compute_dtype(fp32) == torch.float32
    assert _linear_out_dtypes(mixed, lambda: mixed(input_ids=IDS)) == {torch.bfloat16}
    assert _linear_out_dtypes(fp32, lambda: fp32(input_ids=IDS)) == {torch.float32}
    # the same function to bf16 rounding (8 mantissa bits: ~0.4% per product, summed over layers)
    a, _ = token_logps(fp32, IDS)
    b, _ = token_logps(mixed, IDS)
    assert b.dtype == torch.float32
    torch.testing.assert_close(b, a, atol=0.05, rtol=0.0)
    assert (b - a).abs().max() > 0  # and it did compute in bf16
    ga, gb = _grads(fp32), _grads(mixed)
    assert ga.keys() == gb.keys() and all(g.dtype == torch.float32 for g in gb.values())
    for k in ga:
        cos = torch.nn.functional.cosine_similarity(ga[k].flatten(), gb[k].flatten(), dim=0)
        assert cos > 0.99, (k, cos.item())


def test_small_updates_reach_fp32_weights_and_round_away_in_bf16():
    """Why bf16-mixed: 10 AdamW steps at lr 1e-6 on weights of size ~0.02. Each step moves a
    weight by ~1e-6, ~1/80 of the bf16 spacing at 0.02 (2^-6 * 2^-8 = 6e-5 for |w| in
    [2^-6, 2^-5)), so a bf16 weight rounds back to where it was; an fp32 one moves."""
    torch.manual_seed(0)
    w = torch.randn(256, 256) * 0.02

    def moved(dtype):
        p = torch.nn.Parameter(w.to(dtype).clone())
        before = p.detach().clone()
        opt = torch.optim.AdamW([p], lr=1e-6, weight_decay=0.0)
        for _ in range(10):
            p.grad = torch.randn_like(p)
            opt.step()
        return (p.detach() != before).float().mean().item()

    assert moved(torch.float32) > 0.99
    assert moved(torch.bfloat16) < 0.1


def test_value_and_reward_heads_read_a_bf16_decoder_stack(tiny_model_dir, tokenizer):
    critic = ValueModel(load_causal_lm(str(tiny_model_dir), dtype="bf16-mixed"))
    values = {}
    dtypes = _linear_out_dtypes(critic.lm.model, lambda: values.setdefault("v", critic(IDS)))
    assert dtypes == {torch.bfloat16} and values["v"].dtype == torch.float32
    rm = load_reward_model(str(tiny_model_dir), dtype="bf16-mixed", pad_token_id=tokenizer.pad_token_id)
    assert {p.dtype for p in rm.parameters()} == {torch.float32}
    r = {}
    dtypes = _linear_out_dtypes(rm.model, lambda: r.setdefault("r", sequence_rewards(rm, IDS, torch.ones_like(IDS))))
    assert dtypes == {torch.bfloat16} and r["r"].dtype == torch.float32


def test_lora_adapters_train_in_fp32_under_bf16_compute(tiny_model_dir):
    model = apply_lora(load_causal_lm(str(tiny_model_dir), dtype="bf16-mixed"), r=4, alpha=8, dropout=0.0,
                       target_modules=["all-linear"])
    assert compute_dtype(model) == torch.bfloat16
    grads = _grads(model)
    assert grads and all("lora_" in n and g.dtype == torch.float32 for n, g in grads.items())
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)  # B starts at 0, so A's gradient is 0


def test_a_deepcopy_computes_with_its_own_weights(tiny_model_dir):
    """The HF engine's replica under torchrun is a deepcopy: its autocast forward must be bound
    to the copy, not to the original's weights."""
    model = load_causal_lm(str(tiny_model_dir), dtype="bf16-mixed")
    replica = copy.deepcopy(model)
    before, _ = token_logps(model, IDS)
    with torch.no_grad():
        for p in replica.parameters():
            p.mul_(0.5)
    after, _ = token_logps(model, IDS)
    moved, _ = token_logps(replica, IDS)
    assert torch.equal(before, after) and not torch.allclose(moved, before, atol=1e-3)
    assert compute_dtype(replica) == torch.bfloat16


@pytest.mark.parametrize("fast_decode", [True, False])
def test_engine_samples_with_the_trainers_bf16_log_probs(tiny_model_dir, tokenizer, fast_decode):
    """The HF engine under bf16-mixed: prefill and every decode step (its own or the model's
    forward) compute in bf16 like the trainer's forward, and the log-probs it reports match the
    trainer's to bf16 rounding."""
    from relign.rollout.engine import SamplingParams
    from relign.rollout.hf_engine import HFEngine

    model = load_causal_lm(str(tiny_model_dir), dtype="bf16-mixed")
    engine = HFEngine(model, tokenizer, seed=0, fast_decode=fast_decode)
    assert (engine.fast is not None) == fast_decode
    prompts = [tokenizer.encode("Compute 7 + 5 - 3."), tokenizer.encode("Hello")]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True)
    out = []
    assert _linear_out_dtypes(model, lambda: out.extend(engine.generate(prompts, params, seeds=[1, 2]))) == {torch.bfloat16}
    gaps = engine_gaps(model, prompts, out)
    assert len(gaps) == 4 and max(gaps) < 0.02, gaps


ONEDNN_PROBE = """
import os, sys, torch
import relign  # sets the oneDNN cache sizes unless the user did
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) // 1024
torch.set_num_threads(1)
lin = torch.nn.Linear(256, 1024)
with torch.inference_mode(), torch.autocast('cpu', dtype=torch.bfloat16):
    lin(torch.randn(8, 256))
    start = rss()
    for t in range(1, int(sys.argv[1]) + 1):  # 600 shapes, as 600 decode steps over a growing KV cache give
        lin(torch.randn(t, 256))
print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'], rss() - start)
"""


@pytest.mark.slow
def test_bf16_kernels_of_new_shapes_do_not_pile_up():
    """oneDNN caches a bf16 kernel per shape; relign caps its caches at 64 entries (relign/__init__.py),
    which keeps a run with ever-new shapes bounded (600 shapes: +63 MB capped, +397 MB at 1,024 entries,
    on the CI machine). A value the user exported wins."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", ONEDNN_PROBE, "600"], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    assert out[:2] == ["64", "64"] and int(out[2]) < 200, out
    out = subprocess.run([sys.executable, "-c", ONEDNN_PROBE, "0"], capture_output=True, text=True, check=True,
                         env={**env, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}).stdout.split()  # the setting only
    assert out[:2] == ["16", "64"], out


def engine_gaps(model, prompts, out) -> list[float]:
    """The largest |engine - trainer| log-prob of each completion in ``out`` (engine.generate's)."""
    gaps = []
    for p, group in zip(prompts, out):
        for c in group:
            ids = torch.tensor([p + c.token_ids])
            target = torch.zeros_like(ids, dtype=torch.float32)
            target[:, len(p):] = 1
            lp, _ = token_logps(model, ids, target_mask=target)
            gaps.append((lp[0, len(p):] - torch.tensor(c.logps)).abs().max().item())
    return gaps
