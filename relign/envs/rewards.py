"""Score responses with a reward function in worker processes, with a timeout per call.

Reward functions are code we do not control: a user's ``file.py:fn``, or a math grader that
can spend minutes inside sympy. ``RewardPool`` runs one function (named by spec, with fixed
keyword options) in ``num_workers`` processes and guarantees every call comes back:

* a call that raises gives ``RewardResult(0, 0, error="exception")``;
* a call that runs past ``timeout`` seconds — a Python ``while True``, a C-level hang —
  gives ``error="timeout"``; its worker is killed (SIGKILL) and a fresh one started;
* ``pool.stats`` counts ``calls``, ``exceptions`` and ``timeouts``; ``pool.recent_errors``
  keeps the last messages.

Workers come from the "spawn" start method, not "fork": the parent holds torch's thread
pools (and maybe CUDA), which a forked child inherits in a broken state. Each worker loads
the function by spec once, then serves one job at a time over a Pipe, so a timeout is
pinned to exactly one call. Jobs go to whichever worker is free, so a batch is scored in
parallel. A job is sent only to a worker that has finished starting, so start-up time
(imports) never counts against a call's timeout.

Workers die with the parent: they are daemonic (killed at normal interpreter exit), exit on
EOF when the parent's end of the pipe closes, and a watcher thread exits them if the parent
process disappears (SIGKILL) while they are busy. As with every "spawn" pool, a script that
creates a pool at import time needs an ``if __name__ == "__main__":`` guard.

``num_workers=0`` calls the function in this process: no start-up cost and no IPC (the
built-in gsm8k/countdown rewards take microseconds), exceptions still caught, but no timeout.

A task's reward is referenced by its spec plus options, e.g.
``RewardPool("relign.envs.gsm8k:reward", kwargs={"format_weight": 0.1})``, which is what
``RewardPool.from_task(get_task("gsm8k", format_weight=0.1))`` builds.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from relign.envs.base import RewardResult, Task, load_function, normalize_reward

log = logging.getLogger(__name__)

_MAX_LOGGED_ERRORS = 5


def _failed(kind: str) -> RewardResult:
    return RewardResult(reward=0.0, score=0.0, components={}, error=kind)


# --------------------------------------------------------------------------- worker side


def _watch_parent(parent_pid: int) -> None:
    # If the parent is SIGKILLed while this worker is stuck in a long call, nobody would ever
    # close our pipe; poll for re-parenting and leave. (A C extension that hangs while holding
    # the GIL blocks this thread too; the parent's normal exit still kills daemonic workers.)
    def run() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=run, name="relign-parent-watch", daemon=True).start()


def _worker_main(conn: Connection, spec: str, kwargs: dict[str, Any], parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    _watch_parent(parent_pid)
    try:
        fn = load_function(spec)
    except BaseException as e:
        conn.send(("init_error", type(e).__name__, str(e), traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        job, prompt, response, extra_info = msg
        try:
            res = normalize_reward(fn(prompt, response, extra_info, **kwargs))
            out: tuple = ("ok", job, (res.reward, res.score, res.components))
        except BaseException as e:  # SystemExit from user code is a failed call, not an exit
            out = ("error", job, f"{type(e).__name__}: {e}"[:2000])
        try:
            conn.send(out)
        except (BrokenPipeError, OSError):
            return


# --------------------------------------------------------------------------- parent side


@dataclass
class _Worker:
    proc: Any  # multiprocessing.context.SpawnProcess
    conn: Connection
    ready: bool = False
    job: int | None = None  # index into the current batch
    deadline: float = 0.0


class RewardPool:
    """Score ``(prompt, response, extra_info)`` batches with the reward function ``spec``.

    Args:
        spec: ``"package.module:function"`` or ``"path/to/file.py:function"``; the function is
            called as ``fn(prompt, response, extra_info, **kwargs)``.
        kwargs: fixed keyword options (``{"format_weight": 0.1}``); must be picklable.
        num_workers: worker processes; 0 = call in this process (no timeout).
        timeout: seconds allowed per call (not counting a worker's start-up).
        start_timeout: seconds allowed for a worker to import and load the function.
    """

    def __init__(
        self,
        spec: str,
        *,
        kwargs: dict[str, Any] | None = None,
        num_workers: int = 2,
        timeout: float = 10.0,
        start_timeout: float = 120.0,
    ):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.spec = spec
        self.kwargs = dict(kwargs or {})
        self.num_workers = num_workers
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        self.stats = {"calls": 0, "exceptions": 0, "timeouts": 0}
        self.recent_errors: deque[str] = deque(maxlen=20)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._closed = False
        self._fn = None
        if num_workers == 0:
            self._fn = load_function(spec)
            return
        self._ctx = mp.get_context("spawn")
        try:
            self._workers = [self._start() for _ in range(num_workers)]
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_task(cls, task: Task, **kwargs: Any) -> RewardPool:
        """A pool for ``task``'s reward: its spec and its reward options (format_weight, ...)."""
        return cls(task.reward_spec, kwargs=task.reward_kwargs, **kwargs)

    # ----------------------------------------------------------------- public

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], extra_infos: Sequence[dict]
    ) -> list[RewardResult]:
        """One ``RewardResult`` per response, in order. Never raises for a failing call."""
        if not (len(prompts) == len(responses) == len(extra_infos)):
            raise ValueError(
                f"prompts, responses and extra_infos differ in length: {len(prompts)}, {len(responses)}, {len(extra_infos)}"
            )
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            self.stats["calls"] += len(prompts)
            jobs = list(zip(prompts, responses, extra_infos))
            if self.num_workers == 0:
                return [self._call_here(*job) for job in jobs]
            try:
                return self._score_in_workers(jobs)
            except BaseException:
                # Interrupted (Ctrl-C, a worker that cannot restart): a worker still busy with
                # this batch would later answer with a stale job index, so replace it.
                for w in list(self._workers):
                    if w.job is not None:
                        w.job = None
                        self._replace(w)
                raise

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def score_one(self, prompt: str, response: str, extra_info: dict) -> RewardResult:
        return self.score([prompt], [response], [extra_info])[0]

    def close(self) -> None:
        """Stop the workers (asking first, then killing). Safe to call twice."""
        self._closed = True
        workers, self._workers = self._workers, []
        for w in workers:
            try:
                w.conn.send(None)
            except Exception:
                pass
        deadline = time.monotonic() + 2.0
        for w in workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=5.0)
            w.conn.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ----------------------------------------------------------------- internals

    def _record_error(self, kind: str, message: str) -> RewardResult:
        self.stats["exceptions" if kind == "exception" else "timeouts"] += 1
        self.recent_errors.append(message)
        n = self.stats["exceptions"] + self.stats["timeouts"]
        if n <= _MAX_LOGGED_ERRORS:
            more = " (further errors are counted in pool.stats, not logged)" if n == _MAX_LOGGED_ERRORS else ""
            log.warning("reward %s: %s%s", self.spec, message, more)
        return _failed(kind)

    def _call_here(self, prompt: str, response: str, extra_info: dict) -> RewardResult:
        try:
            return normalize_reward(self._fn(prompt, response, extra_info, **self.kwargs))  # type: ignore[misc]
        except Exception as e:
            return self._record_error("exception", f"{type(e).__name__}: {e}"[:2000])

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main, args=(child, self.spec, self.kwargs, os.getpid()), name="relign-reward", daemon=True
        )
        proc.start()
        child.close()  # the parent keeps only its end, so a dead worker reads as EOF
        return _Worker(proc=proc, conn=parent)

    def _replace(self, w: _Worker) -> None:
        w.proc.kill()
        w.proc.join(timeout=5.0)
        w.conn.close()
        self._workers[self._workers.index(w)] = self._start()

    def _on_start_message(self, w: _Worker, msg: tuple) -> None:
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "init_error":
            _, type_name, text, tb = msg
            # load_function's own errors (missing file/attribute, bad spec) keep their type and
            # message; anything else (an error while importing the user's module) gets the traceback.
            known = {"FileNotFoundError": FileNotFoundError, "ValueError": ValueError, "TypeError": TypeError}
            if type_name in known and text.startswith("function spec"):
                raise known[type_name](text)
            raise RuntimeError(f"reward function {self.spec!r} failed to load in a worker: {type_name}: {text}\n{tb}")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while not all(w.ready for w in self._workers):
            starting = {w.conn: w for w in self._workers if not w.ready}
            left = deadline - time.monotonic()
            ready = wait(list(starting), timeout=max(0.0, left))
            if not ready:
                raise RuntimeError(f"reward workers for {self.spec!r} did not start within {self.start_timeout:.0f} s")
            for conn in ready:
                w = starting[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    raise RuntimeError(f"a reward worker for {self.spec!r} exited while starting (exit code {w.proc.exitcode})") from None
                self._on_start_message(w, msg)

    def _score_in_workers(self, jobs: list[tuple[str, str, dict]]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        idle_since = time.monotonic()  # guards against waiting forever on workers that never start
        while pending or any(w.job is not None for w in self._workers):
            # 1. hand jobs to free workers
            for w in list(self._workers):
                if not (pending and w.ready and w.job is None):
                    continue
                i = pending.popleft()
                try:
                    w.conn.send((i, *jobs[i]))
                except (BrokenPipeError, ConnectionResetError, EOFError):
                    pending.appendleft(i)  # died between jobs: retry the job on its replacement
                    self._replace(w)
                    continue
                except Exception as e:  # e.g. an extra_info that cannot be pickled
                    results[i] = self._record_error("exception", f"cannot send job to worker: {type(e).__name__}: {e}")
                    continue
                w.job, w.deadline = i, time.monotonic() + self.timeout
            busy = [w for w in self._workers if w.job is not None]
            listening = {w.conn: w for w in self._workers if w.job is not None or not w.ready}
            if not listening:
                continue  # every job was refused at send time; loop ends or dispatches again
            # 2. wait for a result, a finished start-up, or the nearest deadline
            now = time.monotonic()
            if busy:
                wait_s = max(0.0, min(w.deadline for w in busy) - now)
                idle_since = now
            else:
                wait_s = max(0.0, idle_since + self.start_timeout - now)
                if wait_s == 0.0:
                    raise RuntimeError(f"reward workers for {self.spec!r} did not restart within {self.start_timeout:.0f} s")
            for conn in wait(list(listening), timeout=wait_s):
                w = listening[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if w.job is None:
                        raise RuntimeError(f"a reward worker for {self.spec!r} exited while starting (exit code {w.proc.exitcode})") from None
                    # crashed mid-call (segfault, os._exit, killed by the OOM killer)
                    results[w.job] = self._record_error("exception", f"worker died during the call (exit code {w.proc.exitcode})")
                    w.job = None
                    self._replace(w)
                    continue
                if msg[0] == "ok":
                    reward, score, components = msg[2]
                    results[msg[1]] = RewardResult(reward=reward, score=score, components=components)
                    w.job = None
                elif msg[0] == "error":
                    results[msg[1]] = self._record_error("exception", msg[2])
                    w.job = None
                else:
                    self._on_start_message(w, msg)
            # 3. kill whoever ran past its deadline
            now = time.monotonic()
            for w in list(self._workers):
                if w.job is not None and now >= w.deadline:
                    results[w.job] = self._record_error("timeout", f"call exceeded {self.timeout:g} s; worker restarted")
                    w.job = None
                    self._replace(w)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]
