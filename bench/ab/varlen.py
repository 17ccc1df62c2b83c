"""GPU check of P1 (specs/gpu_speed.md): varlen attention from the collator's layout, old vs new.

    run(smoke, device, budget_s) -> dict     # a section of bench/gpu_ab.py

On a GPU (``smoke=False``): the sections' random model of Qwen2.5-0.5B's shape (``bench/gpu_checks.py``'s
``QWEN05``: 14 query / 2 key-value heads, head dim 64; ``bench/ab/common.py``), fp32 weights under bf16-mixed autocast
(``model.dtype=bf16-mixed``), SDPA; on the same inputs:

  packed      forward + backward of 8 sequences of 256 .. 2,048 tokens in one packed row
              (``token_logps`` with the loss mask, the LM head on the targets only):
              old = position ids only (today's path: SDPA per sequence, sequences read from the
              device in every layer); new = the collator's ``Packing`` (one ``varlen_attn`` per
              layer). ms per pass (median of the timed passes, ``torch.cuda.synchronize``),
              peak GiB, |Δ logp| max / mean over the targets (the spec's bar: 2e-2 / 2e-3).
  sync        the new forward, and forward + backward, under ``torch.cuda.set_sync_debug_mode("error")``:
              "silent", or the error (the first op that synchronizes); the old forward too, for contrast.
  gqa         the new pass with the 2 K/V heads passed to ``varlen_attn`` as they are vs
              repeated to 14 (``varlen.REPEAT_KV``): ms and max |Δ logp|.
  groups      a GRPO group (prompt 256, G = 8 responses of 128 .. 1,024 tokens): the responses
              continuing the prompt in one packed row (new) vs the padded shared-prefix path
              (the prompt's KV cache, ``shared_prefix_token_logps``): ms, peak, |Δ logp|.
  compile     a decoder layer through ``torch.compile(backend="eager", fullgraph=True)``: one graph?
  alignment   ``varlen_attn`` itself against the dense masked reference (fp32) on sequences
              with fewer queries than keys (a continuation's prefix): max |Δ| bottom-right
              (what the layout needs) and top-left (what it must not be).

``smoke=True`` runs the same code on tiny shapes on the CPU in a few seconds: the kernel there is
``varlen.reference_varlen_attn`` behind the same wrapper, so a Python error cannot wait for the
device run. Every part checks ``budget_s`` and records what it skipped.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.gpu_checks import QWEN05, SMOKE  # noqa: E402  (the shapes; bench/ab/common.py builds the model)
from relign.data.collate import keep_index, pack_rows  # noqa: E402
from relign.models import varlen  # noqa: E402
from relign.models.logprobs import shared_prefix_token_logps, token_logps  # noqa: E402
from relign.models.precision import enable_autocast  # noqa: E402


def _model(smoke: bool, device: str):
    """The sections' shared random model (``bench/ab/common.py``: built once per process), fp32."""
    from transformers import AutoModelForCausalLM

    from bench.ab import common

    path, _ = common.model_dir(smoke)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(device)
    if torch.device(device).type == "cuda":
        enable_autocast(model)  # model.dtype=bf16-mixed
    return model.train()


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.device(device).type == "cuda" else None


def _timed(fn, device: str, passes: int) -> tuple[torch.Tensor, float, float | None]:
    """(the first pass's log-probs, median ms of ``passes`` passes after one warm-up, peak GiB)."""
    out = fn()
    _sync(device)
    _peak_reset(device)
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return out, statistics.median(times), _peak(device)


def _diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs()[mask.bool()]
    return {"max": float(d.max()), "mean": float(d.mean())}


def _packed_inputs(lens: list[int], vocab: int, device: str, max_length: int, prompt: int):
    """8 sequences in one row: ids, position ids, the loss mask (after ``prompt`` tokens), keep, layout."""
    g = torch.Generator().manual_seed(1)
    _, col, packing = pack_rows(lens, max_length=max_length)
    ids = torch.randint(1, vocab, (1, sum(lens)), generator=g)
    target = (col >= prompt).float()
    target[torch.tensor([0, *lens]).cumsum(0)[:-1]] = 0  # a packed sequence's first token is never a target
    keep = keep_index(target)
    return (ids.to(device), col[None].to(device), target[None].to(device), keep.to(device), packing.to(device))


def _pass(model, ids, pos, target, **kw):
    """One forward + backward of the summed target log-probs; returns the log-probs (detached)."""
    model.zero_grad(set_to_none=True)
    lp, _ = token_logps(model, ids, position_ids=pos, target_mask=target, **kw)
    (lp * target).sum().backward()
    return lp.detach()


