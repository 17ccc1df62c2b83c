"""Run tracking: a progress bar, ``metrics.jsonl`` (always), TensorBoard, Weights & Biases.

Only rank 0 writes or prints; on other ranks every method is a no-op.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from . import distributed
from .errors import ConfigError

Listener = Callable[[int, dict[str, Any]], None]
_listeners: list[Listener] = []


def add_listener(fn: Listener) -> Callable[[], None]:
    """Call ``fn(step, metrics)`` with every row a run logs in this process (rank 0), right after
    it is written to ``metrics.jsonl``: an in-process hook for a custom logger, an early stop
    or a benchmark's clock, the way a TRL user writes a callback. Returns a function that
    removes it. A listener that raises stops the run (it is the caller's code)."""
    _listeners.append(fn)
    return lambda: _listeners.remove(fn) if fn in _listeners else None


def _fmt(value: float) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if value == 0:
        return "0"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    a = abs(value)
    if 1e4 <= a < 1e9:
        return f"{value:.0f}"
    if a >= 1e9 or a < 1e-3:
        return f"{value:.2e}"
    return f"{value:.4g}"


def _label(key: str) -> str:
    """Short progress-bar label: train/loss -> loss, perf/tokens_per_s -> tokens_per_s, eval/loss -> eval_loss."""
    group, _, name = key.rpartition("/")
    return name if group in ("", "train", "perf", "rollout") else f"{group.split('/')[-1]}_{name}"


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    rows = []
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        return rows
    with open(p) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line cut by a crash: everything after it is unreliable
    return rows


class StageClock:
    """Seconds per named stage of a step: ``with clock("update"): ...``; ``clock.metrics()``
    gives ``time/<stage>_s`` for every stage named in ``stages`` (0 for one that did not run),
    so every step logs the same keys. On CUDA the stage waits for its kernels before the
    clock stops (launches are asynchronous)."""

    def __init__(self, stages: tuple[str, ...] = (), device=None):
        import torch

        self.seconds: dict[str, float] = {s: 0.0 for s in stages}
        self._sync = torch.cuda.synchronize if getattr(device, "type", str(device)) == "cuda" else None
        self._t0 = time.perf_counter()

    @contextmanager
    def __call__(self, stage: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0

    def total(self) -> float:
        return time.perf_counter() - self._t0

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}_s": v for k, v in self.seconds.items()} | {"time/step_s": self.total()}


class Tracker:
    """Write metrics for one run and drive its progress bar.

    On resume (``start_step > 0``) the metrics of steps after the checkpoint are dropped from
    ``metrics.jsonl``, so the file reads as one uninterrupted run.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        total_steps: int,
        start_step: int = 0,
        desc: str = "train",
        bar_keys: tuple[str, ...] = (),
        progress: bool = True,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "relign",
        run_name: str = "",
        config: dict[str, Any] | None = None,
    ):
        self.enabled = distributed.is_main()
        self.run_dir = Path(run_dir)
        self.bar_keys = bar_keys
        self._bar = None
        self._tb = None
        self._wandb = None
        self.last: dict[str, Any] = {}
        if not self.enabled:
            return
        self.path = self.run_dir / "metrics.jsonl"
        self._rewrite_upto(start_step)
        self._file = open(self.path, "a")
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, desc=desc, dynamic_ncols=True,
                mininterval=0.5 if sys.stderr.isatty() else 5.0, file=sys.stderr,
            )
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
            except ImportError:
                self._tb = None
        if wandb:
            try:
                import wandb as wb
            except ImportError as e:
                        raise ConfigError("logging.wandb=true needs Weights & Biases: pip install 'relign[wandb]'") from e
            self._wandb = wb.init(
                project=wandb_project, name=run_name or self.run_dir.name, config=config or {},
                dir=str(self.run_dir), resume="allow", id=(run_name or self.run_dir.name).replace("/", "-"),
            )

    def _rewrite_upto(self, step: int) -> None:
        if not self.path.exists():
            return
        rows = [r for r in read_metrics(self.path) if step and r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any], *, advance: bool = True) -> None:
        """Record ``metrics`` for ``step``; ``advance`` moves the progress bar to ``step``."""
        if not self.enabled:
            return
        clean = {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (bool, str)) else v) for k, v in metrics.items()}
        self.last.update(clean)
        self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        self._file.flush()
        for fn in list(_listeners):
            fn(step, clean)
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._bar is not None and advance:
            self._bar.update(step - self._bar.n)
            post = {_label(k): _fmt(self.last[k]) for k in self.bar_keys if k in self.last}
            self._bar.set_postfix(post, refresh=False)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
