"""``bench/gpu_ab.py --only decode``: the HF engine's decode, today's eager loop against the static-shape
step eager, under a CUDA graph, compiled under a graph, under ``torch.compile(mode="reduce-overhead")``,
and transformers' own ``StaticCache`` with a compiled forward (``llm_optims``'s pattern), P5 of
``specs/gpu_speed.md``.

On a GPU: the Qwen2.5-0.5B shape of ``bench/gpu_checks.py`` (random init, bf16 weights;
``bench/ab/common.py``'s model, built once for every section), prompts of 128 random token ids
(no tokenizer: ``IdsTokenizer``), exactly 512 new tokens (``ignore_eos``), greedy,
at 64, 128 and 256 rows. Per case: tokens/s of a steady call (prefill included, as gpu_checks'
decode row), the first call's extra seconds (the capture or the compile) apart, the engine's own
``perf/decode_bw_frac`` and this script's fraction of the roofline bound, max(bytes / bandwidth,
FLOPs / peak) per step at the mean context, the allocator's peak, and the greedy tokens against
today's loop (rows identical, and the share of tokens before a row's first difference: bf16
rounds the full-width attention and the products of another batch layout differently, so a random
model's near-tied logits can part). The cases run most useful first, each only when the budget
still holds its estimate, so a short cap keeps the graph at 64 rows and today's loop.

At ``smoke`` (the suite, a CPU): ``gpu_checks.SMOKE``'s shape in fp32, 6 rows (a bucket of 8) x 12 tokens,
the eager cases only (graphs need CUDA; compiling on a CPU takes minutes), tokens checked equal.

The decision the issue asks for (relign's step or the library's, within 10%) waits for these figures.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
import time

import torch

from bench import gpu_checks
from bench.ab.common import model_dir

PROMPT_LEN, NEW_TOKENS, ROWS = 128, 512, (64, 128, 256)
SMOKE_PROMPT_LEN, SMOKE_NEW_TOKENS, SMOKE_ROWS = 6, 12, (6,)  # 6 rows: a bucket of 8, 2 of them fillers
PARTIAL: dict = {}  # the results so far, which bench/gpu_ab.py keeps if the section runs past its cap


class IdsTokenizer:
    """What the HF engine asks of a tokenizer when prompts are token ids: the special ids and a decode
    (the section's model is built without a tokenizer: bench/ab/common.py)."""

    def __init__(self, config):
        self.eos_token_id, self.pad_token_id = config.eos_token_id, config.pad_token_id

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.device(device).type == "cuda" else None


def reset_peak(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def random_prompts(rows: int, length: int, seed: int) -> list[list[int]]:
    """Token ids among the tiny tokenizer's 4,096 (what gpu_checks' prompts use), past its special ids."""
    rng = random.Random(seed)
    return [[rng.randrange(8, 4096) for _ in range(length)] for _ in range(rows)]


def plans(device: str) -> dict:
    """The engine's decode plans by case name (``fast_decode.DecodePlan``)."""
    from relign.rollout.fast_decode import DecodePlan

    cuda = DecodePlan.for_device("cuda")
    out = {"today": DecodePlan(), "static-eager": DecodePlan(static=True, read_every=16, row_buckets=cuda.row_buckets,
                                                              length_bucket=cuda.length_bucket)}
    if torch.device(device).type == "cuda":
        out.update({"graph": cuda, "compiled-graph": dataclasses.replace(cuda, capture="compile"),
                    "reduce-overhead": dataclasses.replace(cuda, capture="reduce-overhead")})
    return out


def roofline_fraction(tokens_per_s: float, rows: int, context: float, n_params: int, shape: dict, dtype_bytes: int,
                      peaks) -> float | None:
    """tokens/s over the roofline's rows / max(bytes / BW, FLOPs / peak) at the mean ``context``."""
    from relign.rollout.fast_decode import roofline_seconds

    if peaks is None:
        return None
    L, Hkv, H = shape["num_hidden_layers"], shape["num_key_value_heads"], shape["num_attention_heads"]
    D = shape["hidden_size"] // H
    step = roofline_seconds(rows=rows, context=int(rows * context), weight_bytes=n_params * dtype_bytes,
                            weight_params=n_params, kv_bytes_per_token=2 * L * Hkv * D * dtype_bytes,
                            attn_flops_per_token=4 * H * D * L, flops_per_s=peaks[0], bytes_per_s=peaks[1])
    return tokens_per_s / (rows / step)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    first = [next((i for i, (x, y) in enumerate(zip(r, q)) if x != y), len(r)) for r, q in zip(a, b)]
    return {"rows_identical": sum(x == y for x, y in zip(a, b)) / len(a),
            "tokens_before_first_difference": sum(first) / max(1, sum(map(len, a)))}


def hf_static_generate(model, prompts: list[list[int]], T: int, *, pad: int, compiled: bool) -> list[list[int]]:
    """Greedy decoding with transformers' ``StaticCache`` and a compiled one-token forward in a loop of
    our own (``docs/source/en/llm_optims.md``): left-padded rows, a [R, L + T] padding mask updated on
    the device, the tokens kept on the device until the end."""
    from transformers import StaticCache

    dev = next(model.parameters()).device
    R, L = len(prompts), max(len(p) for p in prompts)
    cap = L + T
    kw = {"config": model.config, "max_cache_len": cap}
    if "max_batch_size" in inspect.signature(StaticCache.__init__).parameters:  # transformers before lazy cache layers
        kw.update(max_batch_size=R, device=dev, dtype=next(model.parameters()).dtype)
    cache = StaticCache(**kw)
    ids = torch.full((R, L), pad, dtype=torch.long, device=dev)
    attn = torch.zeros((R, cap), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p, device=dev)
        attn[i, L - len(p): L] = 1
    pos = (attn[:, :L].cumsum(-1) - 1).clamp_min(0)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True,
                       cache_position=torch.arange(L, device=dev)).logits[:, -1]
        tok = logits.argmax(-1)
        out = torch.empty((R, T), dtype=torch.long, device=dev)
        out[:, 0] = tok
        pos, cp = pos[:, -1] + 1, torch.tensor([L], device=dev)

        def one(tok, pos, cp, attn):
            attn.index_fill_(1, cp, 1)
            logits = model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos[:, None], past_key_values=cache,
                           cache_position=cp, use_cache=True).logits[:, -1]
            return logits.argmax(-1)

        step = torch.compile(one, mode="reduce-overhead", fullgraph=True) if compiled else one
        for s in range(1, T):
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            tok = step(tok, pos, cp, attn)
            out[:, s] = tok  # copied out: the graph's output buffer is reused by the next replay
            pos, cp = pos + 1, cp + 1
        return out.tolist()


