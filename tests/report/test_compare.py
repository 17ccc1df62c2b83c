"""relign report RUN_A RUN_B ...: one page overlaying the runs' charts; the report command; no import cycle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relign.report import PALETTE, refresh_after_run, write_compare
from relign.report.command import main
from relign.report.compare import run_labels

from ..conftest import REPO, run_cli, write_jsonl
from .test_report import Page, _assert_offline, make_sft_run

HOSTILE_NAME = 'x<img src=y onerror="alert(1)">'


def make_run(root: Path, rows: list[dict], recipe: str = "sft") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(f"recipe: {recipe}\nmodel:\n  path: tiny:{root.parent.name}\n")
    write_jsonl(root / "metrics.jsonl", rows)
    return root


def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    """Two runs with the same directory name (a/exp, b/exp), numbers chosen to be read back:

    a: train/loss 8, 6, 4 and eval/loss 7, 5 at steps 2, 3; lr 1e-3 throughout; tokens/s 100, 110, 120;
       timestamps 100..120 -> 20 s of wall time
    b: train/loss 9, 5, 2; lr 5e-4 throughout; tokens/s 200 throughout (a flat line beside a's
       rising one); eval/accuracy 0.1, 0.3 at steps 1, 3 (b only); timestamps 0..30 -> 30 s
    """
    a = make_run(tmp_path / "a" / "exp", [
        {"step": s, "time": 100.0 + 10 * (s - 1), "train/loss": loss, "train/lr": 1e-3, "perf/tokens_per_s": tps}
        for s, loss, tps in ((1, 8.0, 100.0), (2, 6.0, 110.0), (3, 4.0, 120.0))
    ] + [{"step": 2, "time": 111.0, "eval/loss": 7.0}, {"step": 3, "time": 120.0, "eval/loss": 5.0}])
    b = make_run(tmp_path / "b" / "exp", [
        {"step": s, "time": t, "train/loss": loss, "train/lr": 5e-4, "perf/tokens_per_s": 200.0}
        for s, t, loss in ((1, 0.0, 9.0), (2, 5.0, 5.0), (3, 30.0, 2.0))
    ] + [{"step": 1, "time": 1.0, "eval/accuracy": 0.1}, {"step": 3, "time": 30.0, "eval/accuracy": 0.3}])
    return a, b


def _series(chart: dict[str, str]) -> list[dict]:
    return json.loads(chart["data-points"])["series"]


def _table_rows(page: Page, text: str, table_id: str) -> dict[str, list[str]]:
    """{row name: cells} of a table of the page (plain text cells)."""
    import re

    body = text.split(f'id="{table_id}"', 1)[1].split("</table>", 1)[0]
    rows = {}
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body):
        cells = re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row)
        if cells:
            rows[cells[0]] = cells[1:]
    return rows


# --------------------------------------------------------------------------- the page


def test_comparison_overlays_the_charts_one_colour_per_run(tmp_path):
    a, b = two_runs(tmp_path)
    path = write_compare([a, b])
    assert path == a / "compare.html" and not (a / "report.html").exists()  # the run's own page stays its own
    text = path.read_text()
    page = Page(text)
    charts = {a_["id"]: a_ for a_ in page.find("figure") if "chart" in a_.get("class", "").split()}

    # the loss chart: both runs' train/loss, a's eval/loss; a colour per run, a dash per metric
    loss = charts["chart-loss"]
    assert json.loads(loss["data-runs"]) == ["a/exp", "b/exp"] and loss["data-keys"] == "train/loss eval/loss"
    assert [(s["key"], s["color"], s["x"], s["y"]) for s in _series(loss)] == [
        ("a/exp: train/loss", PALETTE[0], [1, 2, 3], [8, 6, 4]),
        ("a/exp: eval/loss", PALETTE[0], [2, 3], [7, 5]),
        ("b/exp: train/loss", PALETTE[1], [1, 2, 3], [9, 5, 2]),
    ]
    svg = text.split('id="chart-loss"', 1)[1].split("</svg>", 1)[0]
    assert svg.count('stroke-dasharray="6 3"') == 1  # eval/loss, the chart's second metric

    # one metric a chart: the series are named by run; b's flat line stays beside a's rising one
    tps = charts["chart-tokens-per-s"]
    assert [(s["key"], s["color"], s["y"]) for s in _series(tps)] == [
        ("a/exp", PALETTE[0], [100, 110, 120]), ("b/exp", PALETTE[1], [200, 200, 200])]
    # a metric only b logged: b keeps its colour
    acc = charts["chart-eval-accuracy"]
    assert json.loads(acc["data-runs"]) == ["b/exp"] and [(s["key"], s["color"]) for s in _series(acc)] == [("b/exp", PALETTE[1])]
    # constant in every run: no chart, a row of the constant table with each run's value
    assert "chart-lr" not in charts
    assert _table_rows(page, text, "constant-metrics")["train/lr"] == ["0.001", "5.000e-04"]

    # the legend names each run directory, in its colour
    legend = page.find("li", **{"class": "key"})
    assert [li["data-run"] for li in legend] == ["a/exp", "b/exp"]
    assert f"<code>{a}</code>" in text and f"<code>{b}</code>" in text
    # the summary compares final metrics and wall time
    summary = _table_rows(page, text, "compare-summary")
    assert summary["wall time"] == ["20.0s", "30.0s"] and summary["steps logged"] == ["3", "3"]
    assert summary["train/loss"] == ["4", "2"] and summary["eval/accuracy"] == ["—", "0.3"]
    assert summary["recipe"] == ["sft", "sft"] and summary["model"] == ["tiny:a", "tiny:b"]
    assert summary["run directory"] == [str(a), str(b)]
    # one self-contained page: the page's own script, no trace data, nothing loaded
    assert text.count("<script") == 1 and "default-src 'none'" in text
    _assert_offline(text, page)


def test_every_chart_of_a_comparison_has_a_run_that_varies(tmp_path):
    a, b = two_runs(tmp_path)
    c = make_sft_run(tmp_path / "c")  # a third run, with keys of its own (perf/step_seconds, train/grad_norm)
    text = write_compare([a, b, c], tmp_path / "out" / "cmp.html").read_text()
    charts = Page(text).charts()
    assert {"train/loss", "perf/tokens_per_s", "train/grad_norm", "perf/step_seconds"} <= charts.keys()
    for metric, chart in charts.items():
        assert any(len(set(s["y"])) >= 2 for s in _series(chart)), metric
    assert [s["color"] for s in _series(charts["train/grad_norm"])] == [PALETTE[2]]  # c is the third run


def test_run_names_are_escaped_and_told_apart(tmp_path):
    assert run_labels([Path("/r/a/exp"), Path("/r/b/exp"), Path("/r/a/other")]) == ["a/exp", "b/exp", "a/other"]  # one depth for all
    assert run_labels([Path("/x/one"), Path("/y/two")]) == ["one", "two"]
    a, _ = two_runs(tmp_path)
    evil = make_run(tmp_path / HOSTILE_NAME, [{"step": s, "train/loss": float(s)} for s in (1, 2)])
    text = write_compare([a, evil]).read_text()
    page = Page(text)
    assert not [attrs for tag, attrs in page.elements if tag == "img"] and "<img" not in text
    assert json.loads(page.charts()["train/loss"]["data-runs"]) == ["exp", HOSTILE_NAME]  # intact once parsed


# --------------------------------------------------------------------------- the command


def test_command_writes_the_comparison_where_asked(tmp_path, capsys):
    a, b = two_runs(tmp_path)
    assert main([str(a), str(b)]) == 0
    assert capsys.readouterr().out == f"report: {a / 'compare.html'}\n"
    out = tmp_path / "new" / "dir" / "both.html"
    assert main([str(a), "--out", str(out), str(b)]) == 0 and out.is_file()
    assert 'id="compare-summary"' in out.read_text()
    folder = tmp_path / "folder"
    folder.mkdir()
    assert main([str(a), str(b), f"--out={folder}"]) == 0 and (folder / "compare.html").is_file()
    # one run: its report.html, or the page at --out
    assert main([str(b)]) == 0 and (b / "report.html").is_file()
    assert main([str(b), "--out", str(folder)]) == 0 and 'id="run-facts"' in (folder / "report.html").read_text()
    capsys.readouterr()
    assert main(["--help"]) == 0 and "--out PATH" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["{a}", "{tmp}/nope"], "not found: {tmp}/nope (no such run directory)"),
    (["{a}", "{tmp}/empty"], "not a run directory (no config.yaml or metrics.jsonl): {tmp}/empty"),
    (["{a}", "--colour"], "unknown option --colour (see relign report --help)"),
    (["{a}", "--out"], "--out needs a PATH"),
    (["{a}", "{b}", "--out", "x.html", "--out", "y.html"], "--out given twice"),
    (["{a}", "{a}/"], "the same run directory twice: {a}/"),
])
def test_command_errors_are_one_line(tmp_path, capsys, args, message):
    a, b = two_runs(tmp_path)
    (tmp_path / "empty").mkdir()
    fill = {"a": a, "b": b, "tmp": tmp_path}
    assert main([x.format(**fill) for x in args]) == 2
    err = capsys.readouterr().err
    assert err == f"relign report: error: {message.format(**fill)}\n"
    assert not (a / "compare.html").exists()
    assert main([]) == 2 and "usage: relign report" in capsys.readouterr().err


def test_relign_report_compares_through_the_real_cli(tmp_path):
    a, b = two_runs(tmp_path)
    out = tmp_path / "cmp.html"
    proc = run_cli("report", str(a), str(b), "--out", str(out))
    assert proc.stdout == f"report: {out}\n"
    assert json.loads(Page(out.read_text()).charts()["train/loss"]["data-runs"]) == ["a/exp", "b/exp"]
    proc = run_cli("report", str(a), str(tmp_path / "nope"), check=False)
    assert proc.returncode == 2 and proc.stderr == f"relign report: error: not found: {tmp_path / 'nope'} (no such run directory)\n"


# --------------------------------------------------------------------------- refresh and the import cycle


def test_refresh_after_run_never_raises_and_writes_on_the_first_rank_only(tmp_path, monkeypatch, caplog):
    run = make_sft_run(tmp_path / "sft")
    assert refresh_after_run(run) == run / "report.html" and "train/loss" in (run / "report.html").read_text()
    assert refresh_after_run(tmp_path / "nope") is None and "could not write" in caplog.text
    (run / "report.html").unlink()
    monkeypatch.setenv("RANK", "1")  # torchrun's rank 1, once the CLI has torn the process group down
    assert refresh_after_run(run) is None and not (run / "report.html").exists()


def test_low_level_modules_do_not_import_the_report(tmp_path):
    # a tracker closing and a checkpoint being saved used to refresh report.html themselves
    # (checkpoint -> report -> tracking -> report): now the CLI does it once the run has ended
    code = f"""
import sys
import torch
from relign import checkpoint, config, tracking
tracker = tracking.Tracker({str(tmp_path)!r}, total_steps=1, progress=False, tensorboard=False)
tracker.log(1, {{"train/loss": 1.0}})
tracker.close()


class Model:  # what save_checkpoint needs of a model: save_pretrained
    def save_pretrained(self, path, safe_serialization=True, state_dict=None):
        from safetensors.torch import save_file
        save_file({{"w": torch.zeros(2)}}, str(path / "model.safetensors"))


checkpoint.save_checkpoint({str(tmp_path)!r}, 1, model=Model())
print(sorted(m for m in sys.modules if m.startswith("relign.report")))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
    assert (tmp_path / "metrics.jsonl").is_file() and not (tmp_path / "report.html").exists()
