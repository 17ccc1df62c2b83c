"""relign plan (issue 47): each memory term against a count of its own (by hand, by the model's
parameters, by autograd's saved tensors, by the allocator), the predicted peak of the shipped
presets against the measured one, the one-line refusal before any weights load, the command and
``--dry-run``'s table, the devices."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from relign import devices as D
from relign import plan as P
from relign.config import ConfigError

from .conftest import REPO, load_script, run_cli

plan_check = load_script("bench/plan_check.py", "bench_plan_check")

QWEN05 = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
              intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)


def _toy(dtype=torch.float32, *, lean=True, precision="fp32", vocab=1000, layers=2, **kw):
    """A small Qwen2 (hidden 64, 4 heads of 16, 2 K/V heads, MLP 160) in train mode, as the recipes load it
    (``precision``: a model.dtype's compute mode, models/precision.enable)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from relign.models import lean as lean_mod
    from relign.models import precision as precision_mod

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, attn_implementation="sdpa",
                      **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    precision_mod.enable(model, precision)
    if lean:
        lean_mod.lean_activations(model)
    return model.train(), P.Shape.of(cfg)


# --------------------------------------------------------------------------- the terms, counted


def test_shape_counts_the_parameters_the_model_has():
    # hidden 64, 2 layers; per layer q 64x64 + 64 bias, k and v 64x32 + 32 bias each, o 64x64, gate/up/down
    # 3 x 64x160, two norms of 64: 4096 + 64 + 2 (2048 + 32) + 4096 + 30720 + 128 = 43,264; embeddings 1000 x 64
    # (tied head) and the final norm 64: 64,000 + 2 x 43,264 + 64 = 150,592
    model, s = _toy()
    assert s.params == 150_592 == sum(p.numel() for p in model.parameters())
    # the weights' bytes: fp32 4 each, bf16 2 each
    assert P.weight_bytes(s.params, 4) == sum(p.numel() * p.element_size() for p in model.parameters()) == 602_368
    bf16, _ = _toy(torch.bfloat16)
    assert P.weight_bytes(s.params, 2) == sum(p.numel() * p.element_size() for p in bf16.parameters())
    # an untied head, Llama (no biases) and Qwen3 (q/k norms) count as their models do, on the meta device
    from transformers import AutoConfig, AutoModelForCausalLM

    for kind, extra in (("llama", {}), ("llama", {"tie_word_embeddings": False}), ("qwen3", {"head_dim": 32})):
        cfg = AutoConfig.for_model(kind, vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, **extra)
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(cfg)
        assert P.Shape.of(cfg).params == sum(p.numel() for p in m.parameters()), (kind, extra)


def test_lora_counts_the_adapters_peft_makes():
    from relign.models.loading import apply_lora

    model, s = _toy(lean=False)
    wrapped = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    # r (in + out) per projection: q 4 (64 + 64), k and v 4 (64 + 32) each, o 4 (64 + 64), gate and up 4 (64 + 160) each,
    # down 4 (160 + 64): 512 + 768 + 512 + 1792 + 896 = 4,480 per layer, 2 layers
    assert s.lora_params(4, ["all-linear"]) == trainable == 8_960
    assert s.lora_params(4, ["q_proj", "v_proj"]) == 2 * (512 + 384)


def test_adamw_keeps_two_fp32_copies_of_the_trainable_weights():
    from relign.optim import build_optimizer

    model, s = _toy()
    opt = build_optimizer(model, lr=1e-3)
    model(input_ids=torch.randint(0, 1000, (1, 8))).logits.sum().backward()
    opt.step()
    moments = sum(t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items() if k != "step")
    assert moments == P.adamw_bytes(s.params, 4) == 2 * 4 * 150_592


def _saved_by_layer(model, run, layer: int = 1) -> int:
    """Bytes of the storages autograd keeps while ``layer`` of the decoder runs its forward (each
    storage once; the weights and the rotary table, made before the layer, left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, seen = [False], {}
    block = model.model.layers[layer]
    block.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *a: inside.__setitem__(0, False))
    rotary: set[int] = set()
    model.model.rotary_emb.register_forward_hook(
        lambda m, a, out: rotary.update(t.untyped_storage().data_ptr() for t in out))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in params and ptr not in rotary:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


@pytest.mark.parametrize("dtype, lean, packed", [
    ("fp32", True, False), ("fp32", False, False), ("bf16-mixed", True, False), ("bf16-mixed", False, False),
    ("bf16", True, False), ("bf16", False, False), ("bf16-compute", True, False), ("bf16-compute", False, False),
    ("fp32", True, True)])
def test_one_layer_saves_what_the_formula_says(dtype, lean, packed):
    from relign.models.logprobs import token_logps
    from relign.models.varlen import packed_attention

    prec = P.Precision.of(dtype)
    model, s = _toy(torch.bfloat16 if dtype == "bf16" else torch.float32, lean=lean, precision=dtype)
    T = 100
    ids = torch.randint(0, 1000, (2, T // 2))
    if packed:  # one row of two sequences, 30 and 70 tokens: attention sequence by sequence
        packed_attention(model, "sdpa")
        pos = torch.cat([torch.arange(30), torch.arange(70)])[None]
        run = lambda: token_logps(model, ids.view(1, -1), position_ids=pos, target_mask=torch.ones(1, T))  # noqa: E731
    else:
        run = lambda: token_logps(model, ids, target_mask=torch.ones(2, T // 2))  # noqa: E731
    saved = _saved_by_layer(model, run)
    # bf16-mixed keeps autocast's bf16 copies of the layer's weights too (attention's, the MLP's without lean),
    # bf16-compute the cast copy of every weight of the layer (its norms' too)
    copies = (P.weight_copy_bytes(s, prec, lean=lean) - 2 * s.embedding) // s.layers if prec.compute < prec.param else 0
    assert saved == P.layer_saved_bytes(s, T, prec, lean=lean, packed=packed) + copies
    if (dtype, lean, packed) == ("fp32", True, False):
        # by hand, per token: 4 x (4 x 64 + 2 x 64 + 2 x 32 + 2 x 160) (the layer's input and mid-residual, the two
        # normalized inputs, queries and attention's output, keys and values, g and u) + 4 x 4 (log-sum-exp per
        # head) + 2 x 4 (1/rms of each norm) = 3,096 bytes
        assert saved == 3_096 * T


def test_autocast_copies_are_the_ones_the_backward_keeps():
    model, s = _toy(precision="bf16-mixed")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.dtype == torch.bfloat16 and t.dim() == 2 and t.untyped_storage().data_ptr() not in params \
                and t.shape[0] * t.shape[1] in (64 * 64, 64 * 32, 1000 * 64):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(0, 1000, (1, 7))).logits.float().sum()
    # 2 layers x (q 64x64 + k, v 64x32 + o 64x64) + the tied head 1000 x 64, 2 bytes each
    assert sum(seen.values()) == P.weight_copy_bytes(s, P.Precision.of("bf16-mixed"), lean=True) == 2 * (2 * 12_288 + 64_000)


def _head_peak(path: str, K: int, chunk: int, dtype: str, *, entropy: bool = False, V: int = 2000, d: int = 8) -> int:
    """The allocator's peak of one LM head's forward and backward over K positions (``path``: a, the
    model's logits through LogSoftmaxGather; b, the fused head recomputing in its backward; w, the
    fused head taking its gradients in the forward), on leaves h [K, d] and W [V, d] as the model
    holds them (``dtype``: a model.dtype)."""
    from torch.profiler import ProfilerActivity, profile

    from relign.models import fused_ce
    from relign.models.logprobs import logps_and_entropy

    prec = P.Precision.of(dtype)
    weights, compute = (torch.float32 if b == 4 else torch.bfloat16 for b in (prec.param, prec.compute))
    torch.manual_seed(0)
    h = torch.randn(K, d, dtype=compute, requires_grad=True)
    w = torch.randn(V, d, dtype=weights, requires_grad=True)
    idx = torch.randint(0, V, (K,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if path == "a":
            logits = h @ w.t()  # the LM head's output; the model's forward drops it once the log-probs are taken
            lp, _ = logps_and_entropy(logits, idx, chunk, with_entropy=entropy)  # RL's update logs it, detached
            del logits
            loss = lp.sum()
        elif path == "b":
            loss = fused_ce.linear_log_softmax_gather(h, w, idx, dtype=compute, chunk_tokens=chunk, with_entropy=entropy)[0].sum()
        else:
            loss = fused_ce.linear_weighted_sum(h, w, idx, torch.rand(K), dtype=compute, chunk_tokens=chunk)[0]
        loss.backward()
    return plan_check.allocation_peak(prof.profiler.kineto_results)


@pytest.mark.parametrize("K, chunk, dtype, entropy", [
    (256, 4096, "fp32", False), (256, 4096, "bf16", False), (1024, 256, "fp32", False), (1000, 300, "bf16", False),
    (256, 4096, "bf16", True), (1024, 256, "fp32", True)])
def test_the_loss_logits_peak_as_the_allocator_counts_it(K, chunk, dtype, entropy):
    """Stage a: the model's logits through LogSoftmaxGather (the shared-prefix layout, FSDP2, context parallel,
    other architectures)."""
    V = 2000
    peak = _head_peak("a", K, chunk, dtype, entropy=entropy, V=V)
    predicted = P.logits_bytes(K, V, prec=P.Precision.of(dtype), chunk=chunk, entropy=entropy)
    if chunk >= K:
        # one chunk, by hand, fp32 (b = 4, z the logits themselves): the backward's saved logits and their gradient
        # (4 + 4) and log p turned into the chunk's gradient in place (4): 12 K V; bf16 (b = 2): 2 + 2 and the chunk's
        # fp32 z and log p (4 + 4): 12 K V too. With the entropy in the forward: the bf16 logits (2) beside the chunk's
        # z, log p, p and p log p (4 each): 18 K V
        assert predicted == (18 if entropy else 12) * K * V
    # the allocator also sees the head's small inputs' gradients and the [K] outputs: under 1% here
    assert predicted <= peak <= predicted * 1.01


@pytest.mark.parametrize("path, K, chunk, dtype, entropy", [
    ("b", 256, 4096, "fp32", False), ("b", 256, 4096, "bf16-mixed", True), ("b", 1024, 256, "fp32", True),
    ("b", 1000, 300, "bf16-mixed", False), ("b", 1000, 300, "bf16", False), ("w", 256, 4096, "fp32", False),
    ("w", 256, 4096, "bf16-mixed", False), ("w", 1024, 256, "bf16", False), ("w", 600, 400, "fp32", False)])
def test_the_fused_head_peaks_as_the_allocator_counts_it(path, K, chunk, dtype, entropy):
    """Stage b: the LM head applied chunk by chunk (plain Qwen2/3, Llama, Mistral on one process), recomputing
    its chunks in the backward (DPO, the RL update, b) or taking its gradients in the forward (SFT, w)."""
    V, d = 2000, 8
    peak = _head_peak(path, K, chunk, dtype, entropy=entropy, V=V, d=d)
    s = P.Shape(d=d, layers=1, heads=1, kv_heads=1, head_dim=d, intermediate=d, vocab=V)
    predicted = P.fused_head_bytes(s, K, P.Precision.of(dtype), weighted=path == "w", chunk=chunk, entropy=entropy)
    if (path, K, dtype) == ("b", 256, "fp32"):
        # one chunk, by hand: the backward's fp32 weight gradient dW (4 V d) and dh (4 K d) beside the chunk's
        # recomputed logits and log p, turned into its gradient in place (4 + 4): 8 K V + 4 V d + 4 K d
        assert predicted == 8 * K * V + 4 * V * d + 4 * K * d == 4_168_192
    if (path, K, dtype) == ("w", 600, "fp32"):
        # two chunks, 400 and 200: the second's logits (4 x 200) are made while the first's (4 x 400) and its
        # gradient (4 x 400) are held: 4,000 V, + dW (4 V d) and h (4 K d)
        assert predicted == 4_000 * V + 4 * V * d + 4 * K * d == 8_083_200
    # the allocator also sees the [K] outputs and the gradients' last small casts: under 1% here
    assert predicted * 0.99 <= peak <= predicted * 1.01


def test_the_plan_fuses_the_heads_the_model_code_fuses():
    from relign.models import fused_ce
    from relign.recipes import plan_model

    assert [f"{t}ForCausalLM".lower() for t in plan_model.FUSED_TYPES] == [c.lower() for c in fused_ce.PLAIN_CAUSAL_LMS]
    assert plan_model.head_stage_a("qwen2", lora_head=False, ranks=1) == ""
    assert "LoRA" in plan_model.head_stage_a("llama", lora_head=True, ranks=1)
    assert "FSDP2" in plan_model.head_stage_a("qwen3", lora_head=False, ranks=2)
    assert "not a plain causal LM" in plan_model.head_stage_a("gemma2", lora_head=False, ranks=1)


def test_the_engine_cache_is_the_one_the_plan_counts(tiny_model_dir):
    from relign.models.loading import load_causal_lm, load_tokenizer
    from relign.rollout import hf_engine
    from relign.rollout.engine import SamplingParams
    from relign.rollout.vllm_engine import kv_bytes_per_token

    model, tok = load_causal_lm(str(tiny_model_dir)).eval(), load_tokenizer(str(tiny_model_dir))
    caches = []
    make = hf_engine.growing_cache

    def keep(config, capacity):
        caches.append(make(config, capacity))
        return caches[-1]

    hf_engine.growing_cache = keep
    try:
        engine = hf_engine.HFEngine(model, tok, max_batch_rows=8)
        prompts = [tok.encode("one two three four five"), tok.encode("six seven")]
        engine.generate(prompts, SamplingParams(n=3, max_new_tokens=4, temperature=1.0, ignore_eos=True), seeds=[1, 2])
    finally:
        hf_engine.growing_cache = make
    held = sum(t.numel() * t.element_size() for layer in caches[0].layers for t in (layer.k_buf, layer.v_buf))
    s = P.Shape.of(model.config)
    assert held == P.kv_cache_bytes(s, 6, max(map(len, prompts)) + 4, 4)  # 2 prompts x 3 samples
    assert P.kv_bytes_per_token(s, 2) == kv_bytes_per_token(model.config, torch.bfloat16)


def test_the_reference_free_losses_are_the_recipes():
    from relign.recipes import memory, preference

    assert set(memory.REFERENCE_FREE) == {k for k, row in preference.PAIR_LOSSES.items() if not row.reference}


def test_fitting_tokens_fits_and_twice_as_many_do_not():
    s, prec = P.Shape.of(QWEN05), P.Precision.of("bf16-mixed")
    free = 40 * D.GiB
    n = P.fitting_tokens(s, prec, free)
    used = P.activation_bytes(s, n, n, prec) + P.logits_bytes(n, s.vocab, prec=prec)
    assert 0.5 * free < used <= free  # the logits per position fall with more chunks: the estimate errs low
    assert P.activation_bytes(s, 2 * n, 2 * n, prec) + P.logits_bytes(2 * n, s.vocab, prec=prec) > free


# --------------------------------------------------------------------------- devices


def test_named_devices_and_the_gpu_checks_table():
    h100 = D.named_device("h100")
    assert (h100.memory, h100.available, h100.tflops, h100.tbs) == (81559 * 2**20, 81559 * 2**20 - D.GiB, 989.0, 3.35)
    assert D.named_device("RTX4090").name == "RTX 4090 24 GB" and D.named_device("a100").key == "a100-80"
    assert {g[0] for g in D.GPUS} >= {"h100", "h200", "a100-40", "a100-80", "l40s", "rtx4090"}
    assert D.gpu_peak("NVIDIA H100 80GB HBM3") == (989.0, 3.35) and D.gpu_peak("NVIDIA H100 PCIe") == (756.0, 2.0)
    assert D.gpu_peak("NVIDIA A100-SXM4-40GB")[1] == 1.555 and D.gpu_peak("NVIDIA GeForce RTX 4090")[0] == 165.2
    with pytest.raises(ConfigError, match="'plan.device'"):
        D.named_device("tpu-v5")
    from relign.models.flops import device_peak  # perf/mfu's and bench/gpu_checks.py's: the same table

    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA B200", "NVIDIA A100-SXM4-40GB",
                 "NVIDIA A100-SXM4-80GB", "NVIDIA L40S", "NVIDIA GeForce RTX 4090", "cpu"):
        assert device_peak(name) == D.gpu_peak(name), name


def test_the_local_cpu_is_its_available_ram(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n")
    monkeypatch.setitem(sys.modules, "psutil", None)  # without psutil: /proc/meminfo's MemAvailable
    assert D.available_ram(str(meminfo)) == 8_000_000 * 1024
    monkeypatch.setattr(D, "available_ram", lambda: 12345 * D.GiB)
    cpu = D.local_device("cpu")
    assert (cpu.key, cpu.available) == ("cpu", 12345 * D.GiB)


# --------------------------------------------------------------------------- the promise: predicted vs measured


@pytest.mark.slow(seconds=20)
def test_predicted_peak_within_15_percent_of_the_measured_one(tiny_model_dir, tmp_path):
    """The shipped SFT, DPO, PPO and GRPO presets at two micro-batch sizes, each run through the CLI in
    this process; measured: the peak of torch's CPU allocations from the run's start (bench/plan_check.py
    says how), predicted: the plan the run itself checked at its start. The smaller of the bench's two
    models (its vocabulary of 4,096 keeps the LM head's terms large beside the layers'); the bench runs
    both (docs/plan.md's table)."""
    rows = plan_check.run(tmp_path, list(plan_check.CASES), sizes=["A"], tokenizer=tiny_model_dir)
    assert len(rows) == 8
    bad = [r for r in rows if not 0.85 <= r["ratio"] <= 1.15]
    assert bad == [], plan_check.table(rows)


# --------------------------------------------------------------------------- the refusal, the command, --dry-run


@pytest.fixture(scope="module")
def qwen05(tmp_path_factory) -> Path:
    """A folder with Qwen2.5-0.5B's config.json only: nothing else to load."""
    out = tmp_path_factory.mktemp("qwen05")
    (out / "config.json").write_text(json.dumps({**QWEN05, "architectures": ["Qwen2ForCausalLM"]}))
    return out


def test_a_run_over_the_device_stops_in_one_line_before_any_weights_load(qwen05, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    # max_tokens_per_micro=0: micro_batch_size rows a pass (null would take the GPU's by-device token budget)
    args = ["sft", "sft_tiny", f"model.path={qwen05}", "data.max_length=2048", "micro_batch_size=16", "max_tokens_per_micro=0",
            f"run_dir={run}"]
    proc = run_cli(*args, "plan.device=rtx4090", check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    # the train stage, by hand: 494,032,768 fp32 weights and AdamW's 2 moments (12 B each: 5.52 GiB; one micro-batch a
    # step, so no gradient yet at the loss's backward); the fused LM head (stage b: SFT takes its gradients in the
    # forward) over 16 x 2,047 = 32,752 positions in chunks of 4,096: the fp32 weight gradient (4 x 151,936 x 896 B),
    # the saved h (4 x 32,752 x 896 B) and, while one chunk's logits are made, the previous chunk's logits and gradient
    # (4 B each) beside the next chunk's logits and log p (4 + 4): 151,936 x 12 x 4,096 B, in all 7.57 GiB; and the
    # activations of 32,768 tokens: 4 (4 x 896 + 2 x 896 + 2 x 128 + 2 x 4,864 + 896 packed) + 4 x 14 + 8 = 65,088 B
    # per token and layer, x 24 x 32,768 = 47.7 GiB, and 0.2 GiB around the head: 61.0 GiB
    assert lines == ["relign sft: error: plan: the train stage needs 61.0 GiB per rank, more than the 23.0 GiB available on "
                     "RTX 4090 24 GB; lower micro_batch_size to 3 or less (now 16), or set plan.check=false to start anyway"]
    assert not run.exists()  # it stopped before the run directory, the tokenizer and the weights (the folder has none)
    # plan.check=false starts anyway: past the plan, the run loads its tokenizer and reads its data (missing here)
    proc = run_cli(*args, "plan.device=rtx4090", "plan.check=false", f"model.tokenizer={tiny_model_dir}",
                   f"data.path={tmp_path / 'missing.jsonl'}", check=False)
    assert proc.returncode == 2 and "plan:" not in proc.stderr and "missing.jsonl" in proc.stderr


def test_relign_plan_prints_the_worked_example_of_the_docs(qwen05):
    """docs/plan.md's worked example (Qwen2.5-0.5B GRPO on one H100) is this command's output."""
    args = ["plan", "rl", "grpo", f"model.path={qwen05}", "model.dtype=bf16-mixed", "rollout.n=8",
            "rollout.max_new_tokens=512", "prompts_per_step=16", "--device", "h100"]
    out = run_cli(*args).stdout
    docs = (REPO / "docs" / "plan.md").read_text()
    block = docs.split("```text\n", 1)[1].split("```", 1)[0]
    ours = out.replace(str(qwen05), "Qwen/Qwen2.5-0.5B-Instruct")
    assert ours == block
    # by hand: 494,032,768 weights x 4 B = 1.84 GiB; AdamW 3.68 GiB; the update's fused LM head (Qwen2, one rank,
    # packed) over 4 groups x 8 x 512 = 16,384 positions, at its forward's peak: the bf16 cast of the head's weight
    # (2 x 151,936 x 896 B) and, for one chunk of 4,096, its bf16 logits, their fp32 z, and the logged entropy's log p,
    # p and p log p (2 + 4 + 12 B each): 272,269,312 + 18 x 4,096 x 151,936 B = 10.69 GiB; the KV cache of 128 rows x
    # 1,024 columns x 24 layers x 2 x 2 heads x 64 x 2 B = 1.50 GiB
    rows = {line[:20].strip(): line[20:].split() for line in out.splitlines()[6:21]}
    assert rows["weights"] == ["1.84"] * 4 and rows["AdamW state"] == ["3.68"] * 4 and "logits" not in rows
    assert rows["LM head (fused)"] == ["-", "-", "10.69", "-"] and rows["engine KV cache"] == ["1.50", "-", "-", "-"]
    assert out.count("peak: 37.2 GiB in update") == 1
    proc = run_cli(*args[:-1], "rtx4090", "prompts_per_step=64", "max_tokens_per_micro=65536", check=False)
    assert proc.returncode == 1 and "does not fit: lower micro_batch_size to " in proc.stdout


def test_a_dpo_token_budget_sizes_the_train_stage(qwen05):
    """DPO's packed pairs under max_tokens_per_micro (pairs.micro_batches): the worst-case pair is 2 x
    data.max_length tokens, so a budget of 8,192 at max_length 1,024 runs 4 pairs a pass, 8 passes for a
    rank's 32; the plan names the budget as the key to lower."""
    args = ["plan", "dpo", "dpo", f"model.path={qwen05}", "model.dtype=bf16-mixed", "data.max_length=1024",
            "batch_size=32", "micro_batch_size=1", "--device", "h100"]
    out = run_cli(*args, "max_tokens_per_micro=8192").stdout
    assert "4 pairs of up to 2,048 tokens = 8,192 tokens (packed; budget 8,192), logits at 8,184 positions; " \
           "8 micro-batches per step" in out
    # the whole batch in one pass, 32 x 2,048 tokens, fits too; micro_batch_size no longer counts, so it is not searched
    assert "fits: max_tokens_per_micro: any value fits (65,536 is the rank's whole batch in one pass; now 8,192)" in out
    assert "fits: micro_batch_size" not in out
    # micro_batch_size=4 without a budget is the same train stage
    same = run_cli(*args[:-3], "micro_batch_size=4", "max_tokens_per_micro=0", "--device", "h100").stdout
    row = [line for line in out.splitlines() if line.startswith("total")]
    assert row == [line for line in same.splitlines() if line.startswith("total")]


def test_dry_run_prints_the_plan_beside_its_summary(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    out = run_cli("sft", "sft_tiny", f"model.path={tiny_model_dir}", f"run_dir={run}", "--dry-run").stdout
    summary, table = out.split("relign plan sft on this CPU (available RAM): ", 1)
    assert "  run dir    " in summary and "GiB per rank" in table and "\npeak: " in table
    assert table.rstrip().endswith("dry run: nothing trained, no checkpoint written; no run directory kept")
    assert not run.exists()