def _under_sync_errors(fn, device: str) -> str:
    if torch.device(device).type != "cuda":
        return "skipped (cpu)"
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "silent"
    except RuntimeError as e:  # the op that synchronized: what to fix next
        return f"error: {str(e).splitlines()[0][:300]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def _alignment(device: str, smoke: bool) -> dict:
    """varlen_attn vs the dense reference on sequences with fewer queries than keys."""
    g = torch.Generator().manual_seed(3)
    H, Hkv, D = (4, 2, 16) if smoke else (14, 2, 64)
    nq, nk = ([3, 5, 4], [3, 9, 12]) if smoke else ([64, 200, 128], [64, 456, 1152])  # one plain, two with a prefix
    cu_q = torch.tensor([0, *torch.tensor(nq).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(nk).cumsum(0).tolist()], dtype=torch.int32, device=device)
    half = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    q, k, v = (torch.randn(n, h, D, generator=g).to(device, half) for n, h in ((sum(nq), H), (sum(nk), Hkv), (sum(nk), Hkv)))
    got = varlen._flash(q, k, v, cu_q, cu_k, max(nq), max(nk)).float()
    right = varlen.reference_varlen_attn(q.float(), k.float(), v.float(), cu_q, cu_k, max(nq), max(nk))
    # top-left: the keys of each sequence cut to its query count's causal square, the prefix unseen
    left_cu_k = cu_k[:-1] + 0
    idx = torch.cat([torch.arange(int(a), int(a) + n, device=device) for a, n in zip(left_cu_k.tolist(), nq)])
    left = varlen.reference_varlen_attn(q.float(), k.float()[idx], v.float()[idx], cu_q, cu_q, max(nq), max(nq))
    return {"bottom_right_max_abs": float((got - right).abs().max()), "top_left_max_abs": float((got - left).abs().max()),
            "heads": [H, Hkv], "q_lens": nq, "k_lens": nk}


def _compile_layer(model, ids, pos, packing, device: str) -> dict:
    """``torch.compile(layer, backend="eager", fullgraph=True)`` on the packed row: one graph, and
    its output against the eager layer's (max |Δ|)."""
    from relign.models.precision import autocast_of

    layer = model.model.layers[0]
    torch._dynamo.reset()
    try:
        with torch.no_grad(), autocast_of(model):
            h = model.model.embed_tokens(ids)
            kw = dict(position_embeddings=model.model.rotary_emb(h, pos), position_ids=pos,
                      **varlen.forward_kwargs(model, packing))
            got = torch.compile(layer, backend="eager", fullgraph=True)(h, **kw)
            want = layer(h, **kw)
        got, want = (x[0] if isinstance(x, tuple) else x for x in (got, want))
        return {"fullgraph": "ok", "max_abs": float((got.float() - want.float()).abs().max())}
    except Exception as e:  # noqa: BLE001 - the device run records what broke the graph, and goes on
        return {"fullgraph": f"error: {type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    finally:
        torch._dynamo.reset()


def _shim_flash():
    """On the CPU (smoke): ``varlen._flash`` with the dense reference in place of torch's kernel,
    taking the same keywords, so the wrapper's code runs too."""
    def fn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=None, is_causal=None, enable_gqa=False):
        return varlen.reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)

    varlen._FLASH.update(fn=fn, causal={"window_size": (-1, 0)}, gqa=True)
    varlen.CPU_KERNEL = varlen._flash


