"""The frame around every trainer: open the run, make a model trainable, save, step, close.

    run = frame.open(cfg, "sft", check=_check)          distributed.init, the checks (and resolve), device, plan, seed, run directory
    t = frame.trainable(run, model, ckpt=..., rows=..., total_steps=...)
                                                         resumed weights, FSDP, data order, AdamW + schedule, resume
    save = frame.saver(run, t, tok)                      gather (a collective), atomic checkpoint, barrier
    tracker = frame.tracker(run, t, desc=..., ...)       metrics.jsonl + progress bar; step 0 or "resumed from"
    for step in frame.steps(t):
        ... the recipe's own step ...
        metrics |= frame.optimizer_step(t, max_grad_norm)   clip, step, schedule, zero_grad
        frame.log(run, tracker, save, step, metrics)     log, and save every checkpoint.save_every
    return frame.close(run, metrics=..., keys=..., steps=..., checkpoint=frame.save_last(run, t, save))

Plain functions over two records (``Run``, ``Trainer``), not a base class: each recipe's
``train`` stays the one readable loop of its method (DESIGN.md principle 1), and what comes
before and after the loop is written once, here, so a fix to resume or save lands in one place.
``sft``, ``rm``, ``dpo`` use all of it; ``rl`` its open, trainable, saver, tracker and close; ``rest``,
``eval``, ``demo`` and ``verifier`` (no optimizer of their own) its open and close.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from .. import banner, distributed
from ..checkpoint import (
    gather_train_state, load_model_weights, resolve_resume, resume_training, save_checkpoint, save_final,
    seed_everything
)
from ..data.collate import StepSampler
from ..errors import ConfigError
from ..models.cp import enable_ulysses
from ..models.flops import mfu as flops_mfu
from ..models.flops import peak_flops
from ..models.loading import resolve_device, trainable_parameters
from ..models.precision import mixed_dtype
from ..models.tp import apply_tp, check_heads
from ..optim import build_training, clip_gradients
from ..rundir import open_run
from ..tracking import Tracker, read_metrics
from . import RunResult, build, memory, plan_model


@dataclass
class Run:
    """An open run: its config, recipe name, directory and device, and when it started."""

    cfg: Any
    recipe: str
    run_dir: Path
    device: torch.device
    t_start: float = field(default_factory=time.perf_counter)
    peak: float | None = None
    """Peak FLOP/s of one device (``logging.peak_tflops`` or the GPU's name), None when unknown: no ``perf/mfu``."""
    resolved: Any = None
    """What the recipe's ``resolve`` step returned (``frame.open``): RL's task, estimator and delimiter."""

    @property
    def rank(self) -> int:
        """This rank's share of each step's rows: its data-parallel coordinate."""
        return distributed.data_rank()

    @property
    def world(self) -> int:
        """How many shares the rows are split into: the data-parallel size (the world size without a mesh)."""
        return distributed.data_size()


@dataclass
class Trainer:
    """A model made trainable: sharded, with its optimizer, schedule, data order and the step it resumes after."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: StepSampler
    total_steps: int
    start: int = 0
    """The last step already done (0: a fresh run)."""
    ckpt: Path | None = None
    """The checkpoint it resumed from."""
    params: list[torch.Tensor] = field(default_factory=list)
    """The trainable parameters (what the gradient norm is clipped over)."""
    steps: int = 0
    """The recipe's steps (``steps``, the tracker's count and ``save_last``'s): ``total_steps``, one
    update a step, unless the recipe makes several updates a step (RL: ppo_epochs x mini_batches)."""

    def __post_init__(self):
        self.steps = self.steps or self.total_steps


def open(cfg: Any, recipe: str, *, check: Callable[[Any], Any] | None = None,
         resolve: Callable[[Any], Any] | None = None, seed: int | None = None, config_name: str = "config.yaml") -> Run:
    """Start a run: the process group (torchrun), ``check(cfg)`` before anything is read, then
    ``resolve(cfg)``: what the config leaves to its data, settled in ``cfg`` before the memory plan
    reads it and before the run directory records it (RL's ``rollout.max_turns=0``: the
    environment's own limit), its result kept as ``run.resolved``; the device, every random stream
    seeded (``seed``, default ``cfg.seed``), and the run directory (a fresh one unless resuming the
    same run: ``relign.rundir``). A collective under torchrun."""
    t_start = time.perf_counter()
    distributed.init(wait_timeout=getattr(getattr(cfg, "rollout", None), "wait_timeout", 0.0))  # rl's deadline
    par = getattr(cfg, "parallel", None)  # the trainers' (dp, cp, tp) mesh; eval, rest and demo have none
    if par is not None:
        check_parallel(cfg, recipe)
        distributed.init_mesh(par.tp_size, par.cp_size)
    if check is not None:
        check(cfg)
    resolved = resolve(cfg) if resolve is not None else None
    device = resolve_device(cfg.device)
    memory.check(cfg, recipe, device)  # the predicted peak against the device, before any weights load (relign plan)
    seed_everything(cfg.seed if seed is None else seed)
    run_dir = open_run(cfg, recipe, config_name=config_name)
    return Run(cfg, recipe, run_dir, device, t_start, peak_flops(device, cfg.logging.peak_tflops), resolved)


CP_RECIPES = ("sft", "dpo", "rl")
"""The recipes that split their packed rows over context-parallel ranks (the others run tp and dp)."""


def check_parallel(cfg: Any, recipe: str) -> None:
    """Every parallel setting that cannot work, in one place, before the mesh, the data or any weight
    (``--dry-run`` included): the sizes (at least 1), context parallel's recipes and its packed rows,
    tp x cp dividing the world, and the model's heads against tp and cp, read from its config alone
    (each tp and cp rank takes whole query and key-value heads; a missing model.path is the recipe's
    own check's to name)."""
    par = cfg.parallel
    tp, cp = par.tp_size, par.cp_size
    for key, n in (("parallel.tp_size", tp), ("parallel.cp_size", cp)):
        if n < 1:
            raise ConfigError(f"bad value for {key!r}: {n}; it must be at least 1")
    if cp > 1 and recipe not in CP_RECIPES:
        raise ConfigError(f"parallel.cp_size={cp}: context parallel trains {', '.join(CP_RECIPES[:-1])} and "
                          f"{CP_RECIPES[-1]} in this version (relign {recipe} runs tensor and data parallel)")
    if cp > 1 and not getattr(cfg, "packing", False):
        raise ConfigError(f"parallel.cp_size={cp} splits packed rows over the cp ranks: set packing=true")
    world = distributed.world_size()
    if world % (tp * cp):
        raise ConfigError(f"parallel.tp_size x parallel.cp_size = {tp} x {cp} does not divide the world size "
                          f"{world} (torchrun's --nproc_per_node x --nnodes)")
    if tp * cp > 1 and cfg.model.path:
        s = plan_model.read_shape(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        check_heads(SimpleNamespace(num_attention_heads=s.heads, num_key_value_heads=s.kv_heads), tp, cp)


def checkpoint_to_resume(run: Run) -> Path | None:
    """The checkpoint ``resume`` names (``auto``: the newest valid one in the run directory), or None."""
    return resolve_resume(run.cfg.resume, run.run_dir)


def context_parallel(cfg: Any, *models: torch.nn.Module | None) -> None:
    """``parallel.cp_size`` > 1: the run's packed rows are split over the cp ranks, so every model
    that scores them (None: a model the run has not) runs Ulysses attention (``models.cp``). After
    ``varlen.choose``, whose packed attention Ulysses wraps; nothing on one cp rank."""
    par = cfg.parallel
    if par.cp_size > 1:
        for model in models:
            if model is not None:
                enable_ulysses(model, par.cp_size, par.tp_size)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """Tensor parallel over the mesh's tp ranks (``parallel.tp_size`` > 1), then FSDP2 over the
    data-parallel ranks (a no-op on one process), gathering a mixed-precision model's weights in
    its compute dtype."""
    tp_mesh = distributed.mesh("tp")
    if tp_mesh is not None and tp_mesh.size() > 1:
        apply_tp(model, tp_mesh)
    return distributed.wrap_fsdp(model, mixed_dtype(model))


def trainable(run: Run, model: torch.nn.Module, *, ckpt: Path | None, rows: int, batch_size: int, total_steps: int,
              weights_loaded: bool = False, steps: int = 0) -> Trainer:
    """``model`` ready to train: the checkpoint's weights (before sharding, so every rank starts
    from the same full weights; ``weights_loaded`` when the caller has loaded them already),
    FSDP, the data order over ``rows`` in batches of ``batch_size``, AdamW and its schedule over
    ``total_steps`` updates (``cfg.optim``; ``steps``: the recipe's steps where a step makes several
    updates), and the optimizer, schedule and data position of ``ckpt``."""
    if ckpt is not None and not weights_loaded:
        load_model_weights(model, ckpt)
    model = shard(model)
    sampler = StepSampler(rows, batch_size, seed=run.cfg.seed)
    optimizer, scheduler = build_training(model, run.cfg.optim, total_steps)
    start = resume_training(ckpt, model, optimizer, scheduler, sampler)
    return Trainer(model, optimizer, scheduler, sampler, total_steps, start, ckpt, trainable_parameters(model), steps)


def saver(run: Run, t: Trainer, tokenizer, *, state: dict[str, Any] | None = None,
          extra: Callable[[], tuple[dict[str, Any], dict[str, Any]]] | None = None) -> Callable[[int], None]:
    """``save(step)``: the full model and optimizer state gathered from the shards (a collective:
    every rank calls it), written atomically by rank 0 as ``checkpoints/step_N`` with the
    schedule, the data position, ``state`` (JSON) and what ``extra()`` returns (more tensors, and
    more models by sub-folder: RL's engine state and critic), then a barrier."""
    def save(step: int) -> None:
        model_sd, optim_sd = gather_train_state(t.model, t.optimizer)
        tensors = {"optimizer": optim_sd, "scheduler": t.scheduler.state_dict()}
        models: dict[str, Any] = {}
        if extra is not None:
            more, models = extra()
            tensors.update(more)
        if distributed.is_main():
            save_checkpoint(run.run_dir, step, model=t.model, tokenizer=tokenizer, state_dict=model_sd, tensors=tensors,
                            extra_models=models, keep_last=run.cfg.checkpoint.keep_last,
                            state={"sampler": t.sampler.state_dict(), "recipe": run.recipe, **(state or {})})
        distributed.barrier()

    return save


def tracker(run: Run, t: Trainer, *, desc: str, bar_keys: tuple[str, ...], first: dict[str, float] | None = None
            ) -> Tracker:
    """The run's metrics.jsonl, TensorBoard / W&B and progress bar over the recipe's ``t.steps`` (RL
    counts rollout steps, not updates), from ``t.start``; a fresh run logs ``first`` (its data
    counts) at step 0, a resumed one says where it resumed from."""
    out = build.tracker_for(run.cfg.logging, run.run_dir, total_steps=t.steps, start_step=t.start,
                            desc=desc, bar_keys=bar_keys)
    if t.start:
        out.write(f"resumed from {t.ckpt} at step {t.start}")
    elif first is not None:
        out.log(0, first, advance=False)
    return out


def schedule(cfg: Any, rows: int) -> tuple[int, int]:
    """(total steps, steps per epoch) of an offline trainer: ``max_steps``, or ``epochs`` passes
    over ``rows`` in full batches (the sampler drops an epoch's short tail)."""
    steps_per_epoch = rows // cfg.batch_size
    return cfg.max_steps or max(1, int(math.ceil(cfg.epochs * steps_per_epoch))), steps_per_epoch


def offline_facts(run: Run, total_steps: int, steps_per_epoch: int, data_metrics: dict[str, float], *, train: int,
                  eval_rows: int, unit: str, made: str = "", **extra: Any) -> dict[str, Any]:
    """What the start banner and ``--dry-run`` say about an offline trainer's data (the rows read,
    from its ``data/*`` counts; the examples kept) and its length."""
    cfg = run.cfg
    read = int(data_metrics["data/rows"] + data_metrics.get("data/eval_rows", 0))
    return dict(run_dir=run.run_dir, device=run.device, **extra,
                data=banner.data_line(read, train, eval_rows, made=made),
                steps=banner.steps_line(total_steps, max_steps=cfg.max_steps, epochs=cfg.epochs,
                                        steps_per_epoch=steps_per_epoch, batch=f"{cfg.batch_size} {unit}"))


def steps(t: Trainer) -> range:
    """The steps still to run."""
    return range(t.start + 1, t.steps + 1)


def optimizer_step(t: Trainer, max_grad_norm: float) -> dict[str, float]:
    """Clip the gradient norm, step AdamW and the schedule, zero the gradients; the norm (before
    clipping) and the learning rate the step used, as ``train/*`` metrics."""
    grad_norm = clip_gradients(t.params, max_grad_norm)
    lr = t.scheduler.get_last_lr()[0]
    t.optimizer.step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    return {"train/grad_norm": grad_norm, "train/lr": lr}


def mfu(run: Run, flops: float, seconds: float) -> dict[str, float]:
    """``perf/mfu``: ``flops``, the model FLOPs all ranks did (``models.flops``), over ``seconds``
    on every device at its peak; nothing when the peak is unknown (a CPU without
    ``logging.peak_tflops``): an absent metric, not a 0 that reads as a measurement."""
    return flops_mfu(flops, seconds, run.peak, devices=distributed.world_size())


def epoch(t: Trainer) -> float:
    """Epochs done, fractional."""
    return t.sampler.epoch + t.sampler.position / max(1, t.sampler.n)


def eval_due(step: int, every: int, total_steps: int) -> bool:
    """Every ``every`` steps (0: never) and at the last step."""
    return bool(every and step % every == 0) or step == total_steps


def log(run: Run, out: Tracker, save: Callable[[int], None], step: int, metrics: dict[str, float]) -> None:
    """Log the step's metrics; save every ``checkpoint.save_every`` steps."""
    out.log(step, metrics)
    every = run.cfg.checkpoint.save_every
    if every and step % every == 0:
        save(step)


def save_last(run: Run, t: Trainer, save: Callable[[int], None]) -> Path | None:
    """The last step saved unless it already is (or ``checkpoint.save_final`` is off); the newest checkpoint."""
    return save_final(run.run_dir, save, total_steps=t.steps, start_step=t.start,
                      save_final=run.cfg.checkpoint.save_final)


def close(run: Run, *, metrics: dict[str, Any], keys: tuple[str, ...], steps: int, checkpoint: Path | None = None,
          status: str = "", resumable: bool = True, after: Callable[[], None] | None = None,
          result: dict[str, Any] | None = None) -> RunResult:
    """End the run: the metrics history (rank 0), a barrier, ``after()`` (once every collective is
    behind: a vLLM engine's shutdown ends the process group), the end summary, and the result
    (``result``: its metrics, default ``metrics``)."""
    history = read_metrics(run.run_dir) if distributed.is_main() else []
    distributed.barrier()
    if after is not None:
        after()
    banner.end(run.recipe, run_dir=run.run_dir, seconds=time.perf_counter() - run.t_start, metrics=metrics, keys=keys,
               checkpoint=checkpoint, status=status, resumable=resumable)
    return RunResult(run_dir=run.run_dir, steps=steps, metrics=metrics if result is None else result,
                     checkpoint=checkpoint, history=history)
