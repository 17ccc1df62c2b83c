"""task.name=reasoning_gym: records regenerate reasoning-gym's entries, the reward is its own grader."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import sys
import time
from collections import Counter

import pytest

rg = pytest.importorskip("reasoning_gym")

from relign.envs import reasoning_gym as rgt  # noqa: E402
from relign.envs.tasks import build_task, get_task  # noqa: E402
from relign.errors import ConfigError  # noqa: E402

CHEAP = ["chain_sum", "leg_counting", "basic_arithmetic", "gcd", "lcm", "letter_counting", "spell_backward",
         "count_bits", "base_conversion", "prime_factorization"]


def _task(**rg_opts):
    return get_task("reasoning_gym", chat=False, rg={"system_prompt": "", **rg_opts})


def test_records_are_deterministic_in_the_seed_and_differ_across_seeds():
    t = _task(datasets={"chain_sum": 1.0, "gcd": 1.0})
    a, b, c = t.load(max_rows=20, seed=5), t.load(max_rows=20, seed=5), t.load(max_rows=20, seed=6)
    assert a == b
    assert [r["prompt"] for r in a] != [r["prompt"] for r in c]


@pytest.mark.parametrize("name", CHEAP)
def test_the_regenerated_entry_is_the_original(name):
    """The record names (dataset, config, seed, size, index); the entry built from that, in a
    fresh dataset object made here, is the one the question came from."""
    records = _task(datasets={name: 1.0}).load(max_rows=6, seed=11)
    direct = rg.create_dataset(name, seed=11, size=6)
    for i, rec in enumerate(records):
        original = direct[i]
        ref = rec["extra_info"]["rg"]
        assert ref == {"dataset": name, "config": {}, "seed": 11, "size": 6, "index": i}
        assert rec["prompt"] == original["question"]
        assert rec["extra_info"]["answer"] == original["answer"]
        assert rgt.entry(ref) == original


def test_generator_options_travel_with_the_record():
    cfg = {"min_terms": 4, "max_terms": 4, "min_digits": 1, "max_digits": 1}
    (rec,) = _task(config={"chain_sum": cfg}).load(max_rows=1, seed=2)
    assert rec["extra_info"]["rg"]["config"] == cfg
    assert rec["prompt"] == rg.create_dataset("chain_sum", seed=2, size=1, **cfg)[0]["question"]
    assert rgt.entry(rec["extra_info"]["rg"])["metadata"]["num_terms"] == 4


def test_extra_info_survives_json():
    records = _task(datasets={"chain_sum": 1.0, "leg_counting": 1.0}).load(max_rows=8, seed=0)
    for rec in records:
        back = json.loads(json.dumps(rec["extra_info"]))
        assert back == rec["extra_info"]
        assert rgt.entry(back["rg"]) == rgt.entry(rec["extra_info"]["rg"])


def test_the_mix_draws_as_reasoning_gyms_composite_dataset():
    """The same question per index as reasoning-gym's own CompositeDataset, and dataset shares near
    the weights (600 draws at 1:2:3: each share within 4.5 standard deviations of w_k / 6)."""
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    weights = {"chain_sum": 1.0, "gcd": 2.0, "count_bits": 3.0}
    n = 600
    records = _task(datasets=weights).load(max_rows=n, seed=9)
    composite = CompositeDataset(CompositeConfig(size=n, seed=9, datasets=[DatasetSpec(k, w, {}) for k, w in weights.items()]))
    assert [r["prompt"] for r in records] == [composite[i]["question"] for i in range(n)]
    counts = Counter(r["extra_info"]["rg"]["dataset"] for r in records)
    for name, w in weights.items():
        p = w / 6
        assert abs(counts[name] / n - p) <= 4.5 * (p * (1 - p) / n) ** 0.5, counts


# ---- the reward: reasoning-gym's own score_answer on the extracted answer


def _own_score(name: str, response: str, entry: dict) -> float:
    """reasoning-gym's grade of a response, from its own functions only."""
    return rg.get_score_answer_fn(name)(rg.utils.extract_answer(response), entry)


