"""Charts, pure: metric rows -> series -> inline SVG. Which metrics go in which chart (``CHARTS``).

The patterns below are the names the recipes log (``relign/recipes/*.py``; run the real CLI
and read ``metrics.jsonl`` when in doubt): RL logs ``reward/*``, ``actor/*``, ``critic/*``,
``response/*``, ``time/*``, ``perf/*``; SFT, RM and the DPO family log ``train/*`` and
``eval/*`` (``train/rewards/chosen``, ``train/logps/chosen``, ...). The bare ``rewards/*``
patterns are kept for run directories written before the ``train/`` prefix.
"""

from __future__ import annotations

import fnmatch
import html
import math
from typing import Any, Callable, Iterable

from ..algorithms.scoring import reliability_bins
from .util import PALETTE, _is_num, fmt

MAX_CHART_POINTS = 400  # longer series are averaged into this many buckets

# Named plots, in page order. Each is (id, title, key patterns, band key). Keys matched here
# are not plotted again among the generic per-key plots. Patterns are fnmatch-style.
CHARTS: list[tuple[str, str, tuple[str, ...], str | None]] = [
    ("reward", "Reward (mean ± std)", ("reward/mean",), "reward/std"),
    # beside the reward curve: is the engine sampling from the weights the trainer holds, and how stale is the data
    ("mismatch", "Engine vs trainer: log-prob mismatch, behaviour KL, sync check",
     ("actor/logp_mismatch", "actor/logp_mismatch_max", "actor/behav_kl", "rollout/sync_gap"), None),
    ("behaviour-weights", "Off-policy: behaviour weights pi_prox / pi_behav and PPO ratios",
     ("actor/behav_is_mean", "actor/behav_is_std", "actor/behav_is_max", "actor/behav_is_capped_frac",
      "actor/behav_is_masked_frac", "actor/ratio_min", "actor/ratio_max"), None),
    ("staleness", "Off-policy: staleness (updates between sampling and training)",
     ("rollout/staleness",), None),
    ("reward-components", "Reward score and components", ("reward/score", "reward/*"), None),
    ("calibration", "Calibration: ECE of the reader's top answer", ("calib/ece", "eval/calib/ece"), None),
    ("eval-accuracy", "Eval accuracy", ("eval/accuracy", "eval/pass@*", "eval/maj@*", "eval/score"), None),
    ("rest-accuracy", "Validation accuracy per ReST-EM iteration", ("rest/val_accuracy",), None),
    ("rest-filter", "ReST-EM filter (per iteration)", ("rest/correct_frac", "rest/prompts_with_any", "rest/truncated_frac"), None),
    ("vine", "VinePPO: Monte-Carlo vs policy tokens", ("vine/mc_tokens", "vine/policy_tokens"), None),
    ("trpo", "TRPO trust region", ("trpo/kl", "trpo/surrogate_gain", "trpo/accepted"), None),
    ("loss", "Loss", ("train/loss", "eval/loss", "actor/loss"), None),
    ("preference-rewards", "Implicit rewards (train)",
     ("train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins", "train/rewards/desirable",
      "train/rewards/undesirable", "rewards/chosen", "rewards/rejected", "rewards/margins"), None),
    ("preference-eval-rewards", "Implicit rewards (eval)",
     ("eval/rewards/chosen", "eval/rewards/rejected", "eval/rewards/margins", "eval/rewards/desirable",
      "eval/rewards/undesirable"), None),
    ("preference-accuracy", "Preference accuracy",
     ("train/rewards/accuracy", "train/accuracy", "eval/rewards/accuracy", "eval/accuracy_pairs", "rewards/accuracy"), None),
    ("logps", "Sequence log-probs", ("train/logps/chosen", "train/logps/rejected", "train/logps/mean"), None),
    ("kl", "KL to reference", ("actor/kl", "train/kl"), None),
    ("entropy", "Entropy", ("actor/entropy",), None),
    ("response-length", "Response length (tokens)", ("response/length_mean", "response/length_max"), None),
    ("truncated", "Truncated fraction", ("response/truncated_frac",), None),
    ("clip-frac", "Clip fraction", ("actor/clip_frac",), None),
    ("grad-norm", "Gradient norm", ("actor/grad_norm", "train/grad_norm", "critic/grad_norm"), None),
    ("value-loss", "Value loss", ("critic/value_loss",), None),
    ("tokens-per-s", "Throughput (tokens/s)", ("perf/tokens_per_s", "perf/*tokens_per_s*"), None),
    ("pairs-per-s", "Throughput (pairs/s)", ("perf/pairs_per_s",), None),
    ("time", "Time per step (s)", ("time/rollout_s", "time/reward_s", "time/reference_s", "time/old_logps_s", "time/values_s",
                                  "time/update_s", "time/sync_s", "time/step_s", "time/*"), None),
    ("lr", "Learning rate", ("actor/lr", "train/lr", "critic/lr"), None),
]
# reward/ keys that are counters, not rewards: they fall through to the generic plots.
NOT_REWARD_COMPONENTS = {"reward/mean", "reward/std", "reward/errors", "reward/timeouts"}