def run(smoke: bool, device: str, budget_s: float) -> dict:
    from relign.models.loading import load_causal_lm
    from relign.rollout.engine import SamplingParams
    from relign.rollout.fast_decode import device_peaks
    from relign.rollout.hf_engine import HFEngine

    t_end = time.monotonic() + 0.92 * budget_s
    path, n_params = model_dir(smoke)
    shape = gpu_checks.SMOKE if smoke else gpu_checks.QWEN05
    cuda = torch.device(device).type == "cuda"
    dtype = "bf16" if cuda else "fp32"
    model = load_causal_lm(str(path), dtype=dtype, device=device).eval()
    tok = IdsTokenizer(model.config)
    plen, T, rows_list = (SMOKE_PROMPT_LEN, SMOKE_NEW_TOKENS, SMOKE_ROWS) if smoke else (PROMPT_LEN, NEW_TOKENS, ROWS)
    prompts = random_prompts(max(rows_list), plen, seed=3)
    peaks = device_peaks(torch.cuda.get_device_name()) if cuda else None
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=T, ignore_eos=True)
    elt = 2 if dtype == "bf16" else 4
    PARTIAL.clear()
    res = PARTIAL  # filled as the cases finish
    res.update(setup={"shape": "SMOKE" if smoke else "Qwen2.5-0.5B", "params": n_params, "dtype": dtype, "prompt_len": plen,
                      "new_tokens": T, "greedy": True, "prefill_included": True, "torch": torch.__version__,
                      "device": torch.cuda.get_device_name() if cuda else "cpu", "peaks": peaks},
               cases=[])
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    plan_of = plans(device)
    # (case, rows, estimated seconds on an H200): the most useful first
    todo = [("graph", rows_list[0], 8), ("today", rows_list[0], 25), *[("graph", r, 10) for r in rows_list[1:]],
            ("compiled-graph", rows_list[0], 90), ("hf-static", rows_list[0], 80), ("static-eager", rows_list[0], 20),
            ("reduce-overhead", rows_list[0], 90)]
    if smoke:
        todo = [("today", r, 0) for r in rows_list] + [("static-eager", r, 0) for r in rows_list] + [("hf-static", rows_list[0], 0)]
    for case, R, estimate in todo:
        if case not in plan_of and case != "hf-static":
            continue
        row = {"case": case, "rows": R}
        if time.monotonic() + estimate > t_end:
            res["cases"].append({**row, "skipped": "budget"})
            continue
        batch = prompts[:R]
        try:
            reset_peak(device)
            if case == "hf-static":
                def call():
                    return hf_static_generate(model, batch, T, pad=tok.pad_token_id, compiled=cuda)
            else:
                engine = HFEngine(model, tok, max_batch_rows=R, seed=0, decode=plan_of[case])

                def call():
                    return [g[0].token_ids for g in engine.generate(batch, params)]
            sync(device)
            t0 = time.perf_counter()
            ids = call()
            sync(device)
            first = time.perf_counter() - t0
            if case != "hf-static":
                engine.perf_metrics()  # the first call's figures (capture included) dropped
            steady = []
            for _ in range(1 if smoke or case == "today" else 2):
                sync(device)
                t0 = time.perf_counter()
                ids = call()
                sync(device)
                steady.append(time.perf_counter() - t0)
            tps = R * T / min(steady)
            row.update(tokens_per_s=tps, steady_s=steady, first_call_s=first, capture_s=first - min(steady),
                       peak_gib=peak_gib(device),
                       roofline_fraction=roofline_fraction(tps, R, plen + T / 2, n_params, shape, elt, peaks))
            if case != "hf-static":
                row.update(engine.perf_metrics())
                engine.close()
            outputs[(case, R)] = ids
            if smoke:
                assert all(len(r) == T for r in ids), case
        except Exception as e:  # one case's failure is recorded; the others still run
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        res["cases"].append(row)
    for row in res["cases"]:  # greedy tokens against today's loop at the same rows
        ref = outputs.get(("today", row["rows"]))
        if ref is not None and (row["case"], row["rows"]) in outputs and row["case"] != "today":
            row["greedy_vs_today"] = agreement(outputs[(row["case"], row["rows"])], ref)
    if smoke:  # eager static shapes are today's tokens, exactly (the CPU suite's promise)
        for row in res["cases"]:
            assert "error" not in row, row
            if row["case"] == "static-eager":
                assert row["greedy_vs_today"]["rows_identical"] == 1.0, row
    return dict(res)
