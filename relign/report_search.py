"""The inference-time search part of the run report: accuracy vs. budget, per-problem results, trees.

``relign eval`` with a search strategy (cot, majority, best_of_n, weighted_majority,
step_beam, mcts) writes, next to ``eval.json``:

    sweep.json                  a sweep over strategies x budgets: one row per cell, with its
                                accuracy, 95% interval, tokens per question, engine calls, ...
    search.jsonl                per-problem results of a single-strategy eval
    search/<strategy>_<B>.jsonl per-problem results of each sweep cell (``file`` of its row)

``report.py`` calls three things here: ``load_search`` (what the run holds, from
``load_run``), ``render_search`` (the page section) and ``assets`` (its CSS and JS, inlined
into the page only when the section is there). Everything shown is escaped here, in Python:
the section carries no JSON for the page's script, which only toggles ``hidden``/``open``
and sets ``textContent``. Trees are nested ``<details>``, so they fold without script.
"""

from __future__ import annotations

import functools
import html
import json
import math
import re
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from .report import (
    PALETTE, _count_lines, _cut, _flatten, _is_int, _is_num, _range, _text, fmt, nice_ticks, read_jsonl,
    tick_labels,
)

SWEEP_FILE = "sweep.json"
SEARCH_FILE = "search.jsonl"
SEARCH_DIR = "search"

# Caps that keep the section bounded however large the eval: the page says when one applied.
MAX_SEARCH_FILES = 64  # result files (sweep cells) with a per-problem list
MAX_SEARCH_ROWS = 200  # problems per file
MAX_SEARCH_BYTES = 10_000_000  # markup of the problem rows (trees aside), split evenly over the files
MAX_SEARCH_TREES = 20  # trees per file: those of its first problems that have one
MAX_TREE_BYTES = 10_000_000  # markup of the trees, split evenly over the files
MAX_TREE_NODES = 2000  # nodes per tree (the chosen path first, then breadth-first)
MAX_TREE_DEPTH = 120  # nesting levels per tree
MAX_NODE_TEXT = 400  # characters of a node's step text
MAX_QUESTION_TEXT = 4000
MAX_CANDIDATES = 16  # candidates listed per problem
MAX_CANDIDATE_TEXT = 2000
MIN_FILE_BYTES = 200_000  # a file's share of a budget is never below this


# --------------------------------------------------------------------------- reading


@dataclass
class Cell:
    """One per-problem result file, with the sweep row it belongs to (if any)."""

    file: str  # relative to the run directory, '/'-separated
    label: str
    sweep_row: dict[str, Any] | None = None


@dataclass
class Search:
    sweep: dict[str, Any] | None = None  # sweep.json without its rows
    rows: list[dict[str, Any]] = field(default_factory=list)  # sweep.json rows (dicts only)
    cells: list[Cell] = field(default_factory=list)
    files_left_out: int = 0  # result files past MAX_SEARCH_FILES
    row_cells: list[int | None] = field(default_factory=list)  # each sweep row's index in cells, if embedded
    row_found: list[bool] = field(default_factory=list)  # whether each sweep row's file exists


