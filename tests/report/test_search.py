"""relign report for inference-time search: the accuracy-vs-budget sweep, per-problem results, trees."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from relign import report
from relign.report import load_run, search, sweep, tree, write_report

from ..conftest import write_jsonl
from .test_report import EVIL, Page, _assert_offline, make_eval_run, make_rl_run

HOSTILE = "</script><script>alert(1)</script><img src=x onerror=alert(2)>"
STRATEGIES = ("cot", "best_of_n", "mcts")
BUDGETS = (128, 512, 2048)


def make_tree(hostile: bool = False) -> list[dict]:
    """root 0 -> {1, 2}; 1 -> {3, 4}; 3 -> {5 (terminal, the answer)}; chosen path 0-1-3-5."""
    spec = [  # id, parent, visits, q, prior, value, terminal, answer, chosen, text
        (0, None, 12, 0.55, 1.0, None, False, None, True, ""),
        (1, 0, 7, 0.61, 0.42, 0.6, False, None, True, HOSTILE if hostile else "Step one: 6*3 = 18.\n"),
        (2, 0, 5, 0.2, 0.58, 0.1, False, None, False, "Step one (wrong): 6+3 = 9.\n"),
        (3, 1, 5, 0.8, 0.5, 0.7, False, None, True, "Step two: so the answer is 18.\n"),
        (4, 1, 2, 0.3, 0.5, 0.3, True, "19", False, "Step two: 19.\n"),
        (5, 3, 4, 0.9, 1.0, 0.95, True, "18", True, "The answer is 18."),
    ]
    return [{"id": i, "parent": p, "depth": 0 if p is None else 1, "text": t, "visits": n, "q": q, "prior": pr, "value": v,
             "terminal": term, "answer": a, "tokens": len(t) // 4, "chosen": c}
            for i, p, n, q, pr, v, term, a, c, t in spec]


def search_row(problem: int, strategy: str, *, tree: bool = False, hostile: bool = False, correct: bool = True) -> dict:
    return {
        "problem": problem, "question": (HOSTILE if hostile else f"Question {problem}: what is 6*3?"), "strategy": strategy,
        "answer": "18" if correct else "19", "gold": "18", "correct": correct, "error": None,
        "cost": {"generated_tokens": 480, "prompt_tokens": 2000, "engine_calls": 9, "scorer_calls": 9, "scorer_tokens": 1200,
                 "wall_s": 3.2},
        "candidates": [{"text": "The answer is 18." if correct else HOSTILE, "answer": "18", "score": 0.8,
                        "finish_reason": "stop", "meta": {"node": 5, "kind": "terminal"}}],
        "tree": make_tree(hostile) if tree else None,
    }


def make_sweep_run(root: Path, problems: int = 3) -> Path:
    """A sweep over 3 strategies x 3 budgets (one cell's file missing), mcts cells with trees."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for s, strategy in enumerate(STRATEGIES):
        for b, budget in enumerate(BUDGETS):
            acc = 0.2 + 0.1 * s + 0.05 * b
            file = f"search/{strategy}_{budget}.jsonl"
            rows.append({"strategy": strategy, "budget": budget, "accuracy": acc, "ci_low": acc - 0.1, "ci_high": acc + 0.1,
                         "tokens_per_question": budget * 0.9 + s, "engine_calls": 10 * (b + 1), "wall_s": 1.5 * (b + 1),
                         "num_problems": problems, "failed": int(strategy == "cot" and budget == 128), "file": file})
            if (strategy, budget) != ("cot", 2048):  # its file is missing
                write_jsonl(root / file, [search_row(p, strategy, tree=strategy == "mcts", hostile=p == 1, correct=p != 2)
                                          for p in range(problems)])
    (root / "sweep.json").write_text(json.dumps({"task": "gsm8k", "model": "tiny:micro", "scorer": "verifier", "rows": rows}))
    return root


def make_single_search_run(root: Path, problems: int = 4) -> Path:
    """A single-strategy eval: eval.json with "strategy": "mcts" and search.jsonl."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "eval.json").write_text(json.dumps({
        "model": "tiny:micro", "task": "gsm8k", "strategy": "mcts",
        "metrics": {"accuracy": 0.75, "ci_low": 0.3, "ci_high": 0.95, "tokens_per_question": 480.0}}))
    write_jsonl(root / "search.jsonl", [search_row(p, "mcts", tree=True, hostile=p == 1, correct=p != 2) for p in range(problems)])
    return root


def _page(run_dir: Path) -> tuple[str, Page]:
    text = write_report(run_dir).read_text()
    return text, Page(text)


def _nodes(page: Page, cell: int = 0, problem: str = "0") -> list[dict[str, str]]:
    """The tree nodes of one problem (by walking the elements between its tree and the next)."""
    out, inside, in_cell = [], False, False
    for tag, a in page.elements:
        if tag == "div" and "search-cell" in a.get("class", "").split():
            in_cell = a.get("data-cell") == str(cell)
        if tag == "div" and a.get("class") == "tree":
            inside = in_cell and a.get("data-problem") == problem
        if inside and tag == "li" and "node" in a.get("class", "").split():
            out.append(a)
    return out


# --------------------------------------------------------------------------- tests


def test_sweep_chart_has_one_series_per_strategy_with_error_bars(tmp_path):
    text, page = _page(make_sweep_run(tmp_path / "sweep"))
    (fig,) = page.find("figure", id="chart-sweep")
    assert json.loads(fig["data-series"]) == list(STRATEGIES)
    groups = [a for t, a in page.elements if t == "g" and a.get("class") == "series"]
    assert [g["data-series"] for g in groups] == list(STRATEGIES) and all(g["data-points"] == "3" for g in groups)
    assert len(page.find("path", **{"class": "line"})) == 3  # points joined, one line per strategy
    assert len(page.find("path", **{"class": "errbar"})) == 9  # a 95% interval on every point
    assert len(page.find("circle", **{"class": "pt"})) == 9
    assert "(log scale)" in text  # tokens span 115..1845: a log axis, with 1-2-5 ticks
    ticks = re.findall(r'<text class="tick"[^>]*text-anchor="middle">([^<]+)</text>', text)
    assert ticks == ["100", "200", "500", "1k", "2k"], ticks
    # x positions follow log10(tokens): 117.2, 462.8, 1845.2 tokens for mcts
    mcts = [a for a in page.find("circle", **{"class": "pt"}) if a["data-label"].startswith("mcts")]
    xs = [float(a["cx"]) for a in mcts]
    assert (xs[1] - xs[0]) / (xs[2] - xs[1]) == pytest.approx(math.log(462.8 / 117.2) / math.log(1845.2 / 462.8), rel=0.01)
    assert "mcts, budget 512: accuracy 0.45 [0.35, 0.55]" in mcts[1]["data-label"]
    _assert_offline(text, page)


def test_sweep_table_rows_and_summary(tmp_path):
    text, page = _page(make_sweep_run(tmp_path / "sweep"))
    rows = [a for t, a in page.elements if t == "tr" and "data-strategy" in a]
    assert [(r["data-strategy"], r["data-budget"]) for r in rows] == [(s, str(b)) for s in STRATEGIES for b in BUDGETS]
    assert sum("data-cell" in r for r in rows) == 8  # the missing file has no per-problem list to open
    table = text.split('id="sweep-table"', 1)[1].split("</table>", 1)[0]
    assert "<td>mcts</td><td>512</td><td>0.45 [0.35, 0.55]</td><td>462.8</td><td>20</td><td>3</td><td>3</td><td>0</td>" in table
    assert "search/cot_2048.jsonl</code> (missing)" in table
    assert ">eval<" in text and "sweep of 3 strategies × 3 budgets (9 cells), 8 per-problem result files" in text
    assert 'id="metrics"' not in text and "No metrics logged yet" not in text
    run = load_run(tmp_path / "sweep")
    assert run.subruns == [] and report.infer_recipe(run) == "eval"  # search/ is not a sub-run
    options = re.findall(r'<option value="(\d+)">([^<]+)</option>', text)
    assert options[0] == ("0", "cot · budget 128") and len(options) == 8


def test_sweep_row_files_stay_inside_the_run(tmp_path):
    root = make_sweep_run(tmp_path / "sweep")
    (tmp_path / "outside.jsonl").write_text(json.dumps(search_row(0, "x")) + "\n")
    sweep = json.loads((root / "sweep.json").read_text())
    sweep["rows"][0]["file"] = "../outside.jsonl"
    sweep["rows"][1]["file"] = str(root / "search" / "cot_512.jsonl")  # absolute: not followed
    sweep["rows"][3]["file"] = "./search/best_of_n_128.jsonl"  # the same file as written, normalised
    (root / "sweep.json").write_text(json.dumps(sweep))
    text, page = _page(root)
    rows = [a for t, a in page.elements if t == "tr" and "data-strategy" in a]
    assert "data-cell" not in rows[0] and "data-cell" not in rows[1] and "data-cell" in rows[3]
    assert "../outside.jsonl</code> (missing)" in text
    # search/*.jsonl files no row names (any more) still get their list
    files = [a["data-file"] for a in page.find("div", **{"class": "search-cell"})]
    assert "search/cot_128.jsonl" in files and "search/best_of_n_128.jsonl" in files and len(files) == 8


def test_tree_nodes_stats_and_chosen_path(tmp_path):
    text, page = _page(make_single_search_run(tmp_path / "single"))
    nodes = _nodes(page, 0, "0")
    expected = {n["id"]: n for n in make_tree()}
    assert [n["data-node"] for n in nodes] == ["0", "1", "3", "5", "4", "2"]  # nested depth-first, children in order
    for a in nodes:
        e = expected[int(a["data-node"])]
        assert a["data-visits"] == str(e["visits"]) and a["data-q"] == str(e["q"])
        assert a["data-parent"] == ("" if e["parent"] is None else str(e["parent"]))
        assert (a["data-chosen"] == "1") == e["chosen"] and ("chosen" in a["class"].split()) == e["chosen"]
        assert ("terminal" in a["class"].split()) == e["terminal"]
    # the chosen path is open; the other branches are there, folded
    tree = text.split('<div class="tree" data-problem="0"', 1)[1].split('<div class="tree"', 1)[0]
    for nid in ("0", "1", "3"):
        assert re.search(rf'data-node="{nid}"[^>]*><details open>', tree), nid
    assert re.search(r'data-node="2"[^>]*><div class="nline">', tree)  # a leaf: no fold
    assert "N 7 · Q 0.61 · P 0.42 · V 0.6" in tree and '<span class="nterm" title="terminal">■ 18</span>' in tree
    # the first problem with a tree is open; others are folded
    problems = page.find("details", **{"class": "sproblem"})
    assert [p["data-problem"] for p in problems] == ["0", "1", "2", "3"] and "open" in problems[0] and "open" not in problems[1]
    assert [p["data-correct"] for p in problems] == ["1", "1", "0", "1"] and all(p["data-tree"] == "1" for p in problems)
    assert "480 tok · 9 calls · 9 scorer calls · 3.2 s" in text and "mcts (search.jsonl)" in text
    assert "accuracy 0.75 (3/4)" in text and ">eval<" in text and "1 per-problem result file" in text


def test_untrusted_search_text_is_escaped(tmp_path):
    root = make_sweep_run(tmp_path / "sweep")
    (root / "sweep.json").write_text((root / "sweep.json").read_text().replace('"mcts"', json.dumps("mcts" + EVIL), 1))
    text, page = _page(root)
    assert "<script>alert" not in text and "<img" not in text and "<!-- " not in text
    assert not [a for t, a in page.elements if t == "img"]
    assert text.count("<script") == 2 and text.count("</script>") == 2  # the page's and the section's own
    assert "&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in text  # shown as text
    single = make_single_search_run(tmp_path / "single")
    text, page = _page(single)
    assert "<script>alert" not in text and "<img" not in text and text.count("<script") == 2
    assert "&lt;/script&gt;&lt;script&gt;alert(1)" in text.split('data-problem="1"', 1)[1]  # question and step text
    _assert_offline(text, page)


def test_caps_on_rows_trees_and_nodes(tmp_path, monkeypatch):
    root = make_single_search_run(tmp_path / "single", problems=7)
    monkeypatch.setattr(search, "MAX_SEARCH_ROWS", 5)
    monkeypatch.setattr(search, "MAX_SEARCH_TREES", 2)
    monkeypatch.setattr(tree, "MAX_TREE_NODES", 4)
    text, page = _page(root)
    problems = page.find("details", **{"class": "sproblem"})
    assert len(problems) == 5 and [p["data-tree"] for p in problems] == ["1", "1", "0", "0", "0"]
    assert "the first 5 of 7 problems (at most 5)" in text and "trees of 2 problems, 3 left out (at most 2 a file)" in text
    assert text.count("tree not embedded (the first 2 trees of a file are)") == 3
    # 4 of 6 nodes: the chosen path 0-1-3-5 first
    assert [n["data-node"] for n in _nodes(page, 0, "0")] == ["0", "1", "3", "5"]
    assert "4 of 6 nodes shown (the chosen path, then breadth-first" in text

    # the size budget: rows stop early, and so do trees
    monkeypatch.setattr(search, "MIN_FILE_BYTES", 0)
    monkeypatch.setattr(search, "MAX_SEARCH_BYTES", 100)
    text, page = _page(root)
    assert len(page.find("details", **{"class": "sproblem"})) == 1 and "the first 1 of 7 problems (size budget)" in text
    monkeypatch.setattr(search, "MAX_SEARCH_BYTES", 10_000_000)
    monkeypatch.setattr(search, "MAX_TREE_BYTES", 10)
    text, page = _page(root)
    assert not page.find("div", **{"class": "tree"}) and "tree not embedded (size budget)" in text


def test_build_tree_handles_orphans_cycles_and_deep_chains():
    t = tree.build_tree([{"id": 1, "parent": 0}, {"id": 2, "parent": 3}, {"id": 3, "parent": 2},
                                  {"id": 4, "parent": 4}, "junk", {"parent": 1}])
    assert t.roots == ["1", "4"] and t.keep == {"1", "4"} and t.total == 4  # 2<->3 is a cycle: never reached
    chain = [{"id": i, "parent": i - 1 if i else None, "chosen": True} for i in range(5000)]
    t = tree.build_tree(chain, cap=2000, max_depth=120)
    assert len(t.keep) == 120
    html_text = tree.render_tree(chain[:300], 0)  # iterative: no recursion limit
    assert html_text.count("<li ") == tree.MAX_TREE_DEPTH


def test_log_ticks_and_linear_fallback():
    assert sweep.log_ticks(100, 10_000) == [100, 1000, 10_000]
    assert sweep.log_ticks(200, 3000) == [200, 500, 1000, 2000]
    assert sweep.log_ticks(310, 900) == [500, 700]
    # tokens within a factor of 3: a linear axis
    series, _ = sweep.sweep_series([{"strategy": "cot", "budget": None, "accuracy": 0.5, "tokens_per_question": 100},
                                            {"strategy": "cot", "budget": 256, "accuracy": 0.6, "tokens_per_question": 200},
                                            {"strategy": "cot", "budget": 512, "accuracy": None}])
    svg, log_x = sweep.sweep_chart_svg(series)
    assert not log_x and "(log scale)" not in svg and "no token budget" in svg


def test_runs_without_search_files_render_as_before(tmp_path):
    for make in (make_rl_run, make_eval_run):
        root = make(tmp_path / make.__name__)
        run = load_run(root)
        assert run.search is None
        text, page = _page(root)
        assert 'id="search"' not in text and "sweep-chart" not in text
        assert text.count("<script") == 1 + ('id="trace-data"' in text)  # the page's JS (+ trace data): no section JS
        assert "[hidden]" not in text  # the section's CSS comes only with it


def test_assets_are_inlined_and_safe(tmp_path):
    css, js = search.assets()
    assert "details.sproblem" in css and "search-file" in js and "innerHTML" not in js
    text, _ = _page(make_single_search_run(tmp_path / "single"))
    assert css in text and js in text
