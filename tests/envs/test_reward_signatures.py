"""Reward functions in both signatures (relign's per-sample, TRL's batched), what they may return,
loud failures, and reward files that do not load."""

from __future__ import annotations

import logging

import pytest

from relign.config import ConfigError
from relign.envs.base import load_function, make_custom_task
from relign.envs.reward_fn import RewardResult, detect_reward_style
from relign.envs.rewards import RewardPool
from relign.envs.tasks import build_task

REWARDS = '''
import time


def per_sample(prompt, response, extra_info, weight=1.0):
    return {"reward": weight * float(response == extra_info.get("answer")), "score": float(response == extra_info.get("answer")),
            "components": {"chars": float(len(response))}}


def trl(prompts, completions, answer, weight=1.0, completion_ids=None, **kwargs):
    # TRL's contract: the batch as lists, the dataset's other columns as keyword lists
    assert len(prompts) == len(completions) == len(answer), (len(prompts), len(completions), len(answer))
    assert "prompts" not in kwargs and "completions" not in kwargs
    out = []
    for c, a in zip(completions, answer):
        hit = float(c == a)
        out.append({"reward": weight * hit, "score": hit, "components": {"chars": float(len(c))}})
    return out


def with_ids(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def misbehave(prompts, completions, kind, **kwargs):
    k = kind[0]
    if k == "short":
        return [1.0] * (len(completions) - 1)
    if k == "none":
        return [None] + [1.0] * (len(completions) - 1)
    if k == "nan":
        return [float("nan")] + [1.0] * (len(completions) - 1)
    if k == "str":
        return ["high"] + [1.0] * (len(completions) - 1)
    if k == "scalar":
        return 1.0
    if k == "raise":
        raise RuntimeError("batch boom")
    if k == "hang":
        time.sleep(60)
    return [1.0] * len(completions)
'''


@pytest.fixture
def rewards_file(tmp_path):
    p = tmp_path / "rewards.py"
    p.write_text(REWARDS)
    return p


def _ok(reward: float, score: float, chars: int) -> RewardResult:
    return RewardResult(reward=reward, score=score, components={"chars": float(chars)})


FAIL = RewardResult(0.0, 0.0, {}, "exception")
TIMEOUT = RewardResult(0.0, 0.0, {}, "timeout")


# --------------------------------------------------------------------------- detection


def _sample(prompt, response, extra_info):
    return 0.0


