"""MATH: last-\\boxed extraction, math_verify grading (incl. all 500 MATH-500 golds), threads, loading."""

from __future__ import annotations

import json
import threading

import pytest

from relign.data.readers import DataError
from relign.envs import math as math_task
from relign.envs.tasks import get_task


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{1} no wait \boxed{2}", "2"),  # the last box wins
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not close the group
        (r"\boxed{\left\{ x \right\}}", r"\left\{ x \right\}"),
        (r"\fbox{3}", "3"),
        (r"$\boxed 5$ done", "5"),  # brace-less form
        (r"\boxed  {7}", "7"),
        (r"\boxed{\boxed{5}}", r"\boxed{5}"),  # top-level box; math_verify reads the inner one
        (r"\boxed{2} then \boxed{5", "2"),  # an unclosed box is not an answer
        (r"\boxed{5", None),
        (r"\boxedfoo{3}", None),
        ("no box at all, 42", None),
        (r"\boxed{}", ""),
    ],
)
def test_last_boxed(text, expected):
    assert math_task.last_boxed(text) == expected


@pytest.mark.parametrize(
    "gold, response, correct",
    [
        (r"\frac{1}{2}", r"\boxed{\frac{1}{2}}", True),
        (r"\frac{1}{2}", r"\boxed{0.5}", True),
        (r"0.5", r"\boxed{\frac12}", True),
        (r"\frac{14}{3}", r"\boxed{\dfrac{14}{3}}", True),
        (r"\frac{14}{3}", r"\boxed{4\frac{2}{3}}", True),  # mixed number
        (r"\frac{14}{3}", r"\boxed{\frac{14}{5}}", False),
        (r"\left( 3, \frac{\pi}{2} \right)", r"\boxed{(3, \frac{\pi}{2})}", True),
        (r"\left( 3, \frac{\pi}{2} \right)", r"\boxed{(3, \pi)}", False),
        (r"\text{(C)}", r"\boxed{C}", True),
        (r"\text{(C)}", r"\boxed{\text{(C)}}", True),
        (r"\text{(C)}", r"\boxed{B}", False),
        (r"2\sqrt{5}", r"\boxed{\sqrt{20}}", True),
        (r"\$18.90", r"\boxed{18.9}", True),
        ("10", r"\boxed{10} earlier, finally \boxed{11}", False),  # last box counts
        ("10", "the answer is 10", False),  # unboxed answers do not count
    ],
)
def test_equivalence(gold, response, correct):
    r = math_task.reward("", response, {"answer": gold})
    assert r["score"] == float(correct)
    assert r["components"]["correct"] == float(correct)


def test_format_reward():
    info = {"answer": "3"}
    assert math_task.reward("", r"\boxed{4}", info, format_weight=0.2) == {
        "reward": pytest.approx(0.2),
        "score": 0.0,
        "components": {"correct": 0.0, "format": 1.0},
    }
    assert math_task.reward("", r"\boxed{3}", info, format_weight=0.2)["reward"] == pytest.approx(1.2)
    assert math_task.reward("", "3", info, format_weight=0.2)["components"] == {"correct": 0.0, "format": 0.0}
    assert not math_task.format_ok(r"\boxed{}")
    assert not math_task.format_ok(r"\boxed{3")


def test_all_math500_golds_grade_correct_against_themselves():
    rows = [json.loads(line) for line in open(math_task.DEFAULT_PATH, encoding="utf-8")]
    records = get_task("math500").load()
    assert len(rows) == len(records) == 500
    failed = [
        r["answer"]
        for r, rec in zip(rows, records)
        if math_task.reward(rec["prompt"], f"Reasoning... so the answer is $\\boxed{{{r['answer']}}}$.", rec["extra_info"])["score"] != 1.0
    ]
    assert failed == []  # 500/500 with math-verify 0.9.0 (gold parsed as "$...$")
    # The dataset's own full solutions (several boxes, \fbox, asy code) grade correct too.
    failed = [r["unique_id"] for r, rec in zip(rows, records) if math_task.reward("", r["solution"], rec["extra_info"])["score"] != 1.0]
    assert failed == []


def test_works_outside_the_main_thread():
    # math_verify's signal-based timeout would raise in a thread; we disable it there.
    out = []
    t = threading.Thread(target=lambda: out.append(math_task.reward("", r"\boxed{\dfrac{14}{3}}", {"answer": r"\frac{14}{3}"})))
    t.start()
    t.join()
    assert out[0]["score"] == 1.0


def test_records_and_template():
    rec = get_task("math").load(max_rows=1)[0]
    assert rec["prompt"].startswith("Convert the point $(0,3)$")
    assert rec["prompt"].endswith(r"put your final answer within \boxed{}.")
    assert rec["extra_info"]["answer"] == r"\left( 3, \frac{\pi}{2} \right)"
    assert rec["extra_info"]["level"] == 2 and rec["extra_info"]["subject"] == "Precalculus"


def test_answer_from_solution_and_bad_rows(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"problem": "p", "solution": r"so $\boxed{\frac{a}{b}}$"}) + "\n")
    assert get_task("math").load(str(p))[0]["extra_info"] == {"answer": r"\frac{a}{b}"}
    p.write_text(json.dumps({"problem": "p", "solution": "no box"}) + "\n")
    with pytest.raises(DataError, match="row 1, field 'solution'"):
        get_task("math").load(str(p))
    p.write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n" + json.dumps({"answer": "1"}) + "\n")
    with pytest.raises(DataError, match="row 2, field 'problem': missing"):
        get_task("math").load(str(p))


def test_hub_id(fake_hub):
    rows, calls = fake_hub
    rows[("HuggingFaceH4/MATH-500", None, "test")] = [{"problem": "1+1?", "solution": r"\boxed{2}", "answer": "2", "level": 1}]
    recs = get_task("math").load(math_task.HUB_ID)
    assert calls == [("HuggingFaceH4/MATH-500", None, "test")]
    assert recs[0]["extra_info"] == {"answer": "2", "level": 1}
