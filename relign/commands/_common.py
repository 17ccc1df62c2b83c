"""What every command shares: the one-line error convention (light: ``relign presets`` and ``--version`` import
it without torch; model loading for inference is ``commands.inference``)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class CommandError(Exception):
    """A problem the user can fix; printed as ``relign <command>: error: <message>``, exit 2."""


def fail(command: str, message: str) -> int:
    print(f"relign {command}: error: {message}", file=sys.stderr)
    return 2


class Parser(argparse.ArgumentParser):
    """argparse with relign's error line: one line, no usage block, exit status 2."""

    def __init__(self, command: str, **kwargs):
        super().__init__(prog=f"relign {command}", **kwargs)
        self.command = command

    def error(self, message: str) -> NoReturn:
        fail(self.command, f"{message} (relign {self.command} --help)")
        raise SystemExit(2)
