"""Run directories: where a run writes, and when it may write where another run already did.

Every preset names its ``run_dir``, so running a preset twice would write the second run into
the first one's directory (and ``resume=auto`` would quietly continue the stale checkpoint).
``open_run`` decides, once per run, in one place:

- ``run_dir`` empty: ``runs/<recipe>-<timestamp>``;
- ``run_dir`` new, empty, or holding no run (no config, metrics or checkpoints): that directory;
- ``run_dir`` holding a run and resume asked (``resume=auto`` or a checkpoint path): that
  directory, if the saved config equals the new one except for the keys a resume may change
  (``RESUMABLE``); otherwise a ConfigError that names each differing key with both values;
- ``run_dir`` holding a run and no resume asked: a fresh sibling ``<run_dir>-2`` (``-3``, ...),
  announced on stderr. The old run is never written to.

The resolved directory is what the saved config records as ``run_dir``, so
``relign sft RUN/config.yaml resume=auto`` continues exactly that run. Under torchrun rank 0
decides (and creates the directory, removes a killed save's temp folders, writes the config);
every rank gets its answer, or its error.

Like TRL's ``output_dir`` + ``resume_from_checkpoint``, resume is opt-in; unlike it, a repeated
command never mixes two runs in one directory.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from . import distributed
from .checkpoint import atomic_write_text, remove_stale_temps
from .config import to_yaml
from .errors import ConfigError

# Keys (and key prefixes) a resumed run may change without becoming another run: where it writes,
# how long it goes on (extending a finished run is the usual reason to resume), what it logs, how
# often it saves, and the device. Everything else (model, data, optimizer, algorithm, seed) must match.
RESUMABLE = ("resume", "run_dir", "max_steps", "epochs", "iterations", "max_seconds", "logging", "checkpoint", "device",
             "plan")
# Files whose presence means a directory holds a run (besides the recipe's own config file).
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")
_NO_RESUME = ("", "none", "false", "False")
_MAX_SHOWN = 8  # differing keys named in the error; the rest are counted


# --------------------------------------------------------------------------- process state
#
# What this process was asked (``--dry-run``) and how deep in nested recipe runs it is (the demo's
# stages, ReST-EM's fine-tunes, the verifier's SFT). The console (``relign.banner``) reads it; so
# does ``open_run``, which remembers only the outermost run's directory.

_state = {"dry_run": False, "depth": 0, "memory_plan": ""}


class DryRunDone(Exception):
    """Raised by a recipe after a ``--dry-run`` printed its plan; the CLI exits 0 on it."""


def request_dry_run(on: bool = True) -> None:
    """Make the next recipe print its plan and stop before training (the CLI's ``--dry-run``)."""
    _state["dry_run"] = on


def dry_run_requested() -> bool:
    return bool(_state["dry_run"])


def set_memory_plan(text: str) -> None:
    """The run's memory plan as ``relign plan`` prints it (``recipes/memory.check``, at the run's
    start), for ``--dry-run`` to print beside its own summary."""
    _state["memory_plan"] = text


def memory_plan() -> str:
    return str(_state["memory_plan"])


@contextmanager
def nested():
    """Recipe runs inside another recipe (the demo's stages, ReST-EM's fine-tunes, the verifier's
    SFT) print no banner or summary of their own: the outer run's describe the whole."""
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1


def is_nested() -> bool:
    return _state["depth"] > 0


def make_run_dir(run_dir: str, recipe: str) -> Path:
    """Create ``run_dir`` (empty: ``runs/<recipe>-<timestamp>``) and return it, whatever it holds.

    The plain building block; recipes call ``open_run``, which also keeps runs apart."""
    path = Path(run_dir or default_run_dir(recipe))
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_run_dir(recipe: str) -> str:
    return os.path.join("runs", f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}")


def save_resolved_config(cfg: Any, run_dir: Path, name: str = "config.yaml") -> None:
    atomic_write_text(Path(run_dir) / name, to_yaml(cfg))


def holds_run(path: Path, config_name: str = "config.yaml") -> bool:
    """Whether ``path`` holds an earlier run (its config, metrics or checkpoints)."""
    return any((path / name).exists() for name in {config_name, *RUN_MARKERS})


def run_config_of(model_path: str, config_name: str = "config.yaml") -> Path | None:
    """The resolved config of the run that wrote the model at ``model_path``: the folder's own
    ``config.yaml`` (a run directory), or its run's, above ``checkpoints/step_N``; None if neither."""
    if not model_path or model_path.startswith("tiny:"):
        return None
    p = Path(model_path).expanduser()
    for folder in (p, p.parent.parent if p.parent.name == "checkpoints" else None):
        if folder is not None and (folder / config_name).is_file():
            return folder / config_name
    return None


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _resumable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE)


