"""Load policies, references and tokenizers from a local folder or the hub.

Flat arguments only: recipes read their config and pass plain values here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.dropout import _DropoutNd

from ..checks import COMPILE_CHOICES, check_compute_weights
from ..dtypes import DTYPES
from ..errors import ConfigError
from . import lean, precision
from .tiny import SIZES, build_tiny_model

log = logging.getLogger(__name__)

def resolve_dtype(name: str) -> torch.dtype:
    """The parameter dtype of ``model.dtype`` = ``name`` (bf16-mixed and bf16-compute keep fp32
    parameters and compute in bf16: models/precision.py)."""
    if name not in DTYPES:
        raise ConfigError(f"bad value for 'model.dtype': {name!r}; choose one of fp32, bf16, bf16-mixed, bf16-compute")
    return getattr(torch, DTYPES[name].param)


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def to_device(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """``model.to(device)``; on a GPU, SDPA is kept off its cuDNN kernel (``no_cudnn_attention``)."""
    model.to(device)
    if torch.device(device).type == "cuda":
        no_cudnn_attention()
    return model


def no_cudnn_attention() -> None:
    """Take cuDNN out of the kernels SDPA may pick (flash, memory-efficient and math remain).

    cuDNN's attention builds an execution graph for every new shape (query and key lengths,
    batch) and caches it by shape. relign's shapes change at nearly every call: packed rows hold
    other sequences each micro-batch, padded ones another longest row, and every decode step has
    one more key. On an H200 (torch 2.11, which prefers cuDNN on Hopper) each attention backward
    then took 2.5-3 ms of host time: packed SFT of the 0.5B model ran at 9,220 tokens/s against
    27,102 padded, with the same GPU time (2.2 s in both profiles; host 15.5 s against 4.7 s).
    Without cuDNN: 40,738 and 49,010 (BENCHMARKS.md, "On a GPU"). Flash attention has no
    per-shape set-up. The switch is process-wide (``torch.backends.cuda.enable_cudnn_sdp``), as
    relign's models all run in one process with the same variable shapes."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def resolve_model_path(path: str) -> str:
    """``tiny:SIZE[:ARCH]`` builds (once) a random tiny model with a local tokenizer in the
    relign cache (``$RELIGN_CACHE``, default ~/.cache/relign) and returns its folder, so that
    presets run with no download and no set-up step. Anything else is returned unchanged."""
    if not path.startswith("tiny:"):
        return path
    import os
    import shutil

    parts = path.split(":")
    size = parts[1] if len(parts) > 1 and parts[1] else "micro"
    arch = parts[2] if len(parts) > 2 else "qwen2"
    if size not in SIZES or arch not in ("qwen2", "llama"):
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


# Files that make a folder loadable: a model (config.json), a LoRA adapter, or (for a
# tokenizer given on its own) the tokenizer's files.
MODEL_FILES = ("config.json", "adapter_config.json")
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
HUB_TIMEOUT_S = 5.0  # the one probe of the hub before a download; $RELIGN_HUB_TIMEOUT changes it


def _offline_env() -> str | None:
    """The environment variable that puts the hub libraries offline, if one is set."""
    import os

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return var
    return None


@functools.lru_cache(maxsize=4)
def _probe(endpoint: str, timeout: float) -> str | None:
    """One HEAD request to the hub (proxies from the environment apply). None when it answers,
    else why not. Any HTTP status counts as an answer: the hub is there."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        return f"cannot reach the hub at {endpoint} ({reason}; one try, {timeout:g} s timeout)"
    return None


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be used right now, or None if it can.

    Why a probe: with no network, transformers spends 40-55 s in retries before it gives up
    with a traceback. Offline mode (HF_HUB_OFFLINE=1) is trusted as is; otherwise one HEAD
    request to $HF_ENDPOINT with a short timeout (HUB_TIMEOUT_S, or $RELIGN_HUB_TIMEOUT
    seconds) decides, once per process."""
    import os

    var = _offline_env()
    if var:
        return f"{var} is set (offline mode)"
    from huggingface_hub import constants

    try:
        timeout = float(os.environ.get("RELIGN_HUB_TIMEOUT", HUB_TIMEOUT_S))
    except ValueError:
        timeout = HUB_TIMEOUT_S
    return _probe(constants.ENDPOINT, timeout)


def _in_hub_cache(repo_id: str, files: tuple[str, ...]) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return any(isinstance(try_to_load_from_cache(repo_id, f), str) for f in files)
    except Exception:  # an id the cache layout rejects is simply not cached
        return False


