"""DPO training throughput and peak memory: relign's preference recipe vs TRL's ``DPOTrainer``.

    python bench/dpo_throughput.py            # 2 modes x 2 libraries x 2 repeats x 10 steps, ~15 min on 2 cores
    python bench/dpo_throughput.py --quick    # precompute mode only, 2 libraries x 5 steps, ~3 min, a smoke test
    python bench/dpo_throughput.py --modes precompute --repeats 3

Both libraries train the same tiny random Qwen2 model (``relign.models.tiny``, "small", ~10M
parameters, fp32, CPU, sdpa attention) with sigmoid DPO (beta 0.1) on the shipped Orca DPO
pairs (``orca_dpo_pairs.jsonl``: system + prompt + chosen + rejected), in a fresh subprocess
per run, so each run's peak RSS (VmHWM) is its own.

What is held identical (and checked at the end of every run):
  * the tokens: both render ``[system, user] + [assistant]`` with the tokenizer's ChatML
    template (TRL gets conversational prompt/chosen/rejected rows); the loss covers the
    assistant content + ``<|im_end|>\\n`` on both sides. ``--max-length`` (512) cuts every
    row (prompt + response) from the end on both sides (relign ``data.truncation=truncate``,
    TRL ``truncation_mode=keep_start``). Pairs whose prompt alone nearly fills max_length are
    dropped by relign (prompt >= max_length - 1); TRL gets only the pairs relign kept, so its
    own filter (prompt >= max_length) drops nothing. The per-pair ids of the two sides are
    compared (digests), and so are the reference log-probs of every pair.
  * the batches: TRL reads the kept pairs through a sampler that yields exactly the order
    relign's ``StepSampler`` draws (same seed; a re-implementation checked against relign's
    own), so every optimizer step holds the same pairs (relign then orders them by length
    before cutting its micro-batches; the step's loss is the same). The per-step losses and
    gradient norms are compared.
  * the objective and optimizer: ``-logsigmoid(beta * (chosen - rejected log-ratio))`` with
    summed response log-probs, averaged over the step's pairs (TRL: mean per micro-batch /
    grad accumulation = the same with equal micro-batches); ``torch.optim.AdamW(fused=True)``
    (relign's default on one process, TRL ``optim=adamw_torch_fused``), lr 1e-5 constant, no
    warm-up, weight decay 0, grad-norm clip 1.0; no gradient checkpointing (TRL's DPOConfig
    turns it on by default), fp32 (DPOConfig defaults to bf16), dropout off (both).
  * nothing else: no eval, no checkpoints, relign ``logging.progress=false
    logging.tensorboard=false``, TRL ``report_to="none"``, no tqdm. TRL logs every step
    (``logging_steps=1``: per-step losses for the check; relign writes metrics.jsonl every
    step too).

Modes (like with like):
  precompute  relign ``reference=precompute`` (its default: the starting policy scores every
              pair once before training, no second model) vs TRL ``precompute_ref_log_probs=True``
              (the same; TRL then keeps no reference model either). Both precompute with
              ``--ref-batch-size`` pairs per forward (relign ``eval_batch_size``, TRL
              ``precompute_ref_batch_size``). This is the headline comparison.
  online      relign ``reference=online`` (a frozen reference copy, scored every micro-batch)
              vs TRL's default (``precompute_ref_log_probs=False``: a reference copy, scored
              every micro-batch).

relign runs each pair's prompt once for both responses (``share_prompt=true``, its default,
same log-probs and gradients: one packed row per micro-batch, each rejected response continuing
its prompt); TRL runs the prompt in both rows. ``--relign-set
share_prompt=false`` measures relign without it.

Throughput = pairs / wall time over the steps after ``--warmup``, each step timed from the end
of the previous one (relign: its metrics log call; TRL: ``on_step_end``), so data collation,
logging and the optimizer are included on both sides; model loading, tokenization and the
reference precompute are not (the precompute is timed and reported separately). Every run is
repeated ``--repeats`` times (interleaved, alternating which library goes first); each timed
step counts with its fastest repeat (a shared VM's CPU comes and goes in bursts). The median of
the per-step time ratios is reported too. Output: a markdown table on stdout and
bench/results/dpo_throughput.json. Nothing is downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import _git_state  # noqa: E402
from sft_throughput import _median, _peak_rss_mb, _proc_status_mb, _usage, _wait_quiet, relign_order  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

REPO = Path(__file__).resolve().parent.parent
# The environment as the user started this script, before it imports relign, which sets oneDNN's
# cache sizes (relign/__init__.py): TRL's processes get this one, so each library runs as it comes.
PEER_ENV = dict(os.environ)
THIS = Path(__file__).resolve()
DATA = REPO / "relign" / "data" / "samples" / "orca_dpo_pairs.jsonl"
RESULTS = REPO / "bench" / "results" / "dpo_throughput.json"
LIBS = ("relign", "trl")
MODES = ("precompute", "online")


def _digest(ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# ----------------------------------------------------------------------------- workers


def _step_row(**extra) -> dict:
    return {"end_time": time.time(), "usage": _usage(), **extra}


def worker_relign(a: argparse.Namespace) -> dict:
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    import relign.recipes.preference as pref
    from relign.config import load_config
    from relign.tracking import add_listener

    rss_after_imports = _proc_status_mb("VmRSS")
    rows: list[dict] = []
    box: dict = {}

    def on_log(step, metrics):  # relign.tracking.add_listener: every row the run logs, in process
        if "time/reference_s" in metrics:  # the step-0 row, logged right after the reference precompute
            box["ref_seconds"] = metrics["time/reference_s"]
            box["ref_pairs"] = int(metrics.get("data/kept", 0))  # the training pairs it scored
            box["hwm_after_ref_mb"] = _proc_status_mb("VmHWM")
        if "perf/pairs_per_s" in metrics:
            rows.append(_step_row(loss=float(metrics["train/loss"]), grad_norm=float(metrics["train/grad_norm"]),
                                  inner_pairs_per_s=float(metrics["perf/pairs_per_s"])))

    add_listener(on_log)
    run_dir = tempfile.mkdtemp(prefix="relign-dpo-bench-")
    overrides = [
        f"model.path={a.model}", "model.dtype=fp32", "model.attn_implementation=sdpa",
        f"data.path={DATA}", f"data.max_length={a.max_length}", "data.truncation=truncate",
        "loss=dpo", f"beta={a.beta}", "label_smoothing=0.0", f"reference={a.mode}",
        f"batch_size={a.batch_size}", f"micro_batch_size={a.micro_batch_size}", f"eval_batch_size={a.ref_batch_size}",
        f"max_steps={a.steps}", f"optim.lr={a.lr}", "optim.weight_decay=0.0", "optim.schedule=constant",
        "optim.warmup_steps=0", "optim.warmup_ratio=0.0", "optim.max_grad_norm=1.0",
        f"seed={a.seed}", "device=cpu", "logging.progress=false", "logging.tensorboard=false",
        "checkpoint.save_final=false", "checkpoint.save_every=0", f"run_dir={run_dir}",
        *a.relign_set,
    ]
    ref_logps = None
    try:
        cfg = load_config(pref.Config, None, overrides)
        t0 = time.perf_counter()
        pref.train(cfg)
        total = time.perf_counter() - t0
        cache = Path(run_dir) / pref.REF_FILE
        if cache.is_file():
            from safetensors.torch import load_file

            ref_logps = load_file(str(cache))["train"].tolist()  # [N, 2] chosen/rejected, relign's example order
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "library": "relign",
        "rows": rows,
        "train_call_seconds": total,
        "ref_precompute_seconds": box.get("ref_seconds") if a.mode == "precompute" else None,
        "ref_precompute_pairs": box.get("ref_pairs", 0) if a.mode == "precompute" else 0,
        "rss_after_imports_mb": rss_after_imports,
        "peak_rss_after_ref_precompute_mb": box.get("hwm_after_ref_mb"),
        "ref_logps": ref_logps,
        "config": {
            "overrides": [o.replace(str(a.model), "<model>").replace(str(DATA), str(DATA.relative_to(REPO)))
                          .replace(run_dir, "<run_dir>") for o in overrides],
            "optimizer": "torch.optim.AdamW(fused=True) (relign.optim.build_optimizer)",
        },
    }


def worker_trl(a: argparse.Namespace) -> dict:
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    import datasets
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import DPOConfig, DPOTrainer

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    os.environ["TQDM_DISABLE"] = "1"  # TRL's precompute progress bar
    rss_after_imports = _proc_status_mb("VmRSS")

    with open(a.kept) as f:
        kept = json.load(f)  # raw row indices relign kept, in relign's example order
    raw = [json.loads(line) for line in open(DATA) if line.strip()]

    def conv(r):
        prompt = ([{"role": "system", "content": r["system"]}] if r.get("system") else []) + [{"role": "user", "content": r["prompt"]}]
        return {"prompt": prompt, "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}]}

    train_ds = datasets.Dataset.from_list([conv(raw[i]) for i in kept])
    order = relign_order(len(kept), a.batch_size, a.steps, a.seed)
    rows: list[dict] = []
    box: dict = {"ref_seconds": 0.0}

    class BenchDPO(DPOTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return list(order)  # exactly relign's StepSampler order (any iterable of indices is a sampler)

        def _precompute_ref_logps(self, dataset, name, batch_size):
            box["rss_before_ref_mb"] = _proc_status_mb("VmRSS")
            t0 = time.perf_counter()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            box["ref_seconds"] += time.perf_counter() - t0
            box["hwm_after_ref_mb"] = _proc_status_mb("VmHWM")
            return out

    class Timer(TrainerCallback):
        def __init__(self):
            self.logs: list[dict] = []

        def on_step_end(self, args, state, control, **kw):
            rows.append(_step_row())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.logs.append({"loss": float(logs["loss"]), "grad_norm": float(logs.get("grad_norm", float("nan")))})

    precompute = a.mode == "precompute"
    out_dir = tempfile.mkdtemp(prefix="trl-dpo-bench-")
    args = DPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=a.micro_batch_size,
        gradient_accumulation_steps=a.batch_size // a.micro_batch_size,
        max_steps=a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        seed=a.seed,
        bf16=False,  # DPOConfig defaults to bf16
        fp16=False,
        gradient_checkpointing=False,  # DPOConfig defaults to True; relign's default is False
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="steps",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_length=a.max_length,
        truncation_mode="keep_start",
        loss_type=["sigmoid"],
        beta=a.beta,
        label_smoothing=0.0,
        precompute_ref_log_probs=precompute,
        precompute_ref_batch_size=a.ref_batch_size,
        disable_dropout=True,
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
    )
    tok = AutoTokenizer.from_pretrained(a.model)
    timer = Timer()
    try:
        trainer = BenchDPO(model=a.model, args=args, train_dataset=train_ds, processing_class=tok, callbacks=[timer])
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        prepared = trainer.train_dataset
        t0 = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - t0
        L = a.max_length
        tokens = []
        for ex in prepared:
            p = list(ex["prompt_ids"])
            c, r = (p + list(ex["chosen_ids"]))[:L], (p + list(ex["rejected_ids"]))[:L]
            tokens.append({"prompt_len": len(p), "chosen": _digest(c), "rejected": _digest(r),
                           "chosen_len": len(c), "rejected_len": len(r)})
        ref_logps = ([[x, y] for x, y in zip(prepared["ref_chosen_logps"], prepared["ref_rejected_logps"])]
                     if precompute else None)
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        cfg = {
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "precompute_ref_log_probs": args.precompute_ref_log_probs,
            "precompute_ref_batch_size": args.precompute_ref_batch_size,
            "ref_model": type(trainer.ref_model).__name__ if trainer.ref_model is not None else None,
            "loss_type": list(args.loss_type), "beta": args.beta, "max_length": args.max_length,
            "truncation_mode": args.truncation_mode, "optim": str(args.optim), "optimizer": type(opt).__name__,
            "optimizer_defaults": {k: (list(v) if isinstance(v, tuple) else v) for k, v in opt.defaults.items()
                                   if k in ("lr", "betas", "eps", "fused", "foreach")},
            "group_weight_decay": sorted({g["weight_decay"] for g in opt.param_groups}),
            "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
            "bf16": args.bf16, "logging_steps": args.logging_steps,
        }
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if len(timer.logs) != len(rows):
        raise RuntimeError(f"TRL logged {len(timer.logs)} losses for {len(rows)} steps")
    for r, lg in zip(rows, timer.logs):
        r.update(lg)
    return {
        "library": "trl",
        "rows": rows,
        "train_call_seconds": total,
        "ref_precompute_seconds": box["ref_seconds"] if precompute else None,
        "ref_precompute_pairs": len(kept) if precompute else 0,
        "rss_after_imports_mb": rss_after_imports,
        "rss_before_ref_precompute_mb": box.get("rss_before_ref_mb"),
        "peak_rss_after_ref_precompute_mb": box.get("hwm_after_ref_mb"),
        "ref_logps": ref_logps,
        "tokens": tokens,
        "config": cfg,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "datasets": datasets.__version__},
    }


def run_worker(a: argparse.Namespace) -> None:
    import torch

    res = (worker_relign if a.worker == "relign" else worker_trl)(a)
    res["mode"] = a.mode
    res["peak_rss_mb"] = _peak_rss_mb()
    res["torch_threads"] = torch.get_num_threads()
    rows = res["rows"]
    if len(rows) != a.steps:
        raise RuntimeError(f"{a.worker}: {len(rows)} steps recorded, expected {a.steps}")
    for k in range(1, len(rows)):
        r, p = rows[k], rows[k - 1]
        r["step"] = r["end_time"] - p["end_time"]
        cpu = r["usage"][0] - p["usage"][0]
        r["cpu_seconds"] = cpu
        r["other_load_cores"] = ((r["usage"][3] - p["usage"][3]) - cpu) / max(r["step"], 1e-9)
    with open(a.result, "w") as f:
        json.dump(res, f)


# ----------------------------------------------------------------------------- parent


def _prepare(model_dir: str, a: argparse.Namespace) -> dict:
    """relign's tokenization: which raw rows it keeps, their ids, and the sampling order."""
    from transformers import AutoTokenizer

    from relign.data.collate import StepSampler
    from relign.data.preference import build_pair_examples

    tok = AutoTokenizer.from_pretrained(model_dir)
    full, _ = build_pair_examples(str(DATA), tok, max_length=10**9)  # every row, untruncated, in file order
    examples, stats = build_pair_examples(str(DATA), tok, max_length=a.max_length, truncation="truncate")
    kept = [i for i, e in enumerate(full) if e.prompt_len < a.max_length - 1]  # relign's keep rule (truncate)
    L = a.max_length
    same = len(kept) == len(examples) and all(
        e.chosen_ids == full[i].chosen_ids[:L] and e.rejected_ids == full[i].rejected_ids[:L] for i, e in zip(kept, examples)
    )
    if not same:
        raise RuntimeError("could not map relign's kept pairs back to the raw rows")
    sampler = StepSampler(len(examples), a.batch_size, seed=a.seed)
    theirs = [i for _ in range(a.steps) for i in sampler.next()]
    order = relign_order(len(examples), a.batch_size, a.steps, a.seed)
    if theirs != order:
        raise RuntimeError("bench's copy of relign's sampling order disagrees with relign.data.collate.StepSampler")

    def mean(xs):
        return sum(xs) / len(xs)

    lens = {
        "pairs_in_file": stats.rows, "pairs_kept": stats.kept, "pairs_truncated": stats.truncated,
        "pairs_dropped_prompt_too_long": stats.dropped_too_long,
        "mean_prompt_tokens": mean([e.prompt_len for e in examples]),
        "mean_chosen_tokens": mean([len(e.chosen_ids) - e.prompt_len for e in examples]),
        "mean_rejected_tokens": mean([len(e.rejected_ids) - e.prompt_len for e in examples]),
        "mean_tokens_per_pair_full_rows": mean([len(e.chosen_ids) + len(e.rejected_ids) for e in examples]),
        "mean_tokens_per_pair_prompt_once": mean([len(e.chosen_ids) + len(e.rejected_ids) - e.prompt_len for e in examples]),
        "untruncated_mean_prompt_tokens": mean([e.prompt_len for e in full]),
        "untruncated_mean_chosen_tokens": mean([len(e.chosen_ids) - e.prompt_len for e in full]),
        "untruncated_mean_rejected_tokens": mean([len(e.rejected_ids) - e.prompt_len for e in full]),
    }
    # positions each side's forward covers per timed step, padding included: TRL's micro-batches
    # in sampling order, relign's after it orders the step's pairs by length (pairs.by_positions)
    from relign.recipes.pairs import by_positions

    # relign's default packs each micro-batch with each prompt once (+ its last token again per
    # pair); "relign_kv_cache_prompt" is its padded shared-prompt layout (models varlen does not cover)
    pos = {"trl_full_rows": [], "relign_kv_cache_prompt": [], "real_full_rows": [], "real_prompt_once": [],
           "relign_packed_prompt_once": []}
    for s in range(a.steps):
        step = order[s * a.batch_size:(s + 1) * a.batch_size]
        ours = by_positions(examples, step, share_prompt=True)
        t = rl = real = real1 = packed = 0
        for m in range(0, len(step), a.micro_batch_size):
            mb = [examples[i] for i in step[m:m + a.micro_batch_size]]
            longest = max(max(len(e.chosen_ids), len(e.rejected_ids)) for e in mb)
            t += 2 * len(mb) * longest
            mine = [examples[i] for i in ours[m:m + a.micro_batch_size]]
            P = max(e.prompt_len for e in mine)
            R = max(max(len(e.chosen_ids), len(e.rejected_ids)) - e.prompt_len for e in mine)
            rl += len(mine) * P + 2 * len(mine) * R
            real += sum(len(e.chosen_ids) + len(e.rejected_ids) for e in mb)
            real1 += sum(len(e.chosen_ids) + len(e.rejected_ids) - e.prompt_len for e in mb)
            packed += sum(len(e.chosen_ids) + len(e.rejected_ids) - e.prompt_len + 1 for e in mb)
        for k, v in zip(pos, (t, rl, real, real1, packed)):
            pos[k].append(v)
    return {"examples": examples, "kept": kept, "order": order, "lengths": lens, "positions_per_step": pos}


