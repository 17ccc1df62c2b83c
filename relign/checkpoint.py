"""Atomic checkpoints and resume.

Layout of one checkpoint::

    checkpoints/step_N/
        model.safetensors, config.json, ...   HF save_pretrained (only the adapter with LoRA)
        tokenizer files
        trainer_state.pt                      optimizer / scheduler / RNG tensors (weights_only)
        relign_state.json                     step, data position, metrics, anything JSON

A checkpoint is written under ``checkpoints/.tmp-step_N-<pid>`` and renamed to ``step_N``
only once every file is flushed. ``relign_state.json`` is written last, so a directory named
``step_N`` without it is never treated as complete either.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "relign_state.json"
TENSOR_FILE = "trainer_state.pt"
_STEP_RE = re.compile(r"^step_(\d+)$")


def _fault(point: str, step: int) -> None:
    """Test hook: ``RELIGN_FAULT=<point>`` or ``<point>:<step>`` kills the process hard there.

    Used by the tests to prove that a crash mid-write never leaves a checkpoint that looks
    complete, and that a killed run resumes exactly. Costs one dict lookup otherwise.
    """
    if os.environ.get("RELIGN_FAULT") in (point, f"{point}:{step}"):
        os.kill(os.getpid(), 9)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- RNG


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch: the streams ``rng_state`` saves and restores."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _rng_to_savable(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor | list], dict[str, Any]]:
    """Split RNG state into tensors (for weights_only torch.save) and JSON."""
    tensors: dict[str, Any] = {"torch": state["torch"]}
    if "cuda" in state:
        tensors["cuda"] = list(state["cuda"])
    py = state["python"]
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    js = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
    }
    return tensors, js


def set_rng_state(tensors: dict[str, Any], js: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])
    py = js["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = js["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


# --------------------------------------------------------------------------- save / find / load


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step}"


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model: Any,
    tokenizer: Any = None,
    tensors: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
    keep_last: int = 0,
    extra_models: dict[str, Any] | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``checkpoints/step_N`` atomically and prune to the newest ``keep_last``.

    ``tensors`` (optimizer / scheduler state dicts, ...) go to a weights_only-loadable
    ``trainer_state.pt`` together with the RNG state; ``state`` must be JSON-serialisable.
    ``extra_models`` maps a sub-folder name to another model to save (a critic, say), or to a
    ``(model, full state dict)`` pair when that model is sharded.
    ``state_dict`` is the full model state gathered from sharded ranks (``gather_train_state``);
    call this on rank 0 only in that case.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()

    if state_dict is not None:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    else:
        model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    for name, extra in (extra_models or {}).items():
        extra, extra_sd = extra if isinstance(extra, tuple) else (extra, None)
        extra.save_pretrained(tmp / name, safe_serialization=True, state_dict=extra_sd)
    _fault("checkpoint-mid-write", step)

    rng_tensors, rng_js = _rng_to_savable(rng_state())
    payload = dict(tensors or {})
    payload["rng"] = rng_tensors
    torch.save(payload, tmp / TENSOR_FILE)
    meta = {"step": step, "rng": rng_js, **(state or {})}
    with open(tmp / STATE_FILE, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)

    if final.exists():  # re-saving the same step (e.g. final == last periodic save)
        old = root / f".old-step_{step}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    _fault("checkpoint-saved", step)

    if keep_last > 0:
        for old_step, path in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)
    from .report import refresh_report  # here, not at the top: report reads checkpoints

    refresh_report(run_dir)  # the run's page follows its checkpoints (never raises)
    return final


def gather_train_state(model: Any, optimizer: torch.optim.Optimizer) -> tuple[dict | None, dict]:
    """Full (unsharded) model and optimizer state on CPU, keyed by parameter name.

    A collective under FSDP2: every rank must call it; rank 0 receives the full tensors.
    On one process the model state is None (``save_pretrained`` reads the model itself).
    Keying the optimizer state by parameter name makes a checkpoint independent of the
    number of ranks: a run saved on 2 ranks resumes on 1, or on 4.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from . import distributed

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=opts) if distributed.world_size() > 1 else None
    optim_sd = get_optimizer_state_dict(model, optimizer, options=opts)
    return model_sd, optim_sd


def resume_training(ckpt, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, sampler: Any) -> int:
    """Restore the optimizer, schedule and data position of an offline recipe (sft, rm, dpo) from
    ``ckpt`` (the weights are loaded before sharding, by ``load_model_weights``); returns the
    step to continue after, 0 without a checkpoint."""
    if ckpt is None:
        return 0
    tensors, state = load_checkpoint(ckpt)
    restore_optimizer(model, optimizer, tensors["optimizer"])
    scheduler.load_state_dict(tensors["scheduler"])
    sampler.load_state_dict(state["sampler"])
    return int(state["step"])


def save_final(run_dir, save: Any, *, total_steps: int, start_step: int, save_final: bool) -> Path | None:
    """Save the last step unless it is already saved (or ``save_final`` is off); returns the
    newest checkpoint, which the caller reports as the run's result."""
    if save_final and total_steps > start_step and total_steps not in dict(list_checkpoints(run_dir)):
        save(total_steps)
    saved = list_checkpoints(run_dir)
    return saved[-1][1] if saved else None


def restore_optimizer(model: Any, optimizer: torch.optim.Optimizer, optim_sd: dict) -> None:
    """Load a ``gather_train_state`` optimizer state into a (possibly sharded) optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_sd, options=StateDictOptions(full_state_dict=True))


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first. Temporary and half-written folders are ignored."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and (child / STATE_FILE).is_file() and (child / TENSOR_FILE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def resolve_resume(resume: str, run_dir: str | os.PathLike) -> Path | None:
    """``none``/empty: start fresh; ``auto``: newest complete checkpoint if any; else a path."""
    if resume in ("", "none", "false", "False"):
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        from .config import ConfigError

        raise ConfigError(f"resume={resume}: not a complete relign checkpoint (no {STATE_FILE})")
    return path


def load_checkpoint(path: str | os.PathLike, *, restore_rng: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return (tensors, state) of a checkpoint and, by default, restore the RNG streams."""
    path = Path(path)
    tensors = torch.load(path / TENSOR_FILE, map_location="cpu", weights_only=True)
    with open(path / STATE_FILE) as f:
        state = json.load(f)
    if restore_rng:
        set_rng_state(tensors.get("rng", {}), state["rng"])
    return tensors, state


def load_model_weights(model: Any, path: str | os.PathLike) -> None:
    """Load saved weights (full model or LoRA adapter) into an already built model in place."""
    from safetensors.torch import load_file

    path = Path(path)
    adapter = path / "adapter_model.safetensors"
    if adapter.is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(adapter)))
        return
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no model*.safetensors")
    sd: dict[str, torch.Tensor] = {}
    for fpath in files:
        sd.update(load_file(str(fpath)))
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    missing, unexpected = target.load_state_dict(sd, strict=False)
    # Tied embeddings are saved once; anything else missing means a real mismatch.
    tied = set(getattr(target, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"{path}: weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")