def config_differences(saved: dict[str, Any], new: dict[str, Any],
                       defaults: dict[str, Any] | None = None) -> list[tuple[str, Any, Any]]:
    """``(dotted key, saved value, new value)`` for every key whose value differs, ignoring
    ``RESUMABLE`` keys; keys both sides have first, then those one side lacks (shown as
    ``(absent)``), each group in key order. A key the saved config lacks (written by an older
    relign) is no difference when the new value is the field's default, given in ``defaults``."""
    a, b, d = _flatten(saved), _flatten(new), _flatten(defaults or {})
    out = []
    for key in sorted(set(a) | set(b)):
        if _resumable(key):
            continue
        old, val = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if old is _ABSENT and key in d and d[key] == val:
            continue
        if old != val:
            out.append((key, old, val))
    return sorted(out, key=lambda kv: (kv[1] is _ABSENT or kv[2] is _ABSENT, kv[0]))


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value) if value == "" or " " in value else value
    return repr(value) if isinstance(value, _Absent) else str(value)


def format_differences(diffs: list[tuple[str, Any, Any]]) -> str:
    """``optim.lr 0.001 -> 0.002, seed 0 -> 1`` (the first few, then how many more)."""
    shown = ", ".join(f"{k} {_show(old)} -> {_show(new)}" for k, old, new in diffs[:_MAX_SHOWN])
    more = len(diffs) - _MAX_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _claim_sibling(path: Path) -> Path:
    """Create and return the first free ``<path>-2``, ``<path>-3``, ... ``mkdir`` without
    ``exist_ok`` is the claim, so two runs started at once never get the same one."""
    n = 2
    while True:
        candidate = path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            n += 1


def choose_run_dir(run_dir: str, recipe: str, *, resume: str | None, new_config: dict[str, Any],
                   config_name: str = "config.yaml", defaults: dict[str, Any] | None = None) -> tuple[Path, str]:
    """The directory this run writes to, created, and a note for the user ("" when there is
    nothing to say). ``resume`` is None for a recipe that cannot resume (eval, demo). Raises
    ConfigError when resume is asked into a run with other settings."""
    given = run_dir or default_run_dir(recipe)
    path = Path(given)
    if not path.is_dir() or not holds_run(path, config_name):
        path.mkdir(parents=True, exist_ok=True)
        return path, ""
    if resume is not None and resume not in _NO_RESUME:
        saved = path / config_name
        if saved.is_file():
            try:
                saved_config = OmegaConf.to_container(OmegaConf.load(saved))
            except Exception as e:  # YAML or I/O: either way nothing to compare with
                raise ConfigError(f"run_dir={given}: cannot read its {config_name} to check it is the same run "
                                  f"({type(e).__name__}); drop resume= for a fresh directory beside it") from None
            diffs = config_differences(saved_config if isinstance(saved_config, dict) else {}, new_config, defaults)
            if diffs:
                raise ConfigError(
                    f"run_dir={given} holds a run with different settings: {format_differences(diffs)}; "
                    f"resume={resume} continues a run only with its own settings: set them back, drop resume= for a "
                    f"fresh directory beside it, or start a new run_dir from its checkpoint (run_dir=NEW resume=PATH)")
        return path, ""
    fresh = _claim_sibling(path)
    hint = " (resume=auto would continue that one)" if resume is not None else ""
    return fresh, f"run_dir={given} holds an earlier run{hint}: this run writes to {fresh}"


def open_run(cfg: Any, recipe: str, *, config_name: str = "config.yaml") -> Path:
    """Resolve, create and return the run directory of ``cfg`` (rules in the module docstring),
    and write the resolved config there as ``config_name`` with ``run_dir`` set to it.

    A collective under torchrun: every rank must call it."""
    return Path(distributed.on_main_for_all(lambda: str(_open_on_main(cfg, recipe, config_name))))


def opened(path: Path | str) -> tuple[str, str] | None:
    """What the latest outermost ``open_run`` of this process found at ``path``, if ``path`` is
    the directory it returned: ("created" | "empty" | "run", the config file it wrote). A dry
    run asks it to know what it may remove (``banner.dry_run``): a directory it created, or its
    config in an empty one, and never an earlier run's."""
    if _last_open.get("path") == str(path):
        return _last_open["how"], _last_open["config_name"]
    return None


_last_open: dict[str, str] = {}


def _open_on_main(cfg: Any, recipe: str, config_name: str) -> Path:
    new_config = OmegaConf.to_container(OmegaConf.structured(cfg))
    defaults = OmegaConf.to_container(OmegaConf.structured(type(cfg))) if dataclasses.is_dataclass(cfg) else None
    resume = str(cfg.resume or "") if hasattr(cfg, "resume") else None
    given = getattr(cfg, "run_dir", "")
    existed = bool(given) and Path(given).is_dir()
    held = existed and holds_run(Path(given), config_name)
    path, note = choose_run_dir(given, recipe, resume=resume, new_config=new_config,
                                config_name=config_name, defaults=defaults)
    if not is_nested():  # a stage's open (the verifier's SFT, the demo's) reuses its parent's directory
        how = "created" if not existed or str(path) != str(Path(given)) else "run" if held else "empty"
        _last_open.update(path=str(path), how=how, config_name=config_name)
    if note:
        print(note, file=sys.stderr, flush=True)
    remove_stale_temps(path)  # a killed save's .tmp-step_* / .old-step_* (only rank 0 writes, and not yet)
    resolved = dataclasses.replace(cfg, run_dir=str(path)) if hasattr(cfg, "run_dir") else cfg
    save_resolved_config(resolved, path, config_name)
    return path
