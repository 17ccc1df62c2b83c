"""Atomic checkpoints and resume.

Layout of one checkpoint::

    checkpoints/step_N/
        model.safetensors, config.json, ...   HF save_pretrained (only the adapter with LoRA)
        tokenizer files
        trainer_state.pt                      optimizer / scheduler / RNG tensors (weights_only)
        relign_state.json                     step, data position, metrics, anything JSON
        manifest.json                         every other file's size and sha256, and the step

A checkpoint is written under ``checkpoints/.tmp-step_N-<pid>`` and renamed to ``step_N``
only once every file is flushed. ``relign_state.json`` comes after the weights and tensors (a
directory named ``step_N`` without it is never treated as complete), ``manifest.json`` last.

The rename makes a *kill* harmless; the manifest catches what a rename cannot: a file damaged
afterwards (a full disk, a bad copy, a truncated download). ``resume=auto`` checks the newest
checkpoint against its manifest and falls back to the previous valid one with a warning; an
older checkpoint without a manifest gets the structural checks that need no manifest
(safetensors header vs file size, the zip directory of ``trainer_state.pt``, parseable JSON).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import struct
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import distributed, watchdog
from .errors import ConfigError

STATE_FILE = "relign_state.json"
TENSOR_FILE = "trainer_state.pt"
MANIFEST_FILE = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
# What a killed save leaves behind: the folder being written, or the one being replaced.
_STALE_RE = re.compile(r"^\.(tmp|old)-step_\d+-(\d+)$")
_PROCESS_START = time.time()  # (about) when this process started: older temp folders are not ours
_NO_RESUME = ("", "none", "false", "False")


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
    remove_stale_temps(run_dir)
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
    _write_manifest(tmp, step)  # last: it describes every file above as it is on disk
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

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # every gather's wait is inside these calls (each gathered tensor is copied to the CPU)
    with watchdog.waiting("a collective (gathering the full model and optimizer state) with the other ranks"):
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

    with watchdog.waiting("a collective (loading the optimizer state into its shards) with the other ranks"):
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_sd, options=StateDictOptions(full_state_dict=True))


def _children(run_dir: str | os.PathLike, pattern: re.Pattern) -> list[tuple[Path, re.Match]]:
    """The entries of ``run_dir/checkpoints`` whose name matches ``pattern``, with the match."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return [(child, m) for child in root.iterdir() if (m := pattern.match(child.name))]


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first. Temporary and half-written folders are ignored."""
    found = []
    for child, m in _children(run_dir, _STEP_RE):
        if child.is_dir() and (child / STATE_FILE).is_file() and (child / TENSOR_FILE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def resolve_resume(resume: str, run_dir: str | os.PathLike) -> Path | None:
    """``none``/empty: start fresh; ``auto``: the newest *valid* checkpoint if any; else a path.

    ``auto`` verifies checkpoints newest first (``verify_checkpoint``): a damaged one is moved
    aside to ``checkpoints/damaged-step_N`` with a warning that names the file, and the previous
    valid one is used; if every checkpoint is damaged, a ConfigError names the newest one's file
    and step. A damaged ``resume=PATH`` is an error naming the file. Under torchrun rank 0
    decides (it alone moves folders) and every rank gets its answer, so all resume alike.
    """
    if not distributed.is_initialized():
        return _resolve_resume(resume, run_dir)
    found = distributed.on_main_for_all(lambda: _resolve_resume(resume, run_dir))
    return None if found is None else Path(found)


def _resolve_resume(resume: str, run_dir: str | os.PathLike) -> Path | None:
    if resume in _NO_RESUME:
        return None
    if resume == "auto":
        return _newest_valid(run_dir)
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"resume={resume}: not a complete relign checkpoint (no {STATE_FILE})")
    problem = verify_checkpoint(path)
    if problem is not None:
        raise ConfigError(f"resume={resume}: damaged checkpoint: {problem}")
    return path


def _newest_valid(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint that passes ``verify_checkpoint``; newer damaged ones are moved aside
    (so that no later listing, the final save's "already saved?" included, mistakes them for
    good ones) with a warning."""
    damaged: list[tuple[int, Path, str]] = []
    for step, path in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            for bad_step, bad, why in damaged:
                aside = _set_aside(bad)
                print(f"warning: checkpoint step_{bad_step} is damaged ({why}); moved it to {aside} and resuming "
                      f"from step_{step}", file=sys.stderr, flush=True)
            return path
        damaged.append((step, path, problem))
    if not damaged:
        return None
    step, path, problem = damaged[0]
    older = f"; the {len(damaged) - 1} older checkpoint(s) are damaged too" if len(damaged) > 1 else ""
    raise ConfigError(f"resume=auto: checkpoint step_{step} is damaged: {problem}{older}; no valid checkpoint "
                      f"is left in {path.parent}: delete it to start over, or drop resume= for a fresh run directory")


