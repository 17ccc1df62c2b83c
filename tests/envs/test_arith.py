"""The synthetic arithmetic task: deterministic generation, disjoint splits, exact grading."""

from __future__ import annotations

import json
import random

import pytest

from relign.data.readers import DataError
from relign.envs import arith
from relign.envs.safe_arith import evaluate
from relign.envs.tasks import get_task

INFO = {"answer": 9}  # 7 + 5 - 3


def score(response: str, info=INFO) -> float:
    return arith.reward("Compute 7 + 5 - 3.", response, info)["score"]


@pytest.mark.parametrize(
    "response, correct",
    [
        ("7+5=12, 12-3=9. #### 9", True),
        ("#### 9", True),  # a bare answer counts when it is right
        ("#### 9.", True),  # a closing period is fine
        ("####9\n", True),
        ("7+5=12, 12-3=8. #### 8", False),  # a slip in the steps: wrong answer
        ("#### 9 #### 10", False),  # the last #### counts
        ("#### 10 #### 9", True),
        ("#### -9", False),
        ("7+5=12, 12-3=9.", False),  # no #### (no fallback to the last number)
        ("#### nine", False),
        ("#### 9 apples", False),  # only a period and whitespace may follow
        ("#### 9.5", False),
        ("#### 09x", False),
        ("", False),
    ],
)
def test_reward_on_hand_written_answers(response, correct):
    assert score(response) == float(correct)


def test_reward_negative_answers_and_components():
    assert score("#### -3", {"answer": -3}) == 1.0
    assert score("#### 3", {"answer": -3}) == 0.0
    out = arith.reward("", "#### 9", INFO, format_weight=0.1)
    assert out == {"reward": 1.1, "score": 1.0, "components": {"correct": 1.0, "format": 1.0}}
    out = arith.reward("", "#### 9 #### 9", INFO, format_weight=0.1)  # right answer, but two markers: no format bonus
    assert out["components"] == {"correct": 1.0, "format": 0.0}
    assert arith.reward("", "9", INFO, format_weight=0.1)["reward"] == 0.0


def test_final_answer_for_voting():
    assert arith.final_answer("1+2=3. #### 3") == "3"
    assert arith.final_answer("#### -04") == "-4"  # canonical integers, so string equality is equality
    assert arith.final_answer("no answer") is None


def test_problems_are_deterministic_and_correct():
    a = arith.make_splits(300, 50, seed=3)
    b = arith.make_splits(300, 50, seed=3)
    assert a == b
    assert arith.make_splits(300, 50, seed=4) != a
    train, test = a
    assert len(train) == 300 and len(test) == 50
    for p in train + test:
        assert evaluate(p["expression"]) == p["answer"]  # left to right == precedence with only + and -
        n_ops = p["expression"].count(" + ") + p["expression"].count(" - ")
        assert 2 <= n_ops <= 3
        assert all(1 <= int(t) <= 9 for t in p["expression"].split()[::2])


def test_test_set_is_held_out_and_stable():
    train, test = arith.make_splits(1000, 100, seed=0)
    exprs = [p["expression"] for p in train + test]
    assert len(set(exprs)) == len(exprs)  # no problem in both splits (nor twice in one)
    # the test set does not depend on how many training problems are drawn
    assert arith.make_splits(10, 100, seed=0)[1] == test


def test_shape_options_and_limits():
    train, _ = arith.make_splits(50, 10, seed=0, min_ops=4, max_ops=4, max_operand=3)
    assert all(p["expression"].count(" ") == 8 for p in train)  # 5 operands, 4 operators
    with pytest.raises(ValueError, match="distinct problems"):
        arith.make_splits(100, 100, min_ops=1, max_ops=1, max_operand=3)  # only 18 exist
    with pytest.raises(ValueError, match="min_ops"):
        arith.make_splits(10, 10, min_ops=3, max_ops=2)


def test_solution_is_worked_left_to_right_and_graded_correct():
    assert arith.solution("7 + 5 - 3") == "7+5=12, 12-3=9. #### 9"
    assert arith.solution("2 - 9 + 1") == "2-9=-7, -7+1=-6. #### -6"
    rng = random.Random(0)
    for _ in range(200):
        p = arith.make_problem(rng)
        assert score(arith.solution(p["expression"]), {"answer": p["answer"]}) == 1.0


def test_write_splits_files_and_direct_share(tmp_path):
    paths = arith.write_splits(tmp_path, 400, 40, seed=1, direct_frac=0.5)
    read = lambda name: [json.loads(line) for line in paths[name].read_text().splitlines()]  # noqa: E731
    train, test, sft = read("train"), read("test"), read("sft")
    assert (train, test) == tuple(map(list, arith.make_splits(400, 40, seed=1)))
    assert [r["prompt"] for r in sft] == [f"Compute {p['expression']}." for p in train]
    direct = [r for r in sft if r["response"].startswith("####")]
    assert 0.4 < len(direct) / len(sft) < 0.6
    for r, p in zip(sft, train):  # every demonstration is right, bare or worked
        assert score(r["response"], {"answer": p["answer"]}) == 1.0
    # the share of bare answers does not change the problems; the same seed gives the same files
    other = arith.write_splits(tmp_path / "b", 400, 40, seed=1, direct_frac=0.0)
    assert other["train"].read_text() == paths["train"].read_text()
    assert not any(json.loads(line)["response"].startswith("####") for line in other["sft"].read_text().splitlines())
    again = arith.write_splits(tmp_path / "c", 400, 40, seed=1, direct_frac=0.5)
    assert again["sft"].read_text() == paths["sft"].read_text()


def test_task_by_spec_loads_records(tmp_path):
    paths = arith.write_splits(tmp_path, 20, 5, seed=0)
    task = get_task("relign.envs.arith:task", chat=True)
    records = task.load(str(paths["test"]))
    assert len(records) == 5
    first = json.loads(paths["test"].read_text().splitlines()[0])
    assert records[0]["messages"] == [{"role": "user", "content": f"Compute {first['expression']}."}]
    assert records[0]["extra_info"]["answer"] == first["answer"]
    assert task.reward("", f"#### {first['answer']}", records[0]["extra_info"])["score"] == 1.0
    assert task.extract_answer("#### 12", {}) == "12"
    raw = get_task("relign.envs.arith:task", chat=False).load(str(paths["test"]))
    assert raw[0]["prompt"] == f"Compute {first['expression']}."


def test_rows_without_answer_and_bad_rows(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"expression": "4 - 9 + 2"}) + "\n")
    assert arith.task().load(str(good))[0]["extra_info"]["answer"] == -3  # computed by safe_arith
    for row, field in [
        ({"expression": "1 + 2", "answer": 4}, "answer"),  # a wrong stored answer is a data error
        ({"expression": "__import__('os')"}, "expression"),  # never eval'd
        ({"expression": "7 / 2"}, "expression"),  # not an integer
        ({"answer": 3}, "expression"),
        ({"expression": "1 + 2", "answer": "three"}, "answer"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(row) + "\n")
        with pytest.raises(DataError) as e:
            arith.task().load(str(bad))
        assert e.value.field == field and e.value.row == 1
