"""Shared fixtures: a tiny model with a locally trained tokenizer, built once per session."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One compute thread per xdist worker (and per CLI subprocess it starts): the workers
    # share the cores, and more threads than cores only adds contention.
    os.environ["OMP_NUM_THREADS"] = "1"

REPO = Path(__file__).resolve().parents[1]


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


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run the real command line (``python -m relign ...``) in a subprocess."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "relign", *args], capture_output=True, text=True, env=full_env, cwd=cwd or REPO, timeout=600
    )
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
