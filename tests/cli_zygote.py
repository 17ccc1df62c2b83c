"""A fork server for the suite's ``relign`` runs (``conftest.run_relign``).

A fresh ``python -m relign`` spends 4-7 s of CPU importing torch, transformers and the model
code before it parses an argument; the suite starts the CLI about 160 times. This process
imports all of that once, then forks one child per run. The child is a real process (its own
exit status, stdin/stdout/stderr files, working directory and environment) that runs
``python -m relign ARGS`` exactly as the interpreter would (``runpy``, ``__main__``, atexit),
only without the imports. The server is itself a fresh interpreter, started with the suite's
environment as it was before any test ran, and it never runs a test's code, so no test's state
reaches a child.

What a fork cannot change is what was read at import time: environment variables other than
``RELIGN_*``, for one. ``run_relign`` sends such runs to a plain subprocess instead.

``--vllm``: a second server that has also imported vLLM (5-6 s of a run's start), for the runs
that name it; ``run_relign`` keeps every other run on the plain server, whose children have not
imported it, as a fresh ``relign`` that does not use it has not.

A run on several ranks (``ranks``: each rank's extra environment, torchrun's variables) forks
one child per rank; when one fails the others are killed, as torchrun does.

Protocol, one JSON line each way per run: the request {args, env, cwd, stdin, stdout, stderr
(paths of files), ranks}; the reply {"pids": [...]} at once, then {"code", "codes"} when the
children have ended (code: the first non-zero status, else 0).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import sys
import traceback


def _preload(vllm: bool) -> None:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401

    import relign.cli  # noqa: F401
    from relign.commands import COMMANDS
    from relign.recipes import RECIPES

    for module in [m for m, _ in RECIPES.values()] + [m for m, _, _ in COMMANDS.values()]:
        importlib.import_module(module)
    if vllm:  # as relign imports it (in-process engine mode and its log level set first)
        from relign.config import ConfigError
        from relign.rollout.vllm_engine import import_vllm

        try:
            import_vllm()
        except ConfigError:  # not installed: each run says so itself, as a fresh process would
            pass


def _child(req: dict, rank_env: dict, protocol: tuple[int, int]) -> None:
    code = 1
    try:
        for fd in protocol:
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update({**req["env"], **rank_env})
        # the ranks of one run share stdout and stderr, as torchrun's workers share its own
        for fd, path, flags in ((0, req["stdin"], os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_APPEND),
                                (2, req["stderr"], os.O_WRONLY | os.O_APPEND)):
            f = os.open(path, flags)
            os.dup2(f, fd)
            os.close(f)
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        sys.argv = ["-m", *req["args"]]
        try:
            runpy.run_module("relign", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:  # what the interpreter does with an uncaught exception
            traceback.print_exc()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _wait_all(pids: list[int]) -> list[int]:
    """Exit statuses of ``pids``; once one fails, the others are killed (torchrun's rule: a rank
    waiting in a collective for a dead one would wait forever)."""
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        pid, status = os.wait()
        if pid not in pids:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0:
            for other in pids:
                if other not in codes:
                    try:
                        os.kill(other, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    return [codes[p] for p in pids]


def main() -> None:
    # the protocol runs on copies of stdin/stdout; the children's fds 0-2 are their own files
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    _preload(vllm="--vllm" in sys.argv[1:])
    requests, replies = os.fdopen(rfd, "r"), os.fdopen(wfd, "w")
    replies.write(json.dumps({"env": dict(os.environ)}) + "\n")
    replies.flush()
    for line in requests:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank_env in req.get("ranks") or [{}]:
            pid = os.fork()
            if pid == 0:
                _child(req, rank_env, (rfd, wfd))
            pids.append(pid)
        replies.write(json.dumps({"pids": pids}) + "\n")
        replies.flush()
        codes = _wait_all(pids)
        replies.write(json.dumps({"code": next((c for c in codes if c != 0), 0), "codes": codes}) + "\n")
        replies.flush()

if __name__ == "__main__":
    main()
