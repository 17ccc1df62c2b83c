"""Reading a run directory into a ``Run``, and the facts the summary derives from it.

A run directory holds (every file optional, so a run that has only just started still loads):

    config.yaml              the resolved config
    metrics.jsonl            one row per logged step
    rollouts/step_N.jsonl    RL traces
    checkpoints/step_N/      relign_state.json names the recipe
    eval.json, samples.jsonl eval summary and per-sample rows
    eval/step_N.jsonl        in-training eval samples (RL with eval.samples)
    demo.json                the demo's before/after table; sub-run directories (rl/metrics.jsonl
                             is read for the demo's charts)
    sweep.json, search.jsonl, search/*.jsonl   inference-time search (search.py)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint import STATE_FILE, list_checkpoints
from ..tracking import read_metrics
from .search import load_search
from .util import REPORT_FILE, _dig, _is_num, read_json, read_jsonl

# Folders of a run that are never sub-runs (a demo's sub-runs are its other sub-directories).
NOT_SUBRUNS = {"checkpoints", "rollouts", "tensorboard", "wandb", ".cache", "search"}
RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.json", "demo.json", "samples.jsonl", "sweep.json", "search.jsonl")


@dataclass
class Run:
    path: Path
    config_text: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    trace_files: list[tuple[int, Path]] = field(default_factory=list)  # (step, path), oldest first
    checkpoints: list[int] = field(default_factory=list)
    checkpoint_state: dict[str, Any] = field(default_factory=dict)  # newest relign_state.json
    eval_summary: dict[str, Any] | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)
    samples_file: str = ""  # where the samples came from, relative to the run directory
    demo: dict[str, Any] | None = None
    demo_rl: list[dict[str, Any]] = field(default_factory=list)  # a demo's rl/metrics.jsonl (GRPO stage)
    subruns: list[Path] = field(default_factory=list)
    search: Any = None  # search.Search: sweep.json, search.jsonl, search/*.jsonl


def is_run_dir(root: Path) -> bool:
    """Whether ``root`` holds any of the files a run writes (a typo must not get a report)."""
    return any((root / f).exists() for f in RUN_FILES) or (root / "rollouts").is_dir()


def check_run_dir(root: Path) -> None:
    """Raise FileNotFoundError naming what is missing when ``root`` is not a run directory."""
    if not root.is_dir():
        raise FileNotFoundError(2, "no such run directory", str(root))
    if not is_run_dir(root):
        raise FileNotFoundError(2, "not a run directory (no config.yaml or metrics.jsonl)", str(root / "config.yaml"))


def load_run(root: Path) -> Run:

    root = Path(root)
    run = Run(path=root)
    cfg_path = root / "config.yaml"
    if cfg_path.is_file():
        run.config_text = cfg_path.read_text(errors="replace")
        run.config = _parse_yaml(run.config_text)
    run.metrics = read_metrics(root)
    run.trace_files = trace_files(root)
    ckpts = list_checkpoints(root)
    run.checkpoints = [s for s, _ in ckpts]
    if ckpts:
        run.checkpoint_state = read_json(ckpts[-1][1] / STATE_FILE) or {}
    run.eval_summary = read_json(root / "eval.json")
    run.samples_file = _samples_file(root)
    if run.samples_file:
        run.samples = read_jsonl(root / run.samples_file)
    run.demo = read_json(root / "demo.json")
    if run.demo is not None:
        run.demo_rl = read_metrics(root / "rl")
    run.search = load_search(root, run.eval_summary)
    run.subruns = sorted(
        p for p in root.iterdir()
        if p.is_dir() and p.name not in NOT_SUBRUNS and any((p / f).is_file() for f in RUN_FILES)
    )
    return run


def _parse_yaml(text: str) -> dict[str, Any]:
    try:
        import yaml

        data = yaml.safe_load(text)
    except Exception:  # noqa: BLE001 -- a broken config still gets its text shown
        return {}
    return data if isinstance(data, dict) else {}


def step_files(folder: Path) -> list[tuple[int, Path]]:
    """``folder/step_N.jsonl`` files as (N, path), by step."""
    found = []
    for p in folder.glob("step_*.jsonl") if folder.is_dir() else []:
        m = re.fullmatch(r"step_(\d+)\.jsonl", p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def trace_files(root: Path) -> list[tuple[int, Path]]:
    return step_files(root / "rollouts")


def _samples_file(root: Path) -> str:
    """samples.jsonl of an eval run, else the newest eval/step_N.jsonl of an in-training eval."""
    if (root / "samples.jsonl").is_file():
        return "samples.jsonl"
    evals = step_files(root / "eval")
    return f"eval/{evals[-1][1].name}" if evals else ""


# --------------------------------------------------------------------------- derived facts


def infer_recipe(run: Run) -> str:
    """The recipe that made the run: recorded if possible, else guessed from what it wrote."""
    for source in (run.config, run.checkpoint_state):
        if isinstance(source.get("recipe"), str):
            return source["recipe"]
    keys = metric_keys(run.metrics)
    cfg = run.config
    if run.demo is not None:
        return "demo"
    if (run.path / "rest.json").is_file():
        return "rest"
    if run.eval_summary is not None or run.samples_file == "samples.jsonl" or run.search is not None:
        return "eval"
    if run.trace_files or {"rollout", "algorithm"} <= cfg.keys() or "reward/mean" in keys:
        return "rl"
    if any(k.startswith(("rewards/", "train/rewards/")) for k in keys):
        # DPO-family configs carry a beta; a Bradley-Terry reward model has none.
        return "dpo" if "beta" in cfg or "beta" in (cfg.get("algorithm") or {}) else "rm"
    if "train/loss" in keys or "packing" in cfg:
        return "sft"
    return "unknown"


def metric_keys(rows: list[dict[str, Any]]) -> list[str]:
    """Numeric metric keys in first-seen order (not step/time)."""
    seen: dict[str, None] = {}
    for r in rows:
        for k, v in r.items():
            if k not in ("step", "time") and _is_num(v):
                seen.setdefault(k, None)
    return list(seen)


def final_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Last finite value of each numeric key."""
    out: dict[str, float] = {}
    for r in rows:
        for k, v in r.items():
            if k not in ("step", "time") and _is_num(v) and math.isfinite(v):
                out[k] = v
    return out


