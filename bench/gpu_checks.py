"""The GPU checks of issues 15 and 38, in one command, through relign's public API only.

    python bench/gpu_checks.py                 # on a GPU: Qwen2.5-0.5B-shaped random model, bf16
    python bench/gpu_checks.py --smoke         # anywhere (CPU): a tiny shape, a few steps; what the suite runs

What it measures, each from relign's own metrics (``RunResult.history``: ``perf/*`` and the
stage timers ``time/*_s``), on a random-init model of Qwen2.5-0.5B's shape (hidden 896, 24
layers, 14 query / 2 key-value heads, MLP 4864, tied 151,936-token vocabulary; 494M parameters)
with the tiny local tokenizer (its ids are a subset of the vocabulary; nothing is downloaded):

  sft     tokens/s and MFU, ``packing=true`` vs ``false``, rows of 1/8 to 1 x --seq-len tokens
          (uniform; the first eighth of each is prompt), ``model.dtype=bf16-mixed``, SDPA attention.
          MFU is the run's own ``perf/mfu`` (``relign.models.flops``, the peak passed as
          ``logging.peak_tflops``), time-weighted over the timed steps: 3 x (2 x the decoder's
          linear weights per token + 2 x hidden x vocab where the LM head runs, i.e. at the
          response tokens only, + causal attention) / seconds / peak. The first run's figure
          (15.5%) counted 6 N for every token, the prompt's too, whose LM head ``logits_to_keep``
          skips: about 3% more than this count on these rows.
  dpo     pairs/s, prompts of --seq-len/16 to /8 tokens, responses of /16 to /4, reference precomputed.
  grpo    step seconds by stage (rollout, reward, reference, update, sync) on the HF engine:
          --prompts x G=8 completions of exactly --new-tokens tokens (EOS banned), β = 0.04.
  decode  the HF engine's tokens/s at --decode-rows rows, bf16 weights, against the bandwidth
          bound: rows x bandwidth / (weight bytes + the rows' KV-cache bytes at the mean
          context), i.e. every decode step reads all weights and the whole cache once.
  lora    the grpo check with ``model.lora.enabled=true`` (r 16, all linear layers): the reference
          is the base model with the adapter disabled, the sync moves the adapter only.
  torchrun  one GRPO step through the real launch path: ``torchrun --standalone
          --nproc_per_node 1 -m relign rl ...`` (NCCL). On one process ``wrap_fsdp`` is a no-op and
          NCCL refuses two ranks on one GPU, so FSDP2 itself needs two GPUs.

Every check records the CUDA allocator's peak (``torch.cuda.max_memory_allocated``, reset
before it; for torchrun the child's own peak is not seen) and, beside it, ``relign plan``'s
prediction for the same config (``predicted_gib``; the measured ``run_peak_gib`` is the peak less
what was allocated before the run, and ``predicted_over_measured`` their ratio: within 15% is the
goal of issue 47). The JSON at --out is rewritten after
every check, so a run stopped at its time limit still leaves the checks it finished.

Peak FLOP/s and bandwidth come from the device name (``relign.models.flops.PEAKS``, read from
``relign.devices.GPUS``, the one table of devices: H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s; H100
PCIe: 756, 2.0; H200: 989, 4.8); ``--peak-tflops`` /
``--bandwidth-tbs`` override.
Results: a markdown table on stdout and JSON at --out.

On the device machine: it has torch, transformers, peft and tqdm; relign also needs omegaconf,
carried as wheels (``/.whl/`` is git-ignored). Here, once:

    python -m pip download --no-deps --only-binary=:all: -d .whl omegaconf==2.3.0
    python -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # no wheel on PyPI: build one

then the device run, with ``carry=[".whl"]``:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site &&
    PYTHONUNBUFFERED=1 python3 bench/gpu_checks.py --out $OUT/gpu_checks.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWEN05 = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
              vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0, tie_word_embeddings=True)
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=4096, max_position_embeddings=1024, rope_theta=10_000.0, tie_word_embeddings=True)


def reward(prompt: str, response: str, extra_info: dict) -> float:
    """A reward with variance inside every group (so no group is skipped), cheap to compute."""
    return float(sum(map(ord, response)) % 2)


def build_model(out: Path, shape: dict, *, tokenizer: bool = True) -> int:
    """A random model of ``shape`` with relign's tiny tokenizer (``tokenizer``: saved beside it;
    2 s to train, which ``bench/gpu_ab.py``'s sections, fed token ids, skip); returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from relign.models.tiny import SPECIAL_TOKENS, build_tokenizer

    tok = build_tokenizer(4096, seed=0) if tokenizer else None
    # the tokenizer's special tokens come first, in SPECIAL_TOKENS' order: eos <|im_end|>, pad <|endoftext|>
    cfg = Qwen2Config(**shape, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
                      pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out, safe_serialization=True)
    if tok is not None:
        assert (tok.eos_token_id, tok.pad_token_id) == (cfg.eos_token_id, cfg.pad_token_id)
        tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def text_of(tok, n_tokens: int, rng: random.Random) -> str:
    """About ``n_tokens`` tokens of random words (checked against the tokenizer)."""
    words = [rng.choice(("alpha", "beta", "gamma", "delta", "sum", "of", "the", "and", "seven", "nine")) for _ in range(n_tokens)]
    text = " ".join(words)
    ids = tok.encode(text)[:n_tokens]
    return tok.decode(ids)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def timed_rows(history: list[dict], key: str, warmup: int) -> list[dict]:
    rows = sorted((r for r in history if key in r), key=lambda r: r["step"])
    return rows[warmup:] if len(rows) > warmup else rows


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return (xs[n // 2] + xs[(n - 1) // 2]) / 2 if xs else float("nan")


def run_mfu(rows: list[dict]) -> float | None:
    """The MFU of the timed steps from relign's own ``perf/mfu`` (``relign.models.flops``),
    weighted by each step's seconds; None when the run logged none (no peak known)."""
    rows = [r for r in rows if "perf/mfu" in r]
    if not rows:
        return None
    return sum(r["perf/mfu"] * r["perf/step_seconds"] for r in rows) / sum(r["perf/step_seconds"] for r in rows)


def run_sft(a, model_dir: Path, tmp: Path, tok, peak: float, device: str) -> list[dict]:
    from relign.config import load_config
    from relign.recipes import sft

    rng = random.Random(0)
    n_rows = a.batch * (a.steps + 1)
    rows = []
    for _ in range(n_rows):
        n = rng.randint(a.seq_len // 8, a.seq_len)
        rows.append({"prompt": text_of(tok, n // 8, rng), "completion": text_of(tok, n - n // 8, rng)})
    data = write_jsonl(tmp / "sft.jsonl", rows)
    out = []
    for packing in (False, True):
        cfg = load_config(sft.Config, None, [
            f"model.path={model_dir}", f"model.dtype={a.dtype}", "model.attn_implementation=sdpa", f"data.path={data}",
            f"data.max_length={a.seq_len}", f"batch_size={a.batch}", f"micro_batch_size={a.micro}", f"max_steps={a.steps}",
            f"packing={str(packing).lower()}", "optim.lr=1e-5", "optim.warmup_ratio=0", "optim.schedule=constant",
            f"device={device}", "logging.progress=false", "logging.tensorboard=false", "checkpoint.save_every=0",
            "checkpoint.save_final=false", "eval_every=0", f"run_dir={tmp / ('sft-packed' if packing else 'sft-padded')}",
            *([f"logging.peak_tflops={peak / 1e12}"] if peak else []),
        ])
        before = _reset_peak(device)
        hist = sft.train(cfg).history
        mem = _memory(device, before, predicted(cfg, "sft"))
        steps = timed_rows(hist, "perf/tokens_per_s", a.warmup)
        tps = sum(r["perf/tokens"] for r in steps) / sum(r["perf/step_seconds"] for r in steps)
        out.append({**mem, "check": "sft", "mode": "packed" if packing else "padded", "tokens_per_s": tps,
                    "mfu": run_mfu(steps), "steps_timed": len(steps)})
    return out


def run_dpo(a, model_dir: Path, tmp: Path, tok, device: str) -> dict:
    from relign.config import load_config
    from relign.recipes import preference

    rng = random.Random(1)
    p, r = a.seq_len // 8, a.seq_len // 4
    # lengths drawn as real pairs have them: with every pair cut to one length, cuDNN attention's
    # per-shape graphs (turned off by relign, models.loading.no_cudnn_attention) would always hit
    rows = [{"prompt": text_of(tok, rng.randint(p // 2, p), rng), "chosen": text_of(tok, rng.randint(r // 4, r), rng),
             "rejected": text_of(tok, rng.randint(r // 4, r), rng)} for _ in range(a.batch * (a.steps + 1))]
    data = write_jsonl(tmp / "dpo.jsonl", rows)
    cfg = load_config(preference.Config, None, [
        f"model.path={model_dir}", f"model.dtype={a.dtype}", f"data.path={data}", f"data.max_length={p + r + 8}",
        f"batch_size={a.batch}", f"micro_batch_size={a.micro}", f"eval_batch_size={a.micro}", f"max_steps={a.steps}",
        "optim.lr=1e-6", "optim.warmup_ratio=0", f"device={device}", "logging.progress=false", "logging.tensorboard=false",
        "checkpoint.save_every=0", "checkpoint.save_final=false", "eval_every=0", f"run_dir={tmp / 'dpo'}",
    ])
    before = _reset_peak(device)
    hist = preference.train(cfg).history
    mem = _memory(device, before, predicted(cfg, "dpo"))
    steps = timed_rows(hist, "perf/pairs_per_s", a.warmup)
    ref = next((r["time/reference_s"] for r in hist if "time/reference_s" in r), None)
    return {**mem, "check": "dpo", "pairs_per_s": median([r["perf/pairs_per_s"] for r in steps]),
            "reference_precompute_s": ref, "steps_timed": len(steps)}


def grpo_args(a, model_dir: Path, tmp: Path, tok, device: str, name: str, steps: int, extra: tuple = ()) -> list[str]:
    """The overrides of a GRPO run on random prompts: --prompts x G = 8 completions of exactly
    --new-tokens tokens, KL to the reference in the loss (beta 0.04)."""
    rng = random.Random(2)
    prompts = write_jsonl(tmp / f"{name}.jsonl", [{"prompt": text_of(tok, a.seq_len // 16, rng), "answer": "0"}
                                                   for _ in range(a.prompts * (steps + 1))])
    return [
        f"model.path={model_dir}", f"model.dtype={a.dtype}", "task.name=custom", f"task.path={prompts}",
        f"task.reward_fn={Path(__file__).resolve()}:reward", "task.chat=false", "task.reward_workers=0",
        "rollout.n=8", f"rollout.max_new_tokens={a.new_tokens}", f"rollout.min_new_tokens={a.new_tokens}",
        "algorithm.kl=loss", "algorithm.kl_coef=0.04", f"prompts_per_step={a.prompts}", f"micro_batch_size={a.micro}",
        f"max_steps={steps}", "optim.lr=1e-6", f"device={device}", "logging.progress=false", "logging.tensorboard=false",
        "checkpoint.save_every=0", "checkpoint.save_final=false", "traces_per_step=0", f"run_dir={tmp / name}", *extra,
    ]


def stage_seconds(hist: list[dict], warmup: int) -> tuple[dict, int]:
    """The median seconds of every ``time/*_s`` stage over the timed steps, and their count."""
    steps = timed_rows(hist, "time/step_s", warmup)
    return ({k.removeprefix("time/").removesuffix("_s"): median([r[k] for r in steps])
             for k in sorted(steps[0]) if k.startswith("time/") and k.endswith("_s")}, len(steps))


def run_grpo(a, model_dir: Path, tmp: Path, tok, device: str, lora: bool = False) -> dict:
    from relign.config import load_config
    from relign.recipes import rl

    extra = ("model.lora.enabled=true", "model.lora.r=16", "optim.lr=1e-5") if lora else ()
    steps = a.lora_steps if lora else a.grpo_steps
    name = "lora" if lora else "grpo"
    cfg = load_config(rl.Config, None, grpo_args(a, model_dir, tmp, tok, device, name, steps, extra))
    before = _reset_peak(device)
    stages, n = stage_seconds(rl.train(cfg).history, min(a.warmup, steps - 1))
    return {**_memory(device, before, predicted(cfg, "rl")), "check": name, "rows_per_step": a.prompts * 8,
            "new_tokens": a.new_tokens, "seconds": stages, "steps_timed": n}


def predicted(cfg, recipe: str) -> float:
    """``relign plan``'s peak for ``cfg`` (GiB per rank; the device's size does not change it)."""
    from relign.devices import Device
    from relign.recipes import memory

    room = Device("any", "any", 1 << 50, 1 << 50)
    return memory.plan_for(cfg, recipe, room, search=False).peak.total / 2**30


def _reset_peak(device: str) -> int:
    """Bytes allocated before a run (on CUDA; its peak counter reset), so its own peak can be told apart."""
    import torch

    if device != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _memory(device: str, before: int, predicted_gib: float) -> dict:
    """The run's own peak (max_memory_allocated less what was there before) beside the plan's."""
    import torch

    if device != "cuda":
        return {"predicted_gib": predicted_gib}
    run = (torch.cuda.max_memory_allocated() - before) / 2**30
    return {"predicted_gib": predicted_gib, "run_peak_gib": run, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "predicted_over_measured": predicted_gib / run if run else None}


def run_torchrun(a, model_dir: Path, tmp: Path, tok, device: str) -> dict:
    """One GRPO step as users launch it: torchrun, one process, NCCL on a GPU (gloo on a CPU)."""
    import subprocess

    from relign.tracking import read_metrics

    args = grpo_args(a, model_dir, tmp, tok, device, "torchrun", 1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "relign", "rl", *args]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=a.torchrun_timeout)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        return {"check": "torchrun", "ok": False, "returncode": proc.returncode, "stderr_tail": proc.stderr[-3000:], "launch_wall_s": wall}
    hist = read_metrics(tmp / "torchrun")
    stages, _ = stage_seconds(hist, 0)
    # relign.distributed.init picks NCCL when CUDA is available, gloo otherwise
    return {"check": "torchrun", "ok": True, "backend": "nccl" if device == "cuda" else "gloo", "seconds": stages, "launch_wall_s": wall}


def decode_plan(shape: dict, rows: int, prompt: int, new: int, b: int) -> int:
    """``relign plan``'s terms for the HF engine alone: its weights (b bytes each), its KV cache over
    prompt + new columns, the decode step's weight copies and the larger of a decode step's and the
    prefill's transients."""
    from relign import plan as P

    s = P.Shape.of({**shape, "model_type": "qwen2"})
    prec = P.Precision.of("bf16" if b == 2 else "fp32")
    return (P.weight_bytes(s.params, b) + P.kv_cache_bytes(s, rows, prompt + new, b) + P.decode_copy_bytes(s, b)
            + max(P.decode_step_bytes(s, rows), P.nograd_forward_bytes(s, rows * prompt, 0, prec)))


def run_decode(a, model_dir: Path, tok, n_params: int, shape: dict, bandwidth: float, device: str) -> dict:
    import torch

    from relign.config import ModelConfig
    from relign.models.loading import load_causal_lm
    from relign.recipes.build import engine_for
    from relign.rollout.engine import SamplingParams

    dtype = "bf16" if a.dtype != "fp32" else "fp32"
    before = _reset_peak(device)
    model = load_causal_lm(str(model_dir), dtype=dtype, device=device).eval()
    engine = engine_for("hf", model, tok, max_batch_rows=a.decode_rows, seed=0, m=ModelConfig(path=str(model_dir), dtype=dtype))
    rng = random.Random(3)
    prompt_len = a.seq_len // 16
    prompts = [tok.encode(text_of(tok, prompt_len, rng)) for _ in range(a.decode_rows)]
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=a.new_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(n=1, temperature=1.0, max_new_tokens=4, ignore_eos=True))  # warm-up
    times = []
    for _ in range(a.decode_repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = engine.generate(prompts, params, seeds=list(range(len(prompts))))
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    n_tok = sum(len(c[0].token_ids) for c in out)
    tps = n_tok / min(times)
    elt = 2 if dtype == "bf16" else 4
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * elt
    context = sum(len(p) for p in prompts) / len(prompts) + a.new_tokens / 2
    bytes_per_step = n_params * elt + a.decode_rows * context * kv_per_token
    bound = a.decode_rows * bandwidth / bytes_per_step if bandwidth else None
    return {**_memory(device, before, decode_plan(shape, a.decode_rows, prompt_len, a.new_tokens, elt) / 2**30),
            "check": "decode", "rows": a.decode_rows, "new_tokens": a.new_tokens, "tokens_per_s": tps,
            "bound_tokens_per_s": bound, "fraction_of_bound": tps / bound if bound else None,
            "prefill_included": True}


def peak_text(r: dict) -> str:
    """', peak 12.3 GiB (plan 11.9)': the measured peak and relign plan's, when there is one."""
    if r.get("peak_gib") is None:
        return ""
    plan = f" (plan {r['predicted_gib']:.1f}, run {r['run_peak_gib']:.1f})" if r.get("run_peak_gib") else ""
    return f", peak {r['peak_gib']:.1f} GiB{plan}"


def write_json(path: str, out: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))


def driver_version() -> str | None:
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shape, few steps, CPU or GPU: checks the script runs")
    p.add_argument("--checks", default="sft,decode,grpo,dpo,lora,torchrun", help="in this order: the first ones matter most")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32, help="rows (sft) / pairs (dpo) per optimizer step")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16, help="GRPO prompts per step (x G = 8)")
    p.add_argument("--grpo-steps", type=int, default=3)
    p.add_argument("--lora-steps", type=int, default=2)
    p.add_argument("--torchrun-timeout", type=float, default=300)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--decode-rows", type=int, default=64)
    p.add_argument("--decode-repeats", type=int, default=3)
    p.add_argument("--dtype", default="bf16-mixed", help="model.dtype of the training checks (decode uses bf16 weights)")
    p.add_argument("--peak-tflops", type=float, default=0.0)
    p.add_argument("--bandwidth-tbs", type=float, default=0.0)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_checks.json"))
    a = p.parse_args(argv)
    import torch

    if a.smoke:
        a.seq_len, a.batch, a.micro, a.steps, a.warmup, a.prompts, a.new_tokens = 128, 4, 2, 2, 1, 2, 8
        a.grpo_steps, a.lora_steps = 2, 2
        a.decode_rows, a.decode_repeats = 4, 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    from relign.models.flops import device_peak

    peak_t, bw_t = device_peak(name)
    peak = (a.peak_tflops or peak_t) * 1e12
    bandwidth = (a.bandwidth_tbs or bw_t) * 1e12
    shape = SMOKE if a.smoke else QWEN05
    checks = [c.strip() for c in a.checks.split(",") if c.strip()]

    from relign.models.loading import load_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="relign-gpu-checks-"))
    results: list[dict] = []
    out = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": name, "peak_flops": peak, "bandwidth_bytes_per_s": bandwidth,
           "shape": shape, "args": vars(a), "torch": torch.__version__, "cuda": torch.version.cuda,
           "driver": driver_version() if device == "cuda" else None, "results": results}
    try:
        model_dir = tmp / "model"
        n_params = out["parameters"] = build_model(model_dir, shape)
        tok = load_tokenizer(str(model_dir))
        for c in checks:
            t0 = time.perf_counter()
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if c == "sft":
                res = run_sft(a, model_dir, tmp, tok, peak, device)
            elif c == "dpo":
                res = [run_dpo(a, model_dir, tmp, tok, device)]
            elif c == "grpo":
                res = [run_grpo(a, model_dir, tmp, tok, device)]
            elif c == "decode":
                res = [run_decode(a, model_dir, tok, n_params, shape, bandwidth, device)]
            elif c == "lora":
                res = [run_grpo(a, model_dir, tmp, tok, device, lora=True)]
            elif c == "torchrun":
                res = [run_torchrun(a, model_dir, tmp, tok, device)]
            else:
                p.error(f"unknown check {c!r}")
            for r in res:
                r["wall_s"] = time.perf_counter() - t0
                if "peak_gib" not in r:  # the checks that measured their own runs keep their figures
                    r["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" and c != "torchrun" else None
                print(json.dumps(r), flush=True)
            results.extend(res)
            write_json(a.out, out)  # after every check: a run stopped at its limit keeps what it finished
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_json(a.out, out)
    lines = [f"GPU checks on {name} ({n_params / 1e6:.0f}M parameters, {a.dtype}, torch {torch.__version__})", "",
             "| check | figure |", "|---|---|"]
    for r in results:
        if r["check"] == "sft":
            mfu = f", MFU {r['mfu']:.1%}" if r["mfu"] is not None else ""
            lines.append(f"| SFT {r['mode']}, {a.seq_len} tokens max | {r['tokens_per_s']:,.0f} tokens/s{mfu}{peak_text(r)} |")
        elif r["check"] == "dpo":
            lines.append(f"| DPO | {r['pairs_per_s']:.2f} pairs/s{peak_text(r)} |")
        elif r["check"] in ("grpo", "lora"):
            lines.append(f"| {'LoRA ' if r['check'] == 'lora' else ''}GRPO step, {r['rows_per_step']} x {r['new_tokens']} tokens | "
                         + ", ".join(f"{k} {v:.2f} s" for k, v in r["seconds"].items()) + peak_text(r) + " |")
        elif r["check"] == "torchrun":
            what = (f"{r['backend']}, " + ", ".join(f"{k} {v:.2f} s" for k, v in r["seconds"].items())) if r["ok"] else f"FAILED ({r['returncode']})"
            lines.append(f"| torchrun, 1 process, one GRPO step | {what}; launch to exit {r['launch_wall_s']:.0f} s |")
        else:
            frac = f" = {r['fraction_of_bound']:.0%} of the bound {r['bound_tokens_per_s']:,.0f}" if r["bound_tokens_per_s"] else ""
            lines.append(f"| decode, {r['rows']} rows | {r['tokens_per_s']:,.0f} tokens/s{frac}{peak_text(r)} |")
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    main()
