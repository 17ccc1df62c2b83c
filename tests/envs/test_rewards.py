"""RewardPool: same results as in-process, exceptions and timeouts (Python and C-level) contained."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from relign.envs.reward_fn import RewardResult
from relign.envs.rewards import RewardPool
from relign.envs.tasks import get_task

MISBEHAVE = '''
import ctypes, os

def misbehave(prompt, response, extra_info, scale=1.0):
    if response == "raise":
        raise RuntimeError("boom")
    if response == "loop":
        while True:  # pure-Python infinite loop
            pass
    if response == "c-hang":
        ctypes.CDLL(None).sleep(1000)  # blocks in C, never returns to the interpreter
    if response == "exit":
        os._exit(3)  # the worker dies mid-call
    if response == "nan":
        return float("nan")
    if response == "str":
        return "not a reward"
    return {"reward": scale * len(response), "score": 1.0, "components": {"len": len(response)}}
'''


@pytest.fixture
def spec(tmp_path):
    p = tmp_path / "misbehave.py"
    p.write_text(MISBEHAVE)
    return f"{p}:misbehave"


def _ok(n: int, scale: float = 2.0) -> RewardResult:
    return RewardResult(reward=scale * n, score=1.0, components={"len": float(n)})


FAIL = RewardResult(0.0, 0.0, {}, "exception")
TIMEOUT = RewardResult(0.0, 0.0, {}, "timeout")


def test_workers_contain_exceptions_and_timeouts(spec):
    responses = ["ab", "raise", "loop", "abc", "c-hang", "exit", "nan", "str", "abcd"]
    t0 = time.monotonic()
    with RewardPool(spec, kwargs={"scale": 2.0}, num_workers=2, timeout=1.0) as pool:
        results = pool.score(["p"] * len(responses), responses, [{}] * len(responses))
        assert results == [_ok(2), FAIL, TIMEOUT, _ok(3), TIMEOUT, FAIL, FAIL, FAIL, _ok(4)]
        assert pool.stats == {"calls": 9, "exceptions": 4, "timeouts": 2}
        assert "RuntimeError: boom" in pool.recent_errors
        # the killed workers were replaced: later calls still work, in parallel
        assert pool.score(["p", "p"], ["xy", "xyz"], [{}, {}]) == [_ok(2), _ok(3)]
        assert pool.score_one("p", "loop", {}) == TIMEOUT
        assert pool.score_one("p", "x", {}) == _ok(1)
        assert pool.stats == {"calls": 13, "exceptions": 4, "timeouts": 3}
        assert len(pool.worker_pids) == 2 and all(_alive(pid) for pid in pool.worker_pids)
    # two 1 s timeouts ran side by side on 2 workers, plus one more: well under the serial worst case
    assert time.monotonic() - t0 < 10
    assert pool.worker_pids == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(["p"], ["x"], [{}])


def test_in_process_mode_catches_exceptions(spec):
    pool = RewardPool(spec, kwargs={"scale": 2.0}, num_workers=0)
    responses = ["ab", "raise", "nan", "str", "abcd"]
    assert pool.score([""] * 5, responses, [{}] * 5) == [_ok(2), FAIL, FAIL, FAIL, _ok(4)]
    assert pool.stats == {"calls": 5, "exceptions": 3, "timeouts": 0}
    pool.close()


def test_pool_matches_in_process_results_on_real_rows():
    task = get_task("countdown", format_weight=0.1)
    records = task.load(max_rows=12)
    # right, wrong, malformed and hostile answers
    responses = []
    for i, rec in enumerate(records):
        a, b, c = rec["extra_info"]["nums"]
        responses.append(
            [
                f"<answer>{a} + {b} + {c} + 1</answer>",  # well formed, wrong (an extra number): 0 + 0.1
                f"{a}+{b}",  # no tag: 0
                "<answer>__import__('os')</answer>",  # well formed, refused: 0 + 0.1
                f"<answer>{a}/{b}</answer><answer>{c}/0</answer>",  # two tags, last divides by zero: 0
            ][i % 4]
        )
    responses[0] = "<answer>30 + 93 - 100</answer>"  # the first row's solution
    prompts, infos = [r["prompt"] for r in records], [r["extra_info"] for r in records]
    with RewardPool.from_task(task, num_workers=2, timeout=5) as pool:
        assert (pool.spec, pool.kwargs) == ("relign.envs.countdown:reward", {"format_weight": 0.1})
        in_workers = pool.score(prompts, responses, infos)
    in_process = RewardPool.from_task(task, num_workers=0).score(prompts, responses, infos)
    assert in_workers == in_process
    expected = [1.1] + [(0.1, 0.0, 0.1, 0.0)[i % 4] for i in range(1, len(records))]
    assert [r.reward for r in in_process] == pytest.approx(expected)
    assert in_process[0] == RewardResult(reward=pytest.approx(1.1), score=1.0, components={"correct": 1.0, "format": 1.0})
    assert all(r.error is None for r in in_process)


def test_bad_spec_fails_at_construction(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py:f"):
        RewardPool(f"{tmp_path}/nope.py:f", num_workers=1)
    with pytest.raises(ValueError, match="no attribute 'nope'"):
        RewardPool("relign.envs.gsm8k:nope", num_workers=0)
    with pytest.raises(ValueError, match="differ in length"):
        RewardPool("relign.envs.gsm8k:reward", num_workers=0).score(["a"], [], [])


def test_workers_do_not_outlive_a_killed_parent(spec, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            from relign.envs.rewards import RewardPool
            if __name__ == "__main__":
                pool = RewardPool({spec!r}, num_workers=1, timeout=600)
                print(pool.worker_pids[0], flush=True)
                pool.score(["p"], ["loop"], [{{}}])  # the worker spins; the parent waits
            """
        )
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(parent.stdout.readline())
        time.sleep(0.3)
        parent.kill()  # SIGKILL: no atexit handlers, no chance to close the pool
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(worker_pid):
            time.sleep(0.1)
        assert not _alive(worker_pid), "reward worker outlived its parent"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_math_reward_in_a_worker_matches_in_process():
    # In a worker, math_verify runs in the main thread with its own signal-based timeout on.
    infos = [{"answer": r"\frac{14}{3}"}] * 3
    responses = [r"so \boxed{\dfrac{14}{3}}", r"\boxed{4.5}", "no box"]
    with RewardPool("relign.envs.math:reward", kwargs={"format_weight": 0.5}, num_workers=1, timeout=30) as pool:
        assert pool.score([], [], []) == []
        in_worker = pool.score([""] * 3, responses, infos)
    assert in_worker == RewardPool("relign.envs.math:reward", kwargs={"format_weight": 0.5}, num_workers=0).score([""] * 3, responses, infos)
    assert [(r.reward, r.score) for r in in_worker] == [(1.5, 1.0), (0.5, 0.0), (0.0, 0.0)]
