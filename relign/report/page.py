"""One run's page: summary, before/after, sub-runs, eval, search, metrics, traces; and writing it.

An eval with ``scorer=reader`` opens with its reliability diagram (evalview.render_reliability).

A demo's page (demo.json) opens with its charts (demoview.py): a newcomer's first question is
"what did training do", and the answer is a curve, not a table.

The page is one self-contained file: its CSS and JS (relign/report_assets/report.css,
report.js, and search.css/js with the search section) are inlined, the plots are inline SVG,
and a Content-Security-Policy forbids loading anything, so it opens offline from anywhere.
"""

from __future__ import annotations

import datetime as _dt
import html
import logging
import os
from pathlib import Path
from urllib.parse import quote

from .. import distributed
from ..checkpoint import atomic_write_text
from .demoview import render_demo, render_demo_charts
from .evalview import render_eval, render_reliability
from .load import Run, check_run_dir, final_metrics, infer_recipe, last_step, load_run, model_and_task, wall_time
from .metrics import render_metrics
from .search import assets as search_assets
from .search import render_search, summary_text
from .traces import render_traces
from .util import REPORT_FILE, _duration, _kv_table, asset

log = logging.getLogger(__name__)

# The browser itself refuses to load anything from anywhere: only the page's own inline CSS/JS run.
CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"


# --------------------------------------------------------------------------- writing


def write_report(run_dir: str | os.PathLike) -> Path:
    """Write ``RUN_DIR/report.html`` (and one for each sub-run) and return its path.

    Raises FileNotFoundError when ``run_dir`` is not a directory or holds none of the files a
    run writes (so a typo does not drop a report into some unrelated folder).
    """
    root = Path(run_dir)
    check_run_dir(root)
    run = load_run(root)
    for sub in run.subruns:
        write_report(sub)
    out = root / REPORT_FILE
    atomic_write_text(out, render_page(run))  # a browser reloading mid-write sees the old or the new page
    return out


def refresh_after_run(run_dir: str | os.PathLike) -> Path | None:
    """``write_report`` at the end of a run (the CLI calls it after ``train``): never raises.

    A report is a convenience: a bad trace file or a full disk must not fail a run that
    trained. Returns the page's path, or None on failure and on every rank but the first.
    """
    try:
        if not _is_main_rank():
            return None
        return write_report(run_dir)
    except Exception as e:  # noqa: BLE001 -- by contract: log and carry on
        log.warning("could not write %s/%s: %s: %s", run_dir, REPORT_FILE, type(e).__name__, e)
        return None


def refresh_report(run_dir: str | os.PathLike) -> Path | None:
    """The same as ``refresh_after_run``: the name recipes that refresh their own page use (demo)."""
    return refresh_after_run(run_dir)


def _is_main_rank() -> bool:
    """Rank 0 of the process group, or of torchrun's environment once the group is gone (the
    CLI tears it down before the report is written, when every rank would otherwise say 0)."""
    if distributed.is_initialized():
        return distributed.is_main()
    return os.environ.get("RANK", "0") in ("", "0")


# --------------------------------------------------------------------------- sections


def render_summary(run: Run) -> str:
    model, task = model_and_task(run)
    start, seconds = wall_time(run)
    step = last_step(run)
    facts = [
        ("recipe", infer_recipe(run)),
        ("model", model),
        ("task / data", task),
        ("steps logged", "" if step is None else str(step)),
        ("wall time", _duration(seconds) if seconds is not None else ""),
        ("started", _dt.datetime.fromtimestamp(start).strftime("%Y-%m-%d %H:%M:%S") if start else ""),
        ("checkpoints", ", ".join(f"step_{s}" for s in run.checkpoints)),
        ("rollout traces", f"{len(run.trace_files)} steps" if run.trace_files else ""),
        ("search", summary_text(run.search)),
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


def render_subruns(run: Run) -> str:
    if not run.subruns:
        return ""
    items = "".join(
        f'<li><a href="{quote(p.name)}/{REPORT_FILE}">{html.escape(p.name)}</a></li>' for p in run.subruns
    )
    return f'<section id="subruns"><h2>Sub-runs</h2><ul class="subruns">{items}</ul></section>'


# --------------------------------------------------------------------------- the page


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
    search = render_search(run)  # its CSS and JS go into the page only with it
    search_css, search_js = search_assets() if search else ("", "")
    # relign eval scorer=reader opens with its reliability diagram: what a calibration eval is for
    reliability = "" if in_training else render_reliability(run)
    body = [reliability, render_demo_charts(run), render_summary(run), render_demo(run), render_subruns(run),
            "" if in_training else evals, search, metrics, render_traces(run), evals if in_training else ""]
    return page_html(name, name, f"<code>relign report {html.escape(str(run.path))}</code> rewrites it", "".join(body),
                     search_css, search_js)


def page_html(title: str, heading: str, rewrite_html: str, body: str, extra_css: str = "", extra_js: str = "") -> str:
    """The page around ``body``: head with the CSP and inlined assets, header, scripts."""
    generated = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<title>relign report: {html.escape(title)}</title>
<style>{asset("report.css")}{extra_css}</style></head>
<body><header><h1>{html.escape(heading)}</h1><span class="sub">relign report · written {generated} ·
{rewrite_html}</span></header>
<main>{body}</main>
<script>{asset("report.js")}</script>{f"<script>{extra_js}</script>" if extra_js else ""}</body></html>
"""
