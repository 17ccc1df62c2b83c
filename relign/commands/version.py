"""``relign version`` / ``relign --version``: relign and the libraries a bug report needs."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

from .. import __version__
from ._common import fail

# Read from package metadata, not by importing: printing a version must not wait for torch.
LIBRARIES = ("torch", "transformers", "peft", "vllm")


def version_line() -> str:

    parts = []
    for name in LIBRARIES:
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:  # optional ones (vllm) are simply left out
            continue
    parts.append(f"python {platform.python_version()}")
    return f"relign {__version__} ({', '.join(parts)})"


def main(argv: list[str]) -> int:
    if argv and argv[0] not in ("-h", "--help"):
        return fail("version", f"takes no arguments, got {' '.join(argv)}")
    if argv:
        print("usage: relign version   (or relign --version)\n\nPrint relign's version and those of torch, transformers, peft (and vllm).")
        return 0
    print(version_line())
    return 0
