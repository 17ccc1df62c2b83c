"""The demo's page (a run directory with demo.json): three charts first, then the before/after table.

    1. reward     GRPO's mean reward per step on its training problems (rl/metrics.jsonl
                  reward/mean; reward/score too where it differs from it, e.g. with a format weight)
    2. accuracy   held-out accuracy (T=1) over the GRPO steps: step 0 is eval_before (the SFT warm
                  start GRPO starts from), then RL's own evals (eval/accuracy, every
                  demo.eval_every steps), and the last step is eval_after
    3. bars       before / after GRPO: the table's headline metrics side by side

demo.json's "before" and "after" are eval_before/ and eval_after/eval.json's "demo_table" (the
demo writes all of them from one dict), so the points are read from demo.json.
"""

from __future__ import annotations

import html
from typing import Any

from .charts import bars_svg, chart_svg, series_of, swatch
from .load import Run
from .metrics import figure_html, legend_html, render_figure
from .util import PALETTE, _cell, _flatten, _is_int, _is_num, _json, _kv_table, fmt

BEFORE_COLOR = "#9ca3af"  # before: grey; after: the palette's first colour, as in the other charts
BARS = [  # (key in demo.json's before/after, bar label); {n}: samples per problem
    ("accuracy", "accuracy T=1"),
    ("greedy_accuracy", "greedy"),
    ("pass@{n}", "pass@{n}"),
    ("maj@{n}", "maj@{n}"),
    ("worked_frac", "worked answers"),
]


def render_demo_charts(run: Run) -> str:
    """The section the demo's page opens with: a one-line result and the three charts."""
    if run.demo is None:
        return ""
    before, after = _table(run.demo, "before"), _table(run.demo, "after")
    ev = run.demo.get("eval") if isinstance(run.demo.get("eval"), dict) else {}
    n = ev.get("samples") if _is_int(ev.get("samples")) else None
    lead = ""
    if _is_num(before.get("accuracy")) and _is_num(after.get("accuracy")):
        what = [" on ".join(str(run.demo[k]) for k in ("model", "task") if run.demo.get(k))]
        what += [f"{ev['problems']} held-out problems"] if _is_int(ev.get("problems")) else []
        head = ", ".join(w for w in what if w)
        lead = (f'<p class="lead">{html.escape(head + ": " if head else "")}accuracy (T=1) '
                f'<b>{fmt(before["accuracy"])}</b> before GRPO, <b>{fmt(after["accuracy"])}</b> after.</p>')
    figures = [reward_figure(run.demo_rl), accuracy_figure(run.demo_rl, before, after), bars_figure(before, after, n)]
    return f'<section id="demo-charts"><h2>What GRPO did</h2>{lead}<div class="charts">{"".join(figures)}</div></section>'


def reward_figure(rows: list[dict[str, Any]]) -> str:
    """GRPO's reward per step. The demo's reward is the score (1 right, 0 wrong), so reward/score
    is drawn only where it differs from reward/mean (a second line on top of the first says nothing)."""
    keys = ["reward/mean"]
    if any(r.get("reward/score") != r.get("reward/mean") for r in rows if "reward/score" in r):
        keys.append("reward/score")
    return (render_figure("demo-reward", "GRPO reward per step (training problems)", keys, [("", rows)])
            or '<p class="note" id="demo-reward-missing">No GRPO reward curve: rl/metrics.jsonl has no varying reward/mean.</p>')


def accuracy_points(rows: list[dict[str, Any]], before: dict[str, Any], after: dict[str, Any]) -> tuple[list[float], list[float]]:
    """(steps, held-out accuracy): eval_before at step 0, RL's eval/accuracy rows, eval_after at
    GRPO's last step. RL evaluates the last step too (eval.every always ends with one), with the
    demo's problems, samples and seeds: the same number as eval_after (measured); the table's wins."""
    points: dict[float, float] = {}
    if _is_num(before.get("accuracy")):
        points[0.0] = float(before["accuracy"])
    points.update(zip(*series_of(rows, "eval/accuracy")))
    steps = [r["step"] for r in rows if _is_num(r.get("step"))]
    if steps and _is_num(after.get("accuracy")):
        points[float(max(steps))] = float(after["accuracy"])
    xs = sorted(points)
    return xs, [points[x] for x in xs]


def accuracy_figure(rows: list[dict[str, Any]], before: dict[str, Any], after: dict[str, Any]) -> str:
    xs, ys = accuracy_points(rows, before, after)
    if len(xs) < 2:
        return '<p class="note" id="demo-accuracy-missing">No held-out accuracy curve: no GRPO steps in rl/metrics.jsonl.</p>'
    during = [x for x in series_of(rows, "eval/accuracy")[0] if 0 < x < xs[-1]]
    if during:
        note = (f"Step 0: before GRPO (eval_before, the model GRPO starts from); steps {', '.join(fmt(x) for x in during)}: "
                f"RL's eval (demo.eval_every); step {fmt(xs[-1])}: after (eval_after).")
    else:  # eval_every=0 (or not below demo.steps): the line only joins before and after
        note = "No held-out eval during GRPO (demo.eval_every=0): before and after only."
    series = [("held-out accuracy (T=1)", xs, ys)]
    svg, geometry = chart_svg(series, dots=True)
    return figure_html("demo-accuracy", "Held-out accuracy over the GRPO steps", svg,
                       legend_html(series, [(PALETTE[0], "")], [ys[-1]]),
                       f' data-metric="accuracy" data-points="{html.escape(_json(geometry))}"',
                       f'<p class="note">{html.escape(note)}</p>')


def bars_figure(before: dict[str, Any], after: dict[str, Any], n: int | None) -> str:
    """Before / after bars of the metrics both evals have (pass@n and maj@n only when n > 1)."""
    keys, labels = [], []
    for key, label in BARS:
        if "{n}" in key and (n is None or n < 2):
            continue
        key, label = key.format(n=n), label.format(n=n)
        if _is_num(before.get(key)) and _is_num(after.get(key)):
            keys.append(key)
            labels.append(label)
    if not keys:
        return '<p class="note" id="demo-bars-missing">No before/after metrics in demo.json.</p>'
    groups = [("before GRPO", BEFORE_COLOR, [float(before[k]) for k in keys]),
              ("after GRPO", PALETTE[0], [float(after[k]) for k in keys])]
    legend = "".join(f'<span class="key">{swatch(color)}{html.escape(name)}</span>' for name, color, _ in groups)
    return figure_html("demo-bars", "Before / after GRPO (held-out problems)", bars_svg(labels, groups), legend,
                       f' data-keys="{html.escape(" ".join(keys))}"')


def render_demo(run: Run) -> str:
    """The before/after table (every metric of demo.json), and the rest of demo.json."""
    if run.demo is None:
        return ""
    before = _flatten(_table(run.demo, "before"))
    after = _flatten(_table(run.demo, "after"))
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


def _table(demo: dict[str, Any], which: str) -> dict[str, Any]:
    value = demo.get(which)
    return value if isinstance(value, dict) else {}
