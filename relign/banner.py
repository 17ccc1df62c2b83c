"""The run's life on the console: the start banner, ``--dry-run``, the end summary, progress bars.

A recipe calls, on every rank (only the main rank prints):

    banner.dry_run(...)   after its data is read, before any weights load: with --dry-run it
                          prints the resolved config, the data counts, the model size (from
                          the model's config on the meta device) and the memory plan (relign
                          plan's table) and raises DryRunDone
    banner.start(...)     once the model is built: the start banner (stderr, with the progress
                          bars); with --dry-run, the dry run, for a recipe that could not stop earlier
    banner.end(...)       the end summary (stdout): the metrics a user watches, wall time, run
                          dir, newest checkpoint, report path and the command that resumes the run

The CLI calls ``request_dry_run()`` when ``--dry-run`` is on the command line and turns
``DryRunDone`` into exit status 0. Recipes that run other recipes (demo, rest, verifier) wrap
them in ``nested()``: the inner runs print neither banner nor summary, the outer one does.

The ``format_*`` functions are pure (text in, text out) and carry all the layout.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from . import distributed
from .checkpoint import latest_checkpoint
from .config import to_yaml
from .models.loading import count_parameters, model_size
from .rundir import DryRunDone, dry_run_requested, is_nested, memory_plan, opened


def _speaks() -> bool:
    return not is_nested() and distributed.is_main()


# --------------------------------------------------------------------------- pure formatting


def human_count(n: int) -> str:
    """1234 -> 1.23K, 1_300_000 -> 1.30M, 7_615_616_512 -> 7.62B (three significant digits)."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale * 0.9995:  # 999,999 -> 1.00M, not 1000K
            v = n / scale
            return f"{v:.0f}{unit}" if v >= 99.95 else f"{v:.1f}{unit}" if v >= 9.995 else f"{v:.2f}{unit}"
    return str(n)


def format_params(total: int, trainable: int | None) -> str:
    """'1.30M (all trainable)' or '7.62B, 20.2M trainable (0.27%)'."""
    if trainable is None:
        return human_count(total)
    if trainable == total:
        return f"{human_count(total)} (all trainable)"
    share = 100 * trainable / max(total, 1)
    return f"{human_count(total)}, {human_count(trainable)} trainable ({share:.2g}%)"