@pytest.mark.parametrize("template, hand", [
    ("thinking... <answer>{a}</answer>", 1.0),                    # exact
    ("<answer>The answer is {a}</answer>", None),                  # partial credit: oracle inside a longer answer
    ("the answer is {a}", 0.0),                                    # no tag
    ("<answer>{a}", 0.0),                                          # malformed: no closing tag
    ("<answer>9**9**9**9</answer>", 0.0),                          # a tower of powers is text, never evaluated
    ("<answer>1</answer> then <answer>{a}</answer>", 1.0),         # the last tag counts
])
def test_reward_is_reasoning_gyms_own_score(template, hand):
    t = _task(datasets={"chain_sum": 1.0}, score_threshold=1.0)
    rec = t.load(max_rows=3, seed=4)[2]
    entry = rg.create_dataset("chain_sum", seed=4, size=3)[2]
    response = template.replace("{a}", entry["answer"])
    expected = _own_score("chain_sum", response, entry)
    if hand is None:
        hand = len(entry["answer"]) / len(f"The answer is {entry['answer']}")  # rg's partial credit: |oracle| / |answer|
        assert 0 < hand < 1
    assert expected == pytest.approx(hand)
    out = t.reward(rec["prompt"], response, rec["extra_info"])
    assert out["reward"] == pytest.approx(expected)
    assert out["components"] == {"rg": pytest.approx(expected), "format": float("</answer>" in response and "<answer>" in response)}
    assert out["score"] == float(expected >= 1.0)


def test_score_thresholds_the_graded_value_and_countdown_partial_credit():
    t = _task(datasets={"countdown": 1.0}, score_threshold=0.05)
    rec = t.load(max_rows=1, seed=0)[0]
    entry = rg.create_dataset("countdown", seed=0, size=1)[0]
    for response in ("<answer>1 + 1</answer>", "<answer>not math</answer>", f"<answer>{entry['answer']}</answer>"):
        expected = _own_score("countdown", response, entry)
        out = t.reward(rec["prompt"], response, rec["extra_info"])
        assert out["reward"] == pytest.approx(expected)
        assert out["score"] == float(expected >= 0.05)
    assert t.reward(rec["prompt"], f"<answer>{entry['answer']}</answer>", rec["extra_info"])["score"] == 1.0


def test_boxed_answer_format():
    t = _task(datasets={"chain_sum": 1.0}, answer_format="boxed")
    rec = t.load(max_rows=1, seed=1)[0]
    a = rec["extra_info"]["answer"]
    assert t.reward("", f"so \\boxed{{{a}}}", rec["extra_info"])["score"] == 1.0
    assert t.reward("", f"<answer>{a}</answer>", rec["extra_info"])["score"] == 0.0
    assert t.answer_marker == "\\boxed" and t.extract_answer(f"\\boxed{{{a}}}", rec["extra_info"]) == a


def test_majority_vote_and_search_hooks():
    t = _task()
    assert t.answer_marker == "</answer>"
    assert t.extract_answer("x <answer> 12 </answer>", {}) == "12"
    assert t.extract_answer("no tag", {}) is None
    assert t.answers_equal("12", "12") and not t.answers_equal("12", "13")


def test_hostile_answers_score_zero_fast():
    t = _task()
    rec = t.load(max_rows=1, seed=0)[0]
    t0 = time.perf_counter()
    for response in ("<answer>" + "9" * 1_000_000 + "</answer>", "<answer>" + "(" * 100_000 + "</answer>",
                     "<answer>" * 50_000):
        out = t.reward("", response, rec["extra_info"])
        assert out["reward"] == 0.0 and out["score"] == 0.0
    assert time.perf_counter() - t0 < 5


def _graders_calling_eval() -> set[str]:
    """The installed package's datasets whose score_answer calls eval(), found by reading their source."""
    root = pathlib.Path(rg.__file__).parent
    found = set()
    for name, (cls, _) in rg.factory.DATASETS.items():
        src = pathlib.Path(sys.modules[cls.__module__].__file__)
        assert root in src.parents
        tree = ast.parse(src.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
                for fn in node.body:
                    if isinstance(fn, ast.FunctionDef) and fn.name == "score_answer":
                        if any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "eval"
                               for c in ast.walk(fn)):
                            found.add(name)
    return found


def test_no_grader_executes_the_models_answer(monkeypatch):
    assert _graders_calling_eval() <= set(rgt.GRADERS_WITH_EVAL)
    monkeypatch.delenv("RELIGN_PWNED", raising=False)
    payload = "__import__('os').environ.__setitem__('RELIGN_PWNED', '1')"
    for name in rgt.GRADERS_WITH_EVAL:
        t = _task(datasets={name: 1.0})
        rec = t.load(max_rows=1, seed=0)[0]
        assert t.reward("", f"<answer>{payload}</answer>", rec["extra_info"])["reward"] == 0.0
    assert "RELIGN_PWNED" not in os.environ
    # the literal path still grades: string_insertion gives 0.1 for the answer as a list of characters
    t = _task(datasets={"string_insertion": 1.0})
    rec = t.load(max_rows=1, seed=0)[0]
    as_list = str(list(rec["extra_info"]["answer"]))
    assert t.reward("", f"<answer>{as_list}</answer>", rec["extra_info"])["reward"] == pytest.approx(0.1)


