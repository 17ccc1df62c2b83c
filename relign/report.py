"""Static HTML report of a run: summary, metric plots, rollout traces, eval samples.

``write_report(run_dir)`` reads what a run directory holds and writes one self-contained
``RUN_DIR/report.html``: no network is needed to open it (inline CSS and JS, plots drawn here
as inline SVG, a Content-Security-Policy that forbids loading anything). Everything it shows
comes from files, so it works for every recipe and for a run that is still going:

    config.yaml              summary (model, task) + the config itself, collapsible
    metrics.jsonl            final values + one plot per metric family over steps
    rollouts/step_N.jsonl    the trace browser (RL): prompts, responses, token shading
    checkpoints/step_N/      the recipe name (relign_state.json) and the list of checkpoints
    eval.json, samples.jsonl eval summary + per-problem grid of samples and votes
    eval/step_N.jsonl        the same grid for the latest in-training eval (RL with eval.samples)
    demo.json                before/after table; sub-run directories get their own report
    sweep.json, search.jsonl, search/*.jsonl   inference-time search (relign/report_search.py)

Model output is untrusted text: every string is escaped (``html.escape``) in markup, JSON
embedded in ``<script>`` blocks has ``<``, ``>`` and ``&`` escaped so ``</script>`` cannot
close the block, and the page's JS only ever sets ``textContent``, never ``innerHTML``.
"""

from __future__ import annotations

import datetime as _dt
import fnmatch
import html
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import quote

from .checkpoint import STATE_FILE, atomic_write_text, list_checkpoints
from .tracking import read_metrics

log = logging.getLogger(__name__)

REPORT_FILE = "report.html"

# Caps that keep report.html a few MB however long the run: the page says when it cut.
MAX_TRACE_STEPS = 50  # the most recent steps of rollouts/ embedded ...
MAX_TRACE_BYTES = 10_000_000  # ... newest first, until their JSON reaches this
MAX_TOKEN_BYTES = 6_000_000  # token detail (~20 bytes a token) for the newest steps within this
MAX_TRACE_ROWS = 64  # rows per step (the first ones: whole groups, in order)
MAX_TOKENS_PER_ROW = 1024  # token-level detail per response
MAX_TEXT_CHARS = 8000  # prompts and response texts longer than this are cut
MAX_EVAL_PROBLEMS = 500  # problems shown in the eval grid ...
MAX_EVAL_BYTES = 8_000_000  # ... until their samples' text reaches this
MAX_CHART_POINTS = 400  # longer series are averaged into this many buckets

# Folders of a run that are never sub-runs (a demo's sub-runs are its other sub-directories).
NOT_SUBRUNS = {"checkpoints", "rollouts", "tensorboard", "wandb", ".cache", "search"}
RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.json", "demo.json", "samples.jsonl", "sweep.json", "search.jsonl")

# Named plots, in page order. Each is (id, title, key patterns, band key). Keys matched here
# are not plotted again among the generic per-prefix plots. Patterns are fnmatch-style.
CHARTS: list[tuple[str, str, tuple[str, ...], str | None]] = [
    ("reward", "Reward (mean ± std)", ("reward/mean",), "reward/std"),
    ("reward-components", "Reward score and components", ("reward/score", "reward/*"), None),
    ("eval-accuracy", "Eval accuracy", ("eval/accuracy", "eval/pass@*", "eval/maj@*", "eval/score"), None),
    ("rest-accuracy", "Validation accuracy per ReST-EM iteration", ("rest/val_accuracy",), None),
    ("rest-filter", "ReST-EM filter (per iteration)", ("rest/correct_frac", "rest/prompts_with_any", "rest/truncated_frac"), None),
    ("vine", "VinePPO: Monte-Carlo vs policy tokens", ("vine/mc_tokens", "vine/policy_tokens"), None),
    ("trpo", "TRPO trust region", ("trpo/kl", "trpo/surrogate_gain", "trpo/accepted"), None),
    ("loss", "Loss", ("train/loss", "eval/loss", "actor/loss"), None),
    ("preference-rewards", "Implicit rewards", ("rewards/chosen", "rewards/rejected", "rewards/margins"), None),
    ("preference-accuracy", "Preference accuracy", ("rewards/accuracy", "eval/rewards/accuracy", "eval/accuracy_pairs"), None),
    ("kl", "KL to reference", ("actor/kl",), None),
    ("entropy", "Entropy", ("actor/entropy",), None),
    ("response-length", "Response length (tokens)", ("response/length_mean", "response/length_max"), None),
    ("truncated", "Truncated fraction", ("response/truncated_frac",), None),
    ("clip-frac", "Clip fraction", ("actor/clip_frac",), None),
    ("grad-norm", "Gradient norm", ("actor/grad_norm", "train/grad_norm", "critic/grad_norm"), None),
    ("value-loss", "Value loss", ("critic/value_loss",), None),
    ("tokens-per-s", "Throughput (tokens/s)", ("perf/tokens_per_s", "perf/*tokens_per_s*"), None),
    ("time", "Time per step (s)", ("time/rollout_s", "time/reward_s", "time/reference_s", "time/old_logps_s", "time/values_s",
                                  "time/update_s", "time/sync_s", "time/step_s", "time/*"), None),
    ("lr", "Learning rate", ("actor/lr", "train/lr", "critic/lr"), None),
]
# reward/ keys that are counters, not rewards: they fall through to the generic plots.
NOT_REWARD_COMPONENTS = {"reward/mean", "reward/std", "reward/errors", "reward/timeouts"}

# Field names of eval samples.jsonl rows, first match wins. The eval writer is young: adapt
# here, not in the code below. "answer" is read as the gold answer (as in extra_info).
SAMPLE_FIELDS: dict[str, tuple[str, ...]] = {
    "problem": ("problem_index", "problem_idx", "problem_id", "problem", "index", "idx", "id"),
    "prompt": ("prompt", "question", "problem"),
    "response": ("response", "completion", "text", "output"),
    "extracted": ("extracted", "extracted_answer", "pred", "prediction", "parsed"),
    "gold": ("gold", "gold_answer", "target", "reference", "ground_truth", "answer"),
    "correct": ("correct", "is_correct", "score"),
    "reward": ("reward",),
    "finish_reason": ("finish_reason",),
    "length": ("length", "num_tokens", "response_length"),
    "majority": ("majority", "majority_answer", "maj_answer", "maj"),
    "majority_correct": ("majority_correct", "maj_correct"),
    "votes": ("votes", "vote_counts"),
    "samples": ("samples", "responses", "completions"),
}
EXTRACTED_KEYS = ("extracted", "extracted_answer", "pred", "prediction")  # in an RL trace row or its extra_info
GOLD_KEYS = ("answer", "gold", "target", "ground_truth")  # in a trace row's extra_info

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f")


