"""The checks every recipe runs on its config before anything is read or loaded.

A bad number is one line naming the key and its value, not a run that trains on empty batches
and exits 0 (batch_size=0), a ZeroDivisionError (micro_batch_size=0) or a loop that never
starts (max_steps=-1). Each recipe's ``_check`` calls these with its keys; ``check_common``
covers the shared sections (model, data, optim, checkpoint, logging).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any

from .config import SCHEDULES, CheckpointConfig, DataConfig, LoggingConfig, ModelConfig, OptimConfig, PreferenceDataConfig
from .dtypes import DTYPES
from .errors import ConfigError


def check_choice(name: str, value: str, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        raise ConfigError(f"bad value for '{name}': {value!r}; choose one of {', '.join(choices)}")


def get_key(cfg: Any, key: str) -> Any:
    """The value at a dotted key of a config object: ``get_key(cfg, "optim.lr")``."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _bad(key: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"bad value for '{key}': {value!r}; it must be {rule}")


def check_positive(cfg: Any, *keys: str, allow_none: bool = False) -> None:
    """Each key's value must be > 0 (an int: >= 1). ``allow_none``: null means unset."""
    for key in keys:
        value = get_key(cfg, key)
        if value is None and allow_none:
            continue
        if not value > 0:
            raise _bad(key, value, ">= 1" if isinstance(value, int) else "> 0")


def check_non_negative(cfg: Any, *keys: str) -> None:
    """Each key's value must be >= 0 (0 is the documented 'off' / 'all' of these fields)."""
    for key in keys:
        value = get_key(cfg, key)
        if not value >= 0:
            raise _bad(key, value, ">= 0")


def check_fraction(cfg: Any, *keys: str, closed: bool = False) -> None:
    """Each key's value must lie in [0, 1) (``closed``: [0, 1])."""
    for key in keys:
        value = get_key(cfg, key)
        if not (0 <= value <= 1 if closed else 0 <= value < 1):
            raise _bad(key, value, "in [0, 1]" if closed else "in [0, 1)")


def check_divides(cfg: Any, key: str, by: str, ranks: int = 1) -> None:
    """``key`` must be a multiple of ``by`` x ranks (a global batch cut into micro-batches on every rank)."""
    value, part = get_key(cfg, key), get_key(cfg, by)
    if value % (part * ranks):
        across = f" x ranks = {part} x {ranks}" if ranks > 1 else f"={part}"
        raise ConfigError(f"bad value for '{key}': {value}; it must be a multiple of {by}{across} "
                          f"(set {by} to a divisor of {key})")


def _looks_local(path: str) -> bool:
    """A path that can only mean a folder on this machine (a hub id is ``name`` or ``org/name``)."""
    return path.startswith((".", "/", "~")) or path.count("/") > 1 or "\\" in path


def check_model_path(key: str, path: str, *, required: bool = True) -> None:
    """A model key must be set, and a local-looking path must exist (hub ids are checked on load)."""
    if not path:
        if required:
            raise ConfigError(f"missing value for '{key}': give a local model folder, a hub id (org/name) or tiny:SIZE")
        return
    if path.startswith("tiny:"):
        return
    if _looks_local(path) and not Path(path).expanduser().exists():
        raise ConfigError(f"bad value for '{key}': {path!r}; no such folder (give a local model folder, a hub id "
                          "org/name or tiny:SIZE)")


def check_wandb(lg: LoggingConfig) -> None:
    """logging.wandb=true without wandb installed fails now, not when the run's tracker starts."""
    if lg.wandb:
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("logging.wandb=true needs Weights & Biases, which is not installed: pip install "
                              "'relign[wandb]' (or set logging.wandb=false)")


COMPILE_CHOICES = ("auto", "true", "false")  # model.compile (relign.models.loading.compile_enabled)


def check_compute_weights(dtype: str, gradient_checkpointing: bool) -> None:
    """``model.dtype=bf16-compute``'s limits in this version (``models.precision``): one process,
    no gradient checkpointing."""
    if dtype not in DTYPES or DTYPES[dtype].mode != "cast":
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's; read here without importing torch
        raise ConfigError(f"model.dtype={dtype} runs on one process in this version; under torchrun use "
                          "model.dtype=bf16-mixed (its FSDP policy gathers the weights in bf16)")
    if gradient_checkpointing:
        raise ConfigError(f"model.dtype={dtype} does not combine with model.gradient_checkpointing=true (the recompute "
                          "would run on the fp32 weights); use model.dtype=bf16-mixed")


def check_common(cfg: Any) -> None:
    """The shared sections a recipe config has (model, data, optim, checkpoint, logging)."""
    m = getattr(cfg, "model", None)
    if isinstance(m, ModelConfig):
        check_choice("model.dtype", m.dtype, tuple(DTYPES))
        check_choice("model.compile", str(m.compile).lower(), COMPILE_CHOICES)
        check_compute_weights(m.dtype, m.gradient_checkpointing)
        if DTYPES[m.dtype].param == "bfloat16" and not m.lora.enabled and isinstance(getattr(cfg, "optim", None), OptimConfig):
            warnings.warn(
                f"model.dtype={m.dtype} trains bf16 weights: an AdamW update smaller than about |w|/256 rounds to "
                "nothing (at lr 1e-6 most do). model.dtype=bf16-mixed keeps fp32 weights and computes in bf16.",
                stacklevel=2,
            )
        if m.lora.enabled:
            check_positive(cfg, "model.lora.r", "model.lora.alpha")
            check_fraction(cfg, "model.lora.dropout")
    d = getattr(cfg, "data", None)
    if isinstance(d, (DataConfig, PreferenceDataConfig)):
        check_positive(cfg, "data.max_length")
        check_non_negative(cfg, "data.max_rows")
        check_fraction(cfg, "data.eval_fraction")
    o = getattr(cfg, "optim", None)
    if isinstance(o, OptimConfig):
        check_positive(cfg, "optim.lr", "optim.eps")
        check_non_negative(cfg, "optim.weight_decay", "optim.warmup_steps", "optim.max_grad_norm")
        check_fraction(cfg, "optim.beta1", "optim.beta2")
        check_fraction(cfg, "optim.warmup_ratio", "optim.min_lr_ratio", closed=True)
        check_choice("optim.schedule", o.schedule, SCHEDULES)
    if isinstance(getattr(cfg, "checkpoint", None), CheckpointConfig):
        check_non_negative(cfg, "checkpoint.save_every", "checkpoint.keep_last")
    lg = getattr(cfg, "logging", None)
    if isinstance(lg, LoggingConfig):
        check_wandb(lg)


def check_rows(rows: int, batch_size: int, *, what: str, key: str = "batch_size") -> None:
    """At least one full batch of training rows (a step never trains on a partial batch)."""
    if rows < batch_size:
        raise ConfigError(f"{what}: {rows} usable training rows are fewer than one batch ({key}={batch_size}); "
                          f"lower {key} or give more data")
