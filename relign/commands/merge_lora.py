"""``relign merge-lora RUN_OR_ADAPTER OUT``: fold a LoRA adapter into its base model.

The input is an adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, as a
LoRA run saves each checkpoint) or a run directory, whose newest complete checkpoint is used.
OUT is a plain Hugging Face model (safetensors weights, config, tokenizer) that loads without
peft: ``W' = W + (alpha / r) * B @ A`` for every adapted layer (peft's ``merge_and_unload``).
The base is the adapter's ``base_model_name_or_path`` unless ``--base`` names another.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

from ..checkpoint import list_checkpoints
from ..errors import ConfigError
from ..models.loading import check_model_source, from_pretrained_checked, hub_offline, resolve_dtype, resolve_model_path
from ._common import CommandError, Parser

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def find_adapter(arg: str) -> Path:
    """The adapter folder that ``arg`` names: itself, or a run directory's newest checkpoint."""

    p = Path(arg).expanduser()
    if not p.is_dir():
        raise CommandError(f"{arg}: no such folder")
    if (p / ADAPTER_CONFIG).is_file():
        return p
    if (p / "checkpoints").is_dir():
        ckpts = list_checkpoints(p)
        if not ckpts:
            raise CommandError(f"{arg}: a run directory without a complete checkpoint (nothing in {p / 'checkpoints'})")
        step, newest = ckpts[-1]
        if not (newest / ADAPTER_CONFIG).is_file():
            raise CommandError(f"{arg}: the newest checkpoint ({newest}) is a full model, not a LoRA adapter "
                               "(the run did not use model.lora.enabled); use it as it is")
        print(f"merging the newest checkpoint of {arg}: step {step} ({newest})", file=sys.stderr)
        return newest
    if (p / "config.json").is_file():
        raise CommandError(f"{arg}: a full model already (config.json, no {ADAPTER_CONFIG}); nothing to merge")
    raise CommandError(f"{arg}: neither a LoRA adapter ({ADAPTER_CONFIG}) nor a run directory (checkpoints/)")


def _auto_class(task_type: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if task_type in ("", "CAUSAL_LM"):
        return AutoModelForCausalLM, {}
    if task_type == "SEQ_CLS":  # a reward model (relign rm): one score per sequence
        return AutoModelForSequenceClassification, {"num_labels": 1}
    raise CommandError(f"{ADAPTER_CONFIG}: task_type {task_type!r} is not supported (CAUSAL_LM or SEQ_CLS)")


def merge_lora(adapter: Path, out: Path, *, base: str = "", dtype: str = "auto", trust_remote_code: bool = False) -> Path:
    """Write the merged model and the tokenizer to ``out`` (written aside, then renamed)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    try:
        cfg = json.loads((adapter / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CommandError(f"{adapter / ADAPTER_CONFIG}: cannot read it ({e})") from None
    if not (adapter / ADAPTER_WEIGHTS).is_file():
        raise CommandError(f"{adapter}: no {ADAPTER_WEIGHTS} (only safetensors adapters are read)")
    key = "--base" if base else f"{adapter / ADAPTER_CONFIG}: base_model_name_or_path"
    base = base or cfg.get("base_model_name_or_path") or ""
    if not base:
        raise CommandError(f"{adapter / ADAPTER_CONFIG} names no base_model_name_or_path; give the base with --base")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CommandError(f"{out}: already exists and is not empty; choose a new folder")
    loader, extra = _auto_class(cfg.get("task_type") or "")
    base = resolve_model_path(base)
    try:
        local_only = check_model_source(base, key)
    except ConfigError as e:
        raise CommandError(f"{e} (pass --base to use another base model)") from None
    model = from_pretrained_checked(loader, base, key, local_only=local_only, trust_remote_code=trust_remote_code,
                                    dtype="auto" if dtype == "auto" else resolve_dtype(dtype), **extra)
    own_tokenizer = any((adapter / f).is_file() for f in TOKENIZER_FILES)  # relign checkpoints save theirs
    tok = from_pretrained_checked(AutoTokenizer, str(adapter) if own_tokenizer else base, key,
                                  local_only=local_only and not own_tokenizer, trust_remote_code=trust_remote_code)
    with hub_offline(), warnings.catch_warnings():  # a local adapter: nothing to ask the hub
        warnings.simplefilter("ignore", FutureWarning)  # peft calls a transformers name deprecated in v5
        merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    if extra and merged.config.pad_token_id is None:  # a sequence classifier finds the last token by padding
        merged.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out.is_dir():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str]) -> int:
    p = Parser("merge-lora", description="Merge a LoRA adapter (or a LoRA run's newest checkpoint) into its base model.")
    p.add_argument("source", metavar="RUN_OR_ADAPTER", help="adapter folder, or a run directory (its newest checkpoint)")
    p.add_argument("out", metavar="OUT", help="new folder for the merged Hugging Face model")
    p.add_argument("--base", default="", help="base model (default: the adapter's base_model_name_or_path)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="weights dtype (default: the base's)")
    p.add_argument("--trust-remote-code", action="store_true", help="let a hub model run its own code")
    a = p.parse_args(argv)
    adapter = find_adapter(a.source)
    out = merge_lora(adapter, Path(a.out).expanduser(), base=a.base, dtype=a.dtype, trust_remote_code=a.trust_remote_code)
    print(f"wrote the merged model to {out}")
    return 0