def _looks_like_hub_id(path: str) -> bool:
    """``org/name`` or a bare legacy id (``gpt2``); never a path with ./ ~ or a second slash."""
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        return False
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(path)
    except Exception:  # HFValidationError: characters or shape a repo id cannot have
        return False
    return True


def check_model_source(path: str, key: str = "model.path", *, files: tuple[str, ...] = MODEL_FILES) -> bool:
    """Fail at once, in one line naming ``key``, on a model source that cannot load.

    ``path`` is a local folder or a hub id. Returns True when a hub id must load from the local
    hub cache only (the hub is unreachable but the files are cached), else False. Raises
    ConfigError for an empty value, a folder without ``files``, a missing local path, or a hub
    id that is neither cached nor reachable (saying why: offline mode or no answer in time).
    """
    if not path:
        raise ConfigError(f"missing value for '{key}': give a local model folder or a hub id")
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConfigError(f"{key}={path}: is a file; give the model's folder")
        if not any((p / f).is_file() for f in files):
            raise ConfigError(f"{key}={path}: not a model folder (no {' or '.join(files)})")
        return False
    if not _looks_like_hub_id(path):
        raise ConfigError(f"{key}={path}: no such folder")
    why = hub_unreachable()
    if why is None:
        return False
    if _in_hub_cache(path, files):
        return True
    raise ConfigError(f"{key}={path}: no such local folder, and it cannot come from the hub: {why}; "
                      f"give a local folder, or download it first where the hub is reachable")


def _check_source(path: str, what: str) -> None:
    check_model_source(path, what)