# --------------------------------------------------------------------------- public API


def write_report(run_dir: str | os.PathLike) -> Path:
    """Write ``RUN_DIR/report.html`` (and one for each sub-run) and return its path.

    Raises FileNotFoundError when ``run_dir`` is not a directory or holds none of the files a
    run writes (so a typo does not drop a report into some unrelated folder).
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(2, "no such run directory", str(root))
    if not any((root / f).exists() for f in RUN_FILES) and not (root / "rollouts").is_dir():
        raise FileNotFoundError(2, "not a run directory (no config.yaml or metrics.jsonl)", str(root / "config.yaml"))
    run = load_run(root)
    for sub in run.subruns:
        write_report(sub)
    out = root / REPORT_FILE
    atomic_write_text(out, render_page(run))  # a browser reloading mid-write sees the old or the new page
    return out


def refresh_report(run_dir: str | os.PathLike) -> Path | None:
    """``write_report`` for recipes (end of run, checkpoints): never raises, returns None on failure.

    A report is a convenience: a bad trace file or a full disk must not stop training.
    Only the main rank writes (the other ranks return None).
    """
    try:
        from . import distributed

        if not distributed.is_main():
            return None
        return write_report(run_dir)
    except Exception as e:  # noqa: BLE001 -- by contract: log and carry on
        log.warning("could not write %s/%s: %s: %s", run_dir, REPORT_FILE, type(e).__name__, e)
        return None


# --------------------------------------------------------------------------- reading a run


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
    subruns: list[Path] = field(default_factory=list)
    search: Any = None  # report_search.Search: sweep.json, search.jsonl, search/*.jsonl


def load_run(root: Path) -> Run:
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
        run.checkpoint_state = _read_json(ckpts[-1][1] / STATE_FILE) or {}
    run.eval_summary = _read_json(root / "eval.json")
    run.samples_file = _samples_file(root)
    if run.samples_file:
        run.samples = read_jsonl(root / run.samples_file)
    run.demo = _read_json(root / "demo.json")
    from . import report_search  # imports this module: not at the top

    run.search = report_search.load_search(root, run.eval_summary)
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


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a JSONL file (at most ``limit``); a cut or bad line is skipped, not fatal."""
    rows: list[dict[str, Any]] = []
    if not path.is_file():
        return rows
    with open(path, errors="replace") as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


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


# --------------------------------------------------------------------------- summary


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
    if any(k.startswith("rewards/") for k in keys):
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


def _model_and_task(run: Run) -> tuple[str, str]:
    cfg, ev = run.config, run.eval_summary or {}
    model = _dig(cfg, "model", "path") or ev.get("model") or ""
    task = _dig(cfg, "task", "name") or ev.get("task") or ""
    path = _dig(cfg, "task", "path") or _dig(cfg, "data", "path") or ""
    if path and task:
        task = f"{task} ({path})"
    return str(model), str(task or path)


