"""The verifier's data builder: graded samples from relign's own outputs -> Yes/No chat rows."""

from __future__ import annotations

import pytest

from relign.data.readers import DataError
from relign.models.reward import VERIFIER_TEMPLATE
from relign.recipes.verifier import build_verifier_rows, graded_samples, verifier_metrics

from ..conftest import write_jsonl


def test_graded_samples_read_rl_traces_eval_samples_and_files(tmp_path):
    rl = tmp_path / "rl"
    write_jsonl(rl / "rollouts" / "step_2.jsonl", [{"problem": "p2", "prompt": "<x>p2", "response": "r", "score": 0.0}])
    write_jsonl(rl / "rollouts" / "step_10.jsonl", [{"problem": "p10", "prompt": "<x>p10", "response": "r", "score": 1.0}])
    ev = tmp_path / "eval"
    write_jsonl(ev / "samples.jsonl", [{"problem": 0, "question": "q", "prompt": "<x>q", "response": "a", "correct": True,
                                        "score": 1.0}])
    f = write_jsonl(tmp_path / "plain.jsonl", [{"question": "q2", "solution": "s", "label": False}])
    got = graded_samples([str(rl), str(f)])
    # steps in numeric order (2 before 10); the problem text is preferred to the chat-rendered prompt
    assert got == [{"problem": "p2", "response": "r", "correct": False}, {"problem": "p10", "response": "r", "correct": True},
                   {"problem": "q2", "response": "s", "correct": False}]
    # an eval run's `problem` is its index: the question text is read instead
    assert graded_samples([str(ev)]) == [{"problem": "q", "response": "a", "correct": True}]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"problem": 3, "response": "a", "correct": True}])
    with pytest.raises(DataError, match="row 1, field 'problem'"):
        graded_samples([str(bad)])
    with pytest.raises(FileNotFoundError):
        graded_samples([str(tmp_path / "nothing")])


def test_build_rows_dedupes_caps_and_balances():
    samples = [{"problem": "p", "response": f"r{i}", "correct": i == 0} for i in range(5)]
    samples += [{"problem": "p", "response": "r1 ", "correct": False}]  # a repeat (up to whitespace)
    samples += [{"problem": "q", "response": "s", "correct": True}]
    rows = build_verifier_rows(samples, balance=False)
    assert len(rows) == 6
    rows = build_verifier_rows(samples, balance=False, max_per_problem=2)
    assert [r["response"] for r in rows] == ["r0", "r1", "s"]
    rows = build_verifier_rows(samples, balance=True, seed=0)
    assert sum(r["correct"] for r in rows) == 2 and len(rows) == 4
    r = rows[0]
    assert r["messages"][0]["content"] == VERIFIER_TEMPLATE.replace("{problem}", r["problem"]).replace("{solution}", r["response"])
    assert r["messages"][1] == {"role": "assistant", "content": "Yes" if r["correct"] else "No"}


def test_verifier_metrics_by_hand():
    # decisions p > 0.5: [yes, no, yes, no] vs labels [T, T, F, F] -> right on 1st and 4th: 2/4
    m = verifier_metrics([0.9, 0.2, 0.6, 0.1], [True, True, False, False])
    assert m["accuracy"] == 0.5
    assert m["p_yes_correct"] == pytest.approx(0.55) and m["p_yes_incorrect"] == pytest.approx(0.35)
