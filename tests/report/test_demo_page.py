"""The demo's page (RUN/report.html of ``relign demo``): it opens with the GRPO reward curve, the
held-out accuracy over the GRPO steps and a before/after bar chart, drawn from the run's files.

The run directories here are written as relign/recipes/demo.py writes them (``_evaluate``:
eval_before/ and eval_after/eval.json with "metrics", "greedy_metrics" and "demo_table";
``_write_summary``: demo.json with before/after = those demo_tables; rl/metrics.jsonl from the
GRPO stage, with eval/* on the rows of the steps RL evaluated). The expected points are
computed here from those files, not from the report's code.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from relign.report import CSP, write_report

N = 8  # eval samples per problem
STEPS = 30


def _eval_json(out: Path, accuracy: float, greedy: float, pass_n: float, maj_n: float, worked: float) -> dict:
    """eval_*/eval.json as the demo's ``_evaluate`` writes it; returns its demo_table."""
    metrics = {"accuracy": accuracy, "pass@1": accuracy, f"pass@{N}": pass_n, f"maj@{N}": maj_n, "length_mean": 30.5,
               "length_max": 60.0, "truncated_frac": 0.0, "num_problems": 200.0}
    greedy_metrics = {"accuracy": greedy, "pass@1": greedy, "length_mean": 28.0}
    table = {k: metrics[k] for k in ("accuracy", f"pass@{N}", f"maj@{N}", "length_mean", "length_max", "truncated_frac")}
    table |= {"greedy_accuracy": greedy, "greedy_length_mean": 28.0, "worked_frac": worked, "worked_accuracy": 0.91}
    out.mkdir(parents=True)
    (out / "eval.json").write_text(json.dumps({
        "model": "x", "task": "relign.envs.arith:task", "data": "data/test.jsonl", "n": N, "temperature": 1.0, "seed": 0,
        "max_new_tokens": 64, "metrics": metrics, "greedy_metrics": greedy_metrics, "demo_table": table}, indent=2))
    (out / "samples.jsonl").write_text(json.dumps({"prompt": "Compute 1 + 2.", "response": "1+2=3. #### 3", "score": 1.0}) + "\n")
    return table


def make_demo_run(root: Path, eval_steps: tuple[int, ...]) -> Path:
    """A demo run of STEPS GRPO steps whose RL stage evaluated at ``eval_steps``."""
    before = _eval_json(root / "eval_before", 0.5531, 0.56, 0.98, 0.825, 0.479)
    after = _eval_json(root / "eval_after", 0.9337, 0.975, 0.99, 0.9749, 0.997)
    rows = []
    for s in range(1, STEPS + 1):
        mean = round(0.35 + 0.015 * s + 0.04 * ((s * 7) % 5) / 5, 6)  # a rising, wobbly curve
        row = {"step": s, "time": 1000.0 + s, "reward/mean": mean, "reward/std": 0.4, "reward/score": mean,
               "reward/correct": mean, "response/length_mean": 20.0 + s, "actor/loss": -0.01, "time/step_s": 0.3}
        if s in eval_steps:
            # RL's eval at the last step is the same eval of the same weights as eval_after's
            acc = 0.9337 if s == STEPS else round(0.6 + 0.011 * s, 4)
            row |= {"eval/accuracy": acc, f"eval/pass@{N}": 0.99, f"eval/maj@{N}": 0.95, "time/eval_s": 0.9}
        rows.append(row)
    rl = root / "rl"
    rl.mkdir(parents=True)
    (rl / "config.yaml").write_text(f"max_steps: {STEPS}\n")
    (rl / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "demo.json").write_text(json.dumps({
        "before": before, "after": after, "seconds": 284.0, "stage_seconds": {"sft": 178.0, "rl": 100.0},
        "eval": {"problems": 200, "samples": N, "temperature": 1.0, "accuracy": "..."},
        "model": "tiny:shallow", "task": "arith", "seed": 0, "device": "cpu", "engine": "hf"}, indent=2))
    return root


