"""relign report: one self-contained HTML page per run, for every kind of run directory."""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from relign import report
from relign.cli import main
from relign.report import build_traces, evalview, group_samples, nice_ticks, plan_charts, refresh_report, traces, util, write_report
from relign.tracking import read_metrics

from ..conftest import run_cli, write_jsonl
from ..rl_toy import toy_overrides

EVIL = '</script><script>alert("x")</script><img src=x onerror=alert(1)> & <!-- \u2028'


# --------------------------------------------------------------------------- synthetic run dirs


def _trace(prompt: str, response: str, reward: float, advantage: float, *, finish="stop") -> dict:
    tokens = [response[:3], response[3:]] if len(response) > 3 else [response]
    return {
        "prompt": prompt, "response": response, "reward": reward, "score": float(reward > 0),
        "components": {"lead": reward}, "advantage": advantage, "finish_reason": finish, "length": len(tokens),
        "extra_info": {"answer": "42"}, "tokens": tokens, "token_mask": [1] * len(tokens),
        "logps": [-0.1, float("-inf")][: len(tokens)], "token_advantages": [advantage] * len(tokens),
    }


def make_rl_run(root: Path, steps: int = 3) -> Path:
    """metrics for ``steps`` steps, traces for steps 1 and 2 (step 2 holds a hostile response), in-training eval samples."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text("model:\n  path: tiny:micro\ntask:\n  name: gsm8k\n  path: ''\nrollout:\n  n: 2\n"
                                      "algorithm:\n  advantage: grpo\nmax_steps: 3\n")
    rows = [{"step": 0, "time": 1000.0, "eval/accuracy": 0.1, "eval/pass@4": 0.3, "eval/maj@4": 0.2}]
    for s in range(1, steps + 1):
        rows.append({
            "step": s, "time": 1000.0 + 10 * s, "reward/mean": 0.1 * s, "reward/std": 0.05, "reward/score": 0.1 * s,
            "reward/lead": 0.2 * s, "reward/errors": 0.0, "actor/kl": 0.01 * s, "actor/entropy": 2.0 - 0.1 * s,
            "actor/clip_frac": 0.02 * s, "actor/grad_norm": 1.5 + 0.1 * s, "actor/loss": -0.01 * s, "actor/lr": 1e-6,
            "critic/value_loss": 0.3 / s, "response/length_mean": 10.0 + s, "response/length_max": 20.0,
            "response/truncated_frac": 0.1 * s, "time/rollout_s": 1.0 + 0.1 * s, "time/train_s": 2.0, "time/sync_s": 0.1,
            "perf/tokens_per_s": 1234.5 + s, "rollout/rounds": float(s), "custom/thing": float(s),
            "weird": float("nan") if s == 2 else float(s),
        })
    rows.append({"step": steps, "time": 1000.0 + 10 * steps + 5, "eval/accuracy": 0.4, "eval/pass@4": 0.6, "eval/maj@4": 0.5})
    write_jsonl(root / "metrics.jsonl", rows)
    write_jsonl(root / "rollouts" / "step_1.jsonl", [
        {**_trace("Alpha prompt: what is 6*7?", " 42 is it", 1.0, 0.7), "problem": "what is 6*7?"},
        _trace("Alpha prompt: what is 6*7?", "no idea", 0.0, -0.7, finish="length"),
    ])
    write_jsonl(root / "rollouts" / "step_2.jsonl", [
        _trace("Beta prompt <b>bold</b>?", EVIL, 0.0, -0.5),
        _trace("Beta prompt <b>bold</b>?", " fine answer", 1.0, 0.5),
        _trace("Gamma prompt", " other", 1.0, 0.0),
    ])
    write_jsonl(root / "eval" / "step_0.jsonl", _eval_rows()[:3])
    write_jsonl(root / "eval" / "step_3.jsonl", _eval_rows())  # the latest in-training eval is shown
    return root


def make_sft_run(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text("model:\n  path: tiny:tiny\ndata:\n  path: data.jsonl\npacking: true\n")
    rows = [{"step": 0, "time": 5.0, "data/rows": 512.0, "data/kept": 510.0}]
    rows += [{"step": s, "time": 5.0 + s, "train/loss": 8.0 - s, "train/grad_norm": 2.0 + s / 10, "train/lr": 1e-3 / s,
              "perf/tokens_per_s": 3000.0 + s, "perf/step_seconds": 1.0 / s, "train/epoch_constant": 0.5}
             for s in range(1, 5)]
    rows += [{"step": 4, "time": 10.0, "eval/loss": 5.0}]
    write_jsonl(root / "metrics.jsonl", rows)
    return root


def _eval_rows() -> list[dict]:
    """Rows as relign/evaluate.py writes them: problem 0 all correct, problem 1 voted wrong."""
    rows = []
    for problem in range(2):
        for sample in range(3):
            correct = problem == 0 or sample == 2
            rows.append({"problem": problem, "sample": sample, "prompt": f"Problem {problem}: 40+2?",
                         "response": EVIL if sample == 1 else f"The answer is {42 if correct else 7}",
                         "extracted": "42" if correct else "7", "reward": float(correct), "score": float(correct),
                         "correct": correct, "components": {}, "reward_error": None,
                         "finish_reason": "length" if sample == 1 else "stop", "length": 5, "extra_info": {"answer": "42"},
                         "vote": "42" if correct else "7", "votes": {"42": 3} if problem == 0 else {"7": 2, "42": 1},
                         "majority": "42" if problem == 0 else "7", "majority_correct": problem == 0})
    return rows


def make_eval_run(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text("model:\n  path: tiny:micro\ntask:\n  name: gsm8k\nn: 3\n")
    summary = {"accuracy": 0.5, "pass@3": 1.0, "maj@3": 0.5, "num_problems": 2.0}
    (root / "eval.json").write_text(json.dumps({"model": "tiny:micro", "task": "gsm8k", "n": 3, "k": 3,
                                                "metrics": summary, "notes": [], "seconds": 12.0}))
    write_jsonl(root / "samples.jsonl", _eval_rows())
    write_jsonl(root / "metrics.jsonl", [{"step": 0, "time": 100.0, **{f"eval/{k}": v for k, v in summary.items()}}])
    return root


class Page(HTMLParser):
    """Elements with their attributes, and the text of every <script> block by id."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.scripts: dict[str, str] = {}
        self._script: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        self.elements.append((tag, a))
        if tag == "script":
            self._script = a.get("id", f"script{len(self.scripts)}")
            self.scripts[self._script] = ""

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None

    def handle_data(self, data):
        if self._script is not None:
            self.scripts[self._script] += data

    def find(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        return [a for t, a in self.elements if t == tag and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]

    def charts(self) -> dict[str, dict[str, str]]:
        return {a["data-metric"]: a for a in self.find("figure") if "chart" in a.get("class", "").split()}


def _page(run_dir: Path) -> tuple[str, Page]:
    path = write_report(run_dir)
    assert path == run_dir / "report.html"
    text = path.read_text()
    return text, Page(text)


def _constant_table(text: str) -> dict[str, str]:
    """The "Constant metrics" table of a single-run page: {metric: value as shown}."""
    m = re.search(r'<table class="kv" id="constant-metrics">(.*?)</table>', text)
    return dict(re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", m.group(1))) if m else {}


def assert_every_chart_has_data(run_dir: Path, text: str) -> dict[str, dict[str, str]]:
    """Every chart of the page has a series with two distinct finite values; every metric of
    metrics.jsonl that varies is in a chart, every constant one in the constant table."""
    page = Page(text)
    charts = page.charts()
    assert charts, "no chart on the page"
    for metric, attrs in charts.items():
        series = json.loads(attrs["data-points"])["series"]
        assert all(y is not None and math.isfinite(y) for s in series for y in s["y"]), metric
        assert any(len(set(s["y"])) >= 2 for s in series), (metric, series)
    plotted = {k for a in charts.values() for k in [*a["data-keys"].split(), *a.get("data-band", "").split()]}
    constant = _constant_table(text)
    for key in {k for r in read_metrics(run_dir) for k in r if k not in ("step", "time")}:
        values = [r[key] for r in read_metrics(run_dir) if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if len(set(values)) >= 2:
            assert key in plotted, (key, sorted(plotted))
        elif len(values) >= 2:
            assert key in constant or key in plotted, (key, sorted(constant))  # plotted: beside a metric that varies
        else:
            assert key not in constant  # logged once: in the final metrics
    assert not plotted & constant.keys()
    return charts


def _assert_offline(text: str, page: Page) -> None:
    for _, attrs in page.elements:
        for name in ("src", "href", "action", "data", "poster"):
            assert not re.match(r"\s*(https?:)?//", attrs.get(name, ""), re.I), (name, attrs)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", text, re.I)
    assert "@import" not in text


# --------------------------------------------------------------------------- tests


def test_rl_run_has_named_charts_traces_and_is_offline(tmp_path):
    run = make_rl_run(tmp_path / "rl")
    text, page = _page(run)
    charts = page.charts()
    for key in ("reward/mean", "reward/score", "eval/accuracy", "actor/kl", "actor/entropy", "response/length_mean",
                "actor/clip_frac", "actor/grad_norm", "perf/tokens_per_s", "time/rollout_s", "actor/loss",
                "critic/value_loss", "response/truncated_frac", "custom/thing", "rollout/rounds"):
        assert key in charts, (key, sorted(charts))
    assert charts["reward/mean"]["id"] == "chart-reward"
    assert "reward/lead" in charts["reward/score"]["data-keys"].split()
    assert set(charts["eval/accuracy"]["data-keys"].split()) == {"eval/accuracy", "eval/pass@4", "eval/maj@4"}
    assert set(charts["time/rollout_s"]["data-keys"].split()) == {"time/rollout_s", "time/train_s", "time/sync_s"}
    assert "reward/std" not in charts  # the band
    # a flat line is a number: constant metrics are a table, not a plot
    keys = {k for a in charts.values() for k in a["data-keys"].split()}
    assert not {"reward/errors", "actor/lr"} & keys
    assert _constant_table(text) == {"reward/errors": "0", "actor/lr": "1.000e-06"}
    assert 'class="band"' in text
    # every chart's embedded points are valid JSON and match the metrics
    points = json.loads(charts["reward/mean"]["data-points"])
    assert points["series"][0]["x"] == [1, 2, 3] and points["series"][0]["y"] == pytest.approx([0.1, 0.2, 0.3])
    assert json.loads(charts["weird"]["data-points"])["series"][0]["x"] == [1, 3]  # NaN skipped, not drawn

    facts = page.find("table", id="run-facts")
    assert facts and "tiny:micro" in text and ">rl<" in text and "35.0s" in text  # wall time from metrics timestamps
    assert page.find("details", id="config")

    data = json.loads(page.scripts["trace-data"])  # JSON.parse-able: no NaN/Infinity
    assert [s["step"] for s in data["steps"]] == [1, 2]
    step1 = data["steps"][0]
    assert step1["prompts"] == ["Alpha prompt: what is 6*7?"] and len(step1["rows"]) == 2
    assert step1["problems"] == ["what is 6*7?"]  # the summary line of a prompt, free of chat markup
    row = step1["rows"][0]
    assert row["correct"] is True and row["gold"] == "42" and row["advantage"] == 0.7 and row["logps"] == [-0.1, None]
    assert step1["rows"][1]["finish_reason"] == "length" and step1["rows"][1]["correct"] is False
    assert "".join(data["steps"][1]["rows"][0]["tokens"]) == EVIL  # intact once parsed ...
    assert "Held-out eval samples (step 3, the latest)" in text and len(page.find("details", **{"class": "problem"})) == 2
    _assert_offline(text, page)


def test_untrusted_text_cannot_escape_its_context(tmp_path):
    run = make_rl_run(tmp_path / "rl")
    text, page = _page(run)
    block = text.split('id="trace-data">', 1)[1].split("</script>", 1)[0]
    # ... but inert in the file: the only script blocks are ours, no markup from the run
    assert "<" not in block and ">" not in block and "\u2028" not in block
    assert text.count("<script") == 2 and text.count("</script>") == 2
    assert "<b>bold" not in text and "<img" not in text and "<!-- " not in text
    assert not [a for t, a in page.elements if t == "img"]
    assert "Content-Security-Policy" in text and "default-src 'none'" in text


def test_sft_run_plots_loss_and_omits_traces(tmp_path):
    text, page = _page(make_sft_run(tmp_path / "sft"))
    charts = page.charts()
    assert set(charts["train/loss"]["data-keys"].split()) == {"train/loss", "eval/loss"}
    assert {"train/grad_norm", "perf/tokens_per_s", "train/lr", "perf/step_seconds"} <= charts.keys()
    assert "data/rows" not in charts  # logged once: a number in the summary, not a curve ...
    assert _constant_table(text) == {"train/epoch_constant": "0.5"}  # ... and not a constant either
    assert "trace-data" not in page.scripts and ">sft<" in text
    assert page.find("div", id="final-metrics") and "512" in text


def test_eval_run_has_grid_and_votes(tmp_path):
    text, page = _page(make_eval_run(tmp_path / "eval"))
    assert page.find("table", id="eval-summary") and "metrics/pass@3" in text
    problems = page.find("details", **{"class": "problem"})
    assert [p["data-correct"] for p in problems] == ["3", "1"] and all(p["data-samples"] == "3" for p in problems)
    cells = [a for t, a in page.elements if t == "span" and a.get("class", "").startswith("cell ")]
    assert len([c for c in cells if "correct" in c["class"].split()]) >= 4
    assert any("cut" in c["class"].split() for c in cells)  # truncated samples are marked
    assert "7: 2, 42: 1" in text and ">eval<" in text and "majority <code>7</code> ✗" in text
    assert "gold <code>42</code>" in text  # from extra_info
    assert 'id="metrics"' not in text  # the one-step summary in metrics.jsonl is eval.json's, shown above
    assert "</script><script>alert" not in text
    _assert_offline(text, page)


def test_eval_grid_stops_at_its_size_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(evalview, "MAX_EVAL_BYTES", 100)
    text, page = _page(make_eval_run(tmp_path / "eval"))
    assert len(page.find("details", **{"class": "problem"})) == 1 and "Showing the first 1 of 2 problems" in text


def test_empty_run_and_missing_dir(tmp_path, caplog):
    run = tmp_path / "empty"
    run.mkdir()
    (run / "config.yaml").write_text("model:\n  path: x\n")
    (run / "metrics.jsonl").write_text("")
    text, page = _page(run)
    assert "No metrics logged yet" in text and not page.charts() and text.rstrip().endswith("</html>")
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "nope")
    (tmp_path / "not_a_run").mkdir()
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "not_a_run")
    assert refresh_report(run) == run / "report.html"
    assert refresh_report(tmp_path / "nope") is None  # never raises: a report must not stop a run
    assert "could not write" in caplog.text


def test_demo_run_shows_before_after_and_links_subruns(tmp_path):
    root = tmp_path / "demo"
    make_sft_run(root / "sft")
    make_eval_run(root / "eval_after")
    (root / "demo.json").write_text(json.dumps({"before": {"accuracy": 0.1, "pass@4": 0.2},
                                               "after": {"accuracy": 0.35, "pass@4": 0.5}, "seconds": 61.0}))
    text, page = _page(root)
    assert page.find("table", id="demo-table") and "+0.25" in text and "1m 01s" in text
    assert [a["href"] for a in page.find("a")] == ["eval_after/report.html", "sft/report.html"]
    assert (root / "sft" / "report.html").is_file() and (root / "eval_after" / "report.html").is_file()


def test_trace_caps_and_size_budget(tmp_path, monkeypatch):
    run = tmp_path / "rl"
    for s in range(1, 8):
        write_jsonl(run / "rollouts" / f"step_{s}.jsonl", [_trace(f"p{s}", "x" * 50, 1.0, 0.1)] * 5)
    monkeypatch.setattr(traces, "MAX_TRACE_STEPS", 4)
    monkeypatch.setattr(traces, "MAX_TRACE_ROWS", 3)
    full = build_traces(report.trace_files(run))
    assert [s["step"] for s in full["steps"]] == [4, 5, 6, 7] and full["total_steps"] == 7 and full["token_steps"] == 4
    assert all(len(s["rows"]) == 3 and s["total_rows"] == 5 for s in full["steps"])
    row = full["steps"][0]["rows"][0]
    assert row["tokens"] == ["x" * 3, "x" * 47] and row["response"] == "" and "token_mask" not in row  # all 1: implied

    with_tokens = len(util._json(full["steps"][-1]))
    text_only = len(util._json(report.trace_step(7, [_trace("p7", "x" * 50, 1.0, 0.1)] * 3, 5, token_detail=False)))
    assert text_only < with_tokens
    # room for two steps with tokens, then one more as text
    monkeypatch.setattr(traces, "MAX_TOKEN_BYTES", 2 * with_tokens + 10)
    monkeypatch.setattr(traces, "MAX_TRACE_BYTES", 2 * with_tokens + text_only + 10)
    data = build_traces(report.trace_files(run))
    assert [s["step"] for s in data["steps"]] == [5, 6, 7] and data["token_steps"] == 2
    assert [s["token_detail"] for s in data["steps"]] == [False, True, True]  # the newest keep token detail
    old = data["steps"][0]["rows"][0]
    assert old["tokens"] == [] and old["response"] == "x" * 50 and "logps" not in old
    text, _ = _page(run)
    assert "the last 3 of 7 steps" in text and "token detail for the newest 2" in text

    # a response longer than the token cap keeps its whole text next to the first tokens
    monkeypatch.setattr(traces, "MAX_TOKENS_PER_ROW", 1)
    long = report.trace_row(_trace("p", "x" * 50, 1.0, 0.1), 0)
    assert long["tokens"] == ["xxx"] and long["tokens_cut"] == 1 and long["response"] == "x" * 50


def test_chart_plan_and_ticks():
    named, rest = plan_charts(["reward/mean", "reward/std", "reward/score", "rewards/chosen", "rewards/accuracy",
                               "train/loss", "foo/bar", "foo/baz", "plain"])
    ids = {cid: keys for cid, _, keys, _ in named}
    assert ids["reward"] == ["reward/mean"] and ids["reward-components"] == ["reward/score"]
    assert ids["preference-rewards"] == ["rewards/chosen"] and ids["preference-accuracy"] == ["rewards/accuracy"]
    assert rest == {"foo": ["foo/bar", "foo/baz"], "other": ["plain"]}
    # the names the DPO family, KTO and the reward model log (train/ and eval/ prefixes)
    named, rest = plan_charts(["train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins",
                               "train/rewards/accuracy", "train/accuracy", "eval/rewards/margins", "eval/rewards/accuracy",
                               "train/rewards/desirable", "train/logps/chosen", "train/kl", "perf/pairs_per_s"])
    ids = {cid: keys for cid, _, keys, _ in named}
    assert ids["preference-rewards"] == ["train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins",
                                         "train/rewards/desirable"]
    assert ids["preference-eval-rewards"] == ["eval/rewards/margins"]
    assert ids["preference-accuracy"] == ["train/rewards/accuracy", "train/accuracy", "eval/rewards/accuracy"]
    assert ids["logps"] == ["train/logps/chosen"] and ids["kl"] == ["train/kl"] and ids["pairs-per-s"] == ["perf/pairs_per_s"]
    assert rest == {}
    assert nice_ticks(0, 1) == [0, 0.25, 0.5, 0.75, 1.0]
    assert nice_ticks(-0.03, 0.97) == [0, 0.25, 0.5, 0.75]
    assert nice_ticks(3, 3) == [3]
    assert all(math.isclose(t, round(t, 6)) for t in nice_ticks(0.1, 0.7))


def test_eval_samples_with_other_field_names():
    # without a recorded majority_correct, it is read off the graded samples that gave that answer
    rows = [{k: v for k, v in r.items() if k != "majority_correct"} for r in _eval_rows()]
    assert [p["majority_correct"] for p in group_samples(rows)] == [True, False]
    # one row per problem with a nested list, "question" for the prompt, "score" for correctness
    problems = group_samples([{"id": 7, "question": "Q?", "answer": "4",
                               "samples": [{"text": "4", "pred": "4", "score": 1.0}, {"text": "5", "pred": "5", "score": 0.0}]}])
    (p,) = problems
    assert p["index"] == 7 and p["prompt"] == "Q?" and p["gold"] == "4"
    assert [(s["extracted"], s["correct"]) for s in p["samples"]] == [("4", True), ("5", False)]


def test_report_of_a_real_rl_run_through_the_cli(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run_cli("rl", *toy_overrides(tiny_model_dir, tmp_path, fn="graded"), f"run_dir={run}", "max_steps=2",
            "prompts_per_step=2", "rollout.n=2", "checkpoint.save_every=0", "checkpoint.save_final=false",
            "algorithm.kl=loss", "algorithm.kl_coef=0.05")
    proc = run_cli("report", str(run))
    assert proc.stdout.strip() == f"report: {run / 'report.html'}"
    text = (run / "report.html").read_text()
    page = Page(text)
    assert {"reward/mean", "time/rollout_s", "reward/score"} <= page.charts().keys()
    assert_every_chart_has_data(run, text)  # and actor/kl: a plot if it moved off 0 in 2 steps, else in the table
    # counters that never move in a single-turn run whose reward never fails: numbers, not flat plots
    assert {"reward/errors": "0", "rollout/rounds": "1"}.items() <= _constant_table(text).items()
    data = json.loads(page.scripts["trace-data"])
    assert [s["step"] for s in data["steps"]] == [1, 2] and len(data["steps"][0]["rows"]) == 4
    assert data["steps"][0]["rows"][0]["tokens"] and ">rl<" in text
    _assert_offline(text, page)
    assert main(["report", str(tmp_path / "nope")]) == 2  # in-process: the same CLI, no second interpreter start
    assert "relign report: error: not found" in capsys.readouterr().err


# Short real runs of each recipe through the CLI (3 steps): the charts the recipe's real metric
# names give. The RL recipe is checked above, in test_report_of_a_real_rl_run_through_the_cli.
PAIRS = ["data.max_rows=16", "data.max_length=192", "data.eval_fraction=0.25", "batch_size=4", "micro_batch_size=2",
         "optim.lr=1e-3", "optim.warmup_ratio=0", "optim.schedule=constant"]
REAL_RUNS = {  # name: (command, preset, overrides, named charts the page must have)
    "sft": ("sft", "sft_tiny.yaml", ["data.max_rows=16", "data.max_length=256", "batch_size=4", "micro_batch_size=2"],
            {"chart-loss": "train/loss", "chart-grad-norm": "train/grad_norm", "chart-lr": "train/lr"}),
    # (accuracy is left out here: at step 1 the policy is its reference, and whether a tie of
    # implicit rewards counts as correct is float noise; the plan of its chart is checked above)
    "rm": ("rm", "rm.yaml", PAIRS, {"chart-loss": "train/loss", "chart-preference-rewards": "train/rewards/chosen"}),
    "dpo": ("dpo", "dpo.yaml", PAIRS, {"chart-loss": "train/loss", "chart-preference-rewards": "train/rewards/chosen",
                                       "chart-logps": "train/logps/chosen"}),
    "kto": ("dpo", "kto.yaml", PAIRS, {"chart-loss": "train/loss", "chart-preference-rewards": "train/rewards/desirable"}),
}


@pytest.mark.parametrize("name", list(REAL_RUNS))
def test_every_chart_of_a_real_run_has_data(name, tiny_model_dir, tmp_path):
    command, preset, overrides, expected = REAL_RUNS[name]
    run = tmp_path / name
    # the CLI in-process (as tests/e2e/test_cli_search.py does): the same code path, no second interpreter start
    assert main([command, str(Path(__file__).parents[2] / "examples" / preset), f"model.path={tiny_model_dir}", f"run_dir={run}",
                 *overrides, "max_steps=3", "eval_every=0", "checkpoint.save_every=0", "checkpoint.save_final=false",
                 "logging.tensorboard=false", "logging.progress=false"]) == 0
    text = write_report(run).read_text()
    charts = assert_every_chart_has_data(run, text)
    by_id = {a["id"]: a["data-metric"] for a in charts.values()}
    assert expected.items() <= by_id.items(), by_id
    if name in ("rm", "dpo", "kto"):
        assert "train/lr" in _constant_table(text)  # optim.schedule=constant: a number, not a flat plot
