"""The accuracy-vs-budget part of the search section: sweep.json rows -> an SVG chart and a table.

``relign eval`` also writes the chart as a standalone ``accuracy_vs_tokens.svg`` with these
functions (``recipes/eval.py``).
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

from ..checkpoint import atomic_write_text
from .charts import _range, nice_ticks, tick_labels, y_grid
from .util import PALETTE, _cut, _is_num, _text, fmt


def series_label(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """"strategy", or "strategy (scorer)" when the rows name more than one scorer."""
    strategy = _text(row.get("strategy")) or "?"
    scorers = {_text(r.get("scorer")) for r in rows if r.get("scorer") is not None}
    scorer = _text(row.get("scorer"))
    return f"{strategy} ({scorer})" if scorer and len(scorers) > 1 else strategy


def sweep_series(rows: list[dict[str, Any]]) -> tuple[list[tuple[str, list[dict[str, float]]]], int]:
    """Rows grouped into series (first-seen order), each point {x, y, lo, hi, budget} sorted by x;
    and how many rows could not be plotted (no finite tokens per question or accuracy)."""
    series: dict[str, list[dict[str, Any]]] = {}
    unplotted = 0
    for r in rows:
        x, y = _fin(r.get("tokens_per_question")), _fin(r.get("accuracy"))
        if x is None or y is None:
            unplotted += 1
            continue
        series.setdefault(series_label(r, rows), []).append(
            {"x": x, "y": y, "lo": _fin(r.get("ci_low")), "hi": _fin(r.get("ci_high")), "budget": r.get("budget")})
    return [(k, sorted(v, key=lambda p: p["x"])) for k, v in series.items()], unplotted


def log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values in [lo, hi] for a log axis: powers of ten, else 1-2-5 steps, else 1-2-3-5-7."""
    k0, k1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    ticks: list[float] = []
    for mults in ((1,), (1, 2, 5), (1, 2, 3, 5, 7)):
        ticks = [float(f"{m * 10.0 ** k:.12g}") for k in range(k0, k1 + 1) for m in mults]
        ticks = [t for t in ticks if lo <= t <= hi]
        if len(ticks) >= 3:
            return ticks
    return ticks if len(ticks) >= 2 else [float(f"{lo:.2g}"), float(f"{hi:.2g}")]


def _compact(t: float) -> str:
    if abs(t) >= 1_000_000:
        return f"{t / 1e6:g}M"
    if abs(t) >= 1000:
        return f"{t / 1000:g}k"
    return fmt(t)


def sweep_chart_svg(series: list[tuple[str, list[dict[str, Any]]]], width: int = 640, height: int = 300) -> tuple[str, bool]:
    """Accuracy (y) against tokens per question (x, log scale when it spans 3x or more), one
    coloured line per series, 95% intervals as vertical error bars. Returns (svg, log_x)."""
    left, right, top, bottom = 50, 14, 10, 40
    pw, ph = width - left - right, height - top - bottom
    xs = [p["x"] for _, pts in series for p in pts]
    ys = [v for _, pts in series for p in pts for v in (p["y"], p["lo"], p["hi"]) if v is not None]
    log_x = min(xs) > 0 and max(xs) / min(xs) >= 3
    if log_x:
        a, b = math.log10(min(xs)), math.log10(max(xs))
        pad = (b - a) * 0.06
        x0, x1 = a - pad, b + pad
        x_ticks = log_ticks(10 ** x0, 10 ** x1)
        x_labels = [_compact(t) for t in x_ticks]
        tx = math.log10
    else:
        x0, x1 = _range(xs)
        if min(xs) >= 0:
            x0 = max(x0, 0.0)
        x_ticks = nice_ticks(x0, x1, 6)
        x_labels = tick_labels(x_ticks)
        tx = float
    y0, y1 = _range(ys)
    if 0 <= min(ys) and max(ys) <= 1:
        y0, y1 = max(y0, 0.0), min(y1, 1.0)

    def px(x: float) -> float:
        return round(left + (tx(x) - x0) / (x1 - x0) * pw, 1)

    def py(y: float) -> float:
        return round(top + (1 - (y - y0) / (y1 - y0)) * ph, 1)

    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" preserveAspectRatio="xMidYMid meet">', *y_grid(left, pw, y0, y1, py)]
    for t, label in zip(x_ticks, x_labels):
        parts.append(f'<line class="grid" x1="{px(t)}" x2="{px(t)}" y1="{top}" y2="{top + ph}"/>'
                     f'<text class="tick" x="{px(t)}" y="{top + ph + 14}" text-anchor="middle">{html.escape(label)}</text>')
    parts.append(f'<rect class="frame" x="{left}" y="{top}" width="{pw}" height="{ph}"/>')
    axis = "generated tokens per question" + (" (log scale)" if log_x else "")
    parts.append(f'<text class="axis-title" x="{left + pw / 2}" y="{height - 6}" text-anchor="middle">{axis}</text>'
                 f'<text class="axis-title" x="12" y="{top + ph / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 12 {top + ph / 2})">accuracy</text>')
    for i, (label, pts) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        dodge = (i - (len(series) - 1) / 2) * 3  # px: error bars of series at the same x stay apart
        g = [f'<g class="series" data-series="{html.escape(label)}" data-points="{len(pts)}">']
        if len(pts) > 1:
            d = "M" + " L".join(f"{round(px(p['x']) + dodge, 1)},{py(p['y'])}" for p in pts)
            g.append(f'<path class="line" stroke="{color}" d="{d}"><title>{html.escape(label)}</title></path>')
        for p in pts:
            x = round(px(p["x"]) + dodge, 1)
            if p["lo"] is not None and p["hi"] is not None:
                lo, hi = py(p["lo"]), py(p["hi"])
                g.append(f'<path class="errbar" stroke="{color}" d="M{x},{lo} L{x},{hi} M{x - 3},{lo} L{x + 3},{lo} '
                         f'M{x - 3},{hi} L{x + 3},{hi}"/>')
            budget = f"budget {fmt(p['budget'])}" if _is_num(p["budget"]) else "no token budget"
            ci = f" [{fmt(p['lo'])}, {fmt(p['hi'])}]" if p["lo"] is not None and p["hi"] is not None else ""
            tip = f"{label}, {budget}: accuracy {fmt(p['y'])}{ci} at {fmt(p['x'])} tokens/question"
            g.append(f'<circle class="pt" cx="{x}" cy="{py(p["y"])}" r="3.5" fill="{color}" '
                     f'data-label="{html.escape(tip)}"><title>{html.escape(tip)}</title></circle>')
        g.append("</g>")
        parts.append("".join(g))
    parts.append("</svg>")
    return "".join(parts), log_x