class Elements(HTMLParser):
    """Every start tag in document order, with its attributes."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}))


def _figures(text: str) -> list[tuple[str, str]]:
    """(id, inner markup) of every <figure class="chart">, in document order."""
    return re.findall(r'<figure class="chart" id="([^"]+)"[^>]*>(.*?)</figure>', text, re.S)


def _path_points(svg: str) -> list[tuple[float, float]]:
    d = re.search(r'<path class="line"[^>]* d="M([^"]+)"', svg).group(1)
    return [tuple(map(float, p.split(","))) for p in d.split(" L")]


def _check_line(fig_attrs: dict[str, str], svg: str, want_x: list[float], want_y: list[float]) -> None:
    """The chart's points (data-points, for the hover readout) are the expected numbers, and the
    drawn line goes through them: at the right steps, higher on the page where the value is higher."""
    geometry = json.loads(fig_attrs["data-points"])
    (series,) = geometry["series"]
    assert series["x"] == want_x
    assert series["y"] == pytest.approx(want_y, rel=1e-5)
    drawn = _path_points(svg)
    x0, x1, left, width = geometry["x0"], geometry["x1"], geometry["left"], geometry["width"]
    assert [px for px, _ in drawn] == pytest.approx([left + (x - x0) / (x1 - x0) * width for x in want_x], abs=0.06)
    for i in range(len(want_y)):
        for j in range(len(want_y)):
            if want_y[i] > want_y[j]:
                assert drawn[i][1] < drawn[j][1]  # SVG y grows downwards


def _render(root: Path) -> tuple[str, list[tuple[str, dict[str, str]]]]:
    text = write_report(root).read_text()
    return text, Elements(text).elements


@pytest.mark.parametrize("eval_steps", [(10, 20, 30), (5, 10, 15, 20, 25, 30)])
def test_demo_page_leads_with_reward_accuracy_and_before_after_charts(tmp_path, eval_steps):
    root = make_demo_run(tmp_path / "demo", eval_steps)
    text, elements = _render(root)

    # the first three charts, in this order, come before any table
    figures = [(i, a) for i, (t, a) in enumerate(elements) if t == "figure"]
    assert [a["id"] for _, a in figures[:3]] == ["chart-demo-reward", "chart-demo-accuracy", "chart-demo-bars"]
    first_table = next(i for i, (t, _) in enumerate(elements) if t == "table")
    assert figures[2][0] < first_table
    assert text.index('id="demo-charts"') < text.index('id="summary"') < text.index('id="demo-table"')
    markup = dict(_figures(text))

    # 1. reward/mean per GRPO step, from rl/metrics.jsonl (reward/score is the same number: not drawn twice)
    rows = [json.loads(line) for line in (root / "rl" / "metrics.jsonl").read_text().splitlines()]
    _check_line(figures[0][1], markup["chart-demo-reward"],
                [float(r["step"]) for r in rows], [r["reward/mean"] for r in rows])
    assert figures[0][1]["data-keys"] == "reward/mean"

    # 2. held-out accuracy: eval_before at step 0, RL's evals, eval_after at the last step
    before = json.loads((root / "eval_before" / "eval.json").read_text())
    after = json.loads((root / "eval_after" / "eval.json").read_text())
    want = [(0.0, before["metrics"]["accuracy"])]
    want += [(float(r["step"]), r["eval/accuracy"]) for r in rows if "eval/accuracy" in r and r["step"] < STEPS]
    want += [(float(STEPS), after["metrics"]["accuracy"])]
    _check_line(figures[1][1], markup["chart-demo-accuracy"], [x for x, _ in want], [y for _, y in want])
    assert markup["chart-demo-accuracy"].count('class="dot"') == len(want) == len(eval_steps) + 1

    # 3. before/after bars: accuracy T=1, greedy, pass@n, maj@n, worked answers
    bars = [a for t, a in elements if t == "rect" and a.get("class") == "bar"]
    got = {(b["data-label"], b["data-group"]): float(b["data-value"]) for b in bars}
    want_bars = {}
    for group, doc in (("before GRPO", before), ("after GRPO", after)):
        want_bars |= {("accuracy T=1", group): doc["metrics"]["accuracy"], ("greedy", group): doc["greedy_metrics"]["accuracy"],
                      (f"pass@{N}", group): doc["metrics"][f"pass@{N}"], (f"maj@{N}", group): doc["metrics"][f"maj@{N}"],
                      ("worked answers", group): doc["demo_table"]["worked_frac"]}
    assert got == want_bars
    assert [b["data-label"] for b in bars[::2]] == ["accuracy T=1", "greedy", f"pass@{N}", f"maj@{N}", "worked answers"]
    heights = [float(b["height"]) / float(b["data-value"]) for b in bars]
    assert max(heights) - min(heights) < 0.01 * max(heights)  # bar height proportional to its value, from 0

    # then the tables and the sub-run links, as before
    assert re.search(r'<table class="kv" id="demo-table">', text)
    hrefs = [a["href"] for t, a in elements if t == "a"]
    assert hrefs == ["eval_after/report.html", "eval_before/report.html", "rl/report.html"]


def test_demo_page_without_evals_during_grpo_still_draws_before_and_after(tmp_path):
    root = make_demo_run(tmp_path / "demo", eval_steps=())  # demo.eval_every=0
    text, elements = _render(root)
    figures = [a for t, a in elements if t == "figure"]
    assert [a["id"] for a in figures[:3]] == ["chart-demo-reward", "chart-demo-accuracy", "chart-demo-bars"]
    before = json.loads((root / "eval_before" / "eval.json").read_text())["metrics"]["accuracy"]
    after = json.loads((root / "eval_after" / "eval.json").read_text())["metrics"]["accuracy"]
    markup = dict(_figures(text))
    _check_line(figures[1], markup["chart-demo-accuracy"], [0.0, float(STEPS)], [before, after])
    assert "No held-out eval during GRPO" in markup["chart-demo-accuracy"]


def test_demo_page_draws_reward_score_where_it_differs_and_stays_self_contained(tmp_path):
    root = make_demo_run(tmp_path / "demo", eval_steps=(15, 30))
    path = root / "rl" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r["reward/score"] = round(r["reward/mean"] - 0.1, 6)  # a format weight: reward = score + format bonus
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text, elements = _render(root)
    reward = next(a for t, a in elements if t == "figure")
    assert reward["data-keys"] == "reward/mean reward/score"
    assert [s["y"] for s in json.loads(reward["data-points"])["series"]][1] == pytest.approx([r["reward/score"] for r in rows])
    # one file: the report's CSP, nothing loaded from anywhere
    assert f'content="{CSP}"' in text
    assert not any(a.get("src") for _, a in elements)
    assert not any(a.get("href", "").startswith(("http:", "https:", "//")) for _, a in elements)


def test_demo_page_of_a_run_without_a_grpo_stage_says_so(tmp_path):
    root = tmp_path / "demo"
    (root / "demo.json").parent.mkdir(parents=True)
    (root / "demo.json").write_text(json.dumps({"before": {"accuracy": 0.1}, "after": {"accuracy": 0.3},
                                               "eval": {"samples": 1, "problems": 5}}))
    text, elements = _render(root)
    assert "No GRPO reward curve" in text and "No held-out accuracy curve" in text
    bars = [a for t, a in elements if t == "rect" and a.get("class") == "bar"]
    assert [(b["data-label"], float(b["data-value"])) for b in bars] == [("accuracy T=1", 0.1), ("accuracy T=1", 0.3)]
