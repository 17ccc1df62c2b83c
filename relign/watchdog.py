"""No silent hangs: every blocking wait has a deadline.

    watchdog.configure(seconds, run_dir, key=K)  once per run (0 seconds: no deadline, the default); K names the setting
    with watchdog.waiting("the reward pool"):   around a wait that may never end
        ...

A wait that outlives its deadline is a hang, not a slow step: a rank that died before a
collective, a reward worker wedged past its own timeout, an engine stuck in a kernel, the
overlap thread deadlocked. Then a monitor thread writes the stack of every thread of the
process to ``run_dir/hang_rank{R}.txt`` and exits the process with status 124 and one line
on stderr naming what it waited for, how long, and where the stacks are. The main thread
cannot be interrupted inside a C call (a gloo collective, a pipe read), so the exit is
``os._exit`` from the monitor, after the children (reward workers) are terminated.

Waits nest and may come from several threads: each has its own deadline.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

EXIT_CODE = 124
"""The process's status after a wait timed out (``timeout(1)``'s)."""

_lock = threading.Lock()
_wake = threading.Condition(_lock)
_waits: dict[int, tuple[str, float, float]] = {}  # id -> (what, deadline, seconds)
_ids = itertools.count()
_settings = {"seconds": 0.0, "dir": None, "key": "the wait's deadline"}
_monitor: threading.Thread | None = None


def configure(seconds: float, run_dir: Path | None, *, key: str) -> None:
    """Every later ``waiting`` gets ``seconds`` (0: no deadline); stacks go to ``run_dir``; ``key`` names the
    caller's setting of ``seconds`` (the line a timed-out rank prints tells the user what to raise)."""
    with _lock:
        _settings.update(seconds=float(seconds), dir=run_dir, key=key)


@contextmanager
def waiting(what: str, seconds: float | None = None) -> Iterator[None]:
    """Run the block under a deadline of ``seconds`` (default: the configured one; 0: none)."""
    limit = _settings["seconds"] if seconds is None else seconds
    if not limit:
        yield
        return
    _start_monitor()
    with _lock:
        key = next(_ids)
        _waits[key] = (what, time.monotonic() + limit, limit)
        _wake.notify()
    try:
        yield
    finally:
        with _lock:
            _waits.pop(key, None)


def join(thread: threading.Thread, what: str) -> None:
    """``thread.join()`` under the deadline (a thread that never ends is a hang like any other)."""
    with waiting(what):
        thread.join()


def _start_monitor() -> None:
    global _monitor
    with _lock:
        if _monitor is not None and _monitor.is_alive():
            return
        _monitor = threading.Thread(target=_watch, name="relign-watchdog", daemon=True)
        _monitor.start()


def _watch() -> None:
    with _lock:
        while True:
            now = time.monotonic()
            late = [w for w in _waits.values() if w[1] <= now]
            if late:
                what, _, seconds = min(late, key=lambda w: w[1])
                break
            nearest = min((w[1] for w in _waits.values()), default=now + 3600.0)
            _wake.wait(timeout=max(0.01, nearest - now))
    _die(what, seconds)


def stacks() -> str:
    """The current stack of every thread of this process, innermost call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f'Thread "{names.get(ident, "?")}" (id {ident}):\n' + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def _die(what: str, seconds: float) -> None:
    rank = os.environ.get("RANK", "0")
    text = f"timed out after {seconds:g} s waiting for {what}\n\n{stacks()}"
    where = "stderr"
    run_dir = _settings["dir"]
    if run_dir is not None:
        try:
            path = Path(run_dir) / f"hang_rank{rank}.txt"
            path.write_text(text)
            where = str(path)
        except OSError:
            pass
    if where == "stderr":
        print(text, file=sys.stderr)
    print(f"relign: rank {rank} waited {seconds:g} s for {what} and stopped ({_settings['key']}); the stack of "
          f"every thread is in {where}", file=sys.stderr, flush=True)
    for child in multiprocessing.active_children():  # reward workers would outlive os._exit
        child.terminate()
    sys.stdout.flush()
    os._exit(EXIT_CODE)
