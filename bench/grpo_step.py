"""GRPO step time and peak memory: relign's RL recipe vs TRL's ``GRPOTrainer``, side by side.

    python bench/grpo_step.py            # 2 libraries x 2 repeats x 10 steps (2 warmup), ~10 min on 2 cores
    python bench/grpo_step.py --quick    # 2 libraries x 1 repeat x 4 steps (1 warmup), ~2 min, a smoke test
    python bench/grpo_step.py --prompts-per-step 8 --max-new-tokens 64    # the earlier (2026-11-21) setup

Both libraries run GRPO on the same tiny random Qwen2 model (``relign.models.tiny``, "small",
10.4M parameters, fp32, CPU, sdpa attention), in a fresh subprocess per run (so each run's
peak RSS, VmHWM, is its own), and both are driven through their public interfaces only:
relign's ``rl.train(config)`` and its run directory (``metrics.jsonl`` with the recipe's own
stage timers ``time/*``, ``rollouts/step_N.jsonl``); TRL's ``GRPOTrainer`` (its generation and
reward phases are timed by overriding trainer methods, as a TRL user would). Settings:

  * the same prompts in the same order: 64 GSM8K questions (``gsm8k_train_512.jsonl``, field
    ``question``) as raw text (no chat template on either side; both tokenize with the
    tokenizer's defaults, checked equal). TRL's dataset is laid out in the order relign's
    ``StepSampler`` draws (same seed) and read with ``shuffle_dataset=False``; the prompt ids
    each step generates from are compared between the two sides.
  * the same amount of generation: 4 prompts x G=8 completions per step, exactly
    ``--max-new-tokens`` (128) tokens each: EOS is banned until then on both sides (relign
    ``rollout.min_new_tokens``, TRL ``generation_kwargs={"min_new_tokens": ...}``; transformers'
    ``generate`` has no ``ignore_eos``). Every step's generated-token count is checked equal.
    Sampling: temperature 1, top_p 1, top_k off, no vLLM (plain transformers ``generate`` in TRL,
    relign's own KV-cache engine ``HFEngine``), KV cache on both.
  * the same objective: GRPO advantages (group mean, divided by the group std), PPO clip 0.2/0.2,
    k3 KL to a separate frozen reference model with beta 0.04 (TRL ``use_bias_correction_kl=False``,
    the plain k3 term relign uses; relign ``algorithm.kl=loss``), loss aggregated per sequence then
    over sequences (TRL ``loss_type="grpo"`` = relign ``algorithm.loss_agg=seq-mean-token-mean``;
    with every completion equally long all aggregations coincide anyway), one optimizer step per
    rollout (TRL ``num_iterations=1``, ``steps_per_generation = gradient_accumulation_steps``, so
    no old-logp pass; relign ``ppo_epochs=1 mini_batches=1``), micro-batch 8 rows for every
    forward (relign ``micro_batch_size=8 max_tokens_per_micro=0``, TRL
    ``per_device_train_batch_size=8``; the reference pass too), fused AdamW lr 1e-6 constant,
    weight decay 0, grad-norm clip 1.0, no gradient checkpointing.
  * the same reward: ``digit_fraction`` below (share of digit characters in the decoded
    completion), called in the training process (relign ``task.reward_workers=0``).
  * relign's defaults otherwise, including ``share_prompt=true`` (training and reference forwards
    run each group's prompt once, same log-probs and gradients; TRL runs the prompt in every row).
    ``--relign-set share_prompt=false`` measures without it. relign writes its rollout traces
    (the bench reads the prompts and lengths from them); TRL ``log_completions=False``.

Timing, per optimizer step (= one rollout + one update on both sides):
  step      wall time from the end of the previous step to the end of this one (relign: the
            ``time`` of its metrics row; TRL: ``on_step_end``), so nothing is left out on either side.
  rollout   relign: ``time/rollout_s + time/reward_s`` (the collector: engine.generate, decode,
            reward). TRL: ``_generate`` (tokenize prompts + ``model.generate`` + decode) +
            ``_calculate_rewards``.
    generate  relign ``time/rollout_s`` (the collector without its reward part); TRL
            ``_generate_single_turn`` (padding + ``generate`` + EOS masking). Prefill + decode.
  train     step - rollout: batch building, reference log-probs, advantages, the micro-batch
            forward/backward passes, grad clip, optimizer step, metrics (and TRL's dataloader).
    ref     reference-model log-probs (relign ``time/reference_s``; TRL the no-grad
            ``_get_per_token_logps_and_entropies`` calls).
The first ``--warmup`` steps are not timed. Every run is repeated ``--repeats`` times
(interleaved, alternating which library goes first); each timed step counts with its fastest
repeat (the repeats do the same work; a shared VM's CPU comes and goes in bursts). The table
reports medians over the timed steps; ratios are relign/TRL times (< 1: relign faster) and
speedups TRL/relign. Output: a markdown table on stdout and bench/results/grpo_step.json.
Nothing is downloaded (HF_HUB_OFFLINE=1).
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
GSM8K = REPO / "relign" / "envs" / "data" / "gsm8k_train_512.jsonl"
RESULTS = REPO / "bench" / "results" / "grpo_step.json"
# relign-vllm: the same run with rollout.engine=vllm; relign-packed: with packing=true
LIBS = ("relign", "relign-vllm", "relign-packed", "relign-stale", "relign-async", "trl")
# rollout.max_staleness=1 sampled in turn (stale) or in a background thread while the update runs (async)
OFF_POLICY = ["rollout.max_staleness=1", "algorithm.tis_cap=2", "algorithm.tis_mode=mask"]
PHASES = ("step", "rollout", "generate", "reward", "train", "ref")


# ----------------------------------------------------------------------------- the reward (both sides)


def digit_fraction(text: str) -> float:
    """Share of digit characters in a completion: cheap, deterministic, varies between samples."""
    return sum(c.isdigit() for c in text) / max(1, len(text))


def relign_reward(prompt: str, response: str, extra_info: dict, **_) -> float:
    return digit_fraction(response)


def trl_reward(prompts, completions, **_) -> list[float]:
    return [digit_fraction(c) for c in completions]


def _digest(prompt_ids: list[list[int]]) -> str:
    return hashlib.sha1(json.dumps(prompt_ids).encode()).hexdigest()[:16]


class _Timers:
    """Accumulating per-phase timers, snapshotted at every step end."""

    def __init__(self):
        self.acc: dict[str, float] = {}
        self.info: dict[str, object] = {}
        self.rows: list[dict] = []

    def add(self, key: str, seconds: float) -> None:
        self.acc[key] = self.acc.get(key, 0.0) + seconds

    def step_end(self, **extra) -> None:
        self.rows.append({"end_time": time.time(), "usage": _usage(), **self.acc, **self.info, **extra})
        self.acc, self.info = {}, {}


# ----------------------------------------------------------------------------- workers


def worker_relign(a: argparse.Namespace) -> dict:
    """relign through its public interface only: ``rl.train`` on a config, then its run directory
    (metrics.jsonl with the recipe's stage timers time/*, rollouts/step_N.jsonl traces)."""
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    import relign.recipes.rl as rl
    from relign.config import load_config
    from relign.tracking import read_metrics
    from transformers import AutoTokenizer

    rss_after_imports = _proc_status_mb("VmRSS")
    run_dir = tempfile.mkdtemp(prefix="relign-grpo-bench-")
    n_completions = a.prompts_per_step * a.group
    overrides = [
        f"model.path={a.model}", f"model.dtype={'bf16-mixed' if a.precision == 'bf16' else 'fp32'}",
        "model.attn_implementation=sdpa",
        "task.name=custom", f"task.path={a.prompts}", f"task.reward_fn={THIS}:relign_reward", "task.chat=false",
        "task.reward_workers=0", "task.max_prompt_length=1024",
        f"rollout.n={a.group}", f"rollout.max_new_tokens={a.max_new_tokens}", f"rollout.min_new_tokens={a.max_new_tokens}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0",
        "algorithm.advantage=grpo", "algorithm.scale_rewards=std", "algorithm.loss_agg=seq-mean-token-mean",
        "algorithm.policy_loss=ppo_clip", "algorithm.clip_low=0.2", "algorithm.clip_high=0.2",
        f"algorithm.kl={'loss' if a.beta > 0 else 'none'}", f"algorithm.kl_coef={a.beta}", "algorithm.kl_estimator=k3",
        "algorithm.ppo_epochs=1", "algorithm.mini_batches=1",
        f"optim.lr={a.lr}", "optim.schedule=constant", "optim.weight_decay=0.0", "optim.warmup_steps=0",
        "optim.warmup_ratio=0.0", "optim.max_grad_norm=1.0",
        f"prompts_per_step={a.prompts_per_step}", f"micro_batch_size={a.micro_batch_size}", "max_tokens_per_micro=0",
        f"max_steps={a.steps}", f"seed={a.seed}", "device=cpu", f"traces_per_step={n_completions}",
        "logging.progress=false", "logging.tensorboard=false", "checkpoint.save_final=false", "checkpoint.save_every=0",
        f"run_dir={run_dir}",
        *(["rollout.engine=vllm"] if a.worker == "relign-vllm" else []),
        *(["packing=true"] if a.worker == "relign-packed" else []),
        *([*OFF_POLICY, "rollout.overlap=none"] if a.worker == "relign-stale" else []),
        *([*OFF_POLICY, "rollout.overlap=thread"] if a.worker == "relign-async" else []),
        *a.relign_set,
    ]
    tok = AutoTokenizer.from_pretrained(a.model)
    try:
        cfg = load_config(rl.Config, None, overrides)
        u0, t0 = _usage(), time.perf_counter()
        result = rl.train(cfg)
        u1, total = _usage(), time.perf_counter() - t0
        other_load = ((u1[3] - u0[3]) - (u1[0] - u0[0])) / max(total, 1e-9)  # per step needs hooks; per run does not
        rows = []
        for m in read_metrics(run_dir):
            if "time/step_s" not in m:
                continue
            traces = [json.loads(x) for x in open(os.path.join(run_dir, "rollouts", f"step_{m['step']}.jsonl"))]
            prompts = list(dict.fromkeys(t["prompt"] for t in traces))  # groups in draw order
            rows.append({
                "end_time": m["time"], "usage": None, "other_load_cores": other_load,
                "rollout": m["time/rollout_s"] + m["time/reward_s"], "reward": m["time/reward_s"],
                "generate": m["time/rollout_s"], "ref": m["time/reference_s"], "relign_update_s": m["time/update_s"],
                "relign_step_s": m["time/step_s"], "relign_stage_seconds": {k: v for k, v in m.items() if k.startswith("time/")},
                "prompts_digest": _digest([tok(p, add_special_tokens=True)["input_ids"] for p in prompts]),
                "n_prompts": len(prompts), "n_completions": len(traces), "gen_tokens": sum(t["length"] for t in traces),
            })
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "library": a.worker,
        "rows": rows,
        "train_call_seconds": total,
        "rss_after_imports_mb": rss_after_imports,
        "final_metrics": {k: v for k, v in result.metrics.items() if isinstance(v, (int, float, str))},
        "config": {
            # machine-specific paths replaced by placeholders, so results can be committed
            "overrides": [
                o.replace(str(a.model), "<model>").replace(str(a.prompts), "<prompts.jsonl>")
                .replace(str(THIS), "bench/grpo_step.py").replace(run_dir, "<run_dir>")
                for o in overrides
            ],
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
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    rss_after_imports = _proc_status_mb("VmRSS")
    T = _Timers()
    G = a.group

    rows = [json.loads(line) for line in open(a.prompts) if line.strip()]
    order = relign_order(len(rows), a.prompts_per_step, a.steps, a.seed)
    train_ds = datasets.Dataset.from_list([{"prompt": rows[i]["prompt"]} for i in order])

    class TimedGRPO(GRPOTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                T.add("rollout_generate_part", time.perf_counter() - t0)

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            T.add("generate", time.perf_counter() - t0)
            uniq = [list(p) for p in prompt_ids[::G]]
            T.info["prompts_digest"] = _digest(uniq)
            T.info["n_prompts"] = len(uniq)
            T.info["n_completions"] = len(completion_ids)
            T.info["gen_tokens"] = sum(len(c) for c in completion_ids)
            return completion_ids, logprobs

        def _calculate_rewards(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super()._calculate_rewards(*args, **kwargs)
            finally:
                T.add("reward", time.perf_counter() - t0)

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                T.add("generate_and_score", time.perf_counter() - t0)

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            if torch.is_grad_enabled():
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            finally:
                T.add("ref" if model is self.ref_model else "nograd_logps_other", time.perf_counter() - t0)

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            T.step_end(rollout=T.acc.get("rollout_generate_part", 0.0) + T.acc.get("reward", 0.0))

    n_completions = a.prompts_per_step * G
    if n_completions % a.micro_batch_size:
        raise SystemExit("prompts_per_step * group must be a multiple of micro_batch_size")
    out_dir = tempfile.mkdtemp(prefix="trl-grpo-bench-")
    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=a.micro_batch_size,
        gradient_accumulation_steps=n_completions // a.micro_batch_size,  # steps_per_generation defaults to this
        num_generations=G,
        num_iterations=1,
        max_completion_length=a.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs={"min_new_tokens": a.max_new_tokens},  # ban EOS: exactly max tokens, like relign
        use_vllm=False,
        beta=a.beta,
        use_bias_correction_kl=False,  # relign's k3 term has no importance weight
        loss_type="grpo",
        scale_rewards="group",
        epsilon=0.2,
        mask_truncated_completions=False,
        max_steps=a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",  # relign builds torch.optim.AdamW(fused=True) on CPU too
        seed=a.seed,
        bf16=a.precision == "bf16",  # fp32 weights, bf16 autocast: what relign's model.dtype=bf16-mixed does
        fp16=False,
        gradient_checkpointing=False,  # GRPOConfig defaults to True; relign's default is False
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="steps",
        logging_steps=10**6,
        log_completions=False,
        disable_tqdm=True,
        shuffle_dataset=False,  # the dataset is already in relign's order
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
    )
    tok = AutoTokenizer.from_pretrained(a.model)
    try:
        trainer = TimedGRPO(model=a.model, reward_funcs=[trl_reward], args=args, train_dataset=train_ds,
                            processing_class=tok, callbacks=[StepEnd()])
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        t0 = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - t0
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        opt_defaults = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opt.defaults.items()
                        if k in ("lr", "betas", "eps", "fused", "foreach")}
        opt_defaults["group_weight_decay"] = sorted({g["weight_decay"] for g in opt.param_groups})
        cfg = {
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "steps_per_generation": args.steps_per_generation, "generation_batch_size": args.generation_batch_size,
            "num_generations": args.num_generations, "num_iterations": args.num_iterations, "beta": args.beta,
            "loss_type": args.loss_type, "scale_rewards": args.scale_rewards, "use_bias_correction_kl": args.use_bias_correction_kl,
            "max_completion_length": args.max_completion_length, "generation_kwargs": trainer.generation_kwargs
            if isinstance(getattr(trainer, "generation_kwargs", None), dict) else None,
            "optim": str(args.optim), "optimizer": type(opt).__name__, "optimizer_defaults": opt_defaults,
            "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
            "ref_model": type(trainer.ref_model).__name__ if trainer.ref_model is not None else None,
            "use_vllm": args.use_vllm,
        }
        cfg["generation_kwargs"] = {k: (v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v))
                                    for k, v in (cfg["generation_kwargs"] or {}).items()}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {
        "library": "trl",
        "rows": T.rows,
        "train_call_seconds": total,
        "rss_after_imports_mb": rss_after_imports,
        "config": cfg,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "datasets": datasets.__version__},
    }


