"""The reliability diagram of ``relign eval scorer=reader``: accuracy against stated confidence per bin,
the diagonal, the bin counts and the abstentions apart, first on the eval's report.html.

The run is written here as ``relign eval`` writes it (eval.json, samples.jsonl rows with ``reader``);
the bins, their accuracies and the ECE are worked out by this file's own code from the rows."""

from __future__ import annotations

import json
import random
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from relign.report import write_report

from ..conftest import write_jsonl

SVG = "{http://www.w3.org/2000/svg}"


def calibration_rows(n_answered: int = 1200, n_abstain: int = 37, seed: int = 0) -> list[dict]:
    """Samples spread over all 10 bins (counts of 3 digits in most) plus ``n_abstain`` with no answer
    (confidence 1 and wrong, as the reader scores them)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n_answered + n_abstain):
        if i < n_answered:
            c = round(rng.random(), 3)
            ok = float(rng.random() < c * 0.8)
            reader = {"confidence": c, "correct": ok, "no_answer": False, "forecast": c}
            text = f"Ryde with {c * 100:.1f}% likelihood."
        else:
            reader = {"confidence": 1.0, "correct": 0.0, "no_answer": True, "forecast": 0.0}
            text = "No Answer"
        rows.append({"problem": i, "sample": 0, "prompt": "Which town?", "question": "Which town?", "response": text,
                     "reward": reader["correct"], "correct": bool(reader["correct"]), "finish_reason": "stop", "length": 6,
                     "extra_info": {"question": "Which town?", "answer": "Ryde", "aliases": []}, "reader": reader})
    return rows


def make_calibration_eval_run(root: Path, rows: list[dict] | None = None) -> Path:
    rows = calibration_rows() if rows is None else rows
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text("model:\n  path: tiny:micro\ntask:\n  name: lc\nscorer: reader\n")
    conf, ok = [r["reader"]["confidence"] for r in rows], [r["reader"]["correct"] for r in rows]
    summary = {"accuracy": sum(ok) / len(rows), "calib/ece": expected_ece(conf, ok), "num_problems": float(len(rows))}
    (root / "eval.json").write_text(json.dumps({"model": "tiny:micro", "task": "lc", "n": 1, "k": 1, "metrics": summary,
                                                "notes": [], "seconds": 1.0}))
    write_jsonl(root / "samples.jsonl", rows)
    write_jsonl(root / "metrics.jsonl", [{"step": 0, "time": 100.0, **{f"eval/{k}": v for k, v in summary.items()}}])
    return root


def bins_of(conf, ok, bins=10):
    """{bin: (count, mean confidence, accuracy)} of the non-empty equal-width bins (1.0 in the last)."""
    out = {}
    for b in range(bins):
        idx = [i for i, c in enumerate(conf) if min(int(c * bins), bins - 1) == b]
        if idx:
            out[b] = (len(idx), sum(conf[i] for i in idx) / len(idx), sum(ok[i] for i in idx) / len(idx))
    return out


def expected_ece(conf, ok):
    return sum(n / len(conf) * abs(a - c) for n, c, a in bins_of(conf, ok).values())


def _svg_of_page(text: str) -> ET.Element:
    start = text.index('<svg class="reliability"')
    return ET.fromstring(text[start:text.index("</svg>", start) + 6])


def _check_diagram(svg: ET.Element, rows: list[dict], ns: str = "") -> None:
    answered = [r["reader"] for r in rows if not r["reader"]["no_answer"]]
    expect = bins_of([g["confidence"] for g in answered], [g["correct"] for g in answered])
    rects = list(svg.iter(f"{ns}rect"))
    bars = [r for r in rects if r.get("class") == "rd-bar"]
    counts = [r for r in rects if r.get("class") == "rd-count"]
    assert len(bars) == len(counts) == len(expect) == 10
    # the panel's height in px, from all bars (each height is rounded to 0.1 px)
    full = sum(float(b.get("height")) for b in bars) / sum(float(b.get("data-accuracy")) for b in bars)
    for bar, count, (k, (n, c, a)) in zip(bars, counts, sorted(expect.items())):
        assert float(bar.get("data-lo")) == pytest.approx(k / 10) and int(bar.get("data-count")) == n
        assert float(bar.get("data-accuracy")) == pytest.approx(a, abs=1e-12)
        assert float(bar.get("data-confidence")) == pytest.approx(c, abs=1e-12)
        assert float(bar.get("height")) == pytest.approx(full * a, abs=0.1)  # drawn to scale (one decimal of a pixel)
        assert int(count.get("data-count")) == n
    dots = [c for c in svg.iter(f"{ns}circle") if c.get("class") == "rd-dot"]
    assert sorted(float(d.get("data-confidence")) for d in dots) == pytest.approx(sorted(c for _, c, _ in expect.values()))
    abstain = [r for r in rects if r.get("class") == "rd-abstain"]
    assert [int(r.get("data-count")) for r in abstain] == [len(rows) - len(answered)]
    assert len([e for e in svg.iter(f"{ns}line") if e.get("class") == "rd-diagonal"]) == 1
    title = "".join(next(t for t in svg.iter(f"{ns}text") if t.get("class") == "rd-title").itertext())
    # the title's ECE is over every sample, the abstentions at confidence 1 and wrong
    ece_all = expected_ece([r["reader"]["confidence"] for r in rows], [r["reader"]["correct"] for r in rows])
    assert f"ECE {ece_all:.3f} over {len(rows)} samples, {len(rows) - len(answered)} without an answer" in title


def test_eval_report_opens_with_the_reliability_diagram(tmp_path):
    rows = calibration_rows()
    text = write_report(make_calibration_eval_run(tmp_path / "eval", rows)).read_text()
    main = text[text.index("<main>") + len("<main>"):]
    assert main.startswith('<section id="reliability">'), main[:200]
    assert main.index('id="reliability"') < main.index('id="summary"') < main.index('id="eval"')
    assert text.count('<svg class="reliability"') == 1  # not again in the eval section
    _check_diagram(_svg_of_page(text), rows)


def test_standalone_file_is_the_same_diagram(tmp_path):
    from relign.report.reliability import reliability_svg

    rows = calibration_rows(300, 5, seed=1)
    g = [r["reader"] for r in rows]
    text = reliability_svg([x["confidence"] for x in g], [x["correct"] for x in g], [x["no_answer"] for x in g],
                           standalone=True)
    assert text.startswith('<svg xmlns="http://www.w3.org/2000/svg"')
    _check_diagram(ET.fromstring(text), rows, ns=SVG)


def test_a_training_run_and_a_plain_eval_have_no_diagram(tmp_path):
    from .test_report import make_eval_run

    text = write_report(make_eval_run(tmp_path / "plain")).read_text()
    assert 'id="reliability"' not in text and "Reliability diagram" not in text