def render_sweep(search: Any) -> str:
    """The chart and table of ``search.sweep`` / ``search.rows`` (a search.Search)."""
    sweep, rows = search.sweep or {}, search.rows
    facts = " · ".join(f"{k} {html.escape(_text(sweep.get(k)))}" for k in ("task", "model", "scorer") if sweep.get(k))
    out = ['<div id="sweep"><h3>Accuracy vs. budget</h3>']
    if facts:
        out.append(f'<p class="note">{facts}</p>')
    series, unplotted = sweep_series(rows)
    if series:
        svg, _ = sweep_chart_svg(series)
        legend = "".join(f'<span class="key"><i style="background:{PALETTE[i % len(PALETTE)]}"></i>{html.escape(k)}</span>'
                         for i, (k, _) in enumerate(series))
        out.append(
            f'<figure class="sweep-chart" id="chart-sweep" data-series="{html.escape(json.dumps([k for k, _ in series]))}">'
            "<figcaption>Accuracy vs. tokens per question (bars: 95% interval)</figcaption>"
            f'{svg}<div class="legend">{legend}</div><div class="readout"></div></figure>')
    if unplotted:
        out.append(f'<p class="note">{unplotted} row(s) without tokens per question or accuracy are in the table only.</p>')
    body = []
    for r, cell, found in zip(rows, search.row_cells, search.row_found):
        acc = _fin(r.get("accuracy"))
        lo, hi = _fin(r.get("ci_low")), _fin(r.get("ci_high"))
        acc_text = fmt(acc) + (f" [{fmt(lo)}, {fmt(hi)}]" if lo is not None and hi is not None else "")
        file = _text(r.get("file"))
        attrs = f' data-strategy="{html.escape(_text(r.get("strategy")))}" data-budget="{html.escape(_text(r.get("budget")))}"'
        if cell is not None:
            attrs += f' data-cell="{cell}" title="show its problems"'
        state = "" if cell is not None else " (not embedded)" if found else " (missing)"
        file_html = f"<code>{html.escape(_cut(file, 200))}</code>{state}" if file else "—"
        cells = [html.escape(series_label(r, rows)), _num(r.get("budget")), html.escape(acc_text),
                 _num(r.get("tokens_per_question")), _num(r.get("engine_calls")), _num(r.get("wall_s")),
                 _num(r.get("num_problems")), _num(r.get("failed")), file_html]
        body.append(f"<tr{attrs}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("strategy", "budget", "accuracy [95% CI]", "tokens / question",
                                             "engine calls", "wall s", "problems", "failed", "file"))
    out.append(f'<table class="sweep" id="sweep-table"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>')
    out.append("</div>")
    return "".join(out)


def _fin(v: Any) -> float | None:
    return float(v) if _is_num(v) and math.isfinite(v) else None


def _num(v: Any) -> str:
    return html.escape(fmt(v)) if _is_num(v) else ("—" if v is None else html.escape(_cut(_text(v), 100)))


_SVG_STYLE = ("<style>.grid{stroke:#eef0f2}.frame{fill:none;stroke:#d0d7de}.tick,.axis-title{font:10px sans-serif;"
              "fill:#57606a}.line,.errbar{fill:none;stroke-width:1.5}.pt{stroke:#fff}.legend{font:11px sans-serif}</style>")


def write_sweep_svg(path, rows: list[dict[str, Any]]) -> None:
    """The report's sweep chart as a file a browser opens on its own (namespace, styles, legend):
    ``relign eval``'s accuracy_vs_tokens.svg."""
    series = sweep_series(rows)[0]
    svg, _ = sweep_chart_svg(series)
    legend = "".join(f'<text class="legend" x="60" y="{24 + 14 * i}" fill="{PALETTE[i % len(PALETTE)]}">'
                     f"\u25cf {html.escape(label)}</text>" for i, (label, _) in enumerate(series))
    svg = svg.replace("<svg", '<svg xmlns="http://www.w3.org/2000/svg"', 1) if "xmlns=" not in svg else svg
    head_end = svg.index(">") + 1
    atomic_write_text(path, svg[:head_end] + _SVG_STYLE + svg[head_end:].replace("</svg>", legend + "</svg>") + "\n")
