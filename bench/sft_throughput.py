"""SFT training throughput and peak memory: relign's SFT recipe vs TRL's ``SFTTrainer``.

    python bench/sft_throughput.py            # 2 modes x 2 libraries x 2 repeats x 10 steps, ~8-9 min on 2 cores
    python bench/sft_throughput.py --quick    # 2 modes x 2 libraries x 5 steps, ~2 min, a smoke test
    python bench/sft_throughput.py --steps 30 --repeats 3 --modes padded
    python bench/sft_throughput.py --precision bf16 --out bench/results/sft_throughput_bf16.json

Both libraries train the same tiny random Qwen2 model (``relign.models.tiny``, "small", ~10M
parameters, fp32, CPU, sdpa attention) on the shipped chat file ``gsm8k_sft.jsonl`` with the
same global batch, micro-batch, number of steps, AdamW settings and assistant-only loss. Each
run is a fresh subprocess, so its peak RSS (VmHWM) is its own.

What is held identical (and checked at the end of the run):
  * the batches: TRL's dataset is laid out in the exact order relign's ``StepSampler`` draws
    (same seed), and TRL reads it with ``train_sampling_strategy="sequential"``; so every
    optimizer step sees the same examples (how each library splits them into micro-batches is
    its own business). The per-step token counts of the two sides are compared.
  * the tokens and the loss mask: TRL gets conversational prompt/completion rows
    (``prompt=[user]``, ``completion=[assistant]``, ``completion_only_loss``); for this ChatML
    template that tokenizes to exactly relign's ids and assistant mask (content + ``<|im_end|>\\n``).
    ``max_length`` defaults to 768, above the longest example (717 tokens), so neither side
    truncates (TRL's padding-free mode refuses ``max_length`` without packing).
  * the loss: token-mean over the whole step's batch in both (TRL normalizes by
    ``num_items_in_batch``); the per-step losses are compared as a correctness check.
  * the optimizer: ``torch.optim.AdamW(fused=True)`` with the same lr / betas / eps / weight
    decay (0), constant schedule, no warmup, grad-norm clipping at 1.0: relign uses the fused
    kernel on one process, and so does TRL's default ``adamw_torch_fused`` (the default
    here; ``--trl-optim adamw_torch`` gives TRL the unfused one).

Modes (like with like):
  packed  relign ``packing=true`` (each micro-batch concatenated into one row with restarting
          position ids) vs TRL ``padding_free=True, packing=False`` (the same flattening).
  padded  relign ``packing=false`` vs TRL with padding (attention mask, right padding).

Throughput = non-pad tokens fed to the model / wall time, over the steps after ``--warmup``,
each step timed from the end of the previous one (so data loading, collation, logging and the
optimizer step are all included for both). A shared VM's CPU comes and goes in bursts that
can make single steps 3-5x slower, so every run is repeated (``--repeats``, interleaved) and
each step counts with its fastest repeat: the repeats run identical batches, so this is the
same work. Because both libraries also run identical batches, the median of the per-step
time ratios relign/TRL is reported as well; it is the most noise-proof number. Output: a markdown table on stdout and bench/results/sft_throughput.json.
Nothing is downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
DATA = REPO / "relign" / "data" / "samples" / "gsm8k_sft.jsonl"
RESULTS = REPO / "bench" / "results" / "sft_throughput.json"
MODES = ("packed", "padded")


# ----------------------------------------------------------------------------- helpers


def _proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # kB -> MiB
    return float("nan")


def _peak_rss_mb() -> float:
    hwm = _proc_status_mb("VmHWM")
    if hwm == hwm:  # not NaN
        return hwm
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all processes, all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _usage() -> tuple[float, int, int, float]:
    """(this process's user + system CPU seconds, minor faults, major faults, machine busy CPU seconds)."""
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime, u.ru_minflt, u.ru_majflt, _machine_busy_seconds()


def _wait_quiet(max_wait: float, threshold_cores: float = 0.3, window: float = 2.0) -> float:
    """Wait (at most ``max_wait`` s) until the rest of the machine uses < ``threshold_cores``
    over a ``window``; returns the load of the last window, in cores."""
    deadline = time.monotonic() + max_wait
    while True:
        b0 = _machine_busy_seconds()
        time.sleep(window)
        load = (_machine_busy_seconds() - b0) / window
        if load < threshold_cores or time.monotonic() >= deadline or load != load:
            return load


def relign_order(n: int, batch_size: int, steps: int, seed: int) -> list[int]:
    """The example indices relign's StepSampler yields for ``steps`` steps, flattened
    (a re-implementation, checked against relign's own sampler in the parent process)."""
    import torch

    order: list[int] = []
    epoch, pos, perm = 0, 0, None
    for _ in range(steps):
        if pos + batch_size > n:
            epoch, pos, perm = epoch + 1, 0, None
        if perm is None:
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        order.extend(perm[pos : pos + batch_size])
        pos += batch_size
    return order


def _timed_window(end_times: list[float], tokens: list[float], warmup: int) -> dict[str, float]:
    """tokens/s over steps warmup+1..N, timed from the end of step ``warmup`` to the end of step N."""
    n = len(end_times)
    if not 1 <= warmup < n:
        raise RuntimeError(f"{n} steps recorded, need 1 <= warmup ({warmup}) < steps")
    seconds = end_times[-1] - end_times[warmup - 1]
    toks = sum(tokens[warmup:])
    return {
        "timed_steps": n - warmup,
        "timed_seconds": seconds,
        "timed_tokens": toks,
        "tokens_per_s": toks / seconds,
        "seconds_per_step": seconds / (n - warmup),
    }


# ----------------------------------------------------------------------------- workers


def worker_relign(a: argparse.Namespace) -> dict:
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from relign.config import load_config
    from relign.recipes.sft import Config, train
    from relign.tracking import add_listener

    rss_after_imports = _proc_status_mb("VmRSS")
    usage: list[tuple[float, int, int]] = []
    # CPU time / page faults at every step's metrics row, through the public in-process hook
    add_listener(lambda step, metrics: usage.append(_usage()) if "perf/tokens" in metrics else None)
    run_dir = tempfile.mkdtemp(prefix="relign-sft-bench-")
    overrides = [
        f"model.path={a.model}",
        f"model.dtype={'bf16-mixed' if a.precision == 'bf16' else 'fp32'}",
        "model.attn_implementation=sdpa",
        f"data.path={DATA}",
        f"data.max_length={a.max_length}",
        f"batch_size={a.batch_size}",
        f"micro_batch_size={a.micro_batch_size}",
        f"max_steps={a.steps}",
        f"packing={'true' if a.mode == 'packed' else 'false'}",
        f"optim.lr={a.lr}",
        "optim.weight_decay=0.0",
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        "optim.warmup_ratio=0.0",
        "optim.max_grad_norm=1.0",
        f"seed={a.seed}",
        "device=cpu",
        "logging.progress=false",
        "logging.tensorboard=false",
        "checkpoint.save_final=false",
        "checkpoint.save_every=0",
        f"run_dir={run_dir}",
        *a.relign_set,
    ]
    try:
        cfg = load_config(Config, None, overrides)
        t0 = time.perf_counter()
        result = train(cfg)
        total = time.perf_counter() - t0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    rows = [r for r in result.history if "perf/tokens" in r]
    rows.sort(key=lambda r: r["step"])
    out = {
        "library": "relign",
        "steps": len(rows),
        "step_tokens": [r["perf/tokens"] for r in rows],
        "step_losses": [r["train/loss"] for r in rows],
        "step_end_times": [r["time"] for r in rows],
        "inner_step_seconds": [r["perf/step_seconds"] for r in rows],
        "step_end_usage": usage,
        "train_call_seconds": total,
        "rss_after_imports_mb": rss_after_imports,
        "config": {"packing": a.mode == "packed", "optimizer": "torch.optim.AdamW (relign.optim.build_optimizer)"},
    }
    return out


def worker_trl(a: argparse.Namespace) -> dict:
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    import datasets
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    rss_after_imports = _proc_status_mb("VmRSS")

    # Same rows, in the order relign's sampler draws them, as conversational prompt/completion.
    rows = [json.loads(line) for line in open(DATA) if line.strip()]
    order = relign_order(len(rows), a.batch_size, a.steps, a.seed)

    def to_pc(r):
        msgs = r["messages"]
        return {"prompt": [m for m in msgs if m["role"] != "assistant"], "completion": [m for m in msgs if m["role"] == "assistant"]}

    train_ds = datasets.Dataset.from_list([to_pc(rows[i]) for i in order])
    padding_free = a.mode == "packed"
    out_dir = tempfile.mkdtemp(prefix="trl-sft-bench-")
    args = SFTConfig(
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
        optim=a.trl_optim,
        seed=a.seed,
        bf16=a.precision == "bf16",  # fp32 weights, bf16 autocast: what relign's model.dtype=bf16-mixed does
        fp16=False,
        gradient_checkpointing=False,  # SFTConfig defaults to True; relign's default is False
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="steps",
        logging_steps=1,  # relign logs every step too; also gives us per-step losses
        disable_tqdm=True,
        train_sampling_strategy="sequential",  # the dataset is already in relign's order
        max_length=None if padding_free else a.max_length,  # padding-free refuses max_length without packing
        padding_free=padding_free,
        packing=False,
        completion_only_loss=True,
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
    )
    tok = AutoTokenizer.from_pretrained(a.model)

    class Timer(TrainerCallback):
        def __init__(self):
            self.end_times: list[float] = []
            self.tokens: list[float] = []
            self.losses: list[float] = []
            self.usage: list[tuple[float, int, int]] = []
            self.trainer = None
            self._last_total = 0

        def on_step_end(self, args, state, control, **kw):
            self.end_times.append(time.time())
            self.usage.append(_usage())
            total = self.trainer._total_train_tokens
            self.tokens.append(float(total - self._last_total))
            self._last_total = total

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    timer = Timer()
    try:
        trainer = SFTTrainer(model=a.model, args=args, train_dataset=train_ds, processing_class=tok, callbacks=[timer])
        timer.trainer = trainer
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        # Sanity: the prepared dataset must hold exactly relign's tokens and mask.
        prepared = trainer.train_dataset
        t0 = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - t0
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # unwrap accelerate's wrapper
        optimizer_name = type(opt).__name__
        opt_defaults = {k: v for k, v in opt.defaults.items() if k in ("lr", "betas", "eps", "fused", "foreach")}
        opt_defaults["group_weight_decay"] = sorted({g["weight_decay"] for g in opt.param_groups})
        checkpointing = bool(getattr(trainer.model, "is_gradient_checkpointing", False))
        first_ids = [list(prepared[i]["input_ids"]) for i in range(min(len(prepared), a.batch_size))]
        first_labels = [list(prepared[i]["labels"]) for i in range(min(len(prepared), a.batch_size))]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {
        "library": "trl",
        "steps": len(timer.end_times),
        "step_tokens": timer.tokens,
        "step_losses": timer.losses,
        "step_end_times": timer.end_times,
        "step_end_usage": timer.usage,
        "train_call_seconds": total,
        "rss_after_imports_mb": rss_after_imports,
        "first_batch_input_ids": first_ids,
        "first_batch_labels": first_labels,
        "config": {
            "padding_free": padding_free,
            "packing": False,
            "max_length": args.max_length,
            "optim": str(args.optim),
            "optimizer": optimizer_name,
            "optimizer_defaults": {k: (list(v) if isinstance(v, tuple) else v) for k, v in opt_defaults.items()},
            "gradient_checkpointing": checkpointing,
            "fused_lm_head": True,
        },
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "datasets": datasets.__version__},
    }