def _spawn(lib: str, mode: str, a: argparse.Namespace, model_dir: str, kept_path: str, tmp: str, rep: int) -> dict:
    result = os.path.join(tmp, f"{lib}-{mode}-{rep}.json")
    cmd = [
        sys.executable, str(THIS), "--worker", lib, "--mode", mode, "--model", model_dir, "--kept", kept_path,
        "--result", result, "--steps", str(a.steps), "--warmup", str(a.warmup), "--batch-size", str(a.batch_size),
        "--micro-batch-size", str(a.micro_batch_size), "--ref-batch-size", str(a.ref_batch_size),
        "--max-length", str(a.max_length), "--lr", str(a.lr), "--beta", str(a.beta), "--seed", str(a.seed),
        "--threads", str(a.threads), *[f"--relign-set={x}" for x in a.relign_set],
    ]
    load_before = _wait_quiet(a.wait_quiet) if a.wait_quiet > 0 else None
    la_before = _loadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env=None if lib.startswith("relign") else PEER_ENV)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"{lib}/{mode} worker failed with exit code {proc.returncode}")
    with open(result) as f:
        res = json.load(f)
    res["process_wall_seconds"] = wall
    res["other_load_cores_before_start"] = load_before
    res["loadavg_before"], res["loadavg_after"] = la_before, _loadavg()
    return res


