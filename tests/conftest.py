"""Shared fixtures: a tiny model with a locally trained tokenizer, built once per session."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One compute thread per xdist worker (and per CLI subprocess it starts): the workers
    # share the cores, and more threads than cores only adds contention.
    os.environ["OMP_NUM_THREADS"] = "1"

REPO = Path(__file__).resolve().parents[1]
_SERVER_ENV = dict(os.environ)  # before any test changed it: the CLI fork server's environment


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from relign.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "qwen2-micro"
    build_tiny_model(out, arch="qwen2", size="micro", seed=0)
    return out


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def load_script(relpath: str, name: str):
    """A script of the repository that is not a package module (bench/*.py, tools/*.py), imported
    by path under ``name`` (registered in sys.modules: dataclasses look their module up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


class _ForkServer:
    """The parent side of ``tests/cli_zygote.py``: one per xdist worker, started on first use."""

    def __init__(self, vllm: bool = False):
        self.log = tempfile.NamedTemporaryFile(prefix="relign-fork-server-", suffix=".log", delete=False)
        flavor = ["--vllm"] if vllm else []
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_zygote", *flavor], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, cwd=REPO,
                                     env={**_SERVER_ENV, "PYTHONUNBUFFERED": "1"})
        self.buf = b""
        # the imports are done; its environment now includes what they set (torch's, relign's defaults)
        self.env = self._expect(self._reply(timeout=300), "env", "start")

    def _expect(self, reply: dict | None, key: str, what: str):
        if reply is None:
            raise RuntimeError(f"the CLI fork server (tests/cli_zygote.py) did not {what} in time:\n"
                               f"{Path(self.log.name).read_text()[-3000:]}")
        return reply[key]

    def _reply(self, timeout: float) -> dict | None:
        """The next reply line, or None when none came within ``timeout`` seconds."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the CLI fork server (tests/cli_zygote.py) died:\n{Path(self.log.name).read_text()[-3000:]}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, args: list[str], env: dict, cwd: Path, stdin: str | None, timeout: float,
            ranks: list[dict] | None = None) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="relign-cli-") as tmp:
            files = {name: Path(tmp) / name for name in ("stdin", "stdout", "stderr")}
            for f in files.values():
                f.write_text("")
            files["stdin"].write_text(stdin or "")
            req = {"args": args, "env": env, "cwd": str(cwd), "ranks": ranks, **{k: str(v) for k, v in files.items()}}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            pids = self._expect(self._reply(timeout=60), "pids", "fork the run")
            done = self._reply(timeout)
            if done is None:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self._reply(timeout=60)
                raise subprocess.TimeoutExpired(["relign", *args], timeout)
            out, err = (files[k].read_text(errors="replace") for k in ("stdout", "stderr"))
        return subprocess.CompletedProcess([sys.executable, "-m", "relign", *args], done["code"], out, err)

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)


_fork_servers: dict[bool, _ForkServer] = {}  # False: the plain server; True: one that has also imported vLLM


def run_relign(args, env: dict | None = None, cwd: Path | None = None, stdin: str | None = None,
               unset: tuple[str, ...] = (), timeout: float = 600, ranks: int = 1, fork: bool = True
               ) -> subprocess.CompletedProcess:
    """``python -m relign ARGS`` as a new process: a fork of the fork server (tests/cli_zygote.py,
    which has torch and transformers imported already) when what the test asks of the
    environment (``env``, ``unset``) differs from the server's only in ``RELIGN_*`` variables,
    read at run time; else a plain subprocess. The run's environment is the suite's at start
    plus ``env``: pass variables there (``monkeypatch.setenv`` does not reach a run). Set
    RELIGN_TEST_SUBPROCESS=1 (or ``fork=False``) for a plain subprocess.

    ``ranks`` > 1: that many ranks, as ``torchrun --standalone --nproc_per_node RANKS`` starts
    them: forked with torchrun's environment, rendezvousing at a TCP store this process holds
    (torchrun's agent store: bound to a free port by the OS, so no port is probed and lost to a
    race), or torchrun itself in the subprocess case."""
    args = [str(a) for a in args]
    # Every run starts from the suite's environment, plus what the test passes: never from
    # what an earlier in-process test left in os.environ (vLLM's import sets VLLM_* variables).
    if fork and sys.platform.startswith("linux") and not os.environ.get("RELIGN_TEST_SUBPROCESS"):  # fork: Linux
        # a run that names vLLM (rollout.engine=vllm, --engine vllm, ...) forks from a server that
        # has imported it too (5-6 s a run); every other run from one that has not, as a fresh
        # process would not have
        vllm = any(a == "vllm" or a.endswith("=vllm") for a in args)
        _fork_server = _fork_servers.get(vllm)
        if _fork_server is None or _fork_server.proc.poll() is not None:
            _fork_server = _fork_servers[vllm] = _ForkServer(vllm)
            atexit.register(_fork_server.close)
        # the server's environment includes what its imports set (setdefault), as a fresh process's would
        child_env = {k: v for k, v in {**_fork_server.env, **(env or {})}.items() if k not in unset}
        changed = {k for k in set(env or {}) | set(unset) if child_env.get(k) != _fork_server.env.get(k)}
        if all(k.startswith("RELIGN_") for k in changed):
            if ranks == 1:
                return _fork_server.run(args, child_env, cwd or REPO, stdin, timeout)
            from torch.distributed import TCPStore

            store = TCPStore("127.0.0.1", 0, ranks, True, timedelta(seconds=timeout), wait_for_workers=False)
            shared = {"WORLD_SIZE": ranks, "LOCAL_WORLD_SIZE": ranks, "ROLE_WORLD_SIZE": ranks, "GROUP_RANK": 0,
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": store.port, "TORCHELASTIC_USE_AGENT_STORE": "True",
                      "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0, "TORCHELASTIC_RUN_ID": "none"}
            per_rank = [{k: str(v) for k, v in {**shared, "RANK": r, "LOCAL_RANK": r, "ROLE_RANK": r}.items()}
                        for r in range(ranks)]
            try:
                return _fork_server.run(args, child_env, cwd or REPO, stdin, timeout, ranks=per_rank)
            finally:
                del store
    full_env = {k: v for k, v in {**_SERVER_ENV, "PYTHONUNBUFFERED": "1", **(env or {})}.items() if k not in unset}
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks > 1 else []
    return subprocess.run([sys.executable, *launcher, "-m", "relign", *args], input=stdin, capture_output=True, text=True,
                          env=full_env, cwd=cwd or REPO, timeout=timeout, stdin=None if stdin is not None else subprocess.DEVNULL)


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run the real command line (``python -m relign ...``) in a new process (``run_relign``)."""
    proc = run_relign(args, env=env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"relign {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


@contextlib.contextmanager
def torch_threads(n: int):
    """Run with ``n`` torch threads. Two cores shared with other jobs: OpenMP workers spinning on
    busy cores make a micro model's small matmuls far slower than one thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """Modules with the most slow-test seconds first (a stable sort; a slow test counts 10 s unless
    its mark says more: ``@pytest.mark.slow(seconds=60)``): with ``--dist loadscope
    --no-loadscope-reorder`` (pyproject's addopts), xdist hands out whole modules in this order
    as workers free up, so the longest runs start at once and the short modules pack around
    them. (Plain ``--dist load`` gives each worker a chunk of consecutive tests up front, and
    loadscope's own reorder puts the modules with the most tests first, slow or not.)"""
    dist = getattr(config, "workerinput", {}).get("relign_dist") or config.getoption("dist", "no")
    if dist != "loadscope":
        return
    slow: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        mark = item.get_closest_marker("slow")
        slow[module] = slow.get(module, 0) + (mark.kwargs.get("seconds", 10) if mark is not None else 0)
    items.sort(key=lambda item: -slow[item.nodeid.split("::")[0]])


class _TellWorkersTheDist:
    @staticmethod
    def pytest_configure_node(node):
        """xdist's controller: a worker's own ``dist`` option reads "no"; it sorts by this one."""
        node.workerinput["relign_dist"] = node.config.getoption("dist")


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_TellWorkersTheDist())