def load_search(root: Path, eval_summary: dict[str, Any] | None = None) -> Search | None:
    """What search output ``root`` holds (the files are read when rendered), or None."""
    search = Search()
    sweep = _read_json(root / SWEEP_FILE)
    if sweep is not None:
        rows = sweep.get("rows")
        search.rows = [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
        search.sweep = {k: v for k, v in sweep.items() if k != "rows"}
    cells: dict[str, Cell] = {}
    if (root / SEARCH_FILE).is_file():
        strategy = _text((eval_summary or {}).get("strategy"))
        cells[SEARCH_FILE] = Cell(SEARCH_FILE, f"{strategy} ({SEARCH_FILE})" if strategy else SEARCH_FILE)
    for row in search.rows:
        rel = _safe_relative(root, row.get("file"))
        if rel and rel not in cells:
            cells[rel] = Cell(rel, cell_label(row), row)
    folder = root / SEARCH_DIR
    for p in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        rel = f"{SEARCH_DIR}/{p.name}"
        if p.is_file() and rel not in cells:
            cells[rel] = Cell(rel, rel)
    search.cells = list(cells.values())[:MAX_SEARCH_FILES]
    search.files_left_out = max(0, len(cells) - MAX_SEARCH_FILES)
    index = {c.file: i for i, c in enumerate(search.cells)}
    rels = [_safe_relative(root, row.get("file")) for row in search.rows]
    search.row_cells = [index.get(rel) for rel in rels]
    search.row_found = [bool(rel) for rel in rels]
    if search.sweep is None and not search.cells:
        return None
    return search


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _safe_relative(root: Path, name: Any) -> str:
    """``name`` as a '/'-path inside ``root`` when it is a relative path to a file there, else ''."""
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        return ""
    p = PurePosixPath(name)
    if p.is_absolute() or any(part in ("", "..") for part in p.parts):
        return ""
    return p.as_posix() if (root / p).is_file() else ""


def cell_label(row: dict[str, Any]) -> str:
    budget = row.get("budget")
    return f"{_text(row.get('strategy')) or '?'} · " + (f"budget {fmt(budget)}" if _is_num(budget) else "no token budget")


def summary_text(search: Search | None) -> str:
    """The summary table's one line about the search output."""
    if search is None:
        return ""
    parts = []
    if search.rows:
        strategies = {_text(r.get("strategy")) for r in search.rows}
        budgets = {_text(r.get("budget")) for r in search.rows}
        parts.append(f"sweep of {len(strategies)} strategies × {len(budgets)} budgets ({len(search.rows)} cells)")
    n = len(search.cells) + search.files_left_out
    if n:
        parts.append(f"{n} per-problem result file{'s' if n != 1 else ''}")
    return ", ".join(parts) or "sweep.json (no rows)"


# --------------------------------------------------------------------------- page assets


@functools.lru_cache(maxsize=None)
def _asset(name: str) -> str:
    text = resources.files("relign").joinpath("report_assets").joinpath(name).read_text(encoding="utf-8")
    if re.search(r"</(script|style)", text, re.I):  # would end the inline block it goes into
        raise ValueError(f"report_assets/{name} must not contain '</script' or '</style'")
    return text


def assets() -> tuple[str, str]:
    """(CSS, JS) of the section, for the page's ``<style>`` and a ``<script>`` of its own."""
    return _asset("search.css"), _asset("search.js")


# --------------------------------------------------------------------------- accuracy vs. budget


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

    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" preserveAspectRatio="xMidYMid meet">']
    y_ticks = nice_ticks(y0, y1)
    for t, label in zip(y_ticks, tick_labels(y_ticks)):
        parts.append(f'<line class="grid" x1="{left}" x2="{left + pw}" y1="{py(t)}" y2="{py(t)}"/>'
                     f'<text class="tick" x="{left - 4}" y="{py(t) + 3}" text-anchor="end">{label}</text>')
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


def render_sweep(search: Search) -> str:
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


# --------------------------------------------------------------------------- trees


@dataclass
class Tree:
    nodes: dict[str, dict[str, Any]]  # id (as text) -> node
    children: dict[str, list[str]]
    roots: list[str]
    keep: set[str]  # the nodes shown
    total: int


def build_tree(raw: list[Any], cap: int | None = None, max_depth: int | None = None) -> Tree:
    """Index a tree's node list and choose the nodes to show: the chosen path (and its
    ancestors) first, then breadth-first from the roots, up to ``cap`` nodes and
    ``max_depth`` levels. A node whose parent is absent is a root; a cycle is never reached."""
    cap = MAX_TREE_NODES if cap is None else cap
    max_depth = MAX_TREE_DEPTH if max_depth is None else max_depth
    nodes: dict[str, dict[str, Any]] = {}
    for n in raw:
        if isinstance(n, dict) and n.get("id") is not None:
            nodes.setdefault(_text(n["id"]), n)
    parent = {k: (_text(n.get("parent")) if n.get("parent") is not None else None) for k, n in nodes.items()}
    children: dict[str, list[str]] = {k: [] for k in nodes}
    roots = []
    for k in nodes:
        p = parent[k]
        if p is None or p not in nodes or p == k:
            parent[k] = None
            roots.append(k)
        else:
            children[p].append(k)
    level: dict[str, int] = {}
    queue = deque((r, 0) for r in roots)
    order = []
    while queue:
        k, d = queue.popleft()
        if k in level:
            continue
        level[k] = d
        order.append(k)
        queue.extend((c, d + 1) for c in children[k])
    keep: set[str] = set()
    for k in order:  # the chosen path, with every ancestor so that it hangs together
        if _truthy(nodes[k].get("chosen")) and level[k] < max_depth and k not in keep:
            path, a = [], k
            while a is not None and a not in keep:
                path.append(a)
                a = parent[a]
            if len(keep) + len(path) <= cap:
                keep.update(path)
    for k in order:
        if len(keep) >= cap:
            break
        if level[k] < max_depth and (parent[k] is None or parent[k] in keep):
            keep.add(k)
    return Tree(nodes, children, roots, keep, len(nodes))


def render_tree(raw: list[Any], problem: Any) -> str:
    tree = build_tree(raw)
    any_chosen = any(_truthy(tree.nodes[k].get("chosen")) for k in tree.keep)
    parts: list[str] = []
    stack: list[tuple[str, str]] = [("open", r) for r in reversed([r for r in tree.roots if r in tree.keep])]
    while stack:
        op, k = stack.pop()
        if op == "close":
            parts.append("</ul></details></li>")
            continue
        node = tree.nodes[k]
        kids = [c for c in tree.children[k] if c in tree.keep]
        chosen, terminal = _truthy(node.get("chosen")), _truthy(node.get("terminal"))
        classes = "node" + (" chosen" if chosen else "") + (" terminal" if terminal else "") + ("" if kids else " leaf")
        attrs = (f'class="{classes}" data-node="{html.escape(k)}" data-parent="{html.escape(_text(node.get("parent")))}" '
                 f'data-visits="{html.escape(_text(node.get("visits")))}" data-q="{html.escape(_text(node.get("q")))}" '
                 f'data-chosen="{int(chosen)}"')
        line = _node_line(k, node, terminal)
        if kids:
            is_open = chosen or (not any_chosen and tree.nodes[k].get("parent") is None)
            parts.append(f'<li {attrs}><details{" open" if is_open else ""}><summary>{line}</summary><ul>')
            stack.append(("close", k))
            stack.extend(("open", c) for c in reversed(kids))
        else:
            parts.append(f'<li {attrs}><div class="nline">{line}</div></li>')
    shown = len(tree.keep)
    note = f"{tree.total} nodes" if shown == tree.total else (
        f"{shown} of {tree.total} nodes shown (the chosen path, then breadth-first up to {MAX_TREE_NODES} nodes"
        f" and {MAX_TREE_DEPTH} levels)")
    note += "; highlighted: the path to the chosen answer" if any_chosen else ""
    return (
        f'<div class="tree" data-problem="{html.escape(_text(problem))}" data-nodes="{tree.total}" data-shown="{shown}">'
        '<div class="tree-tools"><button type="button" data-act="expand">expand all</button>'
        '<button type="button" data-act="collapse">collapse all</button>'
        '<button type="button" data-act="chosen">chosen path</button>'
        f'<span class="note">{html.escape(note)} · N visits · Q mean value · P prior · V value · ■ terminal</span></div>'
        f'<ul class="tree-root">{"".join(parts)}</ul></div>'
    )


def _node_line(key: str, node: dict[str, Any], terminal: bool) -> str:
    text = _text(node.get("text")).strip("\n")
    empty = "(root)" if node.get("parent") is None else "(empty)"
    text_html = (f'<span class="ntext">{html.escape(_cut(text, MAX_NODE_TEXT))}</span>' if text.strip()
                 else f'<span class="ntext empty">{empty}</span>')
    stats = []
    for name, short in (("visits", "N"), ("q", "Q"), ("prior", "P"), ("value", "V")):
        v = node.get(name)
        if _is_num(v):
            stats.append(f"{short} {fmt(v)}")
    if _is_num(node.get("tokens")):
        stats.append(f"{fmt(node['tokens'])} tok")
    term = ""
    if terminal:
        answer = node.get("answer")
        shown = " " + html.escape(_cut(_text(answer), 100)) if answer is not None else ""
        term = f'<span class="nterm" title="terminal">■{shown}</span>'
    return (f'<span class="nid">#{html.escape(_cut(key, 40))}</span>{text_html}{term}'
            f'<span class="nstats">{html.escape(" · ".join(stats))}</span>')


# --------------------------------------------------------------------------- per-problem results


def render_cell(root: Path, cell: Cell, index: int, row_budget: int, tree_budget: int, open_first_tree: bool) -> str:
    path = root / cell.file
    rows = read_jsonl(path, limit=MAX_SEARCH_ROWS)
    total = _count_lines(path)
    problems, used, tree_used, trees, trees_skipped, tree_budget_hit = [], 0, 0, 0, 0, False
    first_tree = True
    for i, row in enumerate(rows):
        tree_html, tree_note = "", ""
        tree = row.get("tree")
        if isinstance(tree, list) and tree:
            if trees >= MAX_SEARCH_TREES:
                trees_skipped += 1
                tree_note = f"tree not embedded (the first {MAX_SEARCH_TREES} trees of a file are)"
            else:
                tree_html = render_tree(tree, row.get("problem", i))
                if tree_used + len(tree_html) > tree_budget:
                    tree_html, tree_budget_hit = "", True
                    trees_skipped += 1
                    tree_note = "tree not embedded (size budget)"
                else:
                    trees += 1
                    tree_used += len(tree_html)
        is_open = bool(tree_html) and open_first_tree and first_tree
        first_tree = first_tree and not tree_html
        problems.append(_problem_html(row, i, tree_html, tree_note, is_open))
        used += len(problems[-1]) - len(tree_html)
        if used > row_budget:
            break
    notes = []
    if len(problems) < len(rows):
        notes.append(f"the first {len(problems)} of {total} problems (size budget)")
    elif len(rows) >= MAX_SEARCH_ROWS and total > len(rows):
        notes.append(f"the first {len(problems)} of {total} problems (at most {MAX_SEARCH_ROWS})")
    elif total > len(rows):
        notes.append(f"{total - len(rows)} unreadable line(s) skipped")
    if trees_skipped:
        notes.append(f"trees of {trees} problems, {trees_skipped} left out"
                     + (" (size budget)" if tree_budget_hit else f" (at most {MAX_SEARCH_TREES} a file)"))
    shown = rows[:len(problems)]
    graded = [r["correct"] for r in shown if isinstance(r.get("correct"), bool)]
    costs = [r["cost"] for r in shown if isinstance(r.get("cost"), dict)]
    gen = [c["generated_tokens"] for c in costs if _is_num(c.get("generated_tokens"))]
    errors = sum(1 for r in shown if r.get("error"))
    stats = [f"{len(problems)} problems" + (" shown" if len(problems) < total else "")]
    if graded:
        stats.append(f"accuracy {fmt(sum(graded) / len(graded))} ({sum(graded)}/{len(graded)})")
    if gen:
        stats.append(f"{fmt(sum(gen) / len(gen))} generated tokens a problem")
    if errors:
        stats.append(f"{errors} failed")
    head = html.escape(" · ".join(stats)) + (f" — embedded: {html.escape('; '.join(notes))}" if notes else "")
    body = "".join(problems) or '<p class="empty">No rows.</p>'
    return (f'<div class="search-cell" data-cell="{index}" data-file="{html.escape(cell.file)}"{" hidden" if index else ""}>'
            f'<p class="note"><code>{html.escape(cell.file)}</code>: {head}</p>{body}</div>')


def _problem_html(row: dict[str, Any], i: int, tree_html: str, tree_note: str, is_open: bool) -> str:
    problem = row.get("problem") if _is_int(row.get("problem")) else i
    correct = row.get("correct") if isinstance(row.get("correct"), bool) else None
    mark = {True: ("ok", "✓"), False: ("bad", "✗"), None: ("unk", "?")}[correct]
    cost = row.get("cost") if isinstance(row.get("cost"), dict) else {}
    cost_bits = []
    for key, unit in (("generated_tokens", "tok"), ("engine_calls", "calls"), ("scorer_calls", "scorer calls"), ("wall_s", "s")):
        if _is_num(cost.get(key)):
            cost_bits.append(f"{fmt(cost[key])} {unit}")
    error = row.get("error")
    n_nodes = len(row["tree"]) if isinstance(row.get("tree"), list) else 0
    summary = (
        f'<span class="pidx">#{html.escape(_text(problem))}</span>'
        f'<span class="mark {mark[0]}">{mark[1]}</span>'
        f'<span>answer <code>{html.escape(_cut(_text(row.get("answer")), 200) or "—")}</code></span>'
        f'<span>gold <code>{html.escape(_cut(_text(row.get("gold")), 200) or "—")}</code></span>'
        f'<span class="scost">{html.escape(" · ".join(cost_bits))}</span>'
        + (f'<span class="badge tree">tree {n_nodes}</span>' if n_nodes else "")
        + ('<span class="badge err">error</span>' if error else "")
    )
    body = [f'<pre class="question">{html.escape(_cut(_text(row.get("question")), MAX_QUESTION_TEXT))}</pre>']
    if error:
        body.append(f'<pre class="error">{html.escape(_cut(_text(error), 2000))}</pre>')
    if cost:
        body.append('<p class="costline">' + html.escape(" · ".join(f"{k} {_text(v)}" for k, v in _flatten(cost).items()))
                    + "</p>")
    cands = row.get("candidates") if isinstance(row.get("candidates"), list) else []
    if cands:
        items = []
        for j, c in enumerate(cands[:MAX_CANDIDATES]):
            c = c if isinstance(c, dict) else {"text": c}
            meta = [f"answer <code>{html.escape(_cut(_text(c.get('answer')), 200) or '—')}</code>"]
            if _is_num(c.get("score")):
                meta.append(f"score {fmt(c['score'])}")
            if c.get("finish_reason"):
                meta.append(html.escape(_text(c["finish_reason"])))
            if c.get("meta"):
                meta.append(html.escape(_cut(_text(c["meta"]), 300)))
            items.append(f'<div class="cand"><div class="meta">candidate {j} · {" · ".join(meta)}</div>'
                         f'<pre>{html.escape(_cut(_text(c.get("text")), MAX_CANDIDATE_TEXT))}</pre></div>')
        more = f" (the first {MAX_CANDIDATES} shown)" if len(cands) > MAX_CANDIDATES else ""
        body.append(f'<details class="cands"><summary>{len(cands)} candidate{"s" if len(cands) != 1 else ""}{more}</summary>'
                    f'{"".join(items)}</details>')
    if tree_note:
        body.append(f'<p class="note">{html.escape(tree_note)}</p>')
    body.append(tree_html)
    return (
        f'<details class="sproblem" data-problem="{html.escape(_text(problem))}" '
        f'data-correct="{"" if correct is None else int(correct)}" data-tree="{int(bool(tree_html))}" '
        f'data-error="{int(bool(error))}"{" open" if is_open else ""}><summary>{summary}</summary>'
        f'<div class="sbody">{"".join(body)}</div></details>'
    )


# --------------------------------------------------------------------------- the section


def render_search(run: Any) -> str:
    """The "Inference-time search" section of ``run`` (a report.Run), or '' when it has none."""
    search: Search | None = getattr(run, "search", None)
    if search is None:
        return ""
    out = ['<section id="search"><h2>Inference-time search</h2>']
    if search.sweep is not None:
        out.append(render_sweep(search))
    if search.cells:
        n = len(search.cells)
        row_budget = max(MIN_FILE_BYTES, MAX_SEARCH_BYTES // n)
        tree_budget = max(MIN_FILE_BYTES, MAX_TREE_BYTES // n)
        options = "".join(f'<option value="{i}">{html.escape(c.label)}</option>' for i, c in enumerate(search.cells))
        out.append(
            '<div id="search-results"><h3>Per-problem results</h3>'
            '<div class="search-controls">'
            f'<label>Results <select id="search-file">{options}</select></label>'
            '<label>Show <select id="search-filter"><option value="all">all</option><option value="correct">correct</option>'
            '<option value="incorrect">incorrect</option><option value="tree">with a tree</option>'
            '<option value="error">failed</option></select></label><span id="search-count"></span></div>')
        if search.files_left_out:
            out.append(f'<p class="note">{search.files_left_out} more result files are not embedded '
                       f"(at most {MAX_SEARCH_FILES}).</p>")
        out += [render_cell(run.path, c, i, row_budget, tree_budget, open_first_tree=i == 0)
                for i, c in enumerate(search.cells)]
        out.append("</div>")
    out.append("</section>")
    return "".join(out)


# --------------------------------------------------------------------------- helpers


def _fin(v: Any) -> float | None:
    return float(v) if _is_num(v) and math.isfinite(v) else None


def _truthy(v: Any) -> bool:
    return v is True or (_is_num(v) and v > 0)


def _num(v: Any) -> str:
    return html.escape(fmt(v)) if _is_num(v) else ("—" if v is None else html.escape(_cut(_text(v), 100)))
