"""``relign demo``: a whole post-training pipeline, on a laptop CPU, in a few minutes.

    1. model    a tiny random model with a locally trained tokenizer (tiny:SIZE), or demo.model
    2. task     multi-step arithmetic generated from the seed (relign.envs.arith): training
                problems, disjoint held-out test problems, SFT demonstrations
    3. SFT      a short warm start (relign.recipes.sft). Half the demonstrations show the
                worked steps, half give the bare answer, so the model learns the answer format
                and both ways of answering, and is right only part of the time
    4. eval     the held-out problems: demo.eval_samples samples each at temperature 1, + greedy
    5. GRPO     relign.recipes.rl with its default algorithm (Dr. GRPO) on the training
                problems. Only a correct answer is rewarded; on 4-6 step problems a bare answer
                is usually wrong, so the policy learns to work step by step (and to slip less)
    6. eval     the same problems with the same sampling seeds
    7. report   before/after table, demo.json, report.html (opening with the GRPO reward curve, held-out
                accuracy over the GRPO steps and the before/after bars)

Every stage is a real recipe run or eval in its own sub-directory (sft/, eval_before/, rl/,
eval_after/) with its resolved config, so any stage can be inspected or rerun alone, e.g.
``relign rl RUN/rl/config.yaml``. docs/demo.md has the expected numbers.

For a real model or task (a GPU and a hub connection): ``demo.model=Qwen/Qwen2.5-0.5B-Instruct
demo.task=gsm8k`` trains on the task's training set and evaluates on its shipped test set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import banner, distributed, rundir
from ..checkpoint import atomic_write_text, list_checkpoints
from ..checks import check_choice, check_model_path, check_non_negative, check_wandb
from ..config import ConfigError, LoggingConfig, ModelConfig, load_config
from ..dtypes import DTYPES
from ..envs import arith
from ..envs.tasks import from_file, get_task, is_multi_turn
from ..evaluate import evaluate, write_samples
from ..models.loading import load_causal_lm, load_tokenizer, resolve_device, resolve_model_path
from ..models.tiny import SIZES
from ..report import refresh_report
from ..rollout.engine import ENGINES
from ..rollout.vllm_engine import import_vllm
from . import RunResult, build, frame, rl, sft

ARITH = "arith"
ARITH_SPEC = "relign.envs.arith:task"
# Training sets of the built-in tasks (their shipped data are test sets).
KNOWN_TRAIN: dict[str, tuple[str, str]] = {
    "gsm8k": ("openai/gsm8k:main", "train"),
    "countdown": ("Jiayi-Pan/Countdown-Tasks-3to4", "train"),
}


@dataclass
class DemoConfig:
    steps: int = 300
    """GRPO steps; each samples group_size completions for each of prompts_per_step training problems."""
    sft_steps: int = 2500
    """SFT warm-start steps (0 = no warm start: RL starts from the model as it is)."""
    model_size: str = "shallow"
    """Tiny random model built offline when demo.model is empty: micro, tiny, shallow, small or base."""
    model: str = ""
    """A real model instead of a tiny one: local folder or hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct)."""
    task: str = ARITH
    """arith (synthetic, generated from the seed) or a task relign rl knows: gsm8k, countdown, math, 'module:factory'."""
    seed: int = 0
    """Seed for the problems, the model's initialisation, data order and sampling."""
    threads: int = 0
    """CPU threads for torch (0 = torch's default: every core). 1 = one core, for a machine that is busy with other work."""
    dtype: str = "fp32"
    """model.dtype of every stage: fp32, or bf16-mixed (fp32 weights, bf16 arithmetic: a real model on a GPU)."""
    engine: str = "hf"
    """Inference engine of GRPO's rollouts and of the evals: hf (built in) or vllm (pip install "relign[vllm]")."""
    # ---- arith problems
    train_problems: int = 4000
    """arith: training problems (the SFT demonstrations and the RL prompts)."""
    test_problems: int = 200
    """Held-out problems evaluated before and after RL (other tasks: the first N of the test set; 0 = all)."""
    min_ops: int = 4
    """arith: fewest + / - operations per problem."""
    max_ops: int = 6
    """arith: most + / - operations per problem."""
    max_operand: int = 9
    """arith: operands are integers 1..max_operand."""
    direct_frac: float = 0.5
    """arith: share of SFT demonstrations that give the bare answer ("#### 9") instead of the worked steps."""
    # ---- other tasks
    train_path: str = ""
    """Other tasks: training prompts, a file, folder or hub id (empty: the task's training set, e.g. openai/gsm8k:main)."""
    train_split: str = ""
    """Other tasks: split of train_path (empty: train for the known training sets)."""
    test_path: str = ""
    """Other tasks: held-out problems (empty: the task's shipped test set)."""
    sft_data: str = ""
    """Other tasks: SFT warm-start records (prompt/response or messages); empty: no SFT stage."""
    # ---- training and evaluation
    sft_lr: float = 0.0
    """SFT peak learning rate (0 = 2e-3 for a tiny random model, 1e-5 for demo.model)."""
    sft_batch_size: int = 32
    """SFT examples per step."""
    lr: float = 0.0
    """GRPO learning rate, 10% warmup then cosine decay (0 = 1e-4 for a tiny random model, 1e-6 for demo.model)."""
    prompts_per_step: int = 16
    """GRPO training problems per step."""
    group_size: int = 8
    """GRPO samples per problem (the group whose mean reward is the baseline)."""
    max_new_tokens: int = 0
    """Longest completion in GRPO and eval (0 = 64 for arith, 512 for other tasks)."""
    eval_samples: int = 8
    """Samples per held-out problem at temperature 1; accuracy is their mean correctness (pass@1)."""
    eval_every: int = 50
    """Also evaluate during GRPO every N steps (eval/* in rl/metrics.jsonl: report.html's accuracy curve; 0 = off)."""
    sft_overrides: list[str] = field(default_factory=list)
    """More key=value settings for the SFT stage (see relign sft --help), applied last."""
    rl_overrides: list[str] = field(default_factory=list)
    """More key=value settings for the GRPO stage (see relign rl --help), applied last."""