def run_worker(a: argparse.Namespace) -> None:
    import torch

    res = (worker_relign if a.worker.startswith("relign") else worker_trl)(a)
    res["peak_rss_mb"] = _peak_rss_mb()
    res["torch_threads"] = torch.get_num_threads()
    rows = res["rows"]
    if len(rows) != a.steps:
        raise RuntimeError(f"{a.worker}: {len(rows)} steps recorded, expected {a.steps}")
    for k in range(1, len(rows)):
        r, p = rows[k], rows[k - 1]
        r["step"] = r["end_time"] - p["end_time"]
        r["train"] = r["step"] - r["rollout"]
        if r["usage"] is not None:
            cpu = r["usage"][0] - p["usage"][0]
            r["other_load_cores"] = ((r["usage"][3] - p["usage"][3]) - cpu) / max(r["step"], 1e-9)
            r["cpu_seconds"] = cpu
    with open(a.result, "w") as f:
        json.dump(res, f)


# ----------------------------------------------------------------------------- parent


def _write_prompts(path: str, n: int) -> list[str]:
    qs = []
    with open(GSM8K) as f:
        for line in f:
            if line.strip():
                qs.append(json.loads(line)["question"])
            if len(qs) == n:
                break
    with open(path, "w") as f:
        for q in qs:
            f.write(json.dumps({"prompt": q}) + "\n")
    return qs


