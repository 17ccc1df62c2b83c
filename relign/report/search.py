"""Inference-time search in the report: what a search eval wrote, its per-problem results, the section.

``relign eval`` with a search strategy (cot, majority, best_of_n, weighted_majority,
step_beam, mcts) writes, next to ``eval.json``:

    sweep.json                  a sweep over strategies x budgets: one row per cell, with its
                                accuracy, 95% interval, tokens per question, engine calls, ...
    search.jsonl                per-problem results of a single-strategy eval
    search/<strategy>_<B>.jsonl per-problem results of each sweep cell (``file`` of its row)

The page calls three things here: ``load_search`` (what the run holds, from ``load_run``),
``render_search`` (the section) and ``assets`` (its CSS and JS, inlined into the page only
when the section is there). The accuracy-vs-budget chart is in sweep.py, trees in tree.py.
Everything shown is escaped here, in Python: the section carries no JSON for the page's
script, which only toggles ``hidden``/``open`` and sets ``textContent``. Trees are nested
``<details>``, so they fold without script.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from .sweep import render_sweep
from .tree import render_tree
from .util import _cut, _flatten, _is_int, _is_num, _text, asset, count_lines, fmt, read_json, read_jsonl

SWEEP_FILE = "sweep.json"
SEARCH_FILE = "search.jsonl"
SEARCH_DIR = "search"

# Caps that keep the section bounded however large the eval: the page says when one applied.
MAX_SEARCH_FILES = 64  # result files (sweep cells) with a per-problem list
MAX_SEARCH_ROWS = 200  # problems per file
MAX_SEARCH_BYTES = 10_000_000  # markup of the problem rows (trees aside), split evenly over the files
MAX_SEARCH_TREES = 20  # trees per file: those of its first problems that have one
MAX_TREE_BYTES = 10_000_000  # markup of the trees, split evenly over the files
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
    sweep = read_json(root / SWEEP_FILE)
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


def assets() -> tuple[str, str]:
    """(CSS, JS) of the section, for the page's ``<style>`` and a ``<script>`` of its own."""
    return asset("search.css"), asset("search.js")


# --------------------------------------------------------------------------- per-problem results


def render_cell(root: Path, cell: Cell, index: int, row_budget: int, tree_budget: int, open_first_tree: bool) -> str:
    path = root / cell.file
    rows = read_jsonl(path, limit=MAX_SEARCH_ROWS)
    total = count_lines(path)
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