@dataclass
class Config:
    demo: DemoConfig = field(default_factory=DemoConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run_dir: str = ""
    """Where everything goes: data/, sft/, eval_before/, rl/, eval_after/, demo.json (empty: runs/demo-<time>)."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""


def _check(cfg: Config) -> None:
    d = cfg.demo
    if not d.model and d.model_size not in SIZES:
        raise ConfigError(f"bad value for 'demo.model_size': {d.model_size!r}; choose one of {', '.join(SIZES)}")
    if d.steps < 1 or d.sft_steps < 0 or d.eval_samples < 1 or d.eval_every < 0 or d.threads < 0:
        raise ConfigError("demo.steps and demo.eval_samples must be >= 1; demo.sft_steps, demo.eval_every, demo.threads >= 0")
    if d.group_size < 2 or d.prompts_per_step < 1 or d.sft_batch_size < 1:
        raise ConfigError("demo.group_size must be >= 2 (GRPO compares samples of a problem); prompts_per_step, sft_batch_size >= 1")
    if d.dtype not in DTYPES or DTYPES[d.dtype].mode == "cast":  # bf16-compute: not in the demo's stages
        raise ConfigError(f"bad value for 'demo.dtype': {d.dtype!r}; choose one of fp32, bf16, bf16-mixed")
    check_choice("demo.engine", d.engine, ENGINES)
    if d.engine == "vllm":  # before the run directory exists
        import_vllm("demo.engine")
    check_non_negative(cfg, "demo.test_problems", "demo.max_new_tokens", "demo.sft_lr", "demo.lr")
    check_model_path("demo.model", d.model, required=False)
    check_wandb(cfg.logging)
    if d.task == ARITH:
        if not 1 <= d.min_ops <= d.max_ops or d.max_operand < 1 or not 0.0 <= d.direct_frac <= 1.0:
            raise ConfigError("demo: need 1 <= min_ops <= max_ops, max_operand >= 1 and 0 <= direct_frac <= 1")
        if d.train_problems < d.prompts_per_step or d.test_problems < 1:
            raise ConfigError("demo.train_problems must be >= demo.prompts_per_step and demo.test_problems >= 1")
        return
    if from_file(d.task) or is_multi_turn(d.task):
        raise ConfigError(f"demo.task={d.task} is not supported: give a single-turn task name or a 'module:factory' spec")
    if not d.train_path and d.task not in KNOWN_TRAIN:
        raise ConfigError(f"demo.task={d.task}: set demo.train_path to its training prompts (known defaults: {', '.join(KNOWN_TRAIN)})")


def _say(message: str) -> None:
    """Stage headers go to stderr with the progress bars; the result table goes to stdout."""
    print(message, file=sys.stderr, flush=True)


def _stage_config(cls: type, settings: dict[str, Any], overrides: list[str], what: str):
    """A stage's config: the class defaults, the demo's ``settings`` (dotted keys), and the
    user's ``overrides`` on top. The overrides go through ``load_config``, so a typo gets the
    usual message; the demo's settings are set as Python values (paths need no quoting)."""
    try:
        cfg = load_config(cls, None, list(overrides))
    except ConfigError as e:
        raise ConfigError(f"demo.{what}_overrides: {e}") from None
    user_keys = {o.partition("=")[0].strip() for o in overrides}
    for key, value in settings.items():
        if key in user_keys:
            continue
        *parents, leaf = key.split(".")
        obj = cfg
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    return cfg


# --------------------------------------------------------------------------- stages


def _chat(d: DemoConfig) -> bool:
    """Prompts through the chat template for a real (instruct) model; plain text for a tiny one,
    which is trained from scratch and has no use for the template's 8 tokens around a 10-token
    prompt (they were 17% of the SFT stage's tokens)."""
    return bool(d.model)


def _sources(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """The task and where its prompts come from; nothing is written or downloaded yet.
    arith: files RUN/data/{train,test,sft}.jsonl, written by ``_write_problems``."""
    d = cfg.demo
    if d.task == ARITH:
        data = run_dir / "data"
        return {"task": get_task(ARITH_SPEC, chat=_chat(d)), "spec": ARITH_SPEC, "train": str(data / "train.jsonl"), "split": "",
                "test": str(data / "test.jsonl"), "sft": str(data / "sft.jsonl"), "reward_workers": 0}
    try:
        task = get_task(d.task, chat=_chat(d))
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise ConfigError(f"demo.task: {e}") from None
    train, split = (d.train_path, d.train_split) if d.train_path else KNOWN_TRAIN[d.task]
    # real tasks may grade with slow libraries (math-verify): rewards in worker processes with a timeout
    return {"task": task, "spec": d.task, "train": train, "split": split, "test": d.test_path or task.default_path,
            "sft": d.sft_data, "reward_workers": 2}


def _write_problems(cfg: Config, data: dict[str, Any]) -> None:
    """arith: generate the problems and demonstrations; then read the held-out records."""
    d = cfg.demo
    if d.task == ARITH:
        arith.write_splits(Path(data["test"]).parent, d.train_problems, d.test_problems, seed=d.seed, direct_frac=d.direct_frac,
                           min_ops=d.min_ops, max_ops=d.max_ops, max_operand=d.max_operand)
    data["records"] = data["task"].load(data["test"], max_rows=0 if d.task == ARITH else d.test_problems)


def _evaluate(name: str, model_path: str, data: dict[str, Any], cfg: Config, device, max_new_tokens: int) -> dict[str, float]:
    """Held-out eval of one checkpoint: ``eval_samples`` samples at temperature 1 and one greedy
    sample per problem, with fixed seeds (the same prompts and random streams before and after).
    Writes RUN/<name>/eval.json, samples.jsonl (temperature 1) and greedy_samples.jsonl."""
    d, out = cfg.demo, Path(cfg.run_dir) / name
    tok = load_tokenizer(model_path)
    model = load_causal_lm(model_path, dtype=d.dtype, device=device).eval().requires_grad_(False)
    engine = build.engine_for(d.engine, model, tok, max_batch_rows=256, seed=d.seed, m=ModelConfig(path=model_path, dtype=d.dtype),
                        max_model_len=1024 + max_new_tokens, key="demo.engine")
    common = dict(max_new_tokens=max_new_tokens, seed=d.seed, reward_workers=data["reward_workers"], progress=cfg.logging.progress)
    n = d.eval_samples
    try:
        summary, rows = evaluate(engine, tok, data["task"], data["records"], n=n, ks=sorted({1, n}), temperature=1.0,
                                 desc=f"{name} T=1", **common)
        greedy, greedy_rows = evaluate(engine, tok, data["task"], data["records"], n=1, temperature=0.0, desc=f"{name} greedy",
                                       **common)
    finally:
        engine.close()  # one vLLM engine per process: the next stage builds its own
    del model, engine
    out.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # The table's metrics. accuracy = mean correctness of all samples at T=1 = pass@1.
    keep = ["accuracy", f"pass@{n}", f"maj@{n}", "length_mean", "length_max", "truncated_frac"]
    result = {k: summary[k] for k in keep if k in summary}
    result["greedy_accuracy"] = greedy["accuracy"]
    result["greedy_length_mean"] = greedy["length_mean"]
    if d.task == ARITH:
        # How often the model writes out its steps ("7+5=12, ...") rather than a bare answer, and
        # how often those worked answers are right: separates "works step by step more often"
        # from "makes fewer slips" in the change of accuracy.
        worked = [r for r in rows if "=" in r["response"]]
        result["worked_frac"] = len(worked) / len(rows)
        result["worked_accuracy"] = sum(r["score"] for r in worked) / len(worked) if worked else 0.0
    atomic_write_text(out / "eval.json", json.dumps({
        "model": model_path, "task": data["spec"], "data": data["test"], "n": n, "temperature": 1.0, "seed": d.seed,
        "max_new_tokens": max_new_tokens, "metrics": summary, "greedy_metrics": greedy, "demo_table": result,
    }, indent=2) + "\n")
    write_samples(out / "samples.jsonl", rows)
    write_samples(out / "greedy_samples.jsonl", greedy_rows)
    return result


# --------------------------------------------------------------------------- the pipeline


def _stage_configs(cfg: Config, data: dict[str, Any], run_dir: Path, model_spec: str, *, run_sft: bool, max_new: int,
                   logging: dict[str, Any]):
    """(sft.Config, rl.Config) of the two training stages, with the user's demo.*_overrides,
    each checked now: a bad setting of a stage stops the demo before the stages before it ran."""
    d = cfg.demo
    tiny = not d.model
    sft_lr = d.sft_lr or (2e-3 if tiny else 1e-5)
    rl_lr = d.lr or (1e-4 if tiny else 1e-6)
    # a 1M-parameter model's activations are a few MB, and recomputing them costs 5-8% of a step
    # at its sizes (Python overhead per call); a real model's save memory at no measurable cost
    lean = {"model.lean_activations": not tiny}
    sft_cfg = _stage_config(sft.Config, {
        "model.path": model_spec, "model.dtype": d.dtype, **lean, "data.path": data["sft"], "data.chat_template": _chat(d),
        "data.max_length": 512 if tiny else 2048, "max_steps": d.sft_steps, "batch_size": d.sft_batch_size,
        # the tiny model's step in one packed row (sft's default packing: no padding, attention
        # example by example): 200 steps took 37 s against 47 s as length-sorted padded
        # micro-batches of 8, the previous default (2-core AVX2 EPYC); a real model's in rows of 4
        "micro_batch_size": d.sft_batch_size if tiny else min(4, d.sft_batch_size), "optim.lr": sft_lr,
        "optim.warmup_ratio": 0.05, "seed": d.seed, "device": cfg.device, "run_dir": str(run_dir / "sft"), **logging,
    }, d.sft_overrides, "sft")
    rl_cfg = _stage_config(rl.Config, {
        "model.path": model_spec, "model.dtype": d.dtype, **lean, "task.name": data["spec"], "task.path": data["train"],
        "task.split": data["split"], "task.chat": _chat(d), "task.reward_workers": data["reward_workers"],
        "rollout.n": d.group_size, "rollout.max_new_tokens": max_new, "rollout.engine": d.engine,
        # a learning rate for the model's scale; warmup, and a cosine decay that keeps what was learned
        "optim.lr": rl_lr, "optim.warmup_steps": max(1, d.steps // 10), "optim.schedule": "cosine",
        "max_steps": d.steps, "prompts_per_step": d.prompts_per_step, "micro_batch_size": d.group_size * max(1, 64 // d.group_size),
        "eval.every": d.eval_every, "eval.path": data["test"], "eval.max_rows": d.test_problems, "eval.n": d.eval_samples,
        "eval.temperature": 1.0, "seed": d.seed, "device": cfg.device, "run_dir": str(run_dir / "rl"), **logging,
    }, d.rl_overrides, "rl")
    for stage, check, stage_cfg in (("sft", sft._check, sft_cfg), ("rl", rl._check, rl_cfg)):
        if stage == "sft" and not run_sft:
            continue
        try:
            check(stage_cfg)
        except ConfigError as e:
            raise ConfigError(f"the demo's {stage} stage (demo.* settings and demo.{stage}_overrides): {e}") from None
    return sft_cfg, rl_cfg


def _write_summary(cfg: Config, run_dir: Path, data: dict[str, Any], device, *, before: dict[str, float],
                   after: dict[str, float], seconds: dict[str, float], total: float, start_model: str, final_model: str,
                   sft_ran: bool) -> None:
    """demo.json, the before/after table on stdout, and report.html."""
    d = cfg.demo
    summary = {
        "before": before, "after": after, "seconds": round(total, 1),
        "stage_seconds": {k: round(v, 1) for k, v in seconds.items()},
        "eval": {"problems": len(data["records"]), "samples": d.eval_samples, "temperature": 1.0,
                 "accuracy": "mean correctness of all samples at temperature 1 (= pass@1); greedy_accuracy: one greedy answer each"},
        "model": d.model or f"tiny:{d.model_size}", "task": d.task, "seed": d.seed, "device": str(device), "engine": d.engine,
        "threads": torch.get_num_threads(), "cpu": banner.cpu_name(), "before_model": start_model, "after_model": final_model,
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    atomic_write_text(run_dir / "demo.json", json.dumps(summary, indent=2) + "\n")
    print(format_table(summary, sft_ran=sft_ran))
    if (path := refresh_report(run_dir)) is not None:
        print(f"report: {path}")


def _open(cfg: Config) -> frame.Run:
    """The demo's run: its checks, one process, its thread count, the device, a fresh run directory."""
    _check(cfg)
    distributed.init()
    if distributed.world_size() > 1:
        raise ConfigError("relign demo runs in one process; run the sft and rl recipes under torchrun instead")
    if cfg.demo.threads:
        # A tiny model's matrices are too small to split well, and a thread that waits for a
        # sibling on a busy core stalls every op (4x slower sampling measured on a loaded 2-core
        # machine); a fixed count also keeps results reproducible across machines.
        torch.set_num_threads(cfg.demo.threads)
    device, t_start = resolve_device(cfg.device), time.perf_counter()
    # a run_dir that holds an earlier demo gives a fresh one beside it (relign.rundir), so the
    # stages (sft/, rl/) always start in empty directories and never pick up old checkpoints
    run = frame.Run(cfg, "demo", rundir.open_run(cfg, "demo"), device, t_start)
    cfg.run_dir = str(run.run_dir)
    return run


def _model_and_task(cfg: Config, data: dict, model_spec: str, seconds: dict[str, float]) -> None:
    """Stages 1 and 2: the model (a tiny one built once into $RELIGN_CACHE, offline: relign.models.tiny)
    and the task's problems and demonstrations, deterministic from the seed."""
    d = cfg.demo
    t0 = time.perf_counter()
    model_path = resolve_model_path(model_spec)
    seconds["model"] = time.perf_counter() - t0
    _say(f"[1/6] model: {'' if d.model else model_spec + ' (random init) at '}{model_path}")
    t0 = time.perf_counter()
    _write_problems(cfg, data)
    seconds["data"] = time.perf_counter() - t0
    _say(f"[2/6] task: multi-step arithmetic, {d.train_problems} training problems, {d.test_problems} held-out (written to "
         f"{Path(cfg.run_dir) / 'data'})" if d.task == ARITH else f"[2/6] task: {d.task}, training prompts {data['train']}, "
         f"{len(data['records'])} held-out problems from {data['test']}")


def train(cfg: Config) -> RunResult:
    run = _open(cfg)
    d, run_dir, device, t_start = cfg.demo, run.run_dir, run.device, run.t_start
    max_new = d.max_new_tokens or (64 if d.task == ARITH else 512)
    seconds: dict[str, float] = {}
    # tiny:SIZE is resolved by the recipes themselves (and written as such in their configs)
    model_spec = d.model or f"tiny:{d.model_size}"
    data = _sources(cfg, run_dir)
    # The two training stages' configs, built (and the user's overrides checked) before any training.
    run_sft = bool(d.sft_steps and data["sft"])
    sft_cfg, rl_cfg = _stage_configs(cfg, data, run_dir, model_spec, run_sft=run_sft, max_new=max_new,
                                    logging=_stage_logging(cfg.logging))
    banner.start("demo", cfg, run_dir=run_dir, device=device, model_path=model_spec, dtype=d.dtype,
                 data=_data_line(d, data), steps=(f"SFT {sft_cfg.max_steps:,} x {sft_cfg.batch_size} demonstrations, "
                                                 if run_sft else "")
                 + f"GRPO {rl_cfg.max_steps:,} x {rl_cfg.prompts_per_step} problems x {rl_cfg.rollout.n} samples")

    # ---- 1. model, 2. task
    _model_and_task(cfg, data, model_spec, seconds)

    # ---- 3. SFT warm start
    start_model = _sft_stage(sft_cfg, d, data, seconds) if run_sft else model_spec
    if not run_sft:
        _say("[3/6] SFT warm start: skipped" + ("" if d.sft_steps else " (demo.sft_steps=0)") +
             ("" if data["sft"] else f" (no demonstrations for {d.task}: set demo.sft_data)"))

    # ---- 4. held-out eval before RL
    _say(f"[4/6] eval before GRPO: {len(data['records'])} held-out problems x {d.eval_samples} samples at T=1, and greedy")
    t0 = time.perf_counter()
    before = _evaluate("eval_before", start_model, data, cfg, device, max_new)
    seconds["eval_before"] = time.perf_counter() - t0

    # ---- 5. GRPO from the warm start: relign rl's default algorithm (Dr. GRPO)
    final_model = _rl_stage(rl_cfg, d, start_model, run_dir, seconds)

    # ---- 6. held-out eval after RL: same problems, same seeds
    _say("[6/6] eval after GRPO")
    t0 = time.perf_counter()
    after = _evaluate("eval_after", final_model, data, cfg, device, max_new)
    seconds["eval_after"] = time.perf_counter() - t0

    # ---- 7. table, demo.json, report.html
    _write_summary(cfg, run_dir, data, device, before=before, after=after, seconds=seconds,
                   total=time.perf_counter() - t_start, start_model=start_model, final_model=final_model,
                   sft_ran=start_model != model_spec)
    metrics = {f"before/{k}": v for k, v in before.items()} | {f"after/{k}": v for k, v in after.items()}
    return frame.close(run, metrics=metrics, steps=rl_cfg.max_steps, checkpoint=Path(final_model), resumable=False,
                       keys=("before/accuracy", "after/accuracy", "before/greedy_accuracy", "after/greedy_accuracy"))


def _stage_logging(lg: LoggingConfig) -> dict[str, Any]:
    """The stages log as the demo does (W&B's run name is each stage's own)."""
    return {"logging.progress": lg.progress, "logging.tensorboard": lg.tensorboard, "logging.wandb": lg.wandb,
            "logging.wandb_project": lg.wandb_project, "logging.peak_tflops": lg.peak_tflops}


def _data_line(d: DemoConfig, data: dict[str, Any]) -> str:
    if d.task == ARITH:
        return f"arith: {d.train_problems:,} training problems, {d.test_problems:,} held-out"
    return f"{d.task}: training prompts from {data['train']}, held-out problems from {data['test']}"


def _sft_stage(sft_cfg, d: DemoConfig, data: dict[str, Any], seconds: dict[str, float]) -> str:
    """The SFT warm start; its last checkpoint, where GRPO starts."""
    _say(f"[3/6] SFT warm start: {sft_cfg.max_steps} steps of {sft_cfg.batch_size} demonstrations, lr {sft_cfg.optim.lr:g}")
    t0 = time.perf_counter()
    with rundir.nested():  # the demo's banner and summary describe the whole pipeline
        result = sft.train(sft_cfg)
    seconds["sft"] = time.perf_counter() - t0
    if result.checkpoint is None:
        raise ConfigError("the SFT stage saved no checkpoint (checkpoint.save_final=false in demo.sft_overrides?)")
    return str(result.checkpoint)


def _rl_stage(rl_cfg, d: DemoConfig, start_model: str, run_dir: Path, seconds: dict[str, float]) -> str:
    """GRPO from ``start_model``; its last checkpoint."""
    if not any(o.partition("=")[0].strip() == "model.path" for o in d.rl_overrides):
        rl_cfg.model.path = start_model
    a = rl_cfg.algorithm
    _say(f"[5/6] GRPO ({a.advantage} advantages, scale_rewards={a.scale_rewards}, {a.loss_agg}): {rl_cfg.max_steps} steps "
         f"x {rl_cfg.prompts_per_step} problems x {rl_cfg.rollout.n} samples, lr {rl_cfg.optim.lr:g}")
    t0 = time.perf_counter()
    with rundir.nested():
        rl.train(rl_cfg)
    seconds["rl"] = time.perf_counter() - t0
    ckpts = list_checkpoints(run_dir / "rl")
    if not ckpts:
        raise ConfigError("the GRPO stage saved no checkpoint (checkpoint.save_final=false in demo.rl_overrides?)")
    return str(ckpts[-1][1])


ROWS = [  # (key, label, is a fraction)
    ("accuracy", "accuracy (T=1, pass@1)", True),
    ("pass@{n}", "pass@{n} (T=1)", True),
    ("maj@{n}", "maj@{n} (T=1, majority vote)", True),
    ("greedy_accuracy", "greedy accuracy", True),
    ("worked_frac", "answers showing their steps", True),
    ("worked_accuracy", "  accuracy of those", True),
    ("length_mean", "mean length (tokens, T=1)", False),
]


def format_table(summary: dict[str, Any], *, sft_ran: bool = True) -> str:
    """The before/after table printed at the end of the demo."""
    before, after, ev = summary["before"], summary["after"], summary["eval"]
    n = ev["samples"]
    head = "SFT only" if sft_ran else "before"
    lines = [
        "",
        f"relign demo: {summary['model']} on {summary['task']}, {ev['problems']} held-out problems, "
        f"{n} samples each at temperature 1 (+ greedy)",
        f"{'metric':<32}{head:>10}{'after GRPO':>12}{'change':>9}",
    ]
    for key, label, frac in ROWS:
        key, label = key.format(n=n), label.format(n=n)
        if key not in before or key not in after or (key == f"pass@{n}" and n == 1):
            continue
        b, a = before[key], after[key]
        if frac:
            lines.append(f"{label:<32}{100 * b:>9.1f}%{100 * a:>11.1f}%{100 * (a - b):>+9.1f}")
        else:
            lines.append(f"{label:<32}{b:>10.1f}{a:>12.1f}{a - b:>+9.1f}")
    st = summary["stage_seconds"]
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.0f}s" for k, v in st.items() if k not in ("model", "data") or v >= 1)
    lines.append(f"wall time {summary['seconds']:.0f}s ({parts}); change in points")
    return "\n".join(lines)


__all__ = ["Config", "DemoConfig", "format_table", "train"]
