"""relign lc-data: summary distillation rows; frequency_summary's percentages."""

from __future__ import annotations

import json

from relign.envs.calibration import frequency_summary
from relign.envs.reader_rules import RuleReader

from ..conftest import run_cli, write_jsonl


def test_frequency_summary_names_every_answer_and_sums_to_100():
    samples = ["Rome", "Rome", "Oslo", "the Rome", "Bern", "Oslo", "rome.", "Oslo"]  # Rome x4, Oslo x3, Bern x1 (normalized)
    s = frequency_summary("q", samples)
    # 50, 37.5 -> 38, 12.5 -> 12: largest remainder, ties to the first
    assert s == "I think it is Rome with 50% likelihood, Oslo with 38%, Bern with 12%."
    # the rule reader reads the summary back: every answer, summing to 1
    r = RuleReader()
    assert r.extract(["q"], [s]) == [["Rome", "Oslo", "Bern"]]
    assert sum(r.forecast(["q"] * 3, [s] * 3, ["rome", "the Oslo", "BERN"])) == 1.0
    assert frequency_summary("q", ["", "  "]) == "No Answer"
    three = frequency_summary("q", ["x", "y", "z"])
    assert three == "I think it is x with 34% likelihood, y with 33%, z with 33%."


def test_lc_data_rows_are_accepted_by_sft(tiny_model_dir, tmp_path):
    rows = write_jsonl(tmp_path / "lc.jsonl", [
        {"paragraph_generation_prompt": f"Write about topic {i}.", "question": f"Q{i}?", "answer": f"A{i}"} for i in range(3)])
    out = tmp_path / "sft.jsonl"
    run_cli("lc-data", str(tiny_model_dir), str(rows), "--k", "4", "--max-new-tokens", "4", "--out", str(out), "--device", "cpu")
    made = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["prompt"] for m in made] == [f"Write about topic {i}." for i in range(3)]
    assert all(isinstance(m["completion"], str) and m["completion"] for m in made)
    proc = run_cli("sft", f"model.path={tiny_model_dir}", f"data.path={out}", f"run_dir={tmp_path / 'run'}", "batch_size=2",
                   "micro_batch_size=2", "data.eval_fraction=0", "--dry-run")
    assert "3 rows read" in proc.stdout + proc.stderr
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Write.", "question": "Q?"}])
    proc = run_cli("lc-data", str(tiny_model_dir), str(bad), "--out", str(tmp_path / "x.jsonl"), check=False)
    assert proc.returncode != 0 and "bad.jsonl" in proc.stderr and "answer" in proc.stderr
