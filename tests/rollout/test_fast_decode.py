"""The HF engine's own decode step (relign/rollout/fast_decode.py) against transformers' forward.

The step replaces the model's forward for one-token decode steps only, so every test
here compares it with the path it replaces: the same engine with ``fast_decode=False``.
"""

from __future__ import annotations

import pytest
import torch

from relign.rollout.engine import SamplingParams
from relign.rollout.fast_decode import DecodePlan, Weights, device_peaks, roofline_seconds, unsupported_reason
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
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    assert "gpt2" in unsupported_reason(gpt2)
    assert HFEngine(gpt2, _Tok()).fast is None


# ---------------------------------------------------------------------------- static shapes (issue 46)

STATIC = DecodePlan(static=True, read_every=8, row_buckets=(4, 8, 16), length_bucket=32)


def _reads_outside_prefill(monkeypatch) -> list[str]:
    """Every host read (``tolist``, ``item``, ``bool``, ``int``, ``float``, ``cpu``, ``numpy``) of a
    tensor outside the prefill (whose model forward is transformers': its mask code reads twice)."""
    reads: list[str] = []
    inside = [False]
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            if not inside[0]:
                reads.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    prefill = HFEngine._prefill

    def quiet(self, *a, **k):
        inside[0] = True
        try:
            return prefill(self, *a, **k)
        finally:
            inside[0] = False

    monkeypatch.setattr(HFEngine, "_prefill", quiet)
    return reads


@pytest.mark.parametrize("static", [False, True])
def test_host_reads_once_every_k_steps(monkeypatch, static):
    """T = 20 tokens read every k = 8 steps: ceil(20 / 8) = 3 reads in the decode (at 8, 16, 20),
    whatever the rows do; at T = 1, one."""
    model = _model("qwen2")
    plan = STATIC if static else DecodePlan(read_every=8)
    engine = HFEngine(model, _Tok(), decode=plan)
    reads = _reads_outside_prefill(monkeypatch)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=20, ignore_eos=True), seeds=[1, 2, 3, 4])
    assert all(len(c.token_ids) == 20 for g in out for c in g)
    assert reads == ["tolist"] * 3
    reads.clear()
    engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=1, ignore_eos=True))
    assert reads == ["tolist"]


def test_the_static_step_compiles_whole(monkeypatch):
    """``torch.compile(step, backend="eager", fullgraph=True)``: dynamo traces the whole decode step,
    forward and sampling (a host read inside would break the graph and raise), and the compiled
    step gives the eager one's tokens and log-probs."""
    model = _model("qwen3")
    compiled = []
    capture = HFEngine._capture

    def compile_it(self, slot, weights, sampler):
        fn = capture(self, slot, weights, sampler)  # on the CPU: the eager step itself
        compiled.append(torch.compile(fn, backend="eager", fullgraph=True))
        return compiled[-1]

    # top-k, per-row uniforms, the stop ids banned on the device (through the last token: no row
    # finishes, so one bucket and one compile)
    params = [SamplingParams(n=2, temperature=0.9, top_k=40, max_new_tokens=10, min_new_tokens=10, stop_token_ids=[7, 11])]
    want = [HFEngine(model, _Tok(), decode=STATIC).generate(PROMPTS, p, seeds=[1, 2, 3, 4]) for p in params]
    monkeypatch.setattr(HFEngine, "_capture", compile_it)
    got = [HFEngine(model, _Tok(), decode=STATIC).generate(PROMPTS, p, seeds=[1, 2, 3, 4]) for p in params]
    assert len(compiled) == 1
    for a, b in zip(got, want):
        assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
        for x, y in zip((c for g in a for c in g), (c for g in b for c in g)):
            torch.testing.assert_close(torch.tensor(x.logps), torch.tensor(y.logps), atol=1e-6, rtol=0)


