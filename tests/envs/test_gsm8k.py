"""GSM8K: answer extraction, number normalization, grading on real rows, format reward, loading."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from relign.data.readers import DataError
from relign.envs import gsm8k
from relign.envs.tasks import get_task


@pytest.mark.parametrize(
    "response, expected",
    [
        ("#### 72", Decimal(72)),
        ("She pays 3 * 24 = 72 dollars.\n#### 72", Decimal(72)),
        ("#### 1,234", Decimal(1234)),
        ("The total is $1,234.00.", Decimal(1234)),  # no ####: last number; $, commas, .00, trailing period
        ("#### -10", Decimal(-10)),
        ("#### \u22123", Decimal(-3)),  # U+2212 minus sign
        ("He lost -$5 on it", Decimal(-5)),
        ("#### $18", Decimal(18)),
        ("####72", Decimal(72)),
        ("#### 1,450,000", Decimal(1450000)),
        ("It is 5.0", Decimal("5.0")),
        ("The answer is 18.", Decimal(18)),
        ("10-5", Decimal(5)),  # subtraction, not the number -5
        ("x = 10 - 5 = 5", Decimal(5)),
        ("answer: 1,2,3", Decimal(3)),  # a list, not 123
        ("It was 7 and then 9", Decimal(9)),  # no ####: the last number
        ("#### 42\nbut wait, 13 apples", Decimal(42)),  # #### wins over later numbers
        ("First 5\n#### 6\nthen #### 7", Decimal(7)),  # the last ####
        ("It is 18.\n#### ", Decimal(18)),  # #### without a number: fall back to the last number
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_answer(response, expected):
    assert gsm8k.extract_answer(response) == expected


def test_reward_numeric_comparison():
    info = {"answer": "1234"}
    assert gsm8k.reward("", "#### 1234", info)["score"] == 1.0
    assert gsm8k.reward("", "#### 1,234.00", info)["score"] == 1.0
    assert gsm8k.reward("", "so $1,234", info)["score"] == 1.0
    assert gsm8k.reward("", "#### 1235", info)["score"] == 0.0
    assert gsm8k.reward("", "#### 1234.001", info)["score"] == 0.0  # exact within 1e-6 only
    assert gsm8k.reward("", "#### 5.0", {"answer": "5"})["score"] == 1.0
    assert gsm8k.reward("", "#### -3", {"answer": "-3"})["score"] == 1.0
    assert gsm8k.reward("", "#### 3", {"answer": "-3"})["score"] == 0.0
    assert gsm8k.reward("", "I don't know", info)["score"] == 0.0


def test_format_reward_and_weight():
    info = {"answer": "72"}
    # correct and well formatted: 1 + 0.1 * 1
    assert gsm8k.reward("", "3 * 24 = 72\n#### 72", info, format_weight=0.1) == {
        "reward": pytest.approx(1.1),
        "score": 1.0,
        "components": {"correct": 1.0, "format": 1.0},
    }
    # correct by the last-number fallback but no "####": 1 + 0.1 * 0
    r = gsm8k.reward("", "The answer is 72", info, format_weight=0.1)
    assert (r["reward"], r["score"], r["components"]) == (1.0, 1.0, {"correct": 1.0, "format": 0.0})
    # wrong but well formatted: 0 + 0.1 * 1; score stays the correctness
    r = gsm8k.reward("", "#### 71", info, format_weight=0.1)
    assert (r["reward"], r["score"]) == (pytest.approx(0.1), 0.0)
    assert gsm8k.format_ok("#### 72")
    assert not gsm8k.format_ok("#### 72\n#### 72")  # twice
    assert not gsm8k.format_ok("#### seventy-two")
    assert not gsm8k.format_ok("72")


def test_real_rows_grade_against_their_own_answer():
    """The gold "#### N" of real rows (incl. commas and negatives) grades correct against itself."""
    rows = [json.loads(line) for line in open(gsm8k.DEFAULT_PATH, encoding="utf-8")]
    assert len(rows) == 1319
    records = get_task("gsm8k").load()
    assert len(records) == 1319
    # the first row, a row with thousands commas, a negative one
    picked = [0, 1] + [i for i, r in enumerate(rows) if "#### 1,450,000" in r["answer"] or "#### -10" in r["answer"]]
    assert len(picked) == 4
    for i in picked:
        solution, info = rows[i]["answer"], records[i]["extra_info"]
        assert gsm8k.reward(records[i]["prompt"], solution, info)["score"] == 1.0, rows[i]["answer"][-30:]
        wrong = solution.rsplit("####", 1)[0] + f"#### {Decimal(info['answer']) + 1}"
        assert gsm8k.reward(records[i]["prompt"], wrong, info)["score"] == 0.0
    assert records[0]["extra_info"] == {"answer": "18"}
    assert records[picked[2]]["extra_info"]["answer"] in ("1450000", "-10")
    # every gold answer of the file grades correct when written as "#### <gold>"
    assert all(gsm8k.reward("", r["answer"], rec["extra_info"])["score"] == 1.0 for r, rec in zip(rows, records))


def test_prompt_template_and_chat():
    rec = get_task("gsm8k").load(max_rows=1)[0]
    assert rec["prompt"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert rec["prompt"].endswith('as "#### <number>".')
    rec = get_task("gsm8k", chat=True, system_prompt="Be brief.").load(max_rows=1)[0]
    assert rec["messages"][0] == {"role": "system", "content": "Be brief."}
    assert rec["messages"][1]["role"] == "user" and "#### <number>" in rec["messages"][1]["content"]


def test_bad_row_names_file_row_and_field(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps({"question": "q", "answer": "no final"}) + "\n")
    with pytest.raises(DataError) as e:
        get_task("gsm8k").load(str(p))
    assert (e.value.row, e.value.field) == (2, "answer") and "bad.jsonl" in str(e.value)
    p.write_text(json.dumps({"answer": "#### 1"}) + "\n")
    with pytest.raises(DataError, match="row 1, field 'question': missing"):
        get_task("gsm8k").load(str(p))


def test_hub_id_with_config(fake_hub):
    rows, calls = fake_hub
    rows[("openai/gsm8k", "main", "train")] = [{"question": "1+1?", "answer": "1+1=2\n#### 2"}]
    recs = get_task("gsm8k").load(gsm8k.HUB_ID, split="train")
    assert calls == [("openai/gsm8k", "main", "train")]
    assert recs[0]["extra_info"] == {"answer": "2"} and recs[0]["prompt"].startswith("1+1?\n")
