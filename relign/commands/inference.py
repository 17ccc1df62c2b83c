"""What the commands that run a model share (chat, generate, merge-lora): the model a user names, loaded for inference."""

from __future__ import annotations

import sys
from pathlib import Path

from ..checkpoint import latest_checkpoint
from ..errors import ConfigError
from ..models.loading import load_causal_lm, load_tokenizer, resolve_device
from ._common import CommandError


def resolve_model_arg(arg: str) -> str:
    """A model folder, hub id or ``tiny:`` spec as given; a run directory becomes its newest
    complete checkpoint (the folder a user has in hand after ``relign sft ...``)."""
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
    path = resolve_model_arg(arg)
    try:
        tok = load_tokenizer(path, trust_remote_code=trust_remote_code, key="MODEL")
        model = load_causal_lm(path, dtype=dtype, device=resolve_device(device), trust_remote_code=trust_remote_code,
                               key="MODEL")
    except ConfigError as e:
        raise CommandError(str(e)) from None
    return model.eval().requires_grad_(False), tok