def format_duration(seconds: float) -> str:
    """42.1 s, 3 min 05 s, 1 h 02 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def data_line(read: int, train: int, eval_rows: int = 0, *, unit: str = "rows", made: str = "") -> str:
    """'64 rows read, 62 used (54 train, 8 eval)'; 'used' < 'read' means rows were dropped.
    ``made``: the rows become other units (KTO splits a pair in two): '64 rows read -> 128 examples (...)'."""
    used = train + eval_rows
    split = f" ({train:,} train, {eval_rows:,} eval)" if eval_rows else ""
    return f"{read:,} {unit} read -> {used:,} {made}{split}" if made else f"{read:,} {unit} read, {used:,} used{split}"


def steps_line(total: int, *, max_steps: int = 0, epochs: float = 0.0, steps_per_epoch: int = 0, batch: str = "") -> str:
    """'60 (max_steps) x 16 rows' or '36 (3 epochs x 12 steps per epoch) x 16 rows'."""
    how = "max_steps" if max_steps else f"{epochs:g} epoch{'' if epochs == 1 else 's'} x {steps_per_epoch:,} steps per epoch"
    return f"{total:,} ({how})" + (f" x {batch}" if batch else "")


def format_start(recipe: str, *, model: str, params: str, dtype: str, device: str, data: str, steps: str,
                 run_dir: str) -> str:
    """The start banner: what is about to train, on what, for how long, and where it goes."""
    rows = [("model", model), ("parameters", params), ("dtype", dtype), ("device", device), ("data", data),
            ("steps", steps), ("run dir", run_dir)]
    return "\n".join([f"relign {recipe}"] + [f"  {k:<11}{v}" for k, v in rows if v])


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) < 1e9):
        return f"{int(value):,}"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


def format_metrics(metrics: Mapping[str, Any], keys: Iterable[str]) -> str:
    """'train/loss 0.4123  eval/loss 0.5'; keys the run did not log are left out."""
    return "  ".join(f"{k} {_fmt(metrics[k])}" for k in keys if k in metrics)


def format_end(recipe: str, *, seconds: float, metrics: str, run_dir: str, checkpoint: str = "", report: str = "",
               resume: str = "", status: str = "") -> str:
    """The end summary: the numbers a user watches, and where everything is."""
    head = f"relign {recipe}: {status or 'done'} in {format_duration(seconds)}"
    rows = [("metrics", metrics), ("run dir", run_dir), ("checkpoint", checkpoint), ("report", report),
            ("resume", resume)]
    return "\n".join([head] + [f"  {k:<11}{v}" for k, v in rows if v])


def resume_command(command: str, run_dir: str | os.PathLike, argv: list[str] | None = None, world: int = 1) -> str:
    """The command line that continues this run: the original arguments (``sys.argv``) with
    ``run_dir`` pinned and ``resume=auto``. Called other than from the CLI (argv not naming the
    command), it resumes from the resolved ``config.yaml`` the run wrote."""
    argv = list(sys.argv if argv is None else argv)
    args = argv[1:]
    if args[:1] == [command]:
        keep = [a for a in args[1:] if a != "--dry-run" and not a.startswith(("run_dir=", "resume="))]
    else:
        keep = [str(Path(run_dir) / "config.yaml")]
    head = ["relign"] if world <= 1 else ["torchrun", f"--nproc_per_node={world}", "-m", "relign"]
    return shlex.join([*head, command, *keep, f"run_dir={run_dir}", "resume=auto"])


# --------------------------------------------------------------------------- facts about the run


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name and its widest vector extension, e.g. "AMD EPYC, AVX2" (Linux; else
    what ``platform`` knows). Timings depend on it: 2 cores of an AVX2-only EPYC run fp32 matrix
    products at 2/3 the rate of 2 cores with AVX-512, and the demo ran 20-25% longer (BENCHMARKS.md)."""
    import platform

    name, flags = "", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    isa = next((label for flag, label in (("amx_tile", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"),
                                          ("avx2", "AVX2")) if flag in flags), "")
    return f"{name}, {isa}" if isa else name


def _device_line(device) -> str:
    import torch

    world = distributed.world_size()
    ranks = f" x {world} ranks" if world > 1 else ""
    if distributed.mesh() is not None:  # parallel.tp_size / cp_size: how the ranks share the model
        ranks += " as mesh " + " x ".join(f"{k} {v}" for k, v in distributed.mesh_shape().items())
    cpu = f" ({cpu_name()})" if str(device) == "cpu" else ""
    return f"{device}{cpu}{ranks}, {torch.get_num_threads()} CPU threads"


def _discard_new_run_dir(run_dir: Path) -> bool:
    """Remove what this run's ``open_run`` wrote (``rundir.opened``): the directory it created,
    or its config file in an empty directory it was given. An earlier run's directory, or one
    this process did not open, is left alone. True when nothing of the dry run is left."""
    if not run_dir.is_dir():
        return True
    how, config_name = opened(run_dir) or ("", "")
    if how == "created":
        shutil.rmtree(run_dir, ignore_errors=True)
        return not run_dir.exists()
    if how == "empty":
        (run_dir / config_name).unlink(missing_ok=True)
        return True
    return False


# --------------------------------------------------------------------------- what recipes call


def _model_facts(cfg, model, model_path: str | None, dtype: str | None, kind: str) -> tuple[str, str, str]:
    """(model path, parameters, dtype); ``kind`` "frozen": a model that only infers (eval)."""
    m = getattr(cfg, "model", None)
    path = model_path if model_path is not None else m.path
    if model is not None:
        total, trainable = count_parameters(model)
    else:
        total, trainable = model_size(path, kind="seq_cls" if kind == "seq_cls" else "causal",
                                      lora=None if kind == "frozen" else getattr(m, "lora", None),
                                      trust_remote_code=getattr(m, "trust_remote_code", False))
    params = format_params(total, None if kind == "frozen" else trainable)
    return path, params, dtype if dtype is not None else m.dtype


def dry_run(command: str, cfg, *, run_dir, device, data: str, steps: str, model=None, model_path: str | None = None,
            dtype: str | None = None, kind: str = "causal") -> None:
    """With ``--dry-run``: print the resolved config, the data counts and the model size, remove
    the run directory if this process created it, and raise DryRunDone. Otherwise nothing.

    ``model``: the built model, or None to count the parameters from its config (``cfg.model``,
    or ``model_path`` and ``dtype``); ``kind``: causal, seq_cls (a reward model) or frozen
    (inference only: the total is shown, not a trainable share)."""
    if not dry_run_requested() or is_nested():
        return
    path, params, dtype = _model_facts(cfg, model, model_path, dtype, kind)
    distributed.barrier()  # every rank is here before rank 0 removes the directory
    if distributed.is_main():
        text = format_start(command, model=path, params=params, dtype=dtype, device=_device_line(device), data=data,
                            steps=steps, run_dir=str(run_dir))
        gone = _discard_new_run_dir(Path(run_dir))
        where = "no run directory kept" if gone else f"the resolved config is in {Path(run_dir) / 'config.yaml'}"
        plan = f"\n{memory_plan()}\n" if memory_plan() else ""  # relign plan's table (recipes/memory.check)
        print(f"# relign {command} --dry-run: the resolved config\n{to_yaml(cfg)}\n{text}\n{plan}"
              f"dry run: nothing trained, no checkpoint written; {where}", flush=True)
    raise DryRunDone(command)


def start(command: str, cfg, *, run_dir, device, data: str, steps: str, model=None, model_path: str | None = None,
          dtype: str | None = None, kind: str = "causal") -> None:
    """The start banner on the main rank (stderr, where the progress bars are); with
    ``--dry-run``, the dry run instead."""
    dry_run(command, cfg, run_dir=run_dir, device=device, data=data, steps=steps, model=model, model_path=model_path,
            dtype=dtype, kind=kind)
    if not _speaks():
        return
    path, params, dtype = _model_facts(cfg, model, model_path, dtype, kind)
    text = format_start(command, model=path, params=params, dtype=dtype, device=_device_line(device), data=data,
                        steps=steps, run_dir=str(run_dir))
    print(text, file=sys.stderr, flush=True)


def end(command: str, *, run_dir, seconds: float, metrics: Mapping[str, Any], keys: Iterable[str],
        checkpoint: Path | str | None = None, resumable: bool = True, status: str = "") -> None:
    """The end summary on the main rank (stdout). ``report.html`` is named before it exists: the
    CLI refreshes the report once the recipe returns."""
    if not _speaks():
        return
    ckpt = checkpoint if checkpoint is not None else (latest_checkpoint(run_dir) if resumable else None)
    resume = resume_command(command, run_dir, world=distributed.world_size()) if resumable and ckpt else ""
    done = status if status and status != "completed" else ""
    print(format_end(command, seconds=seconds, metrics=format_metrics(metrics, keys), run_dir=str(run_dir),
                     checkpoint=str(ckpt or ""), report=str(Path(run_dir) / "report.html"), resume=resume, status=done),
          flush=True)


def progress(total: int, desc: str, *, enabled: bool = True, leave: bool = True, delay: float = 0.0):
    """A progress bar like the training loop's (tqdm on stderr, sparse when stderr is a file),
    drawn on the main rank only: ``with banner.progress(n, "dpo reference") as bar: bar.update()``.
    ``delay``: appear only once the work has taken that many seconds (an eval inside the
    training loop gets a bar when it is slow, not a flicker every time)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not (enabled and distributed.is_main()), dynamic_ncols=True,
                leave=leave, delay=delay, mininterval=0.5 if sys.stderr.isatty() else 5.0, file=sys.stderr)