# Line styles: one per metric of a chart when the colours stand for runs (a comparison).
DASHES = ("", "6 3", "2 3", "8 3 2 3")

Series = tuple[str, list[float], list[float]]  # (key, steps, values)
Style = tuple[str, str]  # (colour, stroke-dasharray)


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


# --------------------------------------------------------------------------- series


def series_of(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """Steps and finite values of ``key``; rows without a step count as their row index."""
    xs, ys = [], []
    for i, r in enumerate(rows):
        v = r.get(key)
        if _is_num(v) and math.isfinite(v):
            xs.append(_step_of(r, i))
            ys.append(float(v))
    return xs, ys


def varies(ys: list[float]) -> bool:
    """A series worth a plot: at least two distinct finite values (a flat line says nothing a
    number would not, and one point is not a curve)."""
    return len(set(ys)) >= 2


def is_constant(ys: list[float]) -> bool:
    """Logged at two steps or more, always the same value: a row of the constant-metrics table."""
    return len(ys) >= 2 and not varies(ys)


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


def band_of(rows: list[dict[str, Any]], mean_key: str, std_key: str) -> tuple[list[float], list[float], list[float]] | None:
    """(steps, mean - std, mean + std) where both are finite; None below two points."""
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


# --------------------------------------------------------------------------- axes


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


# --------------------------------------------------------------------------- SVG


def y_grid(left: float, pw: float, y0: float, y1: float, py: Callable[[float], float]) -> list[str]:
    """The horizontal gridlines and y labels of a chart whose plot area starts at ``left`` and
    is ``pw`` wide; ``py`` maps a value to its pixel row. Every chart on the page uses it."""
    ticks = nice_ticks(y0, y1)
    return [f'<line class="grid" x1="{left}" x2="{left + pw}" y1="{py(t)}" y2="{py(t)}"/>'
            f'<text class="tick" x="{left - 4}" y="{py(t) + 3}" text-anchor="end">{label}</text>'
            for t, label in zip(ticks, tick_labels(ticks))]


def chart_svg(series: list[Series], band: tuple[list[float], list[float], list[float]] | None = None,
              width: int = 480, height: int = 210, styles: list[Style] | None = None,
              dots: bool = False) -> tuple[str, dict[str, Any]]:
    """An SVG line chart of ``series`` (+ an optional shaded band: xs, lows, highs).

    ``styles`` gives each series its (colour, dash); by default the palette in order, solid.
    ``dots`` marks every point too: for a few measurements (an eval every N steps), where the
    line between them is not data.
    Returns the markup and the geometry + points the page's JS needs for its hover readout.
    """
    styles = styles or [(PALETTE[i % len(PALETTE)], "") for i in range(len(series))]
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

    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" preserveAspectRatio="xMidYMid meet">', *y_grid(left, pw, y0, y1, py)]
    x_ticks = [t for t in nice_ticks(x0, x1, 6) if float(t).is_integer()] or [x0, x1]
    for t in x_ticks:
        parts.append(f'<text class="tick" x="{px(t)}" y="{top + ph + 16}" text-anchor="middle">{fmt(t)}</text>')
    parts.append(f'<rect class="frame" x="{left}" y="{top}" width="{pw}" height="{ph}"/>')
    if band:
        bx, lo, hi = band
        pts = [f"{px(x)},{py(y)}" for x, y in zip(bx, hi)] + [f"{px(x)},{py(y)}" for x, y in reversed(list(zip(bx, lo)))]
        parts.append(f'<polygon class="band" fill="{styles[0][0]}" points="{" ".join(pts)}"/>')
    points = []
    for (key, xs, ys), (color, dash) in zip(series, styles):
        if len(xs) == 1:
            parts.append(f'<circle cx="{px(xs[0])}" cy="{py(ys[0])}" r="3" fill="{color}"><title>{html.escape(key)}</title></circle>')
        else:
            d = "M" + " L".join(f"{px(x)},{py(y)}" for x, y in zip(xs, ys))
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            parts.append(f'<path class="line" stroke="{color}"{dash_attr} d="{d}"><title>{html.escape(key)}</title></path>')
            if dots:
                parts.extend(f'<circle class="dot" cx="{px(x)}" cy="{py(y)}" r="2.5" fill="{color}"/>' for x, y in zip(xs, ys))
        points.append({"key": key, "color": color, "x": xs, "y": [float(f"{y:.6g}") for y in ys]})
    parts.append(f'<line class="cursor" x1="0" x2="0" y1="{top}" y2="{top + ph}" visibility="hidden"/></svg>')
    geometry = {"left": left, "width": pw, "x0": x0, "x1": x1, "series": points}
    return "".join(parts), geometry


def bars_svg(labels: list[str], groups: list[tuple[str, str, list[float]]], width: int = 480, height: int = 210) -> str:
    """An SVG grouped bar chart of fractions (0..1): one group of bars per label, one bar per
    (name, colour, values) of ``groups``, each bar with its value written above it. Every
    ``rect.bar`` carries data-label, data-group and data-value (the number drawn)."""
    left, right, top, bottom = 56, 12, 22, 26  # room above the plot for the label of a bar at 1.0
    pw, ph = width - left - right, height - top - bottom
    y1 = max([1.0, *(v for _, _, vs in groups for v in vs)])  # fractions: the axis shows all of 0..1

    def py(y: float) -> float:
        return round(top + (1 - y / y1) * ph, 1)

    slot = pw / max(len(labels), 1)  # each label's share of the width; its bars fill 70% of it
    bar = slot * 0.7 / max(len(groups), 1)
    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" preserveAspectRatio="xMidYMid meet">',
             *y_grid(left, pw, 0.0, y1, py),
             f'<rect class="frame" x="{left}" y="{top}" width="{pw}" height="{ph}"/>']  # first: the bars go over it
    for i, label in enumerate(labels):
        x_mid = round(left + (i + 0.5) * slot, 1)
        parts.append(f'<text class="tick" x="{x_mid}" y="{top + ph + 16}" text-anchor="middle">{html.escape(label)}</text>')
        for j, (name, color, values) in enumerate(groups):
            v = values[i]
            x = round(x_mid - slot * 0.35 + j * bar, 1)
            parts.append(
                f'<rect class="bar" x="{x}" y="{py(v)}" width="{round(bar - 2, 1)}" height="{round(py(0) - py(v), 1)}" '
                f'fill="{color}" data-label="{html.escape(label)}" data-group="{html.escape(name)}" data-value="{v!r}">'
                f'<title>{html.escape(f"{label}, {name}: {fmt(v)}")}</title></rect>'
                # 3 decimals fit above a bar of a 5-group chart in the smaller font; its title (hover) has fmt's 4 digits
                f'<text class="tick value" x="{round(x + (bar - 2) / 2, 1)}" y="{py(v) - 3}" text-anchor="middle">{v:.3f}</text>')
    parts.append("</svg>")
    return "".join(parts)


