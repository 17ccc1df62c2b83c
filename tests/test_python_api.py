"""docs/python_api.md runs as it is written.

Every ```python block of the page runs, in order, in one namespace (the page says so: it reads
like a notebook). A block that opens with ``# file: NAME.py`` is a file the page asks the reader
to save: it is written into the working directory instead of run. The page's own ``assert``
lines are the checks (a run directory with metrics.jsonl, the reward function's values in the
traces, a scripted engine scoring 1.0, ...); this test adds that every recipe is on the page.

The working directory is a temporary folder (the page writes files there), the page's runs go
under ``$RELIGN_DOCS_RUN``, ``tiny:micro`` resolves in a temporary ``$RELIGN_CACHE`` (seeded with
the session's micro model, which is the same build), the hub is offline and torch has one thread.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from .conftest import torch_threads

PAGE = Path(__file__).resolve().parents[1] / "docs" / "python_api.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```\s*$", re.S | re.M)
_FILE = re.compile(r"# file: (?P<name>[\w./-]+\.py)\n")


def blocks() -> list[tuple[int, str | None, str]]:
    """(line of the block's first code line, file name or None, code) for each python block, in order."""
    text = PAGE.read_text(encoding="utf-8")
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start(1)) + 1
        code = m.group(1)
        f = _FILE.match(code)
        out.append((line, f["name"] if f else None, code))
    return out


def test_every_block_compiles_and_every_recipe_is_shown():
    found = blocks()
    assert len(found) >= 10, "docs/python_api.md: no ```python blocks found"
    for line, _, code in found:
        compile("\n" * (line - 1) + code, str(PAGE), "exec")  # a SyntaxError names the page's line
    from relign.recipes import RECIPES

    code = "\n".join(c for _, name, c in found if name is None)
    for command, (module, _) in RECIPES.items():
        name = module.rsplit(".", 1)[1]
        assert re.search(rf"\bfrom relign\.recipes import .*\b{name}\b", code), (
            f"docs/python_api.md shows no run of `relign {command}` ({module}): add a block that imports and trains it")


def test_python_api_page_runs(tmp_path, monkeypatch, tiny_model_dir):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_model_dir, cache / "tiny" / "qwen2-micro")  # what tiny:micro builds: no second build
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("RELIGN_CACHE", str(cache))
    monkeypatch.setenv("RELIGN_DOCS_RUN", str(tmp_path / "runs"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    namespace: dict = {"__name__": "python_api_page"}
    with torch_threads(1):
        for line, name, code in blocks():
            if name is not None:
                (work / name).write_text(code, encoding="utf-8")
                continue
            # blank lines up to the block's place: a traceback names the page's own line numbers
            exec(compile("\n" * (line - 1) + code, str(PAGE), "exec"), namespace)  # noqa: S102 - our own docs
    assert (tmp_path / "runs" / "sft" / "metrics.jsonl").is_file()