def run_worker(a: argparse.Namespace) -> None:
    import torch

    fn = worker_relign if a.worker == "relign" else worker_trl
    res = fn(a)
    res["mode"] = a.mode
    res["peak_rss_mb"] = _peak_rss_mb()
    res["torch_threads"] = torch.get_num_threads()
    res.update(_timed_window(res["step_end_times"], res["step_tokens"], a.warmup))
    u = res["step_end_usage"]
    res["timed_cpu_seconds"] = u[-1][0] - u[a.warmup - 1][0]
    res["tokens_per_cpu_s"] = res["timed_tokens"] / res["timed_cpu_seconds"]
    res["timed_minor_faults"] = u[-1][1] - u[a.warmup - 1][1]
    res["timed_major_faults"] = u[-1][2] - u[a.warmup - 1][2]
    # CPU the rest of the machine used meanwhile, in cores (other processes compete for the same cores)
    res["other_load_cores"] = ((u[-1][3] - u[a.warmup - 1][3]) - res["timed_cpu_seconds"]) / res["timed_seconds"]
    res["step_other_load_cores"] = [
        ((y[3] - x[3]) - (y[0] - x[0])) / max(t1 - t0, 1e-9)
        for x, y, t0, t1 in zip(u, u[1:], res["step_end_times"], res["step_end_times"][1:])
    ]
    with open(a.result, "w") as f:
        json.dump(res, f)