def _trl(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def _trl_completions_only(completions, **kwargs):
    return [0.0] * len(completions)


def _trl_keyword_only(*, completions, **kwargs):
    return [0.0] * len(completions)


def _kwargs_only(**kwargs):
    return 0.0


class _Scorer:
    def batched(self, prompts, completions, **kwargs):
        return [0.0] * len(completions)

    def single(self, prompt, response, extra_info):
        return 0.0


def test_style_is_detected_from_the_first_parameter():
    assert detect_reward_style(_sample) == "sample"
    assert detect_reward_style(_trl) == "batch"
    assert detect_reward_style(_trl_completions_only) == "batch"
    assert detect_reward_style(_trl_keyword_only) == "batch"
    assert detect_reward_style(_kwargs_only) == "sample"  # no named parameter says "batch"
    assert detect_reward_style(_Scorer().batched) == "batch"  # a bound method: self is not a parameter
    assert detect_reward_style(_Scorer().single) == "sample"
    assert detect_reward_style(len) == "sample"  # builtins keep relign's convention
    # the explicit override wins over the signature
    assert detect_reward_style(_sample, "batch") == "batch"
    assert detect_reward_style(_trl, "sample") == "sample"
    with pytest.raises(ValueError, match=r"task.reward_style='rows': expected one of auto, sample, batch"):
        detect_reward_style(_trl, "rows")


# --------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("workers", [0, 1])
def test_both_signatures_score_the_same(rewards_file, workers):
    # completions "42", "7", "42" against answers "42", "42", and none (the third row has no
    # answer: TRL-style, its column entry is None). weight 2: rewards 2*1, 2*0, 2*0.
    prompts, completions = ["p1", "p2", "p3"], ["42", "7", "42"]
    infos = [{"answer": "42"}, {"answer": "42"}, {"prompts": "ignored: reserved name"}]
    expected = [_ok(2.0, 1.0, 2), _ok(0.0, 0.0, 1), _ok(0.0, 0.0, 2)]
    for fn, style in (("per_sample", "sample"), ("trl", "batch")):
        with RewardPool(f"{rewards_file}:{fn}", kwargs={"weight": 2.0}, num_workers=workers, timeout=30) as pool:
            assert pool.style == style
            assert pool.score(prompts, completions, infos) == expected
            assert pool.stats == {"calls": 3, "exceptions": 0, "timeouts": 0}


@pytest.mark.parametrize("workers", [0, 1])
def test_batched_function_gets_completion_ids(rewards_file, workers):
    with RewardPool(f"{rewards_file}:with_ids", num_workers=workers, timeout=30) as pool:
        out = pool.score(["a", "b"], ["x", "y"], [{}, {}], completion_ids=[[5, 6, 7], [8]])
        assert [r.reward for r in out] == [3.0, 1.0]
        # without ids (an eval caller that has none) the function's own default applies: a TypeError here
        out = pool.score(["a"], ["x"], [{}])
        assert out == [FAIL] and "completion_ids" in out[0].message


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize(
    "kind, expected, message",
    [
        ("short", [FAIL, FAIL], "returned 1 rewards for 2 completions"),
        ("scalar", [FAIL, FAIL], "must return a list of 2 rewards"),
        ("raise", [FAIL, FAIL], "RuntimeError: batch boom"),
        ("none", [FAIL, RewardResult(1.0, 1.0)], "None (TRL's 'not applicable'): scored 0"),
        ("nan", [FAIL, RewardResult(1.0, 1.0)], "reward must be finite, got nan"),
        ("str", [FAIL, RewardResult(1.0, 1.0)], "got str: 'high'"),
    ],
)
def test_bad_batched_returns_are_counted_per_sample(rewards_file, workers, kind, expected, message):
    with RewardPool(f"{rewards_file}:misbehave", num_workers=workers, timeout=30) as pool:
        out = pool.score(["p", "q"], ["a", "b"], [{"kind": kind}, {"kind": kind}])
        assert out == expected
        failed = [r for r in out if r.error]
        assert all(message in r.message for r in failed), [r.message for r in failed]
        assert pool.stats == {"calls": 2, "exceptions": len(failed), "timeouts": 0}
        assert message in pool.recent_errors[-1]
        # the pool goes on: a good batch after a bad one
        assert pool.score(["p"], ["a"], [{"kind": "fine"}]) == [RewardResult(1.0, 1.0)]


def test_a_hanging_batch_times_out_for_all_its_samples(rewards_file):
    # one worker, two samples, 0.5 s per call: the batch gets 0.5 * ceil(2 / 1) = 1 s
    with RewardPool(f"{rewards_file}:misbehave", num_workers=1, timeout=0.5) as pool:
        out = pool.score(["p", "q"], ["a", "b"], [{"kind": "hang"}, {"kind": "hang"}])
        assert out == [TIMEOUT, TIMEOUT]
        assert "call exceeded 1 s" in out[0].message
        assert pool.stats == {"calls": 2, "exceptions": 0, "timeouts": 2}
        assert pool.score(["p"], ["a"], [{"kind": "fine"}]) == [RewardResult(1.0, 1.0)]  # a fresh worker


def test_task_reward_and_custom_task_with_a_batched_function(rewards_file, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "6*7?", "answer": "42"}\n')
    task = make_custom_task(str(data), f"{rewards_file}:trl", reward_kwargs={"weight": 3.0})
    (rec,) = task.load()
    assert rec["extra_info"] == {"answer": "42"}
    assert task.reward(rec["prompt"], "42", rec["extra_info"]) == {"reward": 3.0, "score": 1.0, "components": {"chars": 2.0}}
    pool = RewardPool.from_task(task, num_workers=0)
    assert pool.style == "batch" and pool.score([rec["prompt"]], ["41"], [rec["extra_info"]]) == [_ok(0.0, 0.0, 2)]
    # forced per-sample: the batched function is then called as fn(prompt, response, extra_info) and fails, counted
    forced = make_custom_task(str(data), f"{rewards_file}:trl", reward_style="sample")
    assert RewardPool.from_task(forced, num_workers=0).score(["p"], ["42"], [{"answer": "42"}]) == [FAIL]


# --------------------------------------------------------------------------- reward files that do not load


def test_syntax_error_is_one_line_naming_the_spec_and_file(tmp_path):
    bad = tmp_path / "broken_reward.py"
    bad.write_text("def reward(prompt, response, extra_info)\n    return 1.0\n")  # missing colon
    with pytest.raises(ValueError) as e:
        load_function(f"{bad}:reward")
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(f"function spec '{bad}:reward': cannot load {bad}: SyntaxError: ")
    assert text.endswith("(line 1)")
    # as relign rl / eval build the task: a ConfigError, which the CLI prints as one line
    with pytest.raises(ConfigError, match=r"^task: function spec .*broken_reward.py:reward.*SyntaxError.*\(line 1\)$"):
        build_task("custom", path=str(tmp_path / "rows.jsonl"), reward_fn=str(bad))


def test_errors_while_importing_a_reward_file_name_the_line(tmp_path):
    bad = tmp_path / "raising_reward.py"
    bad.write_text("X = 1\nY = X / 0\ndef reward(prompt, response, extra_info):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"cannot load .*raising_reward.py: ZeroDivisionError: division by zero \(line 2\)$"):
        load_function(f"{bad}:reward")


def test_missing_file_and_function_name_the_spec(tmp_path, rewards_file):
    with pytest.raises(ConfigError, match=r"^task: function spec '.*nope.py:reward': file not found: .*nope.py$"):
        build_task("custom", path="rows.jsonl", reward_fn=str(tmp_path / "nope.py"))
    with pytest.raises(ConfigError, match=r"function spec '.*rewards.py:absent': '.*rewards.py' has no attribute 'absent'"):
        build_task("custom", path="rows.jsonl", reward_fn=f"{rewards_file}:absent")


def test_a_worker_reports_a_syntax_error_as_the_same_line(tmp_path):
    bad = tmp_path / "broken_reward.py"
    bad.write_text("def reward(:\n")
    with pytest.raises(ValueError, match=r"^function spec '.*broken_reward.py:reward': cannot load .*SyntaxError"):
        RewardPool(f"{bad}:reward", num_workers=1)


# --------------------------------------------------------------------------- loud failures in the collector


class _Tok:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1, 2, 3]}


