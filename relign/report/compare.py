"""Several runs on one page (``relign report RUN_A RUN_B ...``): the same charts overlaid.

The charts are those of the union of the runs' metric keys (as planned for one run), one
colour per run, named in the legend; a chart is drawn when any run's series varies. A table
compares each run's recipe, model, steps, wall time and final metrics. The page goes to
``RUN_A/compare.html`` (the first run's own report.html stays its own) or to ``--out PATH``.
"""

from __future__ import annotations

import html
import os
from pathlib import Path

from ..checkpoint import atomic_write_text
from .charts import swatch
from .load import Run, check_run_dir, final_metrics, infer_recipe, last_step, load_run, model_and_task, wall_time
from .metrics import metrics_html, union_keys
from .page import page_html
from .util import PALETTE, _cell, _duration

COMPARE_FILE = "compare.html"


def run_labels(paths: list[Path]) -> list[str]:
    """Short names that tell the runs apart: the directory name, with as many parent folders as
    it takes when two share a name (``a/run`` vs ``b/run``)."""
    parts = [Path(os.path.abspath(p)).parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{'/'.join(p[-1:])} #{i + 1}" for i, p in enumerate(parts)]  # the same directory twice


def default_out(run_dirs: list[str | os.PathLike]) -> Path:
    return Path(run_dirs[0]) / COMPARE_FILE


def write_compare(run_dirs: list[str | os.PathLike], out: str | os.PathLike | None = None) -> Path:
    """Write the comparison page of ``run_dirs`` (two or more) and return its path.

    Raises FileNotFoundError naming the first path that is not a run directory.
    """
    roots = [Path(d) for d in run_dirs]
    for root in roots:
        check_run_dir(root)
    runs = [load_run(root) for root in roots]
    path = Path(out) if out is not None else default_out(run_dirs)
    if path.is_dir():
        path = path / COMPARE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, render_compare(runs, run_labels(roots), out=path if out is not None else None))
    return path


def render_compare(runs: list[Run], labels: list[str], out: Path | None = None) -> str:
    sources = [(label, run.metrics) for label, run in zip(labels, runs)]
    n = len(runs)
    command = "relign report " + " ".join(str(r.path) for r in runs) + (f" --out {out}" if out else "")
    body = [render_legend(runs, labels), render_table(runs, labels, union_keys(sources)),
            f'<section id="metrics"><h2>Metrics</h2>{metrics_html(sources)}</section>']
    title = f"{n} runs: " + ", ".join(labels)
    return page_html(title, f"Comparison of {n} runs", f"<code>{html.escape(command)}</code> rewrites it", "".join(body))


def render_legend(runs: list[Run], labels: list[str]) -> str:
    """Which colour is which run, once for every chart on the page."""
    items = "".join(
        f'<li class="key" data-run="{html.escape(label)}">{swatch(PALETTE[i % len(PALETTE)])}'
        f'<b>{html.escape(label)}</b> <code>{html.escape(str(run.path))}</code></li>'
        for i, (label, run) in enumerate(zip(labels, runs))
    )
    return (f'<section id="runs"><h2>Runs</h2><ul class="legend run-legend" id="run-legend">{items}</ul>'
            '<p class="note">One colour per run in every chart; where a chart has several metrics, each has its own dash.</p>'
            "</section>")


def render_table(runs: list[Run], labels: list[str], keys: list[str]) -> str:
    """Facts and final metrics side by side: one column per run, "—" where a run lacks one."""
    facts: list[tuple[str, list[str]]] = [("run directory", [str(r.path) for r in runs])]
    recipe, model, task, steps, wall = [], [], [], [], []
    for run in runs:
        m, t = model_and_task(run)
        _, seconds = wall_time(run)
        step = last_step(run)
        recipe.append(infer_recipe(run))
        model.append(m)
        task.append(t)
        steps.append("" if step is None else str(step))
        wall.append(_duration(seconds) if seconds is not None else "")
    facts += [("recipe", recipe), ("model", model), ("task / data", task), ("steps logged", steps), ("wall time", wall)]
    head = "<tr><th></th>" + "".join(
        f'<th>{swatch(PALETTE[i % len(PALETTE)])}{html.escape(label)}</th>' for i, label in enumerate(labels)) + "</tr>"
    rows = [f'<tr data-row="{html.escape(name)}"><th>{name}</th>'
            + "".join(f"<td>{html.escape(v) or '—'}</td>" for v in values) + "</tr>" for name, values in facts]
    finals = [final_metrics(run.metrics) for run in runs]
    for k in keys:
        cells = "".join(f"<td>{'—' if f.get(k) is None else _cell(f[k])}</td>" for f in finals)
        rows.append(f'<tr class="metric" data-metric="{html.escape(k)}"><th>{html.escape(k)}</th>{cells}</tr>')
    return ('<section id="summary"><h2>Summary</h2><p class="note">Final value of each metric (the last one logged) '
            'and wall time (first to last metric timestamp) of each run.</p>'
            f'<table class="kv compare" id="compare-summary"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'
            "</section>")