# ---- errors: one line


def test_unknown_dataset_names_the_closest():
    with pytest.raises(ConfigError) as e:
        _task(datasets={"chain_summ": 1.0})
    msg = str(e.value)
    assert "\n" not in msg and "'chain_summ'" in msg and "chain_sum" in msg.split("did you mean")[1]


def test_options_typed_as_enums_are_given_as_text():
    """YAML has no enums: aiw's task_types [siblings] (and word_sorting's transformation) reach the
    generator as its own enum members; without that, aiw failed on 'str' has no attribute 'value'."""
    from reasoning_gym.logic.aiw import TaskType

    cfg = {"task_types": ["siblings"], "task_type_weights": [1.0]}
    records = _task(datasets={"aiw": 1.0}, config={"aiw": cfg}).load(max_rows=12, seed=3)
    theirs = rg.create_dataset("aiw", seed=3, size=12, task_types=[TaskType.SIBLINGS], task_type_weights=[1.0])
    assert [r["prompt"] for r in records] == [theirs[i]["question"] for i in range(12)]
    assert all("sisters does" in r["prompt"] for r in records)  # the siblings templates only
    for r in records:  # the reward rebuilds the entry from the record's text options too
        graded = _task(datasets={"aiw": 1.0}, config={"aiw": cfg}).reward(r["prompt"], f"<answer>{r['extra_info']['answer']}</answer>",
                                                                       r["extra_info"])
        assert graded["score"] == 1.0
    with pytest.raises(ConfigError, match=r"task\.rg\.config\.aiw\.task_types=\['sibling'\]: expected a list of siblings") as e:
        _task(datasets={"aiw": 1.0}, config={"aiw": {"task_types": ["sibling"]}}).load(max_rows=2)
    assert "\n" not in str(e.value)
    (rec,) = _task(datasets={"word_sorting": 1.0}, config={"word_sorting": {"transformation": "uppercase"}}).load(max_rows=1)
    words = rgt.entry(rec["extra_info"]["rg"])["metadata"]["transformed_words"]
    assert words == [w.upper() for w in words] and rec["extra_info"]["answer"].isupper()


def test_rejected_generator_options_are_one_line():
    with pytest.raises(ConfigError, match=r"task\.rg\.config\.chain_sum=.*max_terms") as e:
        _task(config={"chain_sum": {"min_terms": 5, "max_terms": 2}}).load(max_rows=2)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unexpected keyword argument 'bogus'"):
        _task(config={"chain_sum": {"bogus": 1}}).load(max_rows=2)
    with pytest.raises(ConfigError, match="answer_format"):
        _task(answer_format="xml")


def test_a_missing_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now raises ImportError
    with pytest.raises(ConfigError) as e:
        build_task("reasoning_gym")
    assert str(e.value) == 'task.name=reasoning_gym needs the reasoning-gym package: pip install "relign[reasoning-gym]"'


def test_system_prompt_default_and_override():
    t = get_task("reasoning_gym", chat=True, rg={})
    (rec,) = t.load(max_rows=1)
    assert rec["messages"][0] == {"role": "system", "content": rg.utils.SYSTEM_PROMPTS["default"]}
    t = get_task("reasoning_gym", chat=True, system_prompt="Be brief.", rg={})
    assert t.load(max_rows=1)[0]["messages"][0]["content"] == "Be brief."
    t = get_task("reasoning_gym", chat=True, rg={"system_prompt": ""})
    assert [m["role"] for m in t.load(max_rows=1)[0]["messages"]] == ["user"]


def test_generators_that_reseed_numpy_leave_the_trainers_streams_alone():
    """pool_matrix seeds NumPy's global generator with seed + index: building its records (training
    and held-out, whose seed must fit np.random.seed's 32 bits) and rebuilding an entry in the reward
    leave Python's and NumPy's global streams exactly where they were."""
    import random

    import numpy as np

    t = _task(datasets={"pool_matrix": 1.0})
    random.seed(11)
    np.random.seed(11)
    before = (random.getstate(), np.random.get_state()[1].copy())
    train = t.load(max_rows=4, seed=3)
    heldout, _ = t.load_heldout(max_rows=4, seed=3, train_rows=4)
    out = t.reward(train[0]["prompt"], "<answer>1 2</answer>", train[0]["extra_info"])
    assert len(train) == 4 and len(heldout) >= 1 and 0.0 <= out["reward"] <= 1.0
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