def test_a_captures_warm_up_leaves_the_state_as_it_was():
    """Capturing a bucket's step first runs it once (a warm-up, which also compiles), moving the
    tokens, positions, step and column on; they are put back. On the CPU a captured plan runs that
    warm-up and then the eager step: bitwise the uncaptured plan's outputs, buckets changed mid-call
    included (each new bucket is captured when the rows move into it)."""
    import dataclasses

    model = _model("qwen2")
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=24, stop_token_ids=list(range(7, 300, 11)))
    eager = HFEngine(model, _Tok(), decode=STATIC).generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    engine = HFEngine(model, _Tok(), decode=dataclasses.replace(STATIC, capture="graph"))
    out = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    assert len(engine._slots) >= 2  # the rows moved into a smaller bucket, captured there too
    assert [[(c.token_ids, c.logps, c.finish_reason) for c in g] for g in out] == \
        [[(c.token_ids, c.logps, c.finish_reason) for c in g] for g in eager]


def test_dynamic_rope_is_not_captured():
    """Dynamic RoPE reads the longest position back to the host and may swap its frequency table: a
    graph could not hold it, so the engine keeps the static shapes and runs them eagerly."""
    import dataclasses

    import transformers

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=1,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    engine = HFEngine(model, _Tok(), decode=dataclasses.replace(STATIC, capture="graph"))
    assert engine.fast is not None and engine.plan.capture == "none" and engine.plan.static
    assert HFEngine(_model("llama"), _Tok(), decode=dataclasses.replace(STATIC, capture="graph")).plan.capture == "graph"