class _Engine:
    """Hands out the queued texts as completions, in order."""

    def __init__(self, texts):
        self.texts = list(texts)

    def generate(self, prompts, params, seeds=None):
        from relign.rollout.engine import Completion

        return [[Completion([7, 8], [-1.0, -1.0], "stop", self.texts.pop(0)) for _ in range(params.n)] for _ in prompts]


FLAKY = '''
def reward(prompt, response, extra_info):
    if response.startswith("x"):
        raise ValueError(f"cannot grade {response!r}")
    return 1.0
'''


def _collector(tmp_path, texts):
    from relign.data.collate import StepSampler
    from relign.rollout.collect import RolloutCollector
    from relign.rollout.engine import SamplingParams

    spec = tmp_path / "flaky.py"
    spec.write_text(FLAKY)
    records = [{"prompt": f"q{i}", "extra_info": {}} for i in range(4)]
    pool = RewardPool(f"{spec}:reward", num_workers=0)
    c = RolloutCollector(_Tok(), _Engine(texts), records, sampling=SamplingParams(n=1), pool=pool)
    return c, StepSampler(4, 4, seed=0, shuffle=False)


def test_most_rewards_failing_warns_with_the_first_message(tmp_path, caplog):
    # step 1: 3 of 4 raise (> 50%): a warning naming the counts and the first error; step 2: 2 of 4 (not most): quiet
    c, sampler = _collector(tmp_path, ["x1", "x2", "ok", "x3", "x4", "x5", "ok", "ok"])
    with caplog.at_level(logging.WARNING, logger="relign.rollout.collect"):
        groups = c.collect(sampler, 4, dynamic=False, max_rounds=1)
        assert [e.reward for g in groups for e in g.episodes] == [0.0, 0.0, 1.0, 0.0]
        warnings = [r.getMessage() for r in caplog.records if r.name == "relign.rollout.collect"]
        assert len(warnings) == 1
        assert "3 of 4 rewards failed (3 raised, 0 timed out) this step" in warnings[0]
        assert "first error: ValueError: cannot grade 'x1'" in warnings[0]
        caplog.clear()
        c.collect(sampler, 4, dynamic=False, max_rounds=1)
        assert not [r for r in caplog.records if r.name == "relign.rollout.collect"]
    assert c.step_metrics(groups)["reward/errors"] == 3.0


def test_the_warning_reaches_stderr_when_logging_hides_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger("relign.rollout.collect"), "level", logging.ERROR)
    c, sampler = _collector(tmp_path, ["x1", "x2", "x3", "ok"])
    c.collect(sampler, 4, dynamic=False, max_rounds=1)
    err = capsys.readouterr().err
    assert err.count("WARNING: reward function") == 1 and "first error: ValueError: cannot grade 'x1'" in err


def test_every_reward_of_the_first_step_failing_stops_the_run(tmp_path):
    c, sampler = _collector(tmp_path, ["x1", "x2", "x3", "x4"])
    with pytest.raises(ConfigError) as e:
        c.collect(sampler, 4, dynamic=False, max_rounds=1)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(f"task.reward_fn={tmp_path / 'flaky.py'}:reward: every reward of the first step failed: ")
    assert text.endswith("4 of 4 rewards failed (4 raised, 0 timed out); first error: ValueError: cannot grade 'x1'")


def test_all_failing_later_step_warns_but_goes_on(tmp_path, caplog):
    # dynamic sampling would drop the all-zero groups: the failures are counted before that
    c, sampler = _collector(tmp_path, ["ok", "x0", "ok", "x9", "x1", "x2", "x3", "x4"])
    c.collect(sampler, 4, dynamic=True, max_rounds=1)
    with caplog.at_level(logging.WARNING, logger="relign.rollout.collect"):
        assert c.collect(sampler, 4, dynamic=True, max_rounds=1) == []
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "relign.rollout.collect"]
    assert "4 of 4 rewards failed" in msg and "cannot grade 'x1'" in msg
