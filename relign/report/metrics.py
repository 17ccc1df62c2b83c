"""The Metrics section: the planned charts of one run, or of several runs overlaid.

A chart is drawn only when one of its series varies (two distinct finite values or more): a
flat line is a number, so a metric constant over the whole run (the learning rate of a
constant schedule, an error counter that stays 0, a length capped at max_new_tokens) goes
into the "Constant metrics" table instead. A metric logged once (the ``data/*`` counts at step
0) is neither: it is in the summary's final-metrics table.

Several runs (``relign report RUN_A RUN_B``): the charts are those of the union of their
metric keys, one colour per run (the legend names it) and one dash per metric of a chart.
"""

from __future__ import annotations

import html
import json
from typing import Any

from .charts import DASHES, band_of, chart_svg, downsample, is_constant, plan_charts, series_of, swatch, varies
from .load import final_metrics, metric_keys
from .util import PALETTE, _cell, _json, _slug, fmt

Source = tuple[str, list[dict[str, Any]]]  # (run label, metrics rows); the label is "" for a single run


def render_metrics(rows: list[dict[str, Any]]) -> str:
    """The Metrics section's body for one run."""
    return metrics_html([("", rows)])


def union_keys(sources: list[Source]) -> list[str]:
    """Numeric metric keys of every run, first-seen order (run by run)."""
    return list(dict.fromkeys(k for _, rows in sources for k in metric_keys(rows)))


def metrics_html(sources: list[Source]) -> str:
    keys = union_keys(sources)
    if not keys:
        return '<p class="empty">No metrics logged yet.</p>'
    named, rest = plan_charts(keys)
    drawn: set[str] = set()
    figures = []
    for chart_id, title, chart_keys, band in named:
        fig = render_figure(chart_id, title, chart_keys, sources, band)
        if fig:
            figures.append(fig)
            drawn.update(chart_keys)
            drawn.update([band] if band else [])
    others = []
    for key in (k for ks in rest.values() for k in ks):  # one plot per remaining key, in prefix order
        fig = render_figure(key, key, [key], sources)
        if fig:
            others.append(fig)
            drawn.add(key)
    out = [f'<div class="charts">{"".join(figures)}</div>']
    if others:
        out.append(f'<h3>Other metrics</h3><div class="charts">{"".join(others)}</div>')
    constant = [k for k in keys if k not in drawn and any(is_constant(series_of(rows, k)[1]) for _, rows in sources)]
    if constant:
        out.append(constant_table(constant, sources))
    return "".join(out)


def render_figure(chart_id: str, title: str, keys: list[str], sources: list[Source], band_key: str | None = None) -> str:
    """One ``<figure class="chart">`` of ``keys`` over steps, or '' when no series varies."""
    compare = len(sources) > 1
    found: list[tuple[int, str, list[float], list[float]]] = []  # (run index, key, steps, values)
    for j, (_, rows) in enumerate(sources):
        for key in keys:
            xs, ys = series_of(rows, key)
            if xs:
                found.append((j, key, xs, ys))
    if not any(varies(ys) for _, _, _, ys in found):
        return ""
    present = [k for k in keys if any(key == k for _, key, _, _ in found)]  # the chart's keys with data
    series, styles, last = [], [], []
    for n, (j, key, xs, ys) in enumerate(found):
        if compare:
            label = sources[j][0] if len(present) == 1 else f"{sources[j][0]}: {key}"
            styles.append((PALETTE[j % len(PALETTE)], DASHES[present.index(key) % len(DASHES)]))
        else:
            label = key
            styles.append((PALETTE[n % len(PALETTE)], ""))
        series.append((label, *downsample(xs, ys)))
        last.append(ys[-1])  # the legend shows the true last value, not a bucket average
    band = None
    if band_key and not compare and found[0][1] == keys[0]:
        band = band_of(sources[0][1], keys[0], band_key)
    svg, geometry = chart_svg(series, band, styles=styles)
    legend = legend_html(series, styles, last)
    if band:
        legend += f'<span class="key"><i class="band-key"></i>± {html.escape(band_key or "")}</span>'
    extra = f' data-band="{html.escape(band_key or "")}"' if band else ""
    if compare:
        labels = list(dict.fromkeys(sources[j][0] for j, _, _, _ in found))
        extra += f' data-runs="{html.escape(json.dumps(labels))}"'
    attrs = f' data-metric="{html.escape(present[0])}" data-keys="{html.escape(" ".join(present))}"{extra}'
    return figure_html(chart_id, title, svg, legend, attrs + f' data-points="{html.escape(_json(geometry))}"')


def legend_html(series: list[tuple[str, list[float], list[float]]], styles: list[tuple[str, str]], last: list[float]) -> str:
    """One key per series: its line sample, label and last value."""
    return "".join(
        f'<span class="key">{swatch(color, dash)}{html.escape(label)} <b>{fmt(value)}</b></span>'
        for (label, _, _), (color, dash), value in zip(series, styles, last)
    )


def figure_html(chart_id: str, title: str, svg: str, legend: str, attrs: str = "", note: str = "") -> str:
    """A chart's ``<figure>``: caption, SVG, legend, an optional note. ``attrs`` (already
    escaped) holds its data attributes; the page's JS gives a hover readout to those with
    data-points (chart_svg's geometry)."""
    return (
        f'<figure class="chart" id="chart-{_slug(chart_id)}"{attrs}><figcaption>{html.escape(title)}</figcaption>{svg}'
        f'<div class="legend">{legend}</div>{note}<div class="readout"></div></figure>'
    )


def constant_table(keys: list[str], sources: list[Source]) -> str:
    """Metrics that never changed: their value (per run in a comparison) instead of a flat plot."""
    finals = [final_metrics(rows) for _, rows in sources]

    def cell(value: Any) -> str:
        return "—" if value is None else _cell(value)  # "—": the run did not log it
    if len(sources) == 1:
        body = "".join(f"<tr><th>{html.escape(k)}</th><td>{cell(finals[0].get(k))}</td></tr>" for k in keys)
        head = ""
    else:
        head = "<thead><tr><th>metric</th>" + "".join(f"<th>{html.escape(label)}</th>" for label, _ in sources) + "</tr></thead>"
        body = "".join(
            f"<tr><th>{html.escape(k)}</th>" + "".join(f"<td>{cell(f.get(k))}</td>" for f in finals) + "</tr>" for k in keys
        )
    return ('<h3>Constant metrics</h3><p class="note">The same value at every logged step: a number, not a plot.</p>'
            f'<table class="kv" id="constant-metrics">{head}<tbody>{body}</tbody></table>')
