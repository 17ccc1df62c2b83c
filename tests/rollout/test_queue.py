"""RolloutAhead: batches sampled ahead, and the engine's sleep and wake around the update as the
overlap needs them (the RL step loop calls before_update / before_sync and reads metrics)."""

from __future__ import annotations

import contextlib

from relign.rollout.queue import RolloutAhead


class _Engine:
    def __init__(self):
        self.calls: list[str] = []

    def sleep(self):
        self.calls.append("sleep")

    def wake(self):
        self.calls.append("wake")


def _collect_counter():
    n = {"i": 0}

    def collect():
        n["i"] += 1
        return [f"batch {n['i']}"], {"rounds": float(n["i"])}

    return collect


def _run(overlap: bool, depth: int, steps: int = 3):
    engine, timed = _Engine(), []

    @contextlib.contextmanager
    def clock(stage):
        timed.append(stage)
        yield

    ahead = RolloutAhead(_collect_counter(), depth=depth, max_steps=steps, overlap=overlap, engine=engine)
    seen, metrics = [], []
    for step in range(1, steps + 1):
        sampled = ahead.take(step, step - 1)
        ahead.before_update()
        ahead.before_sync(clock)
        seen.append(sampled.groups[0])
        metrics.append(ahead.metrics(step - 1, sampled))
    return ahead, engine, timed, seen, metrics


def test_without_overlap_the_engine_sleeps_through_the_update_and_wakes_for_the_sync():
    ahead, engine, timed, seen, metrics = _run(overlap=False, depth=0)
    assert seen == ["batch 1", "batch 2", "batch 3"] and ahead.stages == ()
    assert engine.calls == ["sleep", "wake"] * 3 and timed == []
    assert metrics == [{}, {}, {}]  # nothing sampled ahead: no staleness to report


def test_with_overlap_the_engine_samples_on_and_the_sync_waits_for_the_next_batch():
    ahead, engine, timed, seen, metrics = _run(overlap=True, depth=1)
    # batch i + 1 is sampled (by version i - 1) while batch i trains: the same batches in the same order
    assert seen == ["batch 1", "batch 2", "batch 3"] and ahead.stages == ("rollout_wait",)
    assert engine.calls == [] and timed == ["rollout_wait"] * 3
    # batch 1 sampled by version 0 and trained at version 0; batch 2 by version 0 at version 1; batch 3 by 1 at 2
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    assert [m["rollout/rounds"] for m in metrics] == [1.0, 2.0, 3.0]
