"""Load policies, references and tokenizers from a local folder or the hub.

Flat arguments only: recipes read their config and pass plain values here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.dropout import _DropoutNd

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        from ..config import ConfigError

        raise ConfigError(f"bad value for 'model.dtype': {name!r}; choose one of fp32, bf16")
    return DTYPES[name]


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_model_path(path: str) -> str:
    """``tiny:SIZE[:ARCH]`` builds (once) a random tiny model with a local tokenizer in the
    relign cache (``$RELIGN_CACHE``, default ~/.cache/relign) and returns its folder, so that
    presets run with no download and no set-up step. Anything else is returned unchanged."""
    if not path.startswith("tiny:"):
        return path
    import os
    import shutil

    from .tiny import SIZES, build_tiny_model

    parts = path.split(":")
    size = parts[1] if len(parts) > 1 and parts[1] else "micro"
    arch = parts[2] if len(parts) > 2 else "qwen2"
    if size not in SIZES or arch not in ("qwen2", "llama"):
        from ..config import ConfigError

        raise ConfigError(f"model '{path}': use tiny:SIZE[:ARCH] with SIZE in {', '.join(SIZES)} and ARCH qwen2 or llama")
    cache = Path(os.environ.get("RELIGN_CACHE", Path.home() / ".cache" / "relign")) / "tiny"
    out = cache / f"{arch}-{size}"
    if not (out / "config.json").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".tmp-{arch}-{size}-{os.getpid()}"
        build_tiny_model(tmp, arch=arch, size=size)
        try:
            os.replace(tmp, out)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _check_source(path: str, what: str) -> None:
    from ..config import ConfigError

    if not path:
        raise ConfigError(f"missing value for '{what}': give a local model folder or a hub id")
    p = Path(path)
    looks_local = path.startswith((".", "/", "~")) or p.exists()
    if looks_local and not (p / "config.json").is_file() and not (p / "adapter_config.json").is_file():
        raise ConfigError(f"{what}={path}: not a model folder (no config.json)")


def load_tokenizer(path: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = resolve_model_path(path)
    _check_source(path, "model.tokenizer")
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        # Padding positions are always masked, so any id works; eos is the usual choice.
        tok.pad_token = tok.eos_token
    return tok


def _is_dropout_name(name: str) -> bool:
    return "dropout" in name or name.endswith("pdrop")


def _zero_dropout_fields(obj: Any) -> None:
    """0.0 for every number-valued dropout attribute of ``obj`` (a module or a config)."""
    for name, value in list(vars(obj).items()):
        if _is_dropout_name(name) and isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:
            setattr(obj, name, 0.0)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Turn every dropout of ``model`` off, in place; the train/eval mode is left as it is.

    Why: post-training compares the policy with a reference (DPO, KTO, the RL KL) or reads
    values and rewards, and these must be deterministic functions of the weights. The policy
    trains in train mode while the reference is scored in eval mode, so any dropout left on
    makes pi != pi_ref at step 1 (a tiny Qwen2 with attention_dropout=0.5: step-1 DPO loss
    0.6903 instead of log 2 = 0.6931) and adds noise to every log-ratio. TRL does the same
    (``disable_dropout=True``). ``eval()`` is not an option: HF gradient checkpointing only
    runs in train mode. Three places hold dropout:

    * ``nn.Dropout`` modules (and Dropout1d/2d/3d, AlphaDropout): ``p = 0``;
    * float attributes such as ``attention_dropout`` (Qwen2/Llama attention passes it to the
      SDPA kernel when ``self.training``), ``attn_dropout``, ``hidden_dropout``, ``attn_pdrop``;
    * ``model.config`` (fields with ``dropout`` in their name or ending in ``pdrop``), so a
      ``save_pretrained`` copy reloads dropout-free elsewhere too.
    """
    from transformers import PretrainedConfig

    for module in model.modules():
        if isinstance(module, _DropoutNd):  # nn.Dropout, Dropout1d/2d/3d, AlphaDropout, ...
            module.p = 0.0
        _zero_dropout_fields(module)
    configs = [getattr(model, "config", None)]
    while configs:  # composite configs (text_config, vision_config, ...) hold their own dropouts
        cfg = configs.pop()
        if isinstance(cfg, PretrainedConfig):
            _zero_dropout_fields(cfg)
            configs.extend(vars(cfg).values())
    return model


def load_causal_lm(
    path: str,
    *,
    dtype: str = "fp32",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    device: str | torch.device = "cpu",
):
    """A Hugging Face causal LM in train mode on ``device``, with its dropout off (``disable_dropout``)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(path)
    _check_source(path, "model.path")
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=resolve_dtype(dtype),
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    model.to(device)
    # before any LoRA wrapping, so the adapter's own lora.dropout stays what the user asked
    disable_dropout(model)
    if gradient_checkpointing:
        # transformers 5 renamed gradient_checkpointing_enable; keep both working.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
    model.train()
    return model


def apply_lora(model, *, r: int, alpha: int, dropout: float, target_modules: list[str] | str, task_type: str = "CAUSAL_LM",
               modules_to_save: list[str] | None = None) -> Any:
    """Wrap ``model`` with a peft LoRA adapter; only the adapter (and ``modules_to_save``, e.g. a
    reward model's new ``score`` head) is trainable."""
    from peft import LoraConfig, get_peft_model

    targets: Any = list(target_modules)
    if targets == ["all-linear"]:
        targets = "all-linear"
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type=task_type,
                        modules_to_save=modules_to_save)
    if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        # Frozen embeddings produce inputs without grad; checkpointed blocks then see no
        # grad path into the adapters unless the inputs require grad.
        model.enable_input_require_grads()
    return get_peft_model(model, config)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