@contextlib.contextmanager
def hub_offline():
    """The hub libraries in offline mode for the duration: for loading cached files while the hub
    is unreachable. ``local_files_only=True`` alone does not reach every lookup (transformers 5
    still asks the hub for ``adapter_config.json``) and each such request retries for ~40 s;
    in offline mode huggingface_hub refuses any request at once."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved


def from_pretrained_checked(loader, path: str, key: str, *, local_only: bool = False, **kwargs):
    """``loader.from_pretrained`` with a hub or file problem turned into one line naming ``key``;
    ``local_only``: from the local hub cache, with the hub libraries offline."""
    try:
        with hub_offline() if local_only else contextlib.nullcontext():
            return loader.from_pretrained(path, **kwargs, **({"local_files_only": True} if local_only else {}))
    except OSError as e:  # transformers reports hub, network and missing-file problems as OSError
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(f"{key}={path}: {first}") from None


def load_tokenizer(path: str, *, trust_remote_code: bool = False, key: str = "model.path"):
    """The tokenizer at ``path``; ``key`` is the config key errors name (``model.tokenizer``
    when the recipe's tokenizer is set on its own)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(path)
    local_only = check_model_source(path, key, files=MODEL_FILES + TOKENIZER_FILES)
    tok = from_pretrained_checked(AutoTokenizer, path, key, local_only=local_only, trust_remote_code=trust_remote_code)
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


def load_model_tokenizer(m: Any):
    """The tokenizer of a recipe's ``model`` config: ``model.tokenizer`` when it is set, else
    ``model.path``; an error names the key the user actually set."""
    if m.tokenizer:
        return load_tokenizer(m.tokenizer, trust_remote_code=m.trust_remote_code, key="model.tokenizer")
    return load_tokenizer(m.path, trust_remote_code=m.trust_remote_code, key="model.path")


def load_causal_lm(
    path: str,
    *,
    dtype: str = "fp32",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    lean_activations: bool = True,
    device: str | torch.device = "cpu",
    key: str = "model.path",
):
    """A Hugging Face causal LM in train mode on ``device``, with its dropout off (``disable_dropout``).
    ``dtype`` bf16-mixed: fp32 parameters, forward under bf16 autocast; bf16-compute: fp32
    parameters, forward on bf16 copies of them (``models.precision``).
    ``lean_activations``: SwiGLU MLPs save less for backward (``models.lean``).
    ``key`` is the config key (or argument) that errors name."""
    from transformers import AutoModelForCausalLM

    check_compute_weights(dtype, gradient_checkpointing)
    path = resolve_model_path(path)
    local_only = check_model_source(path, key)
    model = from_pretrained_checked(
        AutoModelForCausalLM,
        path,
        key,
        dtype=resolve_dtype(dtype),
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        local_only=local_only,
    )
    to_device(model, device)
    precision.enable(model, dtype)  # bf16-mixed: autocast; bf16-compute: bf16 weight copies
    # before any LoRA wrapping, so the adapter's own lora.dropout stays what the user asked
    disable_dropout(model)
    if lean_activations:
        lean.lean_activations(model)
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


# --------------------------------------------------------------------------- regional compile

COMPILE_AUTO: dict[str, bool] = {"cpu": False, "cuda": False}
"""``model.compile=auto`` per device type: on only where regional compile measured faster. CPU:
off (``bench/compile_probe.py``: no gain, and minutes of compile on a small machine). CUDA: off
until ``bench/gpu_ab.py``'s compile section measures a training micro-step faster compiled
(docs/architecture.md, "Regional compile")."""
_COMPILED_ATTR = "_relign_compiled"  # the compiled forward a decoder layer runs (shared by its class)
_CACHE_KEYS = ("past_key_values", "past_key_value", "cache", "layer_past")
_compiled_fns: dict[tuple, Any] = {}


def compile_enabled(value: str, device: str | torch.device) -> bool:
    """Whether ``model.compile`` = ``value`` compiles on ``device``: true, false, or auto
    (``COMPILE_AUTO`` of the device type). OmegaConf hands a YAML true/false to a string field
    as "True"/"False", so case does not matter."""
    v = str(value).lower()
    if v not in COMPILE_CHOICES:
        raise ConfigError(f"bad value for 'model.compile': {value!r}; choose one of auto, true, false")
    return COMPILE_AUTO.get(torch.device(device).type, False) if v == "auto" else v == "true"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of ``model`` (or of the model inside a peft / value-model wrapper): the
    blocks transformers lists in ``_no_split_modules``, as FSDP shards them."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def _compiled_layer_forward(self, *args, **kwargs):
    # A call that reads or writes a KV cache (the HF engine's prefill, generate) runs eagerly: the
    # cache's shapes and Python objects change at every step, which would recompile every step.
    if any(kwargs.get(k) is not None for k in _CACHE_KEYS):
        return type(self).forward(self, *args, **kwargs)
    return getattr(self, _COMPILED_ATTR)(self, *args, **kwargs)


def compile_layers(model: torch.nn.Module, *, backend: str = "inductor", dynamic: bool = True) -> int:
    """Regional ``torch.compile``: each decoder layer's forward runs compiled (``model.compile``).
    In place; returns how many layers. The embedding, the LM head, the log-probs and the optimizer
    stay eager.

    Why per layer and not the whole model: the layers are the same code on the same shapes, so one
    compiled function serves all of them (one graph for 24 layers, compiled once), its guards do
    not see the model's Python around it (masks built per call, the chunked log-probs), and a
    graph break elsewhere cannot split it. ``dynamic``: the sequence length is symbolic from the
    first call, so micro-batches of other lengths reuse the graph. The function is the layer
    class's ``forward`` compiled once per (class, backend, dynamic) and bound to each layer as a
    method, so a ``deepcopy`` (an engine's replica) runs its own weights, the ``state_dict`` keys
    are unchanged, and hooks on the layer (FSDP2's unshard and reshard) run outside the graph, as
    torchtitan orders them. Calls with a KV cache run eagerly (``_compiled_layer_forward``)."""
    n = 0
    for layer in decoder_layers(model):
        if getattr(layer, _COMPILED_ATTR, None) is not None:
            continue
        key = (type(layer), backend, dynamic)
        if key not in _compiled_fns:
            _compiled_fns[key] = torch.compile(type(layer).forward, backend=backend, dynamic=dynamic)
        setattr(layer, _COMPILED_ATTR, _compiled_fns[key])
        layer.forward = types.MethodType(_compiled_layer_forward, layer)
        n += 1
    return n


def compiled(model: torch.nn.Module) -> bool:
    """Whether ``model``'s decoder layers run compiled (``compile_layers``)."""
    return any(getattr(m, _COMPILED_ATTR, None) is not None for m in model.modules())


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
    with warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing` alias, which warns on
        # transformers >= 5.24 although nothing the user wrote needs changing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------- sizes


def count_parameters(model) -> tuple[int, int]:
    """(total, trainable) parameters; shared tensors (tied embeddings) count once."""
    total = trainable = 0
    for p in model.parameters():
        n = p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def model_size(path: str, *, kind: str = "causal", lora=None, trust_remote_code: bool = False,
               key: str = "model.path") -> tuple[int, int]:
    """(total, trainable) parameters of the model at ``path`` without reading its weights: the
    architecture is built from its config on the meta device (no memory, no time)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    folder = resolve_model_path(path)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}={path}: cannot read the model's config: {str(e).splitlines()[0]}") from None
    if kind == "seq_cls":
        config.num_labels = 1
    auto = AutoModelForSequenceClassification if kind == "seq_cls" else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
    if lora is not None and lora.enabled:
        model = apply_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules,
                           **({"task_type": "SEQ_CLS", "modules_to_save": ["score"]} if kind == "seq_cls" else {}))
    return count_parameters(model)