def _set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the ``step_N`` namespace, keeping it for inspection."""
    target = path.with_name(f"damaged-{path.name}")
    if target.exists():
        target = path.with_name(f"damaged-{path.name}-{os.getpid()}")
    os.replace(path, target)
    return target


# --------------------------------------------------------------------------- integrity


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(folder: Path, step: int) -> None:
    """``manifest.json``: the size and sha256 of every file in ``folder`` (sub-folders too)."""
    manifest = folder / MANIFEST_FILE
    files = {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p != manifest
    }
    with open(manifest, "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """What is wrong with the checkpoint at ``path`` as ``"FILE: problem"``, or None if it is whole.

    With a manifest: every listed file exists with its size (all sizes first: cheap, and they
    catch truncation), then its sha256. Hashing runs at ~1.6 GB/s on one core (measured: 3 ms
    for the micro model's 3 MB checkpoint, 80 ms for the small one's 125 MB); a 7B model with
    its AdamW state (~70 GB) would take ~45 s, beside the minutes it takes to write. Without a
    manifest (written before manifests): ``_structural_problem``.
    """
    path = Path(path)
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        return _structural_problem(path)
    try:
        listed = json.loads(manifest.read_text())["files"]
        entries = [(path / rel, int(info["size"]), str(info["sha256"])) for rel, info in listed.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{manifest}: unreadable ({type(e).__name__}: {e})"
    for required in (STATE_FILE, TENSOR_FILE):
        if required not in listed:
            return f"{manifest}: does not list {required}"
    for file, size, _ in entries:
        if not file.is_file():
            return f"{file}: missing (listed in {MANIFEST_FILE})"
        actual = file.stat().st_size
        if actual != size:
            return f"{file}: {actual} bytes where {MANIFEST_FILE} says {size} (truncated or overwritten)"
    for file, _, digest in entries:
        if _sha256(file) != digest:
            return f"{file}: contents differ from {MANIFEST_FILE} (sha256 mismatch: damaged or overwritten)"
    return None


def _structural_problem(path: Path) -> str | None:
    """The checks that need no manifest: the state JSON parses and has a step; the zip
    directory and CRCs of ``trainer_state.pt`` (torch.save writes a zip) hold; every
    safetensors file is as long as its header says. Catches empty, truncated and garbage files,
    not a flipped bit inside a tensor."""
    state = path / STATE_FILE
    try:
        if "step" not in json.loads(state.read_text()):
            return f"{state}: no 'step'"
    except (OSError, ValueError) as e:
        return f"{state}: unreadable ({type(e).__name__}: {e})"
    tensors = path / TENSOR_FILE
    try:
        with zipfile.ZipFile(tensors) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        return f"{tensors}: not a readable torch.save file ({e})"
    if bad is not None:
        return f"{tensors}: damaged (its member {bad} fails its CRC)"
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        return f"{path}: no model*.safetensors"
    for f in weights + sorted(path.glob("*/*.safetensors")):
        problem = _safetensors_problem(f)
        if problem is not None:
            return f"{f}: {problem}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header, then the tensors' bytes,
    whose extent the header gives: the file's size must be exactly their sum."""
    size = path.stat().st_size
    if size < 8:
        return f"{size} bytes, too short for a safetensors file"
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            return f"its header claims {n} bytes but the file has {size} (truncated, or not safetensors)"
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            return f"unreadable header ({type(e).__name__}), not a safetensors file"
    if 8 + n + end != size:
        return f"{size} bytes where its header describes {8 + n + end} (truncated or padded)"
    return None


def remove_stale_temps(run_dir: str | os.PathLike) -> list[Path]:
    """Delete the ``.tmp-step_*`` / ``.old-step_*`` folders a killed save left in ``checkpoints/``.

    Only rank 0 writes checkpoints, so a temp folder is stale unless this very process is writing
    it: one named with another pid, or older than this process (a reused pid). Returns what went.
    """
    gone = []
    for child, m in _children(run_dir, _STALE_RE):
        try:
            stale = int(m.group(2)) != os.getpid() or child.stat().st_mtime < _PROCESS_START
        except OSError:  # gone already
            continue
        if stale:
            shutil.rmtree(child, ignore_errors=True)
            gone.append(child)
    return gone


def load_checkpoint(path: str | os.PathLike, *, restore_rng: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return (tensors, state) of a checkpoint and, by default, restore the RNG streams."""
    path = Path(path)
    try:
        tensors = torch.load(path / TENSOR_FILE, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, zipfile.BadZipFile, pickle.UnpicklingError) as e:
        raise ConfigError(f"{path / TENSOR_FILE}: cannot be loaded ({_first_line(e)})") from e
    try:
        with open(path / STATE_FILE) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path / STATE_FILE}: cannot be read ({_first_line(e)})") from e
    if restore_rng:
        set_rng_state(tensors.get("rng", {}), state["rng"])
    return tensors, state


def load_model_weights(model: Any, path: str | os.PathLike) -> None:
    """Load saved weights (full model or LoRA adapter) into an already built model in place."""
    path = Path(path)
    adapter = path / "adapter_model.safetensors"
    if adapter.is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, _load_safetensors(adapter))
        return
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no model*.safetensors")
    sd: dict[str, torch.Tensor] = {}
    for fpath in files:
        sd.update(_load_safetensors(fpath))
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    missing, unexpected = target.load_state_dict(sd, strict=False)
    # Tied embeddings are saved once; anything else missing means a real mismatch.
    tied = set(getattr(target, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"{path}: weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file``, whose errors name neither the file nor the checkpoint."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{path}: cannot be loaded ({_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
