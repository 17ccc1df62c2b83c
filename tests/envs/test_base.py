"""Reward normalization, loading functions by spec, the task registry and custom tasks."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from relign.data.readers import DataError
from relign.envs.base import Task, load_function, make_custom_task
from relign.envs.reward_fn import RewardResult, normalize_reward
from relign.envs.tasks import TASKS, get_task


def test_normalize_reward_numbers_and_dicts():
    assert normalize_reward(1) == RewardResult(reward=1.0, score=1.0, components={}, error=None)
    assert normalize_reward(0.25) == RewardResult(0.25, 0.25)
    assert normalize_reward(True) == RewardResult(1.0, 1.0)
    assert normalize_reward(Fraction(1, 2)) == RewardResult(0.5, 0.5)
    assert normalize_reward({"reward": 0.5}) == RewardResult(0.5, 0.5)  # score defaults to reward
    r = normalize_reward({"reward": 1.1, "score": 1, "components": {"correct": 1, "format": True}})
    assert r == RewardResult(1.1, 1.0, {"correct": 1.0, "format": 1.0})
    assert all(type(v) is float for v in (r.reward, r.score, *r.components.values()))


@pytest.mark.parametrize("bad", [None, "1.0", [1.0], {"score": 1.0}, {"reward": "x"}, {"reward": 1, "components": [1]}, {"reward": 1, "extra": 2}])
def test_normalize_reward_rejects_other_types(bad):
    with pytest.raises(TypeError, match="reward"):
        normalize_reward(bad)


def test_normalize_reward_rejects_nan():
    with pytest.raises(ValueError, match="finite"):
        normalize_reward(float("nan"))
    with pytest.raises(ValueError, match="finite"):
        normalize_reward({"reward": 1.0, "components": {"c": float("inf")}})


REWARD_FILE = """
CALLS = []

def exact(prompt, response, extra_info, bonus=0.0):
    return float(response.strip() == extra_info["answer"]) + bonus

class Graders:
    @staticmethod
    def length(prompt, response, extra_info):
        return {"reward": len(response), "score": 0.0}

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def reward_file(tmp_path):
    p = tmp_path / "my_reward.py"
    p.write_text(REWARD_FILE)
    return p


def test_load_function_from_file_and_module(reward_file):
    fn = load_function(f"{reward_file}:exact")
    assert fn("", " 42 ", {"answer": "42"}) == 1.0 and fn("", "41", {"answer": "42"}, bonus=0.5) == 0.5
    assert load_function(f"{reward_file}:exact") is fn  # the file is loaded once per process
    assert load_function(f"{reward_file}:Graders.length")("", "abc", {}) == {"reward": 3, "score": 0.0}
    from relign.envs import gsm8k

    assert load_function("relign.envs.gsm8k:reward") is gsm8k.reward


def test_load_function_errors_name_the_spec(reward_file, tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match=f"'{missing}:f'.*file not found"):
        load_function(f"{missing}:f")
    with pytest.raises(ValueError, match="'.*my_reward.py:missing'.*no attribute 'missing'"):
        load_function(f"{reward_file}:missing")
    with pytest.raises(TypeError, match="NOT_A_FUNCTION' is a int"):
        load_function(f"{reward_file}:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="cannot import module 'relign.envs.nope'"):
        load_function("relign.envs.nope:reward")
    with pytest.raises(ValueError, match="no attribute 'nope'"):
        load_function("relign.envs.gsm8k:nope")
    with pytest.raises(ValueError, match="expected 'path/to/file.py:function'"):
        load_function("relign.envs.gsm8k")


def test_registry_and_get_task():
    assert set(TASKS) >= {"gsm8k", "math", "math500", "countdown", "custom"}
    t = get_task("gsm8k", format_weight=0.1)
    assert isinstance(t, Task) and t.name == "gsm8k"
    assert (t.reward_spec, t.reward_kwargs, t.format_weight) == ("relign.envs.gsm8k:reward", {"format_weight": 0.1}, 0.1)
    assert t.reward("", "#### 3", {"answer": "3"})["reward"] == pytest.approx(1.1)
    assert get_task("math500").reward_spec == get_task("math").reward_spec == "relign.envs.math:reward"
    assert get_task("countdown").reward_spec == "relign.envs.countdown:reward"
    with pytest.raises(ValueError, match="unknown task 'gsm9k'.*gsm8k"):
        get_task("gsm9k")


def test_get_task_by_factory_spec(tmp_path):
    p = tmp_path / "tasks.py"
    p.write_text("from relign.envs.gsm8k import task\n\ndef make(**kw):\n    return task(**kw)\n\ndef not_a_task():\n    return 1\n")
    assert get_task(f"{p}:make", format_weight=0.5).format_weight == 0.5
    with pytest.raises(TypeError, match="returned int, not a Task"):
        get_task(f"{p}:not_a_task")


def test_custom_task(reward_file, tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [
        {"prompt": "What is 6*7?", "answer": "42"},
        {"prompt": "What is 2+2?", "extra_info": {"answer": "4"}, "ignored": 1},
        {"prompt": [{"role": "user", "content": "Say hi"}], "answer": "hi"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = make_custom_task(str(data), f"{reward_file}:exact", reward_kwargs={"bonus": 0.5})
    recs = t.load()
    assert recs[0] == {"prompt": "What is 6*7?", "extra_info": {"answer": "42"}}
    assert recs[1] == {"prompt": "What is 2+2?", "extra_info": {"answer": "4"}}
    # a message-list prompt stays a conversation
    assert recs[2] == {"messages": [{"role": "user", "content": "Say hi"}], "extra_info": {"answer": "hi"}}
    assert t.reward(recs[0]["prompt"], "42", recs[0]["extra_info"]) == 1.5
    # a template over any field, as chat with a system prompt, through the registry
    t = get_task("custom", data_path=str(data), reward_fn_spec=f"{reward_file}:exact", template="Q: {prompt}\nA:", chat=True, system_prompt="S")
    recs = t.load(max_rows=1)
    assert recs[0]["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q: What is 6*7?\nA:"}]
    # a bad spec fails when the task is made, not mid-training
    with pytest.raises(ValueError, match="no attribute 'nope'"):
        make_custom_task(str(data), f"{reward_file}:nope")
    # a bad row names file, row and field
    data.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"question": "no prompt"}) + "\n")
    with pytest.raises(DataError, match="data.jsonl, row 2, field 'prompt': missing"):
        make_custom_task(str(data), f"{reward_file}:exact").load()


def test_raw_prompt_with_system_prompt_and_braces():
    t = get_task("math", system_prompt="You are a careful mathematician.")
    rec = t.load(max_rows=1)[0]
    assert rec["prompt"].startswith("You are a careful mathematician.\n\nConvert the point")
    assert rec["prompt"].endswith(r"\boxed{}.")  # literal braces survive templating