# ----------------------------------------------------------------------------- parent


def _check_same_examples(model_dir: str, max_length: int, batch_size: int, steps: int, seed: int) -> dict:
    """relign's tokenization of the rows relign will draw, for comparison with TRL's first batch."""
    from transformers import AutoTokenizer

    from relign.data.collate import StepSampler
    from relign.data.sft import build_sft_examples

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples, stats = build_sft_examples(str(DATA), tok, max_length=max_length)
    sampler = StepSampler(len(examples), batch_size, seed=seed)
    theirs = [i for _ in range(steps) for i in sampler.next()]
    mine = relign_order(len(examples), batch_size, steps, seed)
    if theirs != mine:
        raise RuntimeError("bench's copy of relign's sampling order disagrees with relign.data.collate.StepSampler")
    first = [examples[i] for i in mine[:batch_size]]
    return {"examples": examples, "stats": stats, "order": mine, "first": first}


def _spawn(lib: str, mode: str, a: argparse.Namespace, model_dir: str, tmp: str) -> dict:
    result = os.path.join(tmp, f"{lib}-{mode}.json")
    cmd = [
        sys.executable, os.path.abspath(__file__), "--worker", lib, "--mode", mode, "--model", model_dir,
        "--result", result, "--steps", str(a.steps), "--warmup", str(a.warmup), "--batch-size", str(a.batch_size),
        "--micro-batch-size", str(a.micro_batch_size), "--max-length", str(a.max_length), "--lr", str(a.lr),
        "--seed", str(a.seed), "--trl-optim", a.trl_optim, "--threads", str(a.threads), "--precision", a.precision,
        *[f"--relign-set={x}" for x in a.relign_set],
    ]
    load_before = _wait_quiet(a.wait_quiet) if a.wait_quiet > 0 else None
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
    return res


