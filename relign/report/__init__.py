"""Static HTML report of a run, or of several runs side by side.

``write_report(run_dir)`` reads what a run directory holds and writes one self-contained
``RUN_DIR/report.html``: no network is needed to open it (inline CSS and JS from
relign/report_assets/, plots drawn here as inline SVG, a Content-Security-Policy that forbids
loading anything). Everything it shows comes from files, so it works for every recipe and for
a run that is still going. ``write_compare([run_a, run_b, ...])`` overlays several runs.

The package, one part a file:

    load.py      a run directory -> Run (config, metrics, traces, checkpoints, eval, demo, search)
    charts.py    which metrics go in which chart (CHARTS), series, SVG line and bar charts
    metrics.py   the Metrics section: charts that vary, constant metrics in a table (1 run or several)
    traces.py    the rollout trace browser's data
    evalview.py  eval summary and per-problem sample grid
    reliability.py  the reliability diagram of relign eval scorer=reader (SVG)
    demoview.py  the demo's page: reward, held-out accuracy and before/after charts first, then its table
    search.py    inference-time search section (sweep.py: accuracy vs budget; tree.py: search trees)
    page.py      one run's page; write_report, refresh_after_run
    compare.py   several runs on one page
    command.py   ``relign report`` (main(argv))
    util.py      number text, escaping, JSON for <script>, the assets

Low-level modules (checkpoint, tracking, config) never import this package: the CLI refreshes
the page when a run ends (``refresh_after_run``), and ``relign report`` rewrites it any time.

Model output is untrusted text: every string is escaped (``html.escape``) in markup, JSON
embedded in ``<script>`` blocks has ``<``, ``>`` and ``&`` escaped so ``</script>`` cannot
close the block, and the page's JS only ever sets ``textContent``, never ``innerHTML``.
"""

from __future__ import annotations

from .charts import CHARTS, chart_svg, nice_ticks, plan_charts, tick_labels
from .compare import write_compare
from .evalview import group_samples
from .load import Run, final_metrics, infer_recipe, load_run, metric_keys, trace_files, wall_time
from .page import CSP, refresh_after_run, refresh_report, render_page, write_report
from .traces import build_traces, trace_row, trace_step
from .util import PALETTE, REPORT_FILE, fmt, read_jsonl

__all__ = [
    "CHARTS", "CSP", "PALETTE", "REPORT_FILE", "Run", "build_traces", "chart_svg", "final_metrics", "fmt", "group_samples",
    "infer_recipe", "load_run", "metric_keys", "nice_ticks", "plan_charts", "read_jsonl", "refresh_after_run",
    "refresh_report", "render_page", "tick_labels", "trace_files", "trace_row", "trace_step", "wall_time",
    "write_compare", "write_report",
]