def test_kept_buffers_follow_the_weights_between_calls():
    """Under static shapes the weight copies and buffers live across calls: rewritten in place, so an
    in-place update between calls (a fused AdamW step) shows in the next rollout."""
    model = _model("qwen2")
    engine = HFEngine(model, _Tok(), decode=STATIC)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True)
    before = engine.generate(PROMPTS, params, seeds=[0, 1, 2, 3])
    buffers = [t.data_ptr() for t in engine._weights.tensors()]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    ids = torch.tensor([PROMPTS[0] + [1, 2, 3]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    out = engine.generate(PROMPTS, params, seeds=[0, 1, 2, 3])
    assert [t.data_ptr() for t in engine._weights.tensors()] == buffers  # the same buffers, rewritten
    assert [[c.token_ids for c in g] for g in out] != [[c.token_ids for c in g] for g in before]
    _assert_trainer_logps(model, out, 1.0)


# ---------------------------------------------------------------------------- LoRA from merged copies


def _lora(arch: str = "qwen2", **kw):
    """A LoRA adapter on every linear layer but the head, its B random (peft starts it at 0)."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(_model(arch), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **kw))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return peft.eval()


@pytest.mark.parametrize("static", [False, True])
def test_lora_decodes_from_merged_copies(static):
    """The engine's log-probs equal the peft model's (the trainer's, unmerged adapter) to 1e-4 in
    fp32, with the tokens of peft's own forward; the base weights are bitwise unchanged."""
    peft = _lora()
    assert unsupported_reason(peft) is None
    base = {n: p.detach().clone() for n, p in peft.named_parameters() if "lora_" not in n}
    engine = HFEngine(peft, _Tok(), decode=STATIC if static else None)
    assert engine.fast is not None
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, stop_token_ids=[7, 11])
    out = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    _assert_trainer_logps(peft, out, 1.0)
    forward = HFEngine(peft, _Tok(), fast_decode=False).generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    assert [[c.token_ids for c in g] for g in out] == [[c.token_ids for c in g] for g in forward]
    for n, p in peft.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base[n]), n
    # the merged copies really hold the adapter: without it the tokens differ
    with peft.disable_adapter():
        plain = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    assert [[c.token_ids for c in g] for g in plain] != [[c.token_ids for c in g] for g in out]


@pytest.mark.parametrize("static", [False, True])
def test_lora_adapter_update_shows_in_the_next_call(static):
    peft = _lora("llama")
    engine = HFEngine(peft, _Tok(), decode=STATIC if static else None)
    assert engine.fast is not None  # from the merged copies, not peft's forward
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True)
    before = engine.generate(PROMPTS, params, seeds=[0, 1, 2, 3])
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=0.1, fused=True)
    ids = torch.tensor([PROMPTS[0] + [1, 2, 3]])
    peft.train()
    peft(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    peft.eval()
    out = engine.generate(PROMPTS, params, seeds=[0, 1, 2, 3])
    assert [[c.token_ids for c in g] for g in out] != [[c.token_ids for c in g] for g in before]
    _assert_trainer_logps(peft, out, 1.0)


def test_lora_variants_are_refused_in_one_line():
    from relign.errors import ConfigError

    dora = _lora(use_dora=True)
    with pytest.raises(ConfigError) as e:
        HFEngine(dora, _Tok())
    msg = str(e.value)
    assert "\n" not in msg and "DoRA" in msg and "rollout.fast_decode=false" in msg
    assert HFEngine(dora, _Tok(), fast_decode=False).fast is None  # peft's own forward handles it


# ---------------------------------------------------------------------------- the roofline


def test_roofline_seconds_by_hand():
    # 1e9 weight bytes + 1,000 cached tokens x 1e5 bytes = 1.1e9 bytes at 1e12 B/s = 1.1 ms;
    # FLOPs 2 x 5e8 x 64 + 1,000 x 1e6 = 6.5e10 at 1e14 FLOP/s = 0.65 ms: the bytes bound it
    assert roofline_seconds(rows=64, context=1000, weight_bytes=10**9, weight_params=5 * 10**8, kv_bytes_per_token=10**5,
                            attn_flops_per_token=10**6, flops_per_s=1e14, bytes_per_s=1e12) == pytest.approx(1.1e-3)
    # at 1e13 FLOP/s the FLOPs bound it: 6.5 ms
    assert roofline_seconds(rows=64, context=1000, weight_bytes=10**9, weight_params=5 * 10**8, kv_bytes_per_token=10**5,
                            attn_flops_per_token=10**6, flops_per_s=1e13, bytes_per_s=1e12) == pytest.approx(6.5e-3)
    assert device_peaks("NVIDIA H200") == (989e12, 4.8e12) and device_peaks("NVIDIA H100 PCIe") == (756e12, 2.0e12)
    assert device_peaks("a CPU") is None


def test_decode_bw_frac_counts_the_kept_tokens():
    """perf/decode_bw_frac = the roofline's seconds for the steps that made kept tokens / the steps'
    seconds. With made-up peaks on the CPU, the roofline part against a sum written out here."""
    model = _model("qwen2")
    engine = HFEngine(model, _Tok())
    assert engine.perf_metrics() == {}  # a CPU: no peaks, nothing measured
    flops, bw = 1e12, 1e10
    engine._peaks = (flops, bw)
    T = 6
    out = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=T, ignore_eos=True))
    m = engine.perf_metrics()
    assert engine.perf_metrics() == {}  # read once
    tokens = sum(len(g[0].token_ids) for g in out)
    assert tokens == T * len(PROMPTS)
    seconds = tokens / m["perf/decode_tokens_per_s"]
    # hidden 96, 2 layers, 6 heads of 16, 2 key/value heads, fp32; weights: the copies' bytes
    W = Weights(model).nbytes()
    kv_per_token, attn = 2 * 2 * 2 * 16 * 4, 4 * 6 * 16 * 2
    bound = 0.0
    for s in range(1, T):  # decode step s: every row, its prompt and s tokens of context
        context = sum(len(p) + s for p in PROMPTS)
        bound += max((W + context * kv_per_token) / bw, (2 * (W // 4) * len(PROMPTS) + context * attn) / flops)
    assert m["perf/decode_bw_frac"] * seconds == pytest.approx(bound, rel=1e-9)