def _fmt(x: float, nd: int = 0) -> str:
    return f"{x:,.{nd}f}"


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def _step_seconds(run: dict, warmup: int) -> list[float]:
    """Wall seconds of each timed step (end of previous step to end of this one)."""
    e = run["step_end_times"]
    return [e[k] - e[k - 1] for k in range(max(1, warmup), len(e))]


def _summarize(reps: list[dict], warmup: int) -> dict:
    """Fold the repeats of one (library, mode): every repeat runs the same batches, so for each
    timed step keep its fastest wall time (the least disturbed by the rest of the machine)."""
    base = reps[0]
    for r in reps[1:]:
        if r["step_tokens"] != base["step_tokens"]:
            raise RuntimeError("repeats of the same run saw different batches")
    per_rep = [_step_seconds(r, warmup) for r in reps]
    best_idx = [min(range(len(col)), key=col.__getitem__) for col in zip(*per_rep)]
    best = [per_rep[j][k] for k, j in enumerate(best_idx)]
    # load of the rest of the machine during the steps that were kept
    best_load = [reps[j]["step_other_load_cores"][warmup - 1 + k] for k, j in enumerate(best_idx)]
    tokens = base["step_tokens"][warmup:]
    out = {k: v for k, v in base.items() if k not in ("step_end_times", "step_end_usage", "inner_step_seconds", "step_other_load_cores")}
    out.update({
        "tokens_per_s": sum(tokens) / sum(best),
        "seconds_per_step": sum(best) / len(best),
        "best_step_seconds": best,
        "best_step_other_load_cores": best_load,
        "other_load_cores": sum(b * t for b, t in zip(best_load, best)) / sum(best),
        "timed_tokens": sum(tokens),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in reps),
        "rss_after_imports_mb": max(r["rss_after_imports_mb"] for r in reps),
        "repeats": [
            {k: r.get(k) for k in ("tokens_per_s", "seconds_per_step", "tokens_per_cpu_s", "timed_cpu_seconds", "timed_minor_faults",
                                   "other_load_cores", "other_load_cores_before_start", "peak_rss_mb", "train_call_seconds",
                                   "process_wall_seconds")}
            | {"step_seconds": _step_seconds(r, warmup)}
            for r in reps
        ],
    })
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="run every (library, mode) this many times, interleaved; each step's fastest repeat counts (default 2)")
    p.add_argument("--quick", action="store_true", help="smoke test: 5 steps (2 warmup), 1 repeat")
    p.add_argument("--modes", default="packed,padded", help="comma list of: packed, padded")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=768, help="default 768 keeps every example whole (longest: 717)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads in every run (0: torch's default)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: fp32 weights, bf16 autocast on both sides (relign model.dtype=bf16-mixed, TRL bf16=True)")
    p.add_argument("--trl-optim", default="adamw_torch_fused", help="TRL optim name (adamw_torch_fused = TRL's default and relign's fused AdamW)")
    p.add_argument("--wait-quiet", type=float, default=30.0,
                   help="before each run, wait up to this many seconds for other processes to leave the CPU idle (0: don't)")
    p.add_argument("--relign-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra override of relign's SFT config (repeatable), e.g. model.lean_activations=false")
    p.add_argument("--out", default=str(RESULTS), help="JSON results path")
    # internal
    p.add_argument("--worker", choices=("relign", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warmup, a.repeats = 5, 2, 1
    if a.worker:
        run_worker(a)
        return
    if a.batch_size % a.micro_batch_size:
        p.error("--batch-size must be a multiple of --micro-batch-size")
    if a.warmup < 1 or a.steps <= a.warmup:
        p.error("need 1 <= --warmup < --steps")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
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
    tmp = tempfile.mkdtemp(prefix="sft-bench-")
    try:
        model_dir = os.path.join(tmp, "model")
        build_tiny_model(model_dir, arch="qwen2", size="small")
        with open(os.path.join(model_dir, "config.json")) as f:
            model_cfg = json.load(f)
        from transformers import AutoModelForCausalLM

        n_params = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        ref = _check_same_examples(model_dir, a.max_length, a.batch_size, a.steps, a.seed)

        all_runs: dict[str, list[dict]] = {f"{lib}/{m}": [] for m in modes for lib in ("relign", "trl")}
        for rep in range(a.repeats):
            for mode in modes:  # interleaved, so slow drift of the machine hits both sides alike
                for lib in ("relign", "trl"):
                    print(f"[{rep + 1}/{a.repeats}] {lib} / {mode}: {a.steps} steps ...", file=sys.stderr, flush=True)
                    all_runs[f"{lib}/{mode}"].append(_spawn(lib, mode, a, model_dir, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    runs = {k: _summarize(v, a.warmup) for k, v in all_runs.items()}

    # ---- checks: same examples, tokens and masks; same per-step token counts; losses agree
    checks: dict[str, object] = {}
    first = ref["first"]
    for mode in modes:
        r, t = runs[f"relign/{mode}"], runs[f"trl/{mode}"]
        ids_ok = t["first_batch_input_ids"] == [e.input_ids for e in first]
        labels_ok = all(
            [lab != -100 for lab in labels][1:] == [bool(m) for m in e.loss_mask][1:]
            for labels, e in zip(t["first_batch_labels"], first)
        )
        tokens_ok = r["step_tokens"] == t["step_tokens"]
        diffs = [abs(x - y) for x, y in zip(r["step_losses"], t["step_losses"])]
        # the same batch runs on both sides, so step k of relign and step k of TRL do the same work
        paired = [ts / rs for rs, ts in zip(r["best_step_seconds"], t["best_step_seconds"])]
        checks[mode] = {
            "first_batch_same_input_ids": ids_ok,
            "first_batch_same_loss_mask": labels_ok,
            "same_tokens_every_step": tokens_ok,
            "max_abs_loss_diff": max(diffs) if diffs else None,
            "step1_loss": {"relign": r["step_losses"][0], "trl": t["step_losses"][0]},
            "paired_step_speed_ratios_relign_over_trl": paired,
            "median_paired_step_speed_ratio_relign_over_trl": _median(paired),
        }
        for k in ("first_batch_same_input_ids", "first_batch_same_loss_mask", "same_tokens_every_step"):
            if not checks[mode][k]:
                print(f"WARNING [{mode}]: {k} is false - the comparison is not like for like", file=sys.stderr)
        t.pop("first_batch_input_ids", None)
        t.pop("first_batch_labels", None)
    if "packed" in modes and "padded" in modes:
        pk, pd = runs["relign/packed"]["step_losses"], runs["relign/padded"]["step_losses"]
        checks["relign_packed_vs_padded_max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(pk, pd))

    comparisons = []
    for mode in modes:
        r, t = runs[f"relign/{mode}"], runs[f"trl/{mode}"]
        comparisons.append({
            "mode": mode,
            "relign_tokens_per_s": r["tokens_per_s"],
            "trl_tokens_per_s": t["tokens_per_s"],
            "throughput_ratio_relign_over_trl": r["tokens_per_s"] / t["tokens_per_s"],
            "median_paired_step_speed_ratio_relign_over_trl": checks[mode]["median_paired_step_speed_ratio_relign_over_trl"],
            "relign_peak_rss_mb": r["peak_rss_mb"],
            "trl_peak_rss_mb": t["peak_rss_mb"],
            "peak_rss_ratio_relign_over_trl": r["peak_rss_mb"] / t["peak_rss_mb"],
        })

    out = {
        "benchmark": "sft_throughput",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", "bench/sft_throughput.py", *(argv if argv is not None else sys.argv[1:])]),
        "total_seconds": None,
        "setup": {
            "model": "relign.models.tiny.build_tiny_model(arch='qwen2', size='small')",
            "model_config": {k: model_cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")},
            "parameters": n_params,
            "data": str(DATA.relative_to(REPO)),
            "examples": len(ref["examples"]),
            "mean_tokens_per_example": sum(len(e) for e in ref["examples"]) / len(ref["examples"]),
            "truncated_examples": ref["stats"].truncated,
            "steps": a.steps, "warmup_steps": a.warmup, "repeats": a.repeats, "batch_size": a.batch_size,
            "micro_batch_size": a.micro_batch_size, "grad_accum": a.batch_size // a.micro_batch_size,
            "max_length": a.max_length, "lr": a.lr, "seed": a.seed,
            "dtype": "fp32 weights, bf16 autocast" if a.precision == "bf16" else "fp32", "device": "cpu",
            "attn_implementation": "sdpa", "lr_schedule": "constant", "max_grad_norm": 1.0, "weight_decay": 0.0,
            "trl_optim": a.trl_optim,
            "trl_data_format": "conversational prompt/completion (prompt=[user], completion=[assistant]), completion_only_loss=True, "
                               "rows in relign's sampling order, train_sampling_strategy='sequential'",
            "throughput_definition": "non-pad tokens of the timed steps / sum over timed steps of the step's wall time "
                                     "(end of previous step to end of this step), the fastest of the repeats for each step",
            "peak_rss_definition": "VmHWM of the worker process (whole run: imports, data preparation, model load, training); max over repeats",
        },
        "env": {
            "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "relign": relign.__version__,
        },
        "checks": checks,
        "comparisons": comparisons,
        "runs": runs,
    }

    # ---- markdown
    threads = runs[next(iter(runs))]["torch_threads"]
    lines = [
        f"SFT throughput: relign {relign.__version__} vs TRL {trl.__version__} SFTTrainer "
        f"(tiny qwen2 'small', {n_params / 1e6:.1f}M params, {out['setup']['dtype']}, CPU, {threads} torch threads, torch {torch.__version__}, "
        f"transformers {transformers.__version__})",
        f"batch {a.batch_size} = {a.batch_size // a.micro_batch_size} x micro-batch {a.micro_batch_size}, {a.steps} steps "
        f"({a.warmup} warmup untimed) x {a.repeats} repeat(s), max_length {a.max_length}, AdamW lr {a.lr} constant "
        f"(TRL optim={a.trl_optim}), {len(ref['examples'])} gsm8k chat rows, {out['setup']['mean_tokens_per_example']:.0f} tokens/row",
        "",
        "| mode | library | tokens/s | s/step | other load (cores) | peak RSS MB | RSS after imports MB | relign/TRL tokens/s | relign/TRL median paired step | relign/TRL peak RSS |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in comparisons:
        mode = c["mode"]
        for lib in ("relign", "trl"):
            r = runs[f"{lib}/{mode}"]
            if lib == "relign":
                ratio = (f"{c['throughput_ratio_relign_over_trl']:.2f}x", f"{c['median_paired_step_speed_ratio_relign_over_trl']:.2f}x",
                         f"{c['peak_rss_ratio_relign_over_trl']:.2f}x")
                label = f"relign sft (packing={'true' if mode == 'packed' else 'false'})"
            else:
                ratio = ("", "", "")
                label = f"TRL SFTTrainer ({'padding_free=True' if mode == 'packed' else 'padded'})"
            lines.append(
                f"| {mode} | {label} | {_fmt(r['tokens_per_s'])} | {r['seconds_per_step']:.2f} | {r['other_load_cores']:.2f} | {_fmt(r['peak_rss_mb'])} | "
                f"{_fmt(r['rss_after_imports_mb'])} | {ratio[0]} | {ratio[1]} | {ratio[2]} |"
            )
    lines.append("")
    for mode in modes:
        c = checks[mode]
        lines.append(
            f"check [{mode}]: same ids={c['first_batch_same_input_ids']}, same loss mask={c['first_batch_same_loss_mask']}, "
            f"same tokens every step={c['same_tokens_every_step']}, max |loss diff| relign-TRL={c['max_abs_loss_diff']:.1e}"
        )
        agg = next(x for x in comparisons if x["mode"] == mode)["throughput_ratio_relign_over_trl"]
        if abs(c["median_paired_step_speed_ratio_relign_over_trl"] / agg - 1) > 0.15:
            lines.append(
                f"  note [{mode}]: the aggregate ratio ({agg:.2f}x) and the median paired-step ratio "
                f"({c['median_paired_step_speed_ratio_relign_over_trl']:.2f}x) disagree by >15%: the machine was noisy; "
                "trust the median, or rerun with more --repeats"
            )
    worst = max(r["other_load_cores"] for r in runs.values())
    if worst > 0.25:
        lines.append(
            f"  note: other processes used up to {worst:.2f} of the {os.cpu_count()} cores during the kept steps; "
            "absolute tokens/s are low by roughly that share, ratios are less affected"
        )
    if "relign_packed_vs_padded_max_abs_loss_diff" in checks:
        lines.append(
            f"check: relign packed vs padded max |loss diff|={checks['relign_packed_vs_padded_max_abs_loss_diff']:.1e} "
            "(packing keeps examples apart)"
        )
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