def wall_time(run: Run) -> tuple[float | None, float | None]:
    """(start, seconds): from metrics timestamps, else from file modification times."""
    times = [r["time"] for r in run.metrics if _is_num(r.get("time"))]
    if len(times) >= 1:
        start = min(times)
        cfg = run.path / "config.yaml"
        if cfg.is_file():  # the config is written before the first step: count that step too
            start = min(start, cfg.stat().st_mtime)
        return start, max(times) - start
    for doc in (run.demo, run.eval_summary):
        for key in ("seconds", "wall_s", "wall_time_s", "elapsed_s"):
            if doc and _is_num(doc.get(key)):
                return None, float(doc[key])
    mtimes = [p.stat().st_mtime for p in run.path.iterdir() if p.is_file() and p.name != REPORT_FILE]
    if len(mtimes) >= 2:
        return min(mtimes), max(mtimes) - min(mtimes)
    return None, None


def last_step(run: Run) -> int | None:
    steps = [r["step"] for r in run.metrics if _is_num(r.get("step"))]
    return int(max(steps)) if steps else None


def model_and_task(run: Run) -> tuple[str, str]:
    cfg, ev = run.config, run.eval_summary or {}
    model = _dig(cfg, "model", "path") or ev.get("model") or ""
    task = _dig(cfg, "task", "name") or ev.get("task") or ""
    path = _dig(cfg, "task", "path") or _dig(cfg, "data", "path") or ""
    if path and task:
        task = f"{task} ({path})"
    return str(model), str(task or path)
