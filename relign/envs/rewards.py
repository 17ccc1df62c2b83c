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

A batched (TRL-style) function, ``fn(prompts, completions, **kwargs) -> list`` (see
``relign.envs.base.detect_reward_style``), runs as one call per ``score`` batch in one worker,
with the same isolation: a raise or a hang gives 0 to every sample of the batch, counted. Its
timeout is scaled to the batch: ``timeout * ceil(n / num_workers)``, the longest the
per-sample calls of the same batch could take on the pool. A return value that is not a list
of ``n`` rewards fails the whole batch; an element that is None, NaN or not a number fails
(counts) that sample alone.

A task's reward is referenced by its spec plus options, e.g.
``RewardPool("relign.envs.gsm8k:reward", kwargs={"format_weight": 0.1})``, which is what
``RewardPool.from_task(get_task("gsm8k", format_weight=0.1))`` builds.
"""

from __future__ import annotations

import logging
import math
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

from relign.envs.base import Task, load_function
from relign.envs.reward_fn import (
    REWARD_STYLES,
    RewardResult,
    call_batch,
    detect_reward_style,
    normalize_batch,
    normalize_reward,
)

log = logging.getLogger(__name__)

_MAX_LOGGED_ERRORS = 5


def _failed(kind: str, message: str | None = None) -> RewardResult:
    return RewardResult(reward=0.0, score=0.0, components={}, error=kind, message=message)


def _message(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


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


def _as_tuple(res: RewardResult) -> tuple:
    return (res.reward, res.score, res.components)


def _run_job(fn: Any, kind: str, payload: tuple, kwargs: dict[str, Any]) -> Any:
    """One job's value, in whichever process runs it: a sample's ``(reward, score, components)``,
    or a batch's list of per-sample ``("ok", tuple) | ("error", message)``. Raises on failure."""
    if kind == "sample":
        prompt, response, extra_info = payload
        return _as_tuple(normalize_reward(fn(prompt, response, extra_info, **kwargs)))
    prompts, responses, extra_infos, completion_ids = payload
    entries = normalize_batch(call_batch(fn, prompts, responses, extra_infos, kwargs, completion_ids), len(prompts))
    return [("error", e) if isinstance(e, str) else ("ok", _as_tuple(e)) for e in entries]


