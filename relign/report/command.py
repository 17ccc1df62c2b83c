"""``relign report RUN_DIR [RUN_DIR ...] [--out PATH]``: the command line of the report.

One run directory: its ``report.html``. Two or more: one page overlaying their charts
(compare.py). Errors a user can fix are one line, ``relign report: error: ...``, exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..checkpoint import atomic_write_text
from .compare import write_compare
from .load import check_run_dir, load_run
from .page import render_page, write_report

USAGE = """usage: relign report RUN_DIR [RUN_DIR ...] [--out PATH]

Write RUN_DIR/report.html: summary, metric plots, rollout traces, eval samples (one
self-contained file; opening it needs no network).

With two run directories or more, write one page that overlays their charts, one colour per
run, and compares their final metrics and wall time: RUN_DIR/compare.html of the first run,
or PATH.

options:
  --out PATH   where to write the page (a file, or a folder to hold it)
  -h, --help   show this help"""


class UsageError(Exception):
    """A command-line mistake: printed as one line, exit status 2."""


def parse(argv: list[str]) -> tuple[list[str], str | None]:
    """(run directories, --out or None); raises UsageError."""
    dirs: list[str] = []
    out: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--out" or arg.startswith("--out="):
            if out is not None:
                raise UsageError("--out given twice")
            if arg == "--out":
                if i + 1 >= len(argv):
                    raise UsageError("--out needs a PATH")
                i += 1
                out = argv[i]
            else:
                out = arg.split("=", 1)[1]
            if not out:
                raise UsageError("--out needs a PATH")
        elif arg.startswith("-") and arg != "-":
            raise UsageError(f"unknown option {arg} (see relign report --help)")
        else:
            dirs.append(arg)
        i += 1
    if not dirs:
        raise UsageError("give at least one RUN_DIR (see relign report --help)")
    seen: set[Path] = set()
    for d in dirs:
        key = Path(d).resolve()
        if key in seen:
            raise UsageError(f"the same run directory twice: {d}")
        seen.add(key)
    return dirs, out


def main(argv: list[str]) -> int:
    """The ``report`` subcommand; returns the exit status (0, or 2 on a user error)."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        dirs, out = parse(argv)
        path = _write(dirs, out)
    except UsageError as e:
        return _fail(str(e))
    except FileNotFoundError as e:
        return _fail(_not_found(e))
    except OSError as e:  # a read-only or full disk: name the path
        return _fail(f"cannot write {e.filename or out or dirs[0]}: {e.strerror or e}")
    print(f"report: {path}")
    return 0


def _write(dirs: list[str], out: str | None) -> Path:
    if len(dirs) > 1:
        return write_compare(dirs, out)
    if out is None:
        return write_report(dirs[0])
    check_run_dir(Path(dirs[0]))
    path = Path(out) / "report.html" if Path(out).is_dir() else Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, render_page(load_run(Path(dirs[0]))))
    return path


def _not_found(e: FileNotFoundError) -> str:
    """check_run_dir's errors as a user reads them: what is missing, and where."""
    reason = e.strerror or "not found"
    if reason.startswith("not a run directory"):
        return f"not a run directory (no config.yaml or metrics.jsonl): {Path(e.filename).parent}"
    return f"not found: {e.filename or e} ({reason})"


def _fail(message: str) -> int:
    print(f"relign report: error: {message}", file=sys.stderr)
    return 2
