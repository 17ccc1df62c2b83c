"""``bench/gpu_ab.py --only lora``: a LoRA policy's rollout stage against the full model's (P6 of
``specs/gpu_speed.md``; the issue's goal: at most 1.2x).

The rollout of the GRPO bench of ``bench/gpu_checks.py``: 16 prompts x G = 8 = 128 rows, exactly 512
new tokens, temperature 1, one seed per prompt, on the Qwen2.5-0.5B shape in bf16, through the HF
engine with the device's default decode plan (a CUDA graph of the static step). The same model
with a LoRA adapter (r 16, alpha 32, every linear layer but the head, relign's ``apply_lora``; B
drawn at random so that the adapter changes the tokens), wrapped by peft as the RL recipe wraps
it: the engine decodes from merged copies, base + peft's ``get_delta_weight``, rewritten at every
call. Today's LoRA rollout (``fast_decode=False``: peft's forward with its unmerged adapters, the
path of BENCHMARKS.md's 22.9 s) runs a shorter call, its tokens/s reported. Checked: the base
weights bitwise unchanged by the calls, and the engine's log-probs of a few rows against the peft
model's own forward (``token_logps``; bf16, so loosely: the max is reported).

At ``smoke`` (the suite, a CPU): the SMOKE shape in fp32, 2 prompts x G = 2 x 8 tokens, eager.
"""

from __future__ import annotations

import time

import torch

from bench.ab.common import model_dir
from bench.ab.decode import IdsTokenizer, peak_gib, random_prompts, reset_peak, sync

PARTIAL: dict = {}  # the results so far, which bench/gpu_ab.py keeps if the section runs past its cap


def run(smoke: bool, device: str, budget_s: float) -> dict:
    from relign.models.loading import apply_lora, load_causal_lm
    from relign.models.logprobs import right_pad, token_logps
    from relign.rollout.engine import SamplingParams, derive_seed
    from relign.rollout.hf_engine import HFEngine

    t_end = time.monotonic() + 0.92 * budget_s
    path, _ = model_dir(smoke)
    cuda = torch.device(device).type == "cuda"
    dtype = "bf16" if cuda else "fp32"
    prompts_n, G, T, plen, old_T = (2, 2, 8, 6, 8) if smoke else (16, 8, 512, 128, 64)
    prompts = random_prompts(prompts_n, plen, seed=4)
    seeds = [derive_seed(7, i) for i in range(prompts_n)]
    params = SamplingParams(n=G, temperature=1.0, max_new_tokens=T, ignore_eos=True)
    PARTIAL.clear()
    res = PARTIAL  # filled as the parts finish
    res["setup"] = {"prompts": prompts_n, "group": G, "new_tokens": T, "prompt_len": plen, "dtype": dtype,
                    "lora": "r 16, alpha 32, all-linear", "device": torch.cuda.get_device_name() if cuda else "cpu"}

    def timed(engine, p=params, repeats=2) -> tuple[float, float, list]:
        sync(device)
        t0 = time.perf_counter()
        out = engine.generate(prompts, p, seeds=seeds)
        sync(device)
        first = time.perf_counter() - t0
        best = first
        for _ in range(0 if smoke else repeats):
            sync(device)
            t0 = time.perf_counter()
            out = engine.generate(prompts, p, seeds=seeds)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        return first, best, out

    full = load_causal_lm(str(path), dtype=dtype, device=device).eval()
    tok = IdsTokenizer(full.config)
    reset_peak(device)
    first, best, _ = timed(HFEngine(full, tok, max_batch_rows=prompts_n * G, seed=0))
    res["full"] = {"seconds": best, "first_call_s": first, "tokens_per_s": prompts_n * G * T / best, "peak_gib": peak_gib(device)}

    lora = apply_lora(full, r=16, alpha=32, dropout=0.0, target_modules=["all-linear"]).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
    base = {n: p.detach().clone() for n, p in lora.named_parameters() if "lora_" not in n}
    engine = HFEngine(lora, tok, max_batch_rows=prompts_n * G, seed=0)
    reset_peak(device)
    first, best, out = timed(engine)
    res["lora_merged"] = {"seconds": best, "first_call_s": first, "tokens_per_s": prompts_n * G * T / best,
                          "peak_gib": peak_gib(device), "decode_step": "fast" if engine.fast is not None else "peft forward"}
    res["lora_over_full"] = best / res["full"]["seconds"]
    res["base_weights_unchanged"] = all(torch.equal(p, base[n]) for n, p in lora.named_parameters() if "lora_" not in n)
    # the engine's log-probs of four rows against the peft model's forward over the same tokens
    rows = [(prompts[i // G], out[i // G][i % G]) for i in range(0, min(4, prompts_n * G))]
    ids, mask = right_pad([p + c.token_ids for p, c in rows], tok.pad_token_id, device)
    with torch.inference_mode():
        ref, _ = token_logps(lora, ids, attention_mask=mask)
    res["logp_max_abs_diff_vs_peft"] = max(
        abs(a - b) for (p, c), r in zip(rows, ref) for a, b in zip(c.logps, r[len(p): len(p) + len(c.token_ids)].tolist()))

    if time.monotonic() + (0 if smoke else 20) < t_end:  # today's LoRA rollout: peft's forward, a shorter call
        old = HFEngine(lora, tok, max_batch_rows=prompts_n * G, seed=0, fast_decode=False)
        p_old = SamplingParams(n=G, temperature=1.0, max_new_tokens=old_T, ignore_eos=True)
        first, best, _ = timed(old, p_old, repeats=0 if smoke else 1)
        res["lora_today"] = {"new_tokens": old_T, "seconds": best, "tokens_per_s": prompts_n * G * old_T / best}
        res["lora_merged_over_today_tokens_per_s"] = res["lora_merged"]["tokens_per_s"] / res["lora_today"]["tokens_per_s"]
    else:
        res["lora_today"] = {"skipped": "budget"}
    if smoke:
        assert res["base_weights_unchanged"] and res["lora_merged"]["decode_step"] == "fast"
        assert res["logp_max_abs_diff_vs_peft"] < 1e-4, res
    return dict(res)
