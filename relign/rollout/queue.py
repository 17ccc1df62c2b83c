"""The batches sampled ahead of the update (``rollout.max_staleness``), and their checkpoint form.

With staleness s, step k trains on batch k while batches k+1 .. k+s, sampled by older
weights, wait here. Each batch remembers the policy version that sampled it (the number of
steps done before it was sampled; a step that dynamic sampling skipped counts, though it
changed no weight), so staleness = version now - version then. The queue
is part of the run's state: a checkpoint holds it as plain data (token ids, log-probs,
rewards, extra_info, versions), which ``torch.load(weights_only=True)`` reads back, so a
killed run resumes with the very batches it had in flight.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import watchdog
from .collect import Group
from .multiturn import Episode


@dataclass
class Sampled:
    """One step's groups, the policy version that sampled them, and their collection statistics."""

    groups: list[Group]
    version: int
    stats: dict[str, float] = field(default_factory=dict)
    """The collector's ``last`` of this collection (rounds, generate_s, reward_s)."""


def staleness_metrics(version_now: int, batch: Sampled) -> dict[str, float]:
    """rollout/staleness: updates between sampling and training (one number: a step's batch is sampled by one version)."""
    return {"rollout/staleness": float(version_now - batch.version)}


def queue_state(queue: deque[Sampled]) -> list[dict[str, Any]]:
    """The queue as plain lists and dicts (the checkpoint's ``rollout_queue``)."""
    return [{"version": b.version, "stats": dict(b.stats), "groups": [dataclasses.asdict(g) for g in b.groups]}
            for b in queue]


def queue_from_state(state: list[dict[str, Any]]) -> deque[Sampled]:
    """The inverse of ``queue_state``."""
    out: deque[Sampled] = deque()
    for b in state:
        groups = [Group(**{**g, "episodes": [Episode(**e) for e in g["episodes"]]}) for g in b["groups"]]
        out.append(Sampled(groups, int(b["version"]), dict(b["stats"])))
    return out


class RolloutAhead:
    """Batches 1 .. max_steps, sampled up to ``depth`` steps ahead of the one being trained.

        batch = ahead.take(step, version)   batch ``step``; batches up to step + depth sampled or being sampled
        ... train on batch ...
        ahead.join()                        before the weight sync: the background sampling is done

    ``collect()`` samples the next batch (the collector's draw order: batch i is always the
    i-th call). ``overlap=False``: the batches ahead are sampled in ``take``, in turn, before
    the update. ``overlap=True``: in a background thread, on the engine's own weight copy,
    while the caller trains; ``join`` waits for it (under the watchdog) and re-raises its error.
    Both sample the same batches with the same weights, so they give the same results.
    """

    def __init__(self, collect, *, depth: int, max_steps: int, overlap: bool = False, threads: int = 0, engine=None):
        self.collect, self.depth, self.max_steps, self.overlap = collect, depth, max_steps, overlap
        self.engine = engine
        """The engine that samples (``before_update`` / ``before_sync`` put it to sleep and wake it); None: left alone."""
        self.threads = threads
        """Intra-op threads of the background thread (0: torch's default); set in that thread only."""
        self.queue: deque[Sampled] = deque()
        self.sampled_now: list[Sampled] = []
        """The batches sampled during the last ``take`` / ``join`` (their time is this step's rollout time)."""
        self._thread: threading.Thread | None = None
        self._result: list[Sampled] = []
        self._error: BaseException | None = None

    def take(self, step: int, version: int) -> Sampled:
        self.sampled_now = []
        if not self.queue:  # the first step (or a resumed s = 0 run): batch ``step`` is sampled now
            self._sample(1, version, self.sampled_now)
            self.queue.extend(self.sampled_now)
        ahead = min(step + self.depth, self.max_steps) - (step + len(self.queue) - 1)
        if ahead > 0 and self.overlap:
            self._result, self._error = [], None
            self._thread = threading.Thread(target=self._background, args=(ahead, version), name="relign-rollout",
                                            daemon=True)
            self._thread.start()
        elif ahead > 0:
            more: list[Sampled] = []
            self._sample(ahead, version, more)
            self.queue.extend(more)
            self.sampled_now.extend(more)
        return self.queue.popleft()

    def join(self) -> None:
        if self._thread is None:
            return
        watchdog.join(self._thread, "the overlapped rollout thread (rollout.overlap=thread)")
        self._thread = None
        if self._error is not None:
            raise self._error
        self.queue.extend(self._result)
        self.sampled_now.extend(self._result)

    @property
    def stages(self) -> tuple[str, ...]:
        """The step stages the overlap adds to the clock: rollout_wait, the wait for the next batch."""
        return ("rollout_wait",) if self.overlap else ()

    def before_update(self) -> None:
        """The engine sleeps through the update where it is idle (under overlap it samples the next batch)."""
        if not self.overlap and self.engine is not None:
            self.engine.sleep()

    def before_sync(self, clock) -> None:
        """Before the weight sync: under overlap the next batch must have been sampled by the old
        weights, so wait for it (timed by ``clock("rollout_wait")``); else wake the engine."""
        if self.overlap:
            with clock("rollout_wait"):
                self.join()
        elif self.engine is not None:
            self.engine.wake()

    def metrics(self, version: int, sampled: Sampled) -> dict[str, float]:
        """The trained batch's own collection (not the one sampled ahead this step) where batches are
        sampled ahead: its staleness and its sampling rounds; none at ``depth`` 0."""
        if not self.depth:
            return {}
        return {**staleness_metrics(version, sampled), "rollout/rounds": sampled.stats.get("rounds", 1.0)}

    def _sample(self, n: int, version: int, into: list[Sampled]) -> None:
        for _ in range(n):
            groups, stats = self.collect()
            into.append(Sampled(groups, version, stats))

    def _background(self, n: int, version: int) -> None:
        if self.threads:  # OpenMP's thread count is per calling thread: the trainer's stays as it is
            torch.set_num_threads(self.threads)
        try:
            self._sample(n, version, self._result)
        except BaseException as e:  # re-raised in the main thread by join()
            self._error = e

    def state(self) -> list[dict[str, Any]]:
        return queue_state(self.queue)

    def load(self, state: list[dict[str, Any]]) -> None:
        self.queue = queue_from_state(state)