def run(smoke: bool, device: str, budget_s: float) -> dict:
    start = time.perf_counter()
    left = lambda: budget_s - (time.perf_counter() - start)  # noqa: E731
    cuda = torch.device(device).type == "cuda"
    saved = (dict(varlen._FLASH), varlen.CPU_KERNEL, varlen.REPEAT_KV)
    out: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu", "skipped": []}
    try:
        if cuda:
            out["varlen_attn_loaded"] = varlen.load_flash()
            if not out["varlen_attn_loaded"]:
                out["error"] = "torch.nn.attention.varlen is missing: torch < 2.10"
                return out
            out["varlen_attn_keywords"] = {"causal": varlen._FLASH["causal"], "enable_gqa": varlen._FLASH["gqa"]}
        else:
            _shim_flash()
        shape = SMOKE if smoke else QWEN05
        lens = [8, 16, 24, 32, 40, 48, 56, 64] if smoke else [256 * i for i in range(1, 9)]  # 256 .. 2,048
        passes = 1 if smoke else 3
        max_length = 64 if smoke else 2048
        model = _model(smoke, device)
        ids, pos, target, keep, packing = _packed_inputs(lens, shape["vocab_size"], device, max_length, prompt=lens[0] // 4)
        varlen.enable(model)
        kw_new = dict(keep=keep, **varlen.forward_kwargs(model, packing))

        # ---- packed: old (position ids) vs new (the layout)
        old_lp, old_ms, old_peak = _timed(lambda: _pass(model, ids, pos, target), device, passes)
        new_lp, new_ms, new_peak = _timed(lambda: _pass(model, ids, pos, target, **kw_new), device, passes)
        d = _diff(old_lp, new_lp, target)
        out["packed"] = {"tokens": sum(lens), "lens": lens, "old_ms": old_ms, "new_ms": new_ms, "old_peak_gib": old_peak,
                         "new_peak_gib": new_peak, "dlogp_max": d["max"], "dlogp_mean": d["mean"],
                         "within_spec": d["max"] <= 2e-2 and d["mean"] <= 2e-3}

        # ---- sync: the new forward reads nothing back (the backward's kernels are torch's); the old one does
        def forward(**kw):
            return token_logps(model, ids, position_ids=pos, target_mask=target, **kw)[0]

        out["sync"] = {"new_forward": _under_sync_errors(lambda: forward(**kw_new), device),
                       "new_forward_backward": _under_sync_errors(lambda: _pass(model, ids, pos, target, **kw_new), device),
                       "old_forward": _under_sync_errors(lambda: forward(), device)}

        # ---- compile: a decoder layer traces to one graph through varlen_attn (backend eager: no inductor time)
        if left() > 0:
            out["compile"] = _compile_layer(model, ids, pos, packing, device)
        else:
            out["skipped"].append("compile")

        # ---- gqa: K/V heads as they are vs repeated
        if left() > 0:
            varlen.REPEAT_KV = True
            rep_lp, rep_ms, rep_peak = _timed(lambda: _pass(model, ids, pos, target, **kw_new), device, passes)
            varlen.REPEAT_KV = False
            out["gqa"] = {"direct_ms": new_ms, "repeated_ms": rep_ms, "repeated_peak_gib": rep_peak,
                          "dlogp_max": _diff(new_lp, rep_lp, target)["max"]}
        else:
            out["skipped"].append("gqa")

        # ---- groups: continuations in a packed row vs the padded shared-prefix path
        if left() > 0:
            out["groups"] = _groups(model, shape, device, smoke, passes)
        else:
            out["skipped"].append("groups")

        # ---- alignment of varlen_attn for q < k
        if left() > 0:
            out["alignment"] = _alignment(device, smoke)
        else:
            out["skipped"].append("alignment")
        out["seconds"] = time.perf_counter() - start
        return out
    finally:
        varlen._FLASH.clear()
        varlen._FLASH.update(saved[0])
        varlen.CPU_KERNEL, varlen.REPEAT_KV = saved[1], saved[2]


def _groups(model, shape: dict, device: str, smoke: bool, passes: int) -> dict:
    P, resp = (6, [4, 6, 8, 10, 3, 5, 7, 9]) if smoke else (256, [128 * i for i in range(1, 9)])
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, shape["vocab_size"], (P,), generator=g)
    rows = [torch.cat([prompt, torch.randint(1, shape["vocab_size"], (n,), generator=g)]) for n in resp]
    G, L = len(rows), max(len(r) for r in rows)
    # padded rows for the shared-prefix path
    ids = torch.zeros(G, L, dtype=torch.long)
    att = torch.zeros(G, L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], att[i, : len(r)] = r, 1
    resp_mask = att.clone().float()
    resp_mask[:, :P] = 0
    plens = torch.full((G,), P)
    ids, att, resp_mask, plens = (x.to(device) for x in (ids, att, resp_mask, plens))

    def shared():
        model.zero_grad(set_to_none=True)
        lp, _ = shared_prefix_token_logps(model, ids, att, plens, G)
        (lp * resp_mask).sum().backward()
        return lp.detach()

    # the same rows as one packed row: each response after the first continues the prompt
    row, col, packing = pack_rows([len(r) for r in rows], [0] + [P - 1] * (G - 1), max_length=L)
    p_ids = torch.cat([r[s:] for r, s in zip(rows, [0] + [P - 1] * (G - 1))])[None].to(device)
    target = (col >= P).float()
    keep = keep_index(target)
    p_target, p_pos = target[None].to(device), col[None].to(device)
    kw = dict(keep=keep.to(device), **varlen.forward_kwargs(model, packing.to(device)))
    where = (row.to(device), col.to(device))

    def packed():
        lp = _pass(model, p_ids, p_pos, p_target, **kw)
        return torch.zeros(G, L, device=device).index_put(where, lp[0] * p_target[0])

    old_lp, old_ms, old_peak = _timed(shared, device, passes)
    new_lp, new_ms, new_peak = _timed(packed, device, passes)
    d = _diff(old_lp, new_lp, resp_mask)
    return {"prompt": P, "responses": resp, "packed_tokens": int(p_ids.shape[1]), "padded_tokens": G * (L - P) + P,
            "shared_prefix_ms": old_ms, "continuations_ms": new_ms, "shared_prefix_peak_gib": old_peak,
            "continuations_peak_gib": new_peak, "dlogp_max": d["max"], "dlogp_mean": d["mean"]}


if __name__ == "__main__":
    import json

    print(json.dumps(run(smoke="--smoke" in sys.argv, device="cuda" if torch.cuda.is_available() else "cpu",
                         budget_s=90.0), indent=1))