def _summarize(reps: list[dict], warmup: int, batch_size: int) -> dict:
    """Fold the repeats of one (library, mode): every repeat runs the same batches, so for each
    timed step keep its fastest wall time."""
    n = len(reps[0]["rows"])
    kept = [min(reps, key=lambda r: r["rows"][k]["step"])["rows"][k] for k in range(warmup, n)]
    best = [r["step"] for r in kept]
    best_cpu = [min(r["rows"][k]["cpu_seconds"] for r in reps) for k in range(warmup, n)]
    out = {k: v for k, v in reps[0].items() if k not in ("rows", "ref_logps", "tokens")}
    ref_s = [r["ref_precompute_seconds"] for r in reps if r.get("ref_precompute_seconds") is not None]
    out.update({
        "pairs_per_s": batch_size * len(best) / sum(best),
        "seconds_per_step": sum(best) / len(best),
        "best_step_seconds": best,
        # CPU seconds this process spent per step (both torch threads), the fewest over the repeats: less
        # sensitive than wall time to other processes taking the cores away
        "pairs_per_cpu_s": batch_size * len(best_cpu) / sum(best_cpu),
        "best_step_cpu_seconds": best_cpu,
        "other_load_cores": sum(r["other_load_cores"] * r["step"] for r in kept) / sum(best),
        "step_losses": [r["loss"] for r in reps[0]["rows"]],
        "step_grad_norms": [r["grad_norm"] for r in reps[0]["rows"]],
        "ref_precompute_seconds": min(ref_s) if ref_s else None,
        "ref_precompute_pairs_per_s": (reps[0]["ref_precompute_pairs"] / min(ref_s)) if ref_s else None,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in reps),
        "rss_after_imports_mb": max(r["rss_after_imports_mb"] for r in reps),
        "repeats": [
            {k: r.get(k) for k in ("peak_rss_mb", "peak_rss_after_ref_precompute_mb", "rss_before_ref_precompute_mb", "train_call_seconds", "process_wall_seconds", "ref_precompute_seconds",
                                   "other_load_cores_before_start", "loadavg_before", "loadavg_after")}
            | {"step_seconds": [s["step"] for s in r["rows"][1:]], "step_cpu_seconds": [s["cpu_seconds"] for s in r["rows"][1:]],
               "step_other_load_cores": [s["other_load_cores"] for s in r["rows"][1:]]}
            | ({"relign_inner_pairs_per_s": [s["inner_pairs_per_s"] for s in r["rows"]]} if r["library"] == "relign" else {})
            for r in reps
        ],
    })
    if reps[0]["library"] == "relign":
        inner = [r["inner_pairs_per_s"] for r in kept]
        out["relign_inner_pairs_per_s_median"] = _median(inner)  # relign's own perf/pairs_per_s (kept steps)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="runs per (library, mode), interleaved; each step's fastest repeat counts (default 2)")
    p.add_argument("--quick", action="store_true", help="smoke test: precompute mode, 5 steps (2 warmup), 1 repeat")
    p.add_argument("--modes", default="precompute,online", help="comma list of: precompute, online")
    p.add_argument("--batch-size", type=int, default=8, help="pairs per optimizer step (default 8)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="pairs per forward/backward (default 4: 2 accumulation steps)")
    p.add_argument("--ref-batch-size", type=int, default=8, help="pairs per forward of the reference precompute (default 8)")
    p.add_argument("--max-length", type=int, default=512, help="longest prompt + response row in tokens (default 512)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads in every run (0: torch's default)")
    p.add_argument("--wait-quiet", type=float, default=30.0,
                   help="before each run, wait up to this many seconds for other processes to leave the CPU idle (0: don't)")
    p.add_argument("--relign-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra relign preference override, repeatable (e.g. share_prompt=false)")
    p.add_argument("--out", default=str(RESULTS), help="JSON results path")
    # internal
    p.add_argument("--worker", choices=LIBS, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--kept", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warmup, a.repeats, a.modes = 5, 2, 1, "precompute"
    if a.worker:
        run_worker(a)
        return
    if a.batch_size % a.micro_batch_size:
        p.error("--batch-size must be a multiple of --micro-batch-size")
    if a.warmup < 1 or a.steps <= a.warmup:
        p.error("need 1 <= --warmup < --steps")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")

    import torch
    import transformers
    import trl

    import relign
    from relign.models.tiny import build_tiny_model

    t_start = time.perf_counter()
    la_start = _loadavg()
    git_before = _git_state()
    tmp = tempfile.mkdtemp(prefix="dpo-bench-")
    try:
        model_dir = os.path.join(tmp, "model")
        build_tiny_model(model_dir, arch="qwen2", size="small")
        with open(os.path.join(model_dir, "config.json")) as f:
            model_cfg = json.load(f)
        from transformers import AutoModelForCausalLM

        n_params = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        prep = _prepare(model_dir, a)
        kept_path = os.path.join(tmp, "kept.json")
        with open(kept_path, "w") as f:
            json.dump(prep["kept"], f)
        all_runs: dict[str, list[dict]] = {f"{lib}/{m}": [] for m in modes for lib in LIBS}
        for rep in range(a.repeats):
            for mode in modes:
                for lib in (LIBS if rep % 2 == 0 else LIBS[::-1]):  # alternate who goes first
                    print(f"[{rep + 1}/{a.repeats}] {lib} / {mode}: {a.steps} DPO steps ...", file=sys.stderr, flush=True)
                    all_runs[f"{lib}/{mode}"].append(_spawn(lib, mode, a, model_dir, kept_path, tmp, rep))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    la_end = _loadavg()
    runs = {k: _summarize(v, a.warmup, a.batch_size) for k, v in all_runs.items()}

    # ---- checks: same tokens, same reference log-probs, same losses
    examples = prep["examples"]
    mine = [{"prompt_len": e.prompt_len, "chosen": _digest(e.chosen_ids), "rejected": _digest(e.rejected_ids),
             "chosen_len": len(e.chosen_ids), "rejected_len": len(e.rejected_ids)} for e in examples]
    checks: dict[str, object] = {}
    for mode in modes:
        rr, tr = all_runs[f"relign/{mode}"][0], all_runs[f"trl/{mode}"][0]
        theirs = tr["tokens"]
        same_ids = theirs == mine
        c: dict[str, object] = {
            "same_pairs": len(theirs) == len(mine),
            "same_token_ids_every_pair": same_ids,
            "pairs_with_different_ids": sum(x != y for x, y in zip(theirs, mine)) + abs(len(theirs) - len(mine)),
            "trl_mean_prompt_tokens": sum(t["prompt_len"] for t in theirs) / len(theirs),
            "trl_mean_chosen_tokens": sum(t["chosen_len"] - t["prompt_len"] for t in theirs) / len(theirs),
            "trl_mean_rejected_tokens": sum(t["rejected_len"] - t["prompt_len"] for t in theirs) / len(theirs),
        }
        if rr.get("ref_logps") and tr.get("ref_logps"):
            c["max_abs_ref_logp_diff"] = max(abs(x - y) for u, v in zip(rr["ref_logps"], tr["ref_logps"]) for x, y in zip(u, v))
        rl, tl = runs[f"relign/{mode}"]["step_losses"], runs[f"trl/{mode}"]["step_losses"]
        rg, tg = runs[f"relign/{mode}"]["step_grad_norms"], runs[f"trl/{mode}"]["step_grad_norms"]
        c["step1_loss"] = {"relign": rl[0], "trl": tl[0]}
        c["step1_grad_norm"] = {"relign": rg[0], "trl": tg[0]}
        c["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(rl, tl))
        c["max_rel_grad_norm_diff"] = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(rg, tg))
        paired = [ts / rs for rs, ts in zip(runs[f"relign/{mode}"]["best_step_seconds"], runs[f"trl/{mode}"]["best_step_seconds"])]
        c["paired_step_speed_ratios_relign_over_trl"] = paired
        c["median_paired_step_speed_ratio_relign_over_trl"] = _median(paired)
        checks[mode] = c
        if not same_ids:
            print(f"WARNING [{mode}]: relign and TRL tokenize {c['pairs_with_different_ids']} pairs differently", file=sys.stderr)
        if abs(rl[0] - tl[0]) > 1e-4:
            print(f"WARNING [{mode}]: first-step losses differ: relign {rl[0]:.6f} TRL {tl[0]:.6f}", file=sys.stderr)

    comparisons = []
    for mode in modes:
        r, t = runs[f"relign/{mode}"], runs[f"trl/{mode}"]
        cmp = {
            "mode": mode,
            "relign_pairs_per_s": r["pairs_per_s"], "trl_pairs_per_s": t["pairs_per_s"],
            "throughput_ratio_relign_over_trl": r["pairs_per_s"] / t["pairs_per_s"],
            "median_paired_step_speed_ratio_relign_over_trl": checks[mode]["median_paired_step_speed_ratio_relign_over_trl"],
            "relign_pairs_per_cpu_s": r["pairs_per_cpu_s"], "trl_pairs_per_cpu_s": t["pairs_per_cpu_s"],
            "cpu_efficiency_ratio_relign_over_trl": r["pairs_per_cpu_s"] / t["pairs_per_cpu_s"],
            "relign_peak_rss_mb": r["peak_rss_mb"], "trl_peak_rss_mb": t["peak_rss_mb"],
            "peak_rss_ratio_relign_over_trl": r["peak_rss_mb"] / t["peak_rss_mb"],
        }
        if r["ref_precompute_seconds"] and t["ref_precompute_seconds"]:
            cmp.update({"relign_ref_precompute_seconds": r["ref_precompute_seconds"],
                        "trl_ref_precompute_seconds": t["ref_precompute_seconds"],
                        "ref_precompute_speed_ratio_relign_over_trl": t["ref_precompute_seconds"] / r["ref_precompute_seconds"]})
        comparisons.append(cmp)

    lens = prep["lengths"]
    pos = prep["positions_per_step"]
    out = {
        "benchmark": "dpo_throughput",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", "bench/dpo_throughput.py", *(argv if argv is not None else sys.argv[1:])]),
        "total_seconds": None,
        "setup": {
            "model": "relign.models.tiny.build_tiny_model(arch='qwen2', size='small')",
            "model_config": {k: model_cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                           "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")},
            "parameters": n_params,
            "data": str(DATA.relative_to(REPO)),
            "lengths": lens,
            "steps": a.steps, "warmup_steps": a.warmup, "repeats": a.repeats, "batch_size_pairs": a.batch_size,
            "micro_batch_size_pairs": a.micro_batch_size, "grad_accum": a.batch_size // a.micro_batch_size,
            "ref_precompute_batch_pairs": a.ref_batch_size, "max_length": a.max_length, "loss": "sigmoid DPO",
            "beta": a.beta, "lr": a.lr, "lr_schedule": "constant", "max_grad_norm": 1.0, "weight_decay": 0.0,
            "optimizer": "AdamW fused (both)", "seed": a.seed, "dtype": "fp32", "device": "cpu", "attn_implementation": "sdpa",
            "relign_extra_overrides": a.relign_set,
            "model_positions_per_timed_step_mean": {k: sum(v[a.warmup:]) / len(v[a.warmup:]) for k, v in pos.items()},
            "throughput_definition": "pairs of the timed steps / sum over timed steps of the step's wall time (end of previous "
                                     "step to end of this step), the fastest repeat for each step",
            "peak_rss_definition": "VmHWM of the worker process (imports, data, model load, reference, training); max over repeats",
            "ref_precompute_definition": "relign: its logged time/reference_s (the precompute); TRL: "
                                         "DPOTrainer._precompute_ref_logps (forwards + writing the arrow cache); fastest repeat",
        },
        "env": {
            "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "relign": relign.__version__, "torch_threads": runs[next(iter(runs))]["torch_threads"], "relign_git": git_before,
            "loadavg_start": la_start, "loadavg_end": la_end,
        },
        "checks": checks,
        "comparisons": comparisons,
        "runs": runs,
    }

    # ---- markdown
    threads = out["env"]["torch_threads"]
    lines = [
        f"DPO throughput: relign {relign.__version__} vs TRL {trl.__version__} DPOTrainer (tiny qwen2 'small', "
        f"{n_params / 1e6:.1f}M params, fp32, CPU, {threads} torch threads, torch {torch.__version__}, transformers "
        f"{transformers.__version__}; relign @ {git_before['commit'][:7]}{' + uncommitted changes' if git_before['dirty'] else ''})",
        f"{lens['pairs_kept']} Orca pairs (of {lens['pairs_in_file']}; {lens['pairs_truncated']} truncated, "
        f"{lens['pairs_dropped_prompt_too_long']} dropped), max_length {a.max_length}, mean tokens prompt "
        f"{lens['mean_prompt_tokens']:.0f} / chosen {lens['mean_chosen_tokens']:.0f} / rejected {lens['mean_rejected_tokens']:.0f}; "
        f"batch {a.batch_size} pairs = {a.batch_size // a.micro_batch_size} x micro-batch {a.micro_batch_size}, sigmoid beta {a.beta}, "
        f"AdamW lr {a.lr}; {a.steps - a.warmup} timed steps ({a.warmup} warmup) x {a.repeats} repeat(s)"
        + (f"; relign overrides: {' '.join(a.relign_set)}" if a.relign_set else ""),
        "",
        "| mode | library | pairs/s | s/step | pairs per CPU-s | ref precompute s | peak RSS MB | RSS after imports MB | other load (cores) "
        "| relign/TRL pairs/s | median paired step | relign/TRL pairs per CPU-s | relign/TRL peak RSS |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cmp in comparisons:
        mode = cmp["mode"]
        for lib in LIBS:
            r = runs[f"{lib}/{mode}"]
            if lib == "relign":
                label = f"relign dpo (reference={mode})"
                ratio = (f"**{cmp['throughput_ratio_relign_over_trl']:.2f}x**", f"{cmp['median_paired_step_speed_ratio_relign_over_trl']:.2f}x",
                         f"{cmp['cpu_efficiency_ratio_relign_over_trl']:.2f}x", f"**{cmp['peak_rss_ratio_relign_over_trl']:.2f}x**")
            else:
                label = "TRL DPOTrainer (" + ("precompute_ref_log_probs=True" if mode == "precompute" else "default: reference model") + ")"
                ratio = ("", "", "", "")
            ref = f"{r['ref_precompute_seconds']:.2f}" if r["ref_precompute_seconds"] else "-"
            lines.append(f"| {mode} | {label} | {r['pairs_per_s']:.2f} | {r['seconds_per_step']:.2f} | {r['pairs_per_cpu_s']:.3f} | {ref} | "
                         f"{r['peak_rss_mb']:,.0f} | {r['rss_after_imports_mb']:,.0f} | {r['other_load_cores']:.2f} | "
                         f"{ratio[0]} | {ratio[1]} | {ratio[2]} | {ratio[3]} |")
    lines.append("")
    for mode in modes:
        c = checks[mode]
        extra = f", max |ref logp diff|={c['max_abs_ref_logp_diff']:.1e}" if "max_abs_ref_logp_diff" in c else ""
        lines.append(
            f"check [{mode}]: same token ids every pair={c['same_token_ids_every_pair']}{extra}, step-1 loss relign "
            f"{c['step1_loss']['relign']:.6f} / TRL {c['step1_loss']['trl']:.6f} (log 2 = 0.693147), max |loss diff| over "
            f"{a.steps} steps={c['max_abs_loss_diff']:.1e}, max rel grad-norm diff={c['max_rel_grad_norm_diff']:.1e}"
        )
    mp = out["setup"]["model_positions_per_timed_step_mean"]
    lines.append(f"model positions per step (padding included): TRL {mp['trl_full_rows']:,.0f}, relign packed prompt once "
                 f"{mp['relign_packed_prompt_once']:,.0f}, relign KV-cache shared prompt {mp['relign_kv_cache_prompt']:,.0f} "
                 f"(real tokens: full rows {mp['real_full_rows']:,.0f}, prompt once {mp['real_prompt_once']:,.0f})")
    worst = max(r["other_load_cores"] for r in runs.values())
    lines.append(f"load average (1/5/15 min) at start {la_start}, at end {la_end}; other processes used up to {worst:.2f} "
                 f"of {os.cpu_count()} cores during the kept steps")
    if _git_state() != git_before:
        lines.append("  WARNING: the relign checkout changed while the benchmark ran; runs may mix versions")
        out["env"]["relign_git_after"] = _git_state()
    out["total_seconds"] = time.perf_counter() - t_start
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    tmp_out = a.out + ".tmp"
    with open(tmp_out, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp_out, a.out)
    lines.append(f"JSON: {os.path.relpath(a.out, REPO)} (total {out['total_seconds']:.0f} s)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
