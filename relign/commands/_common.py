"""What the commands share: the one-line error convention and model loading for inference."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
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


def resolve_model_arg(arg: str) -> str:
    """A model folder, hub id or ``tiny:`` spec as given; a run directory becomes its newest
    complete checkpoint (the folder a user has in hand after ``relign sft ...``)."""
    from ..checkpoint import latest_checkpoint

    p = Path(arg).expanduser()
    if p.is_dir() and not (p / "config.json").is_file() and not (p / "adapter_config.json").is_file() \
            and (p / "checkpoints").is_dir():
        ckpt = latest_checkpoint(p)
        if ckpt is None:
            raise CommandError(f"{arg}: a run directory without a complete checkpoint (nothing in {p / 'checkpoints'})")
        print(f"using the newest checkpoint of {arg}: {ckpt}", file=sys.stderr)
        return str(ckpt)
    return arg


def load_for_inference(arg: str, *, dtype: str = "fp32", device: str = "auto", trust_remote_code: bool = False):
    """(model in eval mode without gradients, tokenizer) for ``MODEL``; errors name MODEL."""
    from ..config import ConfigError
    from ..models.loading import load_causal_lm, load_tokenizer, resolve_device

    path = resolve_model_arg(arg)
    try:
        tok = load_tokenizer(path, trust_remote_code=trust_remote_code, key="MODEL")
        model = load_causal_lm(path, dtype=dtype, device=resolve_device(device), trust_remote_code=trust_remote_code,
                               key="MODEL")
    except ConfigError as e:
        raise CommandError(str(e)) from None
    return model.eval().requires_grad_(False), tok