def _dig(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


# --------------------------------------------------------------------------- charts (pure: data -> SVG)

Series = tuple[str, list[float], list[float]]  # (key, steps, values)


def series_of(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """Steps and finite values of ``key``; rows without a step count as their row index."""
    xs, ys = [], []
    for i, r in enumerate(rows):
        v = r.get(key)
        if _is_num(v) and math.isfinite(v):
            xs.append(_step_of(r, i))
            ys.append(float(v))
    return xs, ys


def _step_of(row: dict[str, Any], index: int) -> float:
    step = row.get("step")
    return float(step) if _is_num(step) else float(index)


def downsample(xs: list[float], ys: list[float], n: int = MAX_CHART_POINTS) -> tuple[list[float], list[float]]:
    """Average consecutive points into ``n`` buckets: the SVG stays small, the shape stays."""
    if len(xs) <= n:
        return xs, ys
    out_x, out_y = [], []
    for b in range(n):
        lo, hi = b * len(xs) // n, (b + 1) * len(xs) // n
        out_x.append(sum(xs[lo:hi]) / (hi - lo))
        out_y.append(sum(ys[lo:hi]) / (hi - lo))
    return out_x, out_y


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 x 10^k apart) covering [lo, hi]."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def tick_labels(ticks: list[float]) -> list[str]:
    """Labels with just enough decimals to tell neighbouring ticks apart (7.7245 vs 7.725)."""
    if len(ticks) < 2:
        return [fmt(t) for t in ticks]
    step = ticks[1] - ticks[0]
    biggest = max(abs(t) for t in ticks)
    if biggest >= 1e5 or biggest < 1e-3:
        return [f"{t:.3g}" for t in ticks]
    exp = math.floor(math.log10(step))
    decimals = max(0, -exp + (1 if round(step / 10**exp, 6) == 2.5 else 0))
    return [f"{t:.{decimals}f}" for t in ticks]


def _range(values: Iterable[float]) -> tuple[float, float]:
    vals = list(values)
    lo, hi = min(vals), max(vals)
    if hi == lo:  # a flat line: give it some room
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def chart_svg(series: list[Series], band: tuple[list[float], list[float], list[float]] | None = None,
              width: int = 480, height: int = 210) -> tuple[str, dict[str, Any]]:
    """An SVG line chart of ``series`` (+ an optional shaded band: xs, lows, highs).

    Returns the markup and the geometry + points the page's JS needs for its hover readout.
    """
    left, right, top, bottom = 56, 12, 10, 26
    pw, ph = width - left - right, height - top - bottom
    all_x = [x for _, xs, _ in series for x in xs]
    all_y = [y for _, _, ys in series for y in ys] + (band[1] + band[2] if band else [])
    x0, x1 = (min(all_x), max(all_x)) if max(all_x) > min(all_x) else (min(all_x) - 1, max(all_x) + 1)
    y0, y1 = _range(all_y)

    def px(x: float) -> float:
        return round(left + (x - x0) / (x1 - x0) * pw, 1)

    def py(y: float) -> float:
        return round(top + (1 - (y - y0) / (y1 - y0)) * ph, 1)

    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" preserveAspectRatio="xMidYMid meet">']
    y_ticks = nice_ticks(y0, y1)
    for t, label in zip(y_ticks, tick_labels(y_ticks)):
        parts.append(f'<line class="grid" x1="{left}" x2="{left + pw}" y1="{py(t)}" y2="{py(t)}"/>'
                     f'<text class="tick" x="{left - 4}" y="{py(t) + 3}" text-anchor="end">{label}</text>')
    x_ticks = [t for t in nice_ticks(x0, x1, 6) if float(t).is_integer()] or [x0, x1]
    for t in x_ticks:
        parts.append(f'<text class="tick" x="{px(t)}" y="{top + ph + 16}" text-anchor="middle">{fmt(t)}</text>')
    parts.append(f'<rect class="frame" x="{left}" y="{top}" width="{pw}" height="{ph}"/>')
    if band:
        bx, lo, hi = band
        pts = [f"{px(x)},{py(y)}" for x, y in zip(bx, hi)] + [f"{px(x)},{py(y)}" for x, y in reversed(list(zip(bx, lo)))]
        parts.append(f'<polygon class="band" fill="{PALETTE[0]}" points="{" ".join(pts)}"/>')
    points = []
    for i, (key, xs, ys) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        if len(xs) == 1:
            parts.append(f'<circle cx="{px(xs[0])}" cy="{py(ys[0])}" r="3" fill="{color}"/>')
        else:
            d = "M" + " L".join(f"{px(x)},{py(y)}" for x, y in zip(xs, ys))
            parts.append(f'<path class="line" stroke="{color}" d="{d}"><title>{html.escape(key)}</title></path>')
        points.append({"key": key, "color": color, "x": xs, "y": [float(f"{y:.6g}") for y in ys]})
    parts.append(f'<line class="cursor" x1="0" x2="0" y1="{top}" y2="{top + ph}" visibility="hidden"/></svg>')
    geometry = {"left": left, "width": pw, "x0": x0, "x1": x1, "series": points}
    return "".join(parts), geometry


def render_chart(chart_id: str, title: str, rows: list[dict[str, Any]], keys: list[str], band_key: str | None = None) -> str:
    """One ``<figure class="chart">`` plotting ``keys`` (those with data) over steps."""
    series, last = [], {}
    for key in keys:
        xs, ys = series_of(rows, key)
        if xs:
            series.append((key, *downsample(xs, ys)))
            last[key] = ys[-1]  # the legend shows the true last value, not a bucket average
    if not series:
        return ""
    band = None
    if band_key and series[0][0] == keys[0]:
        band = _band(rows, keys[0], band_key)
    svg, geometry = chart_svg(series, band)
    legend = "".join(
        f'<span class="key"><i style="background:{s["color"]}"></i>{html.escape(s["key"])} '
        f'<b>{fmt(last[s["key"]])}</b></span>' for s in geometry["series"]
    )
    if band:
        legend += f'<span class="key"><i class="band-key"></i>± {html.escape(band_key or "")}</span>'
    return (
        f'<figure class="chart" id="chart-{_slug(chart_id)}" data-metric="{html.escape(series[0][0])}" '
        f'data-keys="{html.escape(" ".join(s[0] for s in series))}" data-points="{html.escape(_json(geometry))}">'
        f'<figcaption>{html.escape(title)}</figcaption>{svg}<div class="legend">{legend}</div>'
        f'<div class="readout"></div></figure>'
    )


def _band(rows: list[dict[str, Any]], mean_key: str, std_key: str) -> tuple[list[float], list[float], list[float]] | None:
    xs, lo, hi = [], [], []
    for i, r in enumerate(rows):
        m, s = r.get(mean_key), r.get(std_key)
        if _is_num(m) and _is_num(s) and math.isfinite(m) and math.isfinite(s):
            xs.append(_step_of(r, i))
            lo.append(m - s)
            hi.append(m + s)
    if len(xs) < 2:
        return None
    bx, blo = downsample(xs, lo)
    _, bhi = downsample(xs, hi)
    return bx, blo, bhi


def plan_charts(keys: list[str]) -> tuple[list[tuple[str, str, list[str], str | None]], dict[str, list[str]]]:
    """Split metric keys into the named charts (CHARTS order) and the rest grouped by prefix."""
    claimed: set[str] = set()
    named = []
    for chart_id, title, patterns, band in CHARTS:
        chosen = []
        for pattern in patterns:
            for k in keys:
                if k in claimed or k in chosen or not fnmatch.fnmatchcase(k, pattern):
                    continue
                if chart_id == "reward-components" and k in NOT_REWARD_COMPONENTS:
                    continue
                chosen.append(k)
        if chosen:
            named.append((chart_id, title, chosen, band))
            claimed.update(chosen)
            if band and band in keys:
                claimed.add(band)
    rest: dict[str, list[str]] = {}
    for k in keys:
        if k not in claimed:
            rest.setdefault(k.rpartition("/")[0] or "other", []).append(k)
    return named, rest


def render_metrics(rows: list[dict[str, Any]]) -> str:
    keys = metric_keys(rows)
    if not keys:
        return '<p class="empty">No metrics logged yet.</p>'
    named, rest = plan_charts(keys)
    out = ['<div class="charts">']
    out += [render_chart(cid, title, rows, ks, band) for cid, title, ks, band in named]
    out.append("</div>")
    # one plot per remaining key, in prefix order; a key logged once (data/* counts at step 0)
    # is a number, not a curve: it is in the final metrics table
    figures = [render_chart(k, k, rows, [k]) for ks in rest.values() for k in ks if len(series_of(rows, k)[0]) >= 2]
    if figures:
        out.append(f'<h3>Other metrics</h3><div class="charts">{"".join(figures)}</div>')
    return "".join(out)


# --------------------------------------------------------------------------- traces (pure: rows -> JSON)


def correctness(row: dict[str, Any]) -> bool | None:
    """Correct if the row says so, else if its score is positive; None when it cannot tell."""
    for key in ("correct", "is_correct"):
        said = _as_bool(row.get(key))
        if said is not None:
            return said
    return _as_bool(row.get("score"))


def trace_row(raw: dict[str, Any], prompt_id: int, *, token_detail: bool = True) -> dict[str, Any]:
    """One response of a rollouts/step_N.jsonl row, cut to the caps, in the page's shape.

    With token detail the response is its tokens (the page joins them for search) and the text
    is stored only when the tokens were cut; without, the text alone.
    """
    extra = raw.get("extra_info") if isinstance(raw.get("extra_info"), dict) else {}
    tokens = raw.get("tokens") if isinstance(raw.get("tokens"), list) and token_detail else []
    n = min(len(tokens), MAX_TOKENS_PER_ROW)
    row = {
        "prompt_id": prompt_id,
        "response": _cut(str(raw.get("response", ""))) if n == 0 or n < len(tokens) else "",
        "reward": _finite(raw.get("reward")),
        "score": _finite(raw.get("score")),
        "correct": correctness(raw),
        "advantage": _finite(raw.get("advantage")),
        "finish_reason": str(raw.get("finish_reason", "")),
        "length": raw.get("length"),
        "gold": _first(extra, GOLD_KEYS),
        "extracted": _first(raw, EXTRACTED_KEYS) or _first(extra, EXTRACTED_KEYS),
        "components": _clean(raw.get("components") or {}),
        "tokens": [str(t) for t in tokens[:n]],
        "tokens_cut": len(tokens) - n,
    }
    for key in ("token_mask", "logps", "token_advantages"):
        values = raw.get(key)
        if n and isinstance(values, list) and len(values) >= n:
            row[key] = _clean(values[:n])
    if all(m == 1 for m in row.get("token_mask", [])):
        row.pop("token_mask", None)  # single-turn: every token is the model's; the page assumes so
    return row


def trace_step(step: int, raws: list[dict[str, Any]], total_rows: int, *, token_detail: bool = True) -> dict[str, Any]:
    """A step's rows with prompts stored once (a group of G responses shares one prompt).

    ``problems`` holds each prompt's problem without chat markup, when the trace has it: the
    page shows it in the prompt's one-line summary, where a chat template's preamble would be.
    """
    prompts: list[str] = []
    problems: list[str] = []
    index: dict[str, int] = {}
    rows = []
    for raw in raws:
        p = str(raw.get("prompt", ""))
        if p not in index:
            index[p] = len(prompts)
            prompts.append(_cut(p))
            problems.append(_cut(_text(raw.get("problem")), 300))
        rows.append(trace_row(raw, index[p], token_detail=token_detail))
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    correct = [r["correct"] for r in rows if r["correct"] is not None]
    return {
        "step": step, "prompts": prompts, "problems": problems, "rows": rows, "total_rows": total_rows,
        "token_detail": token_detail and any(r["tokens"] for r in rows),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "accuracy": sum(correct) / len(correct) if correct else None,
    }


def build_traces(files: list[tuple[int, Path]]) -> dict[str, Any]:
    """The trace browser's data, newest steps first into a size budget.

    The newest steps carry token detail while it fits MAX_TOKEN_BYTES; older ones carry text
    only; steps stop when MAX_TRACE_BYTES is reached (or after MAX_TRACE_STEPS).
    """
    steps: list[dict[str, Any]] = []
    used, token_detail = 0, True
    for step, path in reversed(files[-MAX_TRACE_STEPS:]):
        raws = read_jsonl(path, limit=MAX_TRACE_ROWS)
        total_rows = _count_lines(path)
        data = trace_step(step, raws, total_rows, token_detail=token_detail)
        size = len(_json(data))
        if token_detail and used + size > MAX_TOKEN_BYTES:
            token_detail = False  # and for every older step: one boundary is easy to state on the page
            data = trace_step(step, raws, total_rows, token_detail=False)
            size = len(_json(data))
        if steps and used + size > MAX_TRACE_BYTES:
            break
        steps.append(data)
        used += size
    steps.reverse()
    return {"steps": steps, "total_steps": len(files), "token_steps": sum(s["token_detail"] for s in steps)}


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def render_traces(run: Run) -> str:
    if not run.trace_files:
        return ""
    data = build_traces(run.trace_files)
    shown, total = len(data["steps"]), data["total_steps"]
    notes = [f"the last {shown} of {total} steps" if shown < total else f"all {total} steps"]
    if any(s["total_rows"] > len(s["rows"]) for s in data["steps"]):
        notes.append(f"the first {MAX_TRACE_ROWS} responses of each")
    if data["token_steps"] < shown:
        notes.append(f"token detail for the newest {data['token_steps']} (size budget), text only for the others")
    notes.append(f"tokens up to {MAX_TOKENS_PER_ROW} and text up to {MAX_TEXT_CHARS} characters a response")
    return f"""
<section id="traces"><h2>Rollout traces</h2>
<p class="note">Embedded: {html.escape("; ".join(notes))}. All of them are in <code>rollouts/step_N.jsonl</code>.</p>
<div class="trace-browser">
  <nav id="step-list" aria-label="steps"></nav>
  <div class="trace-main">
    <div class="trace-controls">
      <label>Show <select id="trace-filter">
        <option value="all">all</option><option value="correct">correct</option>
        <option value="incorrect">incorrect</option><option value="truncated">truncated</option></select></label>
      <label>Search <input id="trace-search" type="search" placeholder="text in prompt or response"></label>
      <label>Shade tokens by <select id="trace-shade">
        <option value="advantage">advantage</option><option value="logp">log-prob</option>
        <option value="none">nothing</option></select></label>
      <span id="trace-count"></span>
    </div>
    <p class="note" id="shade-note"></p>
    <div id="trace-view"></div>
  </div>
</div>
<script type="application/json" id="trace-data">{_script_json(data)}</script>
</section>"""


# --------------------------------------------------------------------------- eval samples


def pick(row: dict[str, Any], field_name: str) -> Any:
    """The value of the first alias of ``field_name`` (SAMPLE_FIELDS) that the row has."""
    for name in SAMPLE_FIELDS[field_name]:
        if name in row and row[name] is not None:
            return row[name]
    return None


def group_samples(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """samples.jsonl rows (one per sample, or one per problem with a list) -> one dict per problem."""
    problems: dict[Any, dict[str, Any]] = {}
    for i, row in enumerate(rows):
        nested = pick(row, "samples")
        # the problem's number if the row has one ("problem" may also be its text), else its prompt
        idx = next((row[n] for n in SAMPLE_FIELDS["problem"] if _is_int(row.get(n))), None)
        if idx is None:
            idx = i if isinstance(nested, list) else _text(pick(row, "prompt")) or i
        p = problems.setdefault(idx, {
            "index": idx if _is_int(idx) else len(problems), "prompt": None, "gold": None,
            "majority": None, "majority_correct": None, "votes": None, "samples": [],
        })
        for key in ("prompt", "gold", "majority", "majority_correct", "votes"):
            if p[key] is None:
                p[key] = pick(row, key)
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        if p["gold"] is None:
            p["gold"] = _first(extra, GOLD_KEYS)
        for s in nested if isinstance(nested, list) else [row]:
            s = s if isinstance(s, dict) else {"response": s}
            p["samples"].append({
                "response": _cut(str(pick(s, "response") or "")),
                "extracted": pick(s, "extracted"),
                "correct": _as_bool(pick(s, "correct")),
                "reward": _finite(pick(s, "reward")),
                "finish_reason": pick(s, "finish_reason"),
                "length": pick(s, "length"),
            })
    for p in problems.values():
        if p["majority_correct"] is None and p["majority"] is not None:
            # not recorded: the majority answer is correct if a sample that gave it was graded correct
            same = [s["correct"] for s in p["samples"] if _text(s["extracted"]) == _text(p["majority"])]
            graded = [c for c in same if c is not None]
            p["majority_correct"] = any(graded) if graded else None
    return list(problems.values())


def render_eval(run: Run) -> str:
    if run.eval_summary is None and not run.samples:
        return ""
    in_training = run.samples_file.startswith("eval/")
    title = f"Held-out eval samples ({run.samples_file[5:-6].replace('_', ' ')}, the latest)" if in_training else "Evaluation"
    out = [f'<section id="eval"><h2>{html.escape(title)}</h2>']
    if run.eval_summary is not None:
        out.append(_kv_table(_flatten(run.eval_summary), "eval-summary"))
    if run.samples:
        problems = group_samples(run.samples)
        shown, size = [], 0
        for p in problems[:MAX_EVAL_PROBLEMS]:  # and stop at MAX_EVAL_BYTES: n samples of long answers add up
            shown.append(_problem_html(p))
            size += len(shown[-1])
            if size > MAX_EVAL_BYTES:
                break
        if len(problems) > len(shown):
            out.append(f'<p class="note">Showing the first {len(shown)} of {len(problems)} problems '
                       f"(all are in <code>{html.escape(run.samples_file)}</code>).</p>")
        out.append('<p class="note">One square per sample: <span class="cell correct"></span> correct, '
                   '<span class="cell incorrect"></span> incorrect, <span class="cell unknown"></span> not graded; '
                   'an outlined square was cut at the length limit. Click a problem to read its samples.</p>')
        out.append('<div id="eval-grid">' + "".join(shown) + "</div>")
    out.append("</section>")
    return "".join(out)


def _problem_html(p: dict[str, Any]) -> str:
    cells = "".join(
        f'<span class="cell {_cell_class(s["correct"])}{" cut" if s["finish_reason"] == "length" else ""}" '
        f'title="{html.escape(_text(s["extracted"]) or "no answer")}"></span>' for s in p["samples"]
    )
    n_ok = sum(1 for s in p["samples"] if s["correct"])
    votes = p["votes"]
    if isinstance(votes, dict):
        votes_text = ", ".join(f"{_text(k)}: {_text(v)}" for k, v in sorted(votes.items(), key=lambda kv: -_num_or(kv[1])))
    else:
        votes_text = _text(votes)
    maj_mark = {True: " ✓", False: " ✗"}.get(_as_bool(p["majority_correct"]), "")
    details = "".join(
        f'<div class="sample"><div class="meta">sample {j} · {_cell_text(s["correct"])} · answer '
        f'<code>{html.escape(_text(s["extracted"]) or "—")}</code>'
        + (f' · reward {fmt(s["reward"])}' if s["reward"] is not None else "")
        + (f' · {html.escape(_text(s["finish_reason"]))}' if s["finish_reason"] else "")
        + (f' · {html.escape(_text(s["length"]))} tokens' if s["length"] is not None else "")
        + f'</div><pre>{html.escape(s["response"])}</pre></div>'
        for j, s in enumerate(p["samples"])
    )
    return (
        f'<details class="problem" data-correct="{n_ok}" data-samples="{len(p["samples"])}"><summary>'
        f'<span class="pidx">#{html.escape(_text(p["index"]))}</span><span class="cells">{cells}</span>'
        f'<span class="pmeta">{n_ok}/{len(p["samples"])} correct · gold <code>{html.escape(_text(p["gold"]) or "—")}</code>'
        + (f' · majority <code>{html.escape(_text(p["majority"]))}</code>{maj_mark}' if p["majority"] is not None else "")
        + (f" · votes {html.escape(votes_text)}" if votes_text else "")
        + f'</span></summary><pre class="prompt">{html.escape(_cut(_text(p["prompt"])))}</pre>{details}</details>'
    )


def _cell_class(correct: bool | None) -> str:
    return "unknown" if correct is None else "correct" if correct else "incorrect"


def _cell_text(correct: bool | None) -> str:
    return "not graded" if correct is None else "correct" if correct else "incorrect"


# --------------------------------------------------------------------------- demo and sub-runs


def render_demo(run: Run) -> str:
    if run.demo is None:
        return ""
    before = _flatten(run.demo.get("before") or {})
    after = _flatten(run.demo.get("after") or {})
    rows = []
    for k in list(dict.fromkeys([*before, *after])):
        b, a = before.get(k), after.get(k)
        delta = fmt(a - b) if _is_num(a) and _is_num(b) else ""
        if delta and not delta.startswith("-"):
            delta = "+" + delta
        rows.append(f"<tr><td>{html.escape(k)}</td><td>{_cell(b)}</td><td>{_cell(a)}</td><td>{html.escape(delta)}</td></tr>")
    others = {k: v for k, v in run.demo.items() if k not in ("before", "after")}
    return (
        '<section id="demo"><h2>Before / after</h2><table class="kv" id="demo-table">'
        "<thead><tr><th>metric</th><th>before</th><th>after</th><th>change</th></tr></thead>"
        f'<tbody>{"".join(rows)}</tbody></table>' + (_kv_table(_flatten(others)) if others else "") + "</section>"
    )


def render_subruns(run: Run) -> str:
    if not run.subruns:
        return ""
    items = "".join(
        f'<li><a href="{quote(p.name)}/{REPORT_FILE}">{html.escape(p.name)}</a></li>' for p in run.subruns
    )
    return f'<section id="subruns"><h2>Sub-runs</h2><ul class="subruns">{items}</ul></section>'


# --------------------------------------------------------------------------- the page


def render_summary(run: Run) -> str:
    from . import report_search

    model, task = _model_and_task(run)
    start, seconds = wall_time(run)
    steps = [r["step"] for r in run.metrics if _is_num(r.get("step"))]
    facts = [
        ("recipe", infer_recipe(run)),
        ("model", model),
        ("task / data", task),
        ("steps logged", f"{int(max(steps))}" if steps else ""),
        ("wall time", _duration(seconds) if seconds is not None else ""),
        ("started", _dt.datetime.fromtimestamp(start).strftime("%Y-%m-%d %H:%M:%S") if start else ""),
        ("checkpoints", ", ".join(f"step_{s}" for s in run.checkpoints)),
        ("rollout traces", f"{len(run.trace_files)} steps" if run.trace_files else ""),
        ("search", report_search.summary_text(run.search)),
    ]
    rows = "".join(f"<tr><th>{k}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts if v)
    out = [f'<section id="summary"><h2>Summary</h2><table class="kv" id="run-facts">{rows}</table>']
    final = final_metrics(run.metrics)
    if final:
        groups: dict[str, dict[str, float]] = {}
        for k, v in final.items():
            prefix, _, name = k.rpartition("/")
            groups.setdefault(prefix, {})[name] = v
        tables = "".join(f"<div><h4>{html.escape(p or 'other')}</h4>{_kv_table(g)}</div>" for p, g in groups.items())
        out.append('<details open><summary>Final metrics</summary>'
                   f'<div class="final" id="final-metrics">{tables}</div></details>')
    if run.config_text:
        out.append(f'<details id="config"><summary>config.yaml</summary><pre>{html.escape(run.config_text)}</pre></details>')
    out.append("</section>")
    return "".join(out)


def render_page(run: Run) -> str:
    name = run.path.resolve().name
    # an eval or demo directory without metrics.jsonl has no "Metrics" section; a training run
    # that has logged nothing yet says so
    single_step = len({r.get("step") for r in run.metrics}) <= 1  # an eval run logs its summary once: eval.json shows it
    is_eval = run.eval_summary is not None or run.search is not None
    show_metrics = (bool(run.metrics) and not (single_step and is_eval)) or (not is_eval and run.demo is None)
    metrics = f'<section id="metrics"><h2>Metrics</h2>{render_metrics(run.metrics)}</section>' if show_metrics else ""
    evals = render_eval(run)
    in_training = run.samples_file.startswith("eval/")  # a training run's eval samples come after its own sections
    from . import report_search

    search = report_search.render_search(run)  # its CSS and JS go into the page only with it
    search_css, search_js = report_search.assets() if search else ("", "")
    body = [render_summary(run), render_demo(run), render_subruns(run), "" if in_training else evals, search, metrics,
            render_traces(run), evals if in_training else ""]
    generated = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<title>relign report: {html.escape(name)}</title>
<style>{CSS}{search_css}</style></head>
<body><header><h1>{html.escape(name)}</h1><span class="sub">relign report · written {generated} ·
<code>relign report {html.escape(str(run.path))}</code> rewrites it</span></header>
<main>{"".join(body)}</main>
<script>{JS}</script>{f"<script>{search_js}</script>" if search_js else ""}</body></html>
"""


# --------------------------------------------------------------------------- small helpers


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> float | None:
    return float(v) if _is_num(v) and math.isfinite(v) else None


def _num_or(v: Any, default: float = 0.0) -> float:
    return float(v) if _is_num(v) else default


def _as_bool(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    if _is_num(v) and math.isfinite(v):
        return v > 0
    return None


def _first(d: dict[str, Any], keys: Iterable[str]) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return _clean(d[k])
    return None


def _clean(x: Any) -> Any:
    """JSON-safe copy: non-finite floats become None (JSON.parse rejects NaN and Infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if x is None or isinstance(x, (str, int, bool)):
        return x
    return str(x)


def _json(x: Any) -> str:
    return json.dumps(_clean(x), ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _script_json(x: Any) -> str:
    """JSON safe inside <script>: no '<' (so no '</script>' or '<!--'), no '>' or '&' either."""
    return (_json(x).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _cut(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n… [{len(text) - limit} more characters]"


def _text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return fmt(v)
    return v if isinstance(v, str) else json.dumps(_clean(v), ensure_ascii=False)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "metric"


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"metrics": {"accuracy": 1}} -> {"metrics/accuracy": 1}; lists stay whole."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def _kv_table(d: dict[str, Any], table_id: str = "") -> str:
    ident = f' id="{table_id}"' if table_id else ""
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{_cell(v)}</td></tr>" for k, v in d.items())
    return f'<table class="kv"{ident}>{rows}</table>'


def _cell(v: Any) -> str:
    return html.escape(fmt(v) if _is_num(v) else _cut(_text(v), 500))


def fmt(value: Any) -> str:
    """Short number text: 4 significant digits, integers as integers, tiny/huge in e-notation."""
    if value is None:
        return "—"
    if not _is_num(value):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and float(value).is_integer() and abs(value) < 1e15):
        return str(int(value))
    if not math.isfinite(value):
        return str(value)
    a = abs(value)
    if a >= 1e6 or a < 1e-3:
        return f"{value:.3e}"
    return f"{value:.4g}"


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s" if m else f"{seconds:.1f}s"


# --------------------------------------------------------------------------- page assets

# The browser itself refuses to load anything from anywhere: only the page's own inline CSS/JS run.
CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"

CSS = """
:root { --fg:#1f2328; --muted:#656d76; --line:#d0d7de; --bg:#fff; --soft:#f6f8fa; --accent:#2563eb; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif; color:var(--fg); background:var(--bg); }
header { padding:14px 24px; border-bottom:1px solid var(--line); background:var(--soft); }
header h1 { margin:0; font-size:20px; } .sub { color:var(--muted); font-size:12px; }
main { padding:0 24px 40px; max-width:1500px; }
h2 { margin:28px 0 10px; font-size:17px; border-bottom:1px solid var(--line); padding-bottom:4px; }
h3 { margin:18px 0 6px; font-size:14px; color:var(--muted); }
code, pre { font-family: ui-monospace,SFMono-Regular,Menlo,Consolas,monospace; font-size:12px; }
pre { white-space:pre-wrap; word-break:break-word; background:var(--soft); padding:8px; border-radius:4px; margin:4px 0; max-height:420px; overflow:auto; }
table.kv { border-collapse:collapse; margin:6px 0 10px; }
table.kv th, table.kv td { text-align:left; padding:2px 12px 2px 0; border-bottom:1px solid #eef0f2; vertical-align:top; }
table.kv th { color:var(--muted); font-weight:500; }
details > summary { cursor:pointer; color:var(--accent); margin:4px 0; }
.final { display:flex; flex-wrap:wrap; gap:4px 28px; } .final h4 { margin:6px 0 0; font-size:12px; color:var(--muted); }
.note, .empty { color:var(--muted); font-size:12px; }
.charts { display:grid; grid-template-columns:repeat(auto-fill,minmax(380px,1fr)); gap:14px; }
figure.chart { margin:0; border:1px solid var(--line); border-radius:6px; padding:6px 8px; }
figure.chart figcaption { font-weight:600; font-size:13px; }
figure.chart svg { width:100%; height:auto; display:block; }
svg .grid { stroke:#eef0f2; } svg .frame { fill:none; stroke:var(--line); }
svg .tick { font-size:10px; fill:var(--muted); } svg .line { fill:none; stroke-width:1.6; }
svg .band { opacity:.15; } svg .cursor { stroke:#999; stroke-dasharray:3 3; }
.legend { font-size:11px; color:var(--muted); } .legend .key { margin-right:10px; white-space:nowrap; }
.legend i { display:inline-block; width:10px; height:3px; vertical-align:middle; margin-right:3px; }
.legend i.band-key { height:8px; background:#2563eb; opacity:.2; }
.readout { font-size:11px; min-height:15px; }
.trace-browser { display:flex; gap:14px; align-items:flex-start; }
#step-list { display:flex; flex-direction:column; gap:2px; max-height:80vh; overflow:auto; min-width:150px; position:sticky; top:8px; }
.step-btn { text-align:left; font:12px ui-monospace,monospace; padding:3px 6px; border:1px solid var(--line); background:var(--bg); border-radius:4px; cursor:pointer; }
.step-btn.active { background:var(--accent); color:#fff; border-color:var(--accent); }
.trace-main { flex:1; min-width:0; }
.trace-controls { display:flex; flex-wrap:wrap; gap:14px; align-items:center; margin-bottom:6px; }
.trace-group { border:1px solid var(--line); border-radius:6px; margin:8px 0; padding:4px 8px; }
.trace-row { border-top:1px solid #eef0f2; padding:4px 0; }
.trace-row .meta, .sample .meta { font-size:12px; color:var(--muted); }
.badge { display:inline-block; padding:0 5px; border-radius:8px; font-size:11px; color:#fff; }
.badge.correct { background:#16a34a; } .badge.incorrect { background:#dc2626; } .badge.truncated { background:#9a6700; }
.tokens { font:12px/1.6 ui-monospace,monospace; white-space:pre-wrap; word-break:break-word; background:var(--soft); padding:6px; border-radius:4px; max-height:360px; overflow:auto; }
.tok.env { color:#6e7781; font-style:italic; background:#e7ecf0; }
.cell { display:inline-block; width:11px; height:11px; margin:1px; border-radius:2px; vertical-align:middle; }
.cell.correct { background:#16a34a; } .cell.incorrect { background:#dc2626; } .cell.unknown { background:#afb8c1; }
.cell.cut { outline:2px solid #9a6700; outline-offset:-2px; }
details.problem { border-bottom:1px solid #eef0f2; padding:2px 0; }
details.problem > summary { color:var(--fg); display:flex; gap:10px; align-items:center; flex-wrap:wrap; }
.pidx { font:12px ui-monospace,monospace; min-width:40px; } .pmeta { font-size:12px; color:var(--muted); }
.sample { margin:6px 0 6px 20px; }
"""

# The page's behaviour: chart readouts, the trace browser. Data reaches the DOM only through
# textContent / setAttribute, never innerHTML: model output cannot become markup.
JS = r"""
"use strict";
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}
function num(v) {
  if (v === null || v === undefined) return "—";
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  return (a >= 1e6 || (a < 1e-3 && a > 0)) ? v.toExponential(3) : String(+v.toPrecision(4));
}

// ---- hover readout on every chart: nearest logged step of each series
document.querySelectorAll("figure.chart").forEach(function (fig) {
  const svg = fig.querySelector("svg"), readout = fig.querySelector(".readout");
  const cursor = svg.querySelector(".cursor"), g = JSON.parse(fig.dataset.points);
  svg.addEventListener("mousemove", function (ev) {
    const r = svg.getBoundingClientRect(), vb = svg.viewBox.baseVal;
    const px = (ev.clientX - r.left) * vb.width / r.width;
    const x = g.x0 + (px - g.left) / g.width * (g.x1 - g.x0);
    const parts = [];
    let best = null;
    g.series.forEach(function (s) {
      let i = 0;
      for (let j = 1; j < s.x.length; j++) if (Math.abs(s.x[j] - x) < Math.abs(s.x[i] - x)) i = j;
      if (best === null) best = s.x[i];
      parts.push(s.key + " " + num(s.y[i]));
    });
    readout.textContent = "step " + num(best) + ": " + parts.join(" · ");
    const cx = g.left + (best - g.x0) / (g.x1 - g.x0) * g.width;
    cursor.setAttribute("x1", cx); cursor.setAttribute("x2", cx); cursor.setAttribute("visibility", "visible");
  });
  svg.addEventListener("mouseleave", function () { readout.textContent = ""; cursor.setAttribute("visibility", "hidden"); });
});

// ---- trace browser
(function () {
  const dataEl = document.getElementById("trace-data");
  if (!dataEl) return;
  const data = JSON.parse(dataEl.textContent);
  const list = document.getElementById("step-list"), view = document.getElementById("trace-view");
  const filterEl = document.getElementById("trace-filter"), searchEl = document.getElementById("trace-search");
  const shadeEl = document.getElementById("trace-shade"), countEl = document.getElementById("trace-count");
  const noteEl = document.getElementById("shade-note");
  let current = null;

  data.steps.forEach(function (s, i) {
    let label = "step " + s.step;
    if (s.mean_reward !== null) label += " · r " + num(s.mean_reward);
    if (s.accuracy !== null) label += " · " + Math.round(100 * s.accuracy) + "%";
    const b = el("button", "step-btn", label);
    b.type = "button";
    b.dataset.step = s.step;
    b.addEventListener("click", function () { show(i); });
    list.appendChild(b);
  });

  function shadeStyle(row, j, mode, scale) {
    if (row.token_mask && row.token_mask[j] === 0) return null;
    if (mode === "advantage" && row.token_advantages) {
      const a = row.token_advantages[j];
      if (a === null || scale === 0) return null;
      const alpha = Math.min(1, Math.abs(a) / scale) * 0.55;
      return a >= 0 ? "rgba(22,163,74," + alpha + ")" : "rgba(220,38,38," + alpha + ")";
    }
    if (mode === "logp" && row.logps) {
      const lp = row.logps[j];
      if (lp === null) return null;
      return "rgba(234,88,12," + ((1 - Math.exp(lp)) * 0.7).toFixed(3) + ")";  // unlikely tokens stand out
    }
    return null;
  }

  function tokensView(row, mode, scale) {
    const box = el("div", "tokens");
    if (!row.tokens || row.tokens.length === 0) { box.textContent = row.response; return box; }
    row.tokens.forEach(function (t, j) {
      const span = el("span", "tok", t);
      if (row.token_mask && row.token_mask[j] === 0) span.classList.add("env");
      const bg = shadeStyle(row, j, mode, scale);
      if (bg) span.style.background = bg;
      const tip = [];
      if (row.logps) {
        const lp = row.logps[j];
        tip.push(lp === null ? "logp unknown" : "logp " + num(lp) + " (p " + num(Math.exp(lp)) + ")");
      }
      if (row.token_advantages) tip.push("advantage " + num(row.token_advantages[j]));
      if (row.token_mask && row.token_mask[j] === 0) tip.push("not trained (environment/tool text)");
      span.title = tip.join(" · ");
      box.appendChild(span);
    });
    if (row.tokens_cut > 0) {  // the rest as text: token detail stops at max_tokens
      box.appendChild(el("span", "note", " … " + row.tokens_cut + " more tokens"));
      const full = el("details");
      full.appendChild(el("summary", null, "whole response as text"));
      full.appendChild(el("pre", null, row.response));
      box.appendChild(full);
    }
    return box;
  }

  function rowView(row, k, mode, scale) {
    const div = el("div", "trace-row");
    const truncated = row.finish_reason === "length";
    div.dataset.correct = row.correct === null ? "" : (row.correct ? "1" : "0");
    div.dataset.truncated = truncated ? "1" : "0";
    const text = row.response || (row.tokens || []).join("");
    div.dataset.search = (data_step().prompts[row.prompt_id] + "\n" + text).toLowerCase();
    const meta = el("div", "meta");
    meta.appendChild(el("b", null, "#" + k + " "));
    if (row.correct !== null) {
      const word = row.correct ? "correct" : "incorrect";
      meta.appendChild(el("span", "badge " + word, word));
    }
    if (truncated) meta.appendChild(el("span", "badge truncated", "truncated"));
    const facts = ["reward " + num(row.reward)];
    if (row.score !== null) facts.push("score " + num(row.score));
    facts.push("advantage " + num(row.advantage));
    if (row.length !== null && row.length !== undefined) facts.push(row.length + " tokens");
    facts.push("finish " + row.finish_reason);
    if (row.extracted !== null && row.extracted !== undefined) facts.push("answer " + JSON.stringify(row.extracted));
    if (row.gold !== null && row.gold !== undefined) facts.push("gold " + JSON.stringify(row.gold));
    Object.keys(row.components || {}).forEach(function (c) { facts.push(c + " " + num(row.components[c])); });
    meta.appendChild(el("span", null, " " + facts.join(" · ")));
    div.appendChild(meta);
    div.appendChild(tokensView(row, mode, scale));
    return div;
  }

  function data_step() { return data.steps[current]; }

  function render() {
    const s = data_step(), mode = shadeEl.value;
    let scale = 0;  // one colour scale per step: shades compare across its responses
    s.rows.forEach(function (r) {
      (r.token_advantages || []).forEach(function (a) { if (a !== null) scale = Math.max(scale, Math.abs(a)); });
    });
    noteEl.textContent = !s.token_detail ? "No token detail embedded for this step: the responses as text." : {
      advantage: "Green: positive advantage, red: negative (darker = larger |A|, full at ±" + num(scale) + "). "
        + "Grey italic: environment/tool tokens (not trained). Hover a token for its numbers.",
      logp: "Orange: tokens the sampler found unlikely (darker = lower probability). Hover a token for its numbers.",
    }[mode] || "";
    const groups = [];
    s.rows.forEach(function (r, k) {
      let g = groups[r.prompt_id];
      if (!g) {
        g = groups[r.prompt_id] = el("div", "trace-group");
        const d = el("details", "prompt");
        const text = s.problems[r.prompt_id] || s.prompts[r.prompt_id];
        d.appendChild(el("summary", null, "Prompt " + (r.prompt_id + 1) + ": " + text.slice(0, 120).replace(/\s+/g, " ")));
        d.appendChild(el("pre", null, s.prompts[r.prompt_id]));
        g.appendChild(d);
      }
      g.appendChild(rowView(r, k, mode, scale));
    });
    view.replaceChildren.apply(view, groups.filter(Boolean));
    view.dataset.step = s.step;
    applyFilter();
  }

  function applyFilter() {
    const f = filterEl.value, q = searchEl.value.trim().toLowerCase();
    let shown = 0, total = 0;
    view.querySelectorAll(".trace-group").forEach(function (g) {
      let any = false;
      g.querySelectorAll(".trace-row").forEach(function (r) {
        const ok = (f === "all" || (f === "correct" && r.dataset.correct === "1") || (f === "incorrect" && r.dataset.correct === "0")
          || (f === "truncated" && r.dataset.truncated === "1")) && (!q || r.dataset.search.indexOf(q) >= 0);
        r.hidden = !ok; total++; if (ok) { shown++; any = true; }
      });
      g.hidden = !any;
    });
    const s = data_step();
    countEl.textContent = shown + " of " + total + " responses shown"
      + (s.total_rows > s.rows.length ? " (" + s.total_rows + " in the file)" : "");
  }

  function show(i) {
    current = i;
    list.querySelectorAll(".step-btn").forEach(function (b, j) {
      b.classList.toggle("active", j === i);
      b.setAttribute("aria-pressed", j === i ? "true" : "false");
    });
    render();
  }

  filterEl.addEventListener("change", applyFilter);
  searchEl.addEventListener("input", applyFilter);
  shadeEl.addEventListener("change", render);
  if (data.steps.length) show(data.steps.length - 1);
})();
"""
