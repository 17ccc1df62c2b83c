"""What every command shares: the one-line error convention (light: ``relign presets`` and ``--version`` import
it without torch; model loading for inference is ``commands.inference``)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class CommandError(Exception):
    """A problem the user can fix; printed as ``relign <command>: error: <message>``, exit 2."""


MODEL_HELP = "model folder, hub id, tiny:SIZE, or a run directory (its newest checkpoint)"


def add_model_args(p: argparse.ArgumentParser, *, device_help: str = "auto, cpu, cuda, cuda:1 ...") -> None:
    """The flags of a command that loads a model: its dtype, device and remote code."""
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="auto", help=device_help)
    p.add_argument("--trust-remote-code", action="store_true", help="let a hub model run its own code")


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