def swatch(color: str, dash: str = "") -> str:
    """A legend's line sample: the colour and, in a comparison, the dash of one series."""
    dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<svg class="swatch" width="22" height="8" viewBox="0 0 22 8" aria-hidden="true">'
            f'<line x1="1" x2="21" y1="4" y2="4" stroke="{color}" stroke-width="2"{dash_attr}/></svg>')


def reliability_svg(conf: list[float], correct: list[float], bins: int = 10, width: int = 480, height: int = 210) -> str:
    """A reliability diagram: for each non-empty equal-width bin of stated confidence (labelled
    with its range and count n), the bin's mean confidence beside its observed accuracy; a
    calibrated reader's two bars are equal."""
    kept = [b for b in reliability_bins(conf, correct, bins) if b.count]
    labels = [f"{b.lo:.1f}-{b.hi:.1f} n={b.count}" for b in kept]
    return bars_svg(labels, [("confidence", PALETTE[1], [b.confidence for b in kept]),
                             ("accuracy", PALETTE[0], [b.accuracy for b in kept])], width=width, height=height)


_STANDALONE_STYLE = ("<style>.grid{stroke:#eef0f2}.frame{fill:none;stroke:#d0d7de}.tick{font:10px sans-serif;fill:#57606a}"
                     ".legend{font:11px sans-serif}</style>")


def reliability_file_svg(conf: list[float], correct: list[float], bins: int = 10, title: str = "") -> str:
    """``reliability_svg`` as a file a browser opens on its own (namespace, styles, legend, title)."""
    svg = reliability_svg(conf, correct, bins, height=230)
    svg = svg.replace("<svg", '<svg xmlns="http://www.w3.org/2000/svg"', 1)
    head_end = svg.index(">") + 1
    legend = (f'<text class="legend" x="300" y="14" fill="{PALETTE[1]}">\u25a0 stated confidence</text>'
              f'<text class="legend" x="400" y="14" fill="{PALETTE[0]}">\u25a0 accuracy</text>'
              f'<text class="legend" x="60" y="14" fill="#24292f">{html.escape(title)}</text>')
    return svg[:head_end] + _STANDALONE_STYLE + svg[head_end:].replace("</svg>", legend + "</svg>") + "\n"