def _check_setup(model_dir: str, prompts_path: str, a: argparse.Namespace) -> dict:
    """relign's sampling order and prompt ids vs what the TRL worker will see."""
    from transformers import AutoTokenizer

    from relign.data.collate import StepSampler
    from relign.envs.tasks import get_task
    from relign.envs.tasks import render_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    sampler = StepSampler(sum(1 for _ in open(prompts_path)), a.prompts_per_step, seed=a.seed)
    theirs = [i for _ in range(a.steps) for i in sampler.next()]
    mine = relign_order(sum(1 for _ in open(prompts_path)), a.prompts_per_step, a.steps, a.seed)
    if theirs != mine:
        raise RuntimeError("bench's copy of relign's sampling order disagrees with relign.data.collate.StepSampler")
    task = get_task("custom", data_path=prompts_path, reward_fn_spec=f"{THIS}:relign_reward", chat=False, system_prompt=None)
    recs = task.load(prompts_path)
    raw = [json.loads(line)["prompt"] for line in open(prompts_path)]
    relign_ids = [render_prompt(tok, r)[1] for r in recs]  # as RolloutCollector renders them
    trl_ids = tok(text=raw)["input_ids"]  # as GRPOTrainer._tokenize_prompts for plain-text prompts
    lens = [len(x) for x in relign_ids]
    per_step = [_digest([relign_ids[i] for i in mine[k * a.prompts_per_step:(k + 1) * a.prompts_per_step]]) for k in range(a.steps)]
    return {
        "same_prompt_ids": relign_ids == trl_ids,
        "prompt_tokens": {"min": min(lens), "max": max(lens), "mean": sum(lens) / len(lens)},
        "expected_prompt_digests": per_step,
        "order": mine,
    }