def _worker_main(conn: Connection, spec: str, kwargs: dict[str, Any], parent_pid: int, style: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    _watch_parent(parent_pid)
    try:
        fn = load_function(spec)
        resolved = detect_reward_style(fn, style)
    except BaseException as e:
        conn.send(("init_error", type(e).__name__, str(e), traceback.format_exc()))
        return
    conn.send(("ready", os.getpid(), resolved))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        job, kind, payload = msg
        try:
            out: tuple = ("ok", job, _run_job(fn, kind, payload, kwargs))
        except BaseException as e:  # SystemExit from user code is a failed call, not an exit
            out = ("error", job, _message(e))
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
            called as ``fn(prompt, response, extra_info, **kwargs)``, or once per batch as
            ``fn(prompts=[...], completions=[...], **columns, **kwargs)`` when batched.
        kwargs: fixed keyword options (``{"format_weight": 0.1}``); must be picklable.
        num_workers: worker processes; 0 = call in this process (no timeout).
        timeout: seconds allowed per call (not counting a worker's start-up); a batched call
            gets ``timeout * ceil(batch / num_workers)``.
        start_timeout: seconds allowed for a worker to import and load the function.
        style: "auto" (from the function's signature), "sample" or "batch"; ``self.style`` is
            the resolved one.
    """

    def __init__(
        self,
        spec: str,
        *,
        kwargs: dict[str, Any] | None = None,
        num_workers: int = 2,
        timeout: float = 10.0,
        start_timeout: float = 120.0,
        style: str = "auto",
    ):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if style not in REWARD_STYLES:
            raise ValueError(f"task.reward_style={style!r}: expected one of {', '.join(REWARD_STYLES)}")
        self.spec = spec
        self.style = style  # resolved below: here, or by the first worker that starts
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
            self.style = detect_reward_style(self._fn, style)
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
        """A pool for ``task``'s reward: its spec, its reward options (format_weight, ...) and style."""
        kwargs.setdefault("style", task.reward_style)
        return cls(task.reward_spec, kwargs=task.reward_kwargs, **kwargs)

    # ----------------------------------------------------------------- public

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        extra_infos: Sequence[dict],
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RewardResult]:
        """One ``RewardResult`` per response, in order. Never raises for a failing call.

        ``completion_ids`` (the responses' token ids) are passed to a batched function as
        ``completion_ids=[...]``, as TRL does; a per-sample function never sees them."""
        if not (len(prompts) == len(responses) == len(extra_infos)):
            raise ValueError(
                f"prompts, responses and extra_infos differ in length: {len(prompts)}, {len(responses)}, {len(extra_infos)}"
            )
        if completion_ids is not None and len(completion_ids) != len(prompts):
            raise ValueError(f"completion_ids has {len(completion_ids)} entries for {len(prompts)} responses")
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            self.stats["calls"] += len(prompts)
            if not prompts:
                return []
            if self.style == "batch":
                ids = None if completion_ids is None else [list(x) for x in completion_ids]
                jobs = [("batch", (list(prompts), list(responses), list(extra_infos), ids))]
                timeout = self.timeout * math.ceil(len(prompts) / max(1, self.num_workers))
            else:
                jobs = [("sample", job) for job in zip(prompts, responses, extra_infos)]
                timeout = self.timeout
            try:
                outcomes = [self._call_here(*job) for job in jobs] if self.num_workers == 0 else self._run_in_workers(jobs, timeout)
            except BaseException:
                # Interrupted (Ctrl-C, a worker that cannot restart): a worker still busy with
                # this batch would later answer with a stale job index, so replace it.
                for w in list(self._workers):
                    if w.job is not None:
                        w.job = None
                        self._replace(w)
                raise
            if self.style == "batch":
                return self._batch_results(outcomes[0], len(prompts))
            return [RewardResult(*value) if kind == "ok" else self._record_error(kind, value) for kind, value in outcomes]

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

    def _record_error(self, kind: str, message: str, count: int = 1) -> RewardResult:
        """Count ``count`` failed samples (a failed batch counts each of its samples) and log the
        first few messages."""
        before = self.stats["exceptions"] + self.stats["timeouts"]
        self.stats["exceptions" if kind == "exception" else "timeouts"] += count
        self.recent_errors.append(message)
        if before < _MAX_LOGGED_ERRORS:
            n = before + count
            what = f" ({count} samples of a batch)" if count > 1 else ""
            more = " (further errors are counted in pool.stats, not logged)" if n >= _MAX_LOGGED_ERRORS else ""
            log.warning("reward %s: %s%s%s", self.spec, message, what, more)
        return _failed(kind, message)

    def _batch_results(self, outcome: tuple[str, Any], n: int) -> list[RewardResult]:
        """A batched call's outcome as one ``RewardResult`` per sample: a failed call fails all
        ``n`` (counted ``n`` times), a bad element fails its own sample."""
        kind, value = outcome
        if kind != "ok":
            failed = self._record_error(kind, value, count=n)
            return [_failed(failed.error, failed.message) for _ in range(n)]  # type: ignore[arg-type]
        return [RewardResult(*v) if tag == "ok" else self._record_error("exception", v) for tag, v in value]

    def _call_here(self, kind: str, payload: tuple) -> tuple[str, Any]:
        try:
            return "ok", _run_job(self._fn, kind, payload, self.kwargs)
        except Exception as e:
            return "exception", _message(e)

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main, args=(child, self.spec, self.kwargs, os.getpid(), self.style), name="relign-reward",
            daemon=True,
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
            self.style = msg[2]  # the same in every worker: the same function, the same rule
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

    def _run_in_workers(self, jobs: list[tuple[str, tuple]], timeout: float) -> list[tuple[str, Any]]:
        """Each job's outcome, in order: ``("ok", value)``, or ``("exception" | "timeout", message)``."""
        results: list[tuple[str, Any] | None] = [None] * len(jobs)
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
                    results[i] = ("exception", f"cannot send job to worker: {_message(e)}")
                    continue
                w.job, w.deadline = i, time.monotonic() + timeout
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
                    results[w.job] = ("exception", f"worker died during the call (exit code {w.proc.exitcode})")
                    w.job = None
                    self._replace(w)
                    continue
                if msg[0] == "ok":
                    results[msg[1]] = ("ok", msg[2])
                    w.job = None
                elif msg[0] == "error":
                    results[msg[1]] = ("exception", msg[2])
                    w.job = None
                else:
                    self._on_start_message(w, msg)
            # 3. kill whoever ran past its deadline
            now = time.monotonic()
            for w in list(self._workers):
                if w.job is not None and now >= w.deadline:
                    results[w.job] = ("timeout", f"call exceeded {timeout:g} s; worker restarted")
                    w.job = None
                    self._replace(w)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]