def _git_state() -> dict:
    """Commit and uncommitted changes of the relign checkout being measured."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "HEAD"), "dirty": [x for x in git("status", "--porcelain", "--", "relign").splitlines() if x]}


def _spawn(lib: str, a: argparse.Namespace, model_dir: str, prompts: str, tmp: str, rep: int) -> dict:
    result = os.path.join(tmp, f"{lib}-{rep}.json")
    cmd = [
        sys.executable, str(THIS), "--worker", lib, "--model", model_dir, "--prompts", prompts, "--result", result,
        "--steps", str(a.steps), "--warmup", str(a.warmup), "--prompts-per-step", str(a.prompts_per_step),
        "--group", str(a.group), "--max-new-tokens", str(a.max_new_tokens), "--micro-batch-size", str(a.micro_batch_size),
        "--lr", str(a.lr), "--beta", str(a.beta), "--seed", str(a.seed), "--threads", str(a.threads),
        "--precision", a.precision, *[f"--relign-set={x}" for x in a.relign_set],
    ]
    load_before = _wait_quiet(a.wait_quiet) if a.wait_quiet > 0 else None
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env=None if lib.startswith("relign") else PEER_ENV)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"{lib} worker failed with exit code {proc.returncode}")
    with open(result) as f:
        res = json.load(f)
    res["process_wall_seconds"] = wall
    res["other_load_cores_before_start"] = load_before
    return res


def _summarize(reps: list[dict], warmup: int) -> dict:
    """Fold the repeats of one library: for each timed step keep the repeat whose step was fastest
    (all its phases), then take medians over the timed steps."""
    n = len(reps[0]["rows"])
    kept = []
    for k in range(warmup, n):
        best = min(reps, key=lambda r: r["rows"][k]["step"])
        kept.append(best["rows"][k])
    med = {p: _median([r.get(p, 0.0) for r in kept]) for p in PHASES}
    mean = {p: sum(r.get(p, 0.0) for r in kept) / len(kept) for p in PHASES}
    out = {k: v for k, v in reps[0].items() if k not in ("rows",)}
    every = sorted(r["rows"][k]["step"] for r in reps for k in range(warmup, n))  # all timed steps of all repeats
    out.update({
        "all_timed_steps": {"median": _median(every), "min": every[0], "max": every[-1], "n": len(every)},
        "median_seconds": med,
        "mean_seconds": mean,
        "kept_steps": [{k: r.get(k) for k in (*PHASES, "generate_and_score", "gen_tokens", "n_prompts", "n_completions",
                                              "prompts_digest", "other_load_cores", "cpu_seconds", "relign_stage_seconds")}
                       for r in kept],
        "other_load_cores": sum(r["other_load_cores"] * r["step"] for r in kept) / sum(r["step"] for r in kept),
        "gen_tokens_per_step": [r["gen_tokens"] for r in reps[0]["rows"]],
        "prompts_digests": [r["prompts_digest"] for r in reps[0]["rows"]],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in reps),
        "rss_after_imports_mb": max(r["rss_after_imports_mb"] for r in reps),
        "repeats": [
            {"peak_rss_mb": r["peak_rss_mb"], "train_call_seconds": r["train_call_seconds"],
             "process_wall_seconds": r["process_wall_seconds"], "other_load_cores_before_start": r["other_load_cores_before_start"],
             "steps": [{k: s.get(k) for k in (*PHASES, "generate_and_score", "other_load_cores")} for s in r["rows"][1:]]}
            for r in reps
        ],
    })
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="rollout + update steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="runs per library, interleaved; each step's fastest repeat counts (default 2)")
    p.add_argument("--quick", action="store_true", help="smoke test: 4 steps (1 warmup), 1 repeat")
    p.add_argument("--n-prompts", type=int, default=64, help="GSM8K questions in the prompt set (default 64)")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group", type=int, default=8, help="completions per prompt G (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per completion, exactly (default 128)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient (a reference model is loaded when > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads in every run (0: torch's default)")
    p.add_argument("--wait-quiet", type=float, default=60.0,
                   help="before each run, wait up to this many seconds for other processes to leave the CPU idle (0: don't)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: fp32 weights, bf16 autocast on both sides (relign model.dtype=bf16-mixed, TRL bf16=True)")
    p.add_argument("--relign-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra relign rl override, repeatable (e.g. share_prompt=false to turn off shared-prompt training forwards)")
    p.add_argument("--engines", default="hf", help="relign variants to run, comma-separated: hf, vllm (rollout.engine=vllm), packed (hf with "
                   "packing=true), stale / async (rollout.max_staleness=1 with overlap none / thread); the first is the "
                   "headline (default hf)")
    p.add_argument("--out", default=str(RESULTS), help="JSON results path")
    # internal
    p.add_argument("--worker", choices=LIBS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warmup, a.repeats = 4, 1, 1
    if a.worker:
        run_worker(a)
        return
    if a.warmup < 1 or a.steps <= a.warmup:
        p.error("need 1 <= --warmup < --steps")
    if (a.prompts_per_step * a.group) % a.micro_batch_size:
        p.error("--prompts-per-step x --group must be a multiple of --micro-batch-size")

    import torch
    import transformers
    import trl

    import relign
    from relign.models.tiny import build_tiny_model

    t_start = time.perf_counter()
    git_before = _git_state()
    tmp = tempfile.mkdtemp(prefix="grpo-bench-")
    try:
        model_dir = os.path.join(tmp, "model")
        build_tiny_model(model_dir, arch="qwen2", size="small")
        with open(os.path.join(model_dir, "config.json")) as f:
            model_cfg = json.load(f)
        from transformers import AutoModelForCausalLM

        n_params = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        prompts_path = os.path.join(tmp, "prompts.jsonl")
        _write_prompts(prompts_path, a.n_prompts)
        setup_check = _check_setup(model_dir, prompts_path, a)
        if not setup_check["same_prompt_ids"]:
            print("WARNING: relign and TRL tokenize the prompts differently", file=sys.stderr)

        engines = [e.strip() for e in a.engines.split(",") if e.strip()]
        libs = [*(("relign" if e == "hf" else f"relign-{e}") for e in engines), "trl"]
        all_runs: dict[str, list[dict]] = {lib: [] for lib in libs}
        for rep in range(a.repeats):
            for lib in (libs if rep % 2 == 0 else libs[::-1]):  # alternate who goes first: slow drift hits both
                print(f"[{rep + 1}/{a.repeats}] {lib}: {a.steps} GRPO steps ...", file=sys.stderr, flush=True)
                all_runs[lib].append(_spawn(lib, a, model_dir, prompts_path, tmp, rep))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    runs = {lib: _summarize(v, a.warmup) for lib, v in all_runs.items()}
    r, t = runs[libs[0]], runs["trl"]  # the first relign engine is the headline; the others get a column

    # ---- checks: equal work
    want_tokens = a.prompts_per_step * a.group * a.max_new_tokens
    checks = {
        "same_prompt_ids_tokenization": setup_check["same_prompt_ids"],
        "same_prompts_every_step": r["prompts_digests"] == t["prompts_digests"] == setup_check["expected_prompt_digests"],
        "same_generated_tokens_every_step": r["gen_tokens_per_step"] == t["gen_tokens_per_step"],
        "generated_tokens_per_step": want_tokens,
        "all_steps_exactly_max_new_tokens": all(x == want_tokens for x in r["gen_tokens_per_step"] + t["gen_tokens_per_step"]),
        "completions_per_step": {lib: sorted({s["n_completions"] for s in runs[lib]["kept_steps"]}) for lib in libs},
        "same_generated_tokens_every_step_all_engines": all(runs[lib]["gen_tokens_per_step"] == t["gen_tokens_per_step"]
                                                            for lib in libs),
        "trl_old_logp_passes": sum(1 for s in t["kept_steps"] if s.get("nograd_logps_other")),
    }
    for k in ("same_prompt_ids_tokenization", "same_prompts_every_step", "same_generated_tokens_every_step",
              "all_steps_exactly_max_new_tokens"):
        if not checks[k]:
            print(f"WARNING: {k} is false - the comparison is not like for like", file=sys.stderr)
    assert checks["same_generated_tokens_every_step"] and checks["all_steps_exactly_max_new_tokens"], checks

    paired = [ts["step"] / rs["step"] for rs, ts in zip(r["kept_steps"], t["kept_steps"])]
    mr, mt = r["median_seconds"], t["median_seconds"]
    ratios = {
        "step_speedup_trl_over_relign": mt["step"] / mr["step"],
        "median_paired_step_speedup_trl_over_relign": _median(paired),
        "paired_step_speedups": paired,
        "step_time_ratio_relign_over_trl": mr["step"] / mt["step"],
        "rollout_time_ratio_relign_over_trl": mr["rollout"] / mt["rollout"],
        "generate_time_ratio_relign_over_trl": mr["generate"] / mt["generate"],
        "train_time_ratio_relign_over_trl": mr["train"] / mt["train"],
        "ref_time_ratio_relign_over_trl": mr["ref"] / mt["ref"] if mt["ref"] else None,
        "peak_rss_ratio_relign_over_trl": r["peak_rss_mb"] / t["peak_rss_mb"],
        "targets": {"step_speedup": ">= 3", "peak_rss_ratio": "<= 0.7"},
    }

    out = {
        "benchmark": "grpo_step",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # repository paths relative, so the results can be committed without this machine's paths
        "command": " ".join(["python", "bench/grpo_step.py", *(argv if argv is not None else sys.argv[1:])]
                            ).replace(f"{REPO}/", ""),
        "total_seconds": None,
        "setup": {
            "model": "relign.models.tiny.build_tiny_model(arch='qwen2', size='small')",
            "model_config": {k: model_cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                           "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")},
            "parameters": n_params,
            "prompts": f"first {a.n_prompts} questions of {GSM8K.relative_to(REPO)} as raw text (no chat template)",
            "prompt_tokens": setup_check["prompt_tokens"],
            "steps": a.steps, "warmup_steps": a.warmup, "repeats": a.repeats, "prompts_per_step": a.prompts_per_step,
            "group_size": a.group, "completions_per_step": a.prompts_per_step * a.group, "max_new_tokens": a.max_new_tokens,
            "eos": "banned until max_new_tokens on both sides (relign rollout.min_new_tokens, TRL generation_kwargs min_new_tokens)",
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": "off"},
            "micro_batch_size": a.micro_batch_size, "lr": a.lr, "lr_schedule": "constant", "beta": a.beta,
            "kl": "k3 to a separate frozen reference model (TRL use_bias_correction_kl=False)",
            "loss": "PPO clip 0.2/0.2; TRL loss_type=grpo == relign loss_agg=seq-mean-token-mean",
            "advantages": "group mean baseline / group std (TRL scale_rewards=group, relign scale_rewards=std)",
            "updates_per_rollout": 1, "reward": "digit_fraction(completion), in-process on both sides",
            "relign_extra_overrides": a.relign_set,
            "known_algorithmic_differences": [
                "relign prefills each prompt once and repeats its KV cache G times; TRL's generate prefills every row",
                "relign's training/reference forwards run each group's prompt once (share_prompt=true, its default; "
                "same log-probs and gradients); TRL runs every row's full prompt",
            ],
            "seed": a.seed, "dtype": "fp32 weights, bf16 autocast" if a.precision == "bf16" else "fp32", "device": "cpu", "attn_implementation": "sdpa",
            "phase_definitions": {
                "step": "end of previous step to end of this step (relign metrics log / TRL on_step_end)",
                "rollout": "relign time/rollout_s + time/reward_s; TRL _generate + _calculate_rewards",
                "generate": "relign time/rollout_s; TRL _generate_single_turn (pad + model.generate + EOS mask)",
                "reward": "relign time/reward_s (workers=0); TRL _calculate_rewards",
                "train": "step - rollout (batch build, ref logps, advantages, fwd/bwd, clip, optimizer, metrics)",
                "ref": "reference-model log-probs (relign time/reference_s), micro-batches of micro_batch_size",
            },
            "aggregation": "per timed step the fastest repeat (all its phases); median over timed steps",
            "peak_rss_definition": "VmHWM of the worker process (imports, model + reference load, training); max over repeats",
        },
        "env": {
            "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "relign": relign.__version__, "torch_threads": r["torch_threads"], "relign_git": git_before,
        },
        "checks": checks,
        "ratios": ratios,
        "runs": runs,
    }

    # ---- markdown
    gen_tok = want_tokens
    lines = [
        f"GRPO step: relign {relign.__version__} vs TRL {trl.__version__} GRPOTrainer (tiny qwen2 'small', {n_params / 1e6:.1f}M params, "
        f"{'fp32 weights + bf16 autocast' if a.precision == 'bf16' else 'fp32'}, CPU, {r['torch_threads']} torch threads, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"relign @ {git_before['commit'][:7]}{' + uncommitted changes' if git_before['dirty'] else ''})",
        f"{a.prompts_per_step} prompts x G={a.group} = {a.prompts_per_step * a.group} completions x {a.max_new_tokens} tokens "
        f"(EOS banned) per step, micro-batch {a.micro_batch_size}, beta {a.beta} (k3, ref model), 1 update/rollout, lr {a.lr}; "
        f"{a.steps - a.warmup} timed steps ({a.warmup} warmup) x {a.repeats} repeat(s); median s/step"
        + (f"; relign overrides: {' '.join(a.relign_set)}" if a.relign_set else ""),
        "",
        "| phase | relign s | TRL s | relign/TRL time | speedup (TRL/relign) |",
        "|---|---:|---:|---:|---:|",
    ]
    labels = {"step": "**step (end to end)**", "rollout": "rollout (generate + reward)", "generate": "  generate",
              "reward": "  reward", "train": "train (step - rollout)", "ref": "  ref log-probs"}
    for ph in PHASES:
        x, y = mr[ph], mt[ph]
        rt = f"{x / y:.2f}" if y else "-"
        sp = f"{y / x:.2f}x" if x else "-"
        lines.append(f"| {labels[ph]} | {x:.3f} | {y:.3f} | {rt} | {sp} |")
    lines.append(f"| generated tokens/s (end to end) | {gen_tok / mr['step']:,.0f} | {gen_tok / mt['step']:,.0f} | | "
                 f"{mt['step'] / mr['step']:.2f}x |")
    lines.append(f"| generated tokens/s (generate only) | {gen_tok / mr['generate']:,.0f} | {gen_tok / mt['generate']:,.0f} | | "
                 f"{mt['generate'] / mr['generate']:.2f}x |")
    lines.append(f"| peak RSS MB | {r['peak_rss_mb']:,.0f} | {t['peak_rss_mb']:,.0f} | {ratios['peak_rss_ratio_relign_over_trl']:.2f} | |")
    lines.append("")
    ar, at = r["all_timed_steps"], t["all_timed_steps"]
    ratios["all_steps_median_speedup_trl_over_relign"] = at["median"] / ar["median"]
    lines.append(f"every timed step of every repeat ({ar['n']} per library): relign median {ar['median']:.3f} s "
                 f"({ar['min']:.3f}–{ar['max']:.3f}), TRL median {at['median']:.3f} s ({at['min']:.3f}–{at['max']:.3f}): "
                 f"{at['median'] / ar['median']:.2f}x")
    lines.append(
        f"end-to-end step speedup relign vs TRL: {ratios['step_speedup_trl_over_relign']:.2f}x (median of medians), "
        f"{ratios['median_paired_step_speedup_trl_over_relign']:.2f}x (median paired step); target >= 3x. "
        f"Peak RSS ratio {ratios['peak_rss_ratio_relign_over_trl']:.2f} (target <= 0.7)."
    )
    lines.append(
        f"checks: same prompt ids={checks['same_prompt_ids_tokenization']}, same prompts every step={checks['same_prompts_every_step']}, "
        f"generated tokens/step relign=TRL={want_tokens} every step={checks['all_steps_exactly_max_new_tokens']}, "
        f"TRL old-logp passes={checks['trl_old_logp_passes']}"
    )
    others = [lib for lib in libs if lib not in (libs[0], "trl")]
    if others:  # relign with other rollout engines, same steps, same checks
        head = [libs[0], *others, "trl"]
        lines += ["", "| phase | " + " | ".join(f"{x} s" for x in head) + " | "
                  + " | ".join(f"{x} speedup vs TRL" for x in head[:-1]) + " |",
                  "|---|" + "---:|" * (2 * len(head) - 1)]
        for ph in PHASES:
            secs = [runs[x]["median_seconds"][ph] for x in head]
            lines.append(f"| {labels[ph]} | " + " | ".join(f"{v:.3f}" for v in secs) + " | "
                         + " | ".join(f"{secs[-1] / v:.2f}x" if v else "-" for v in secs[:-1]) + " |")
        for x in head[:-1]:
            sync = [st["relign_stage_seconds"].get("time/sync_s", 0.0) for st in runs[x]["kept_steps"]]
            share = _median([y / st["step"] for y, st in zip(sync, runs[x]["kept_steps"])])
            lines.append(f"{x}: weight sync median {_median(sync):.3f} s/step ({100 * share:.1f}% of the step); "
                         f"peak RSS {runs[x]['peak_rss_mb']:,.0f} MB")
            out["ratios"][f"{x}_step_speedup_trl_over_relign"] = t["median_seconds"]["step"] / runs[x]["median_seconds"]["step"]
            out["ratios"][f"{x}_sync_share_of_step"] = share
    if _git_state() != git_before:
        lines.append("  WARNING: the relign checkout changed while the benchmark ran; runs may mix versions")
        out["env"]["relign_git_after"] = _git_state()
    worst = max(x["other_load_cores"] for x in runs.values())
    if worst > 0.25:
        lines.append(f"  note: other processes used up to {worst:.2f} of the {os.cpu_count()} cores during the kept steps; "
                     "absolute times are high by roughly that share")
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
