"""Shared config pieces and the load / merge / override path.

Typed dataclasses are the single source of truth. OmegaConf turns them into structured
configs, so a YAML preset and ``key.sub=value`` overrides are type-checked against them.
Each field is documented by the string literal right below it (an "attribute docstring");
``field_docs`` reads those with ``ast`` so that ``relign <recipe> --help`` can list them.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf  # noqa: F401  (MISSING re-exported)
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from .errors import ConfigError  # noqa: F401  (re-exported: `from relign.config import ConfigError`)

# Learning-rate schedules after warmup (relign.optim builds them; checked here with the other keys).
SCHEDULES = ("cosine", "constant")


# --------------------------------------------------------------------------- pieces


@dataclass
class LoRAConfig:
    enabled: bool = False
    """Train a LoRA adapter (peft) instead of the full model."""
    r: int = 16
    """LoRA rank."""
    alpha: int = 32
    """LoRA scaling alpha (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt; 'all-linear' adapts every linear layer but the LM head."""


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face causal LM: a local folder or a hub id."""
    tokenizer: str = ""
    """Tokenizer folder or hub id; empty means the same as model.path."""
    dtype: str = "fp32"
    """fp32; bf16-mixed (fp32 weights and optimizer state, bf16 arithmetic: what TRL's bf16=True does;
    the choice for training in bf16); bf16-compute (fp32 weights, the forward on bf16 copies of them: the
    residual stream and norms in bf16 too, fewer bytes, other numerics; one process, no gradient
    checkpointing); or bf16 (bf16 weights: for inference, or LoRA on a bf16 base; full-weight AdamW updates
    below |w|/256 round to nothing)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    lean_activations: bool = True
    """Save less for backward (relign.models.lean): SwiGLU MLPs keep g and u and recompute
    silu(g) * u, Llama/Qwen RMSNorms recompute the normalized x. Same numbers to float rounding.
    Off under model.compile (the compiler chooses what to recompute itself)."""
    compile: str = "auto"
    """torch.compile each decoder layer (regional compile: one graph for all layers, lengths symbolic): true,
    false, or auto = on where measured faster (relign.models.loading.COMPILE_AUTO: off on CPU; on CUDA once
    bench/gpu_ab.py measures it). The first steps then include the compile."""
    trust_remote_code: bool = False
    """Allow a hub model to run its own Python code. Off unless you trust the source."""
    attn_implementation: str = "sdpa"
    """Attention kernel passed to transformers: sdpa, eager or flash_attention_2."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class SamplingConfig:
    """How an engine samples completions (``rollout:`` of rl and rest)."""

    n: int = 8
    """Completions per prompt (RL: the group size G)."""
    temperature: float = 1.0
    """Sampling temperature (RL: the trainer scores log-probs at the same temperature); > 0 for several samples."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = 256
    """Longest completion (per turn in multi-turn rollouts); a completion cut here is truncated."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (a completion ending at one counts as finished; the text is cut before it)."""
    max_batch_rows: int = 256
    """Most sequences the engine decodes at once."""


@dataclass
class VllmConfig:
    """Settings of the vLLM engine (``rollout.engine=vllm``); the HF engine ignores them."""

    gpu_memory_utilization: float = 0.3
    """GPU: the fraction of the GPU's memory vLLM may take for weights and KV cache (the
    trainer shares the GPU). Ignored when kv_cache_gb is set, and on CPU."""
    kv_cache_gb: float = 0.0
    """KV cache size in GiB. 0 = on GPU, from gpu_memory_utilization; on CPU, enough for the
    rows of one engine call (RL: prompts_per_step x n per rank, at most max_batch_rows) of
    max_model_len tokens each (at least 64 MiB, at most 4 GiB)."""
    max_model_len: int = 0
    """Longest sequence (prompt + completion) the engine holds; 0 = the run's longest prompt
    plus its longest response, capped by the model's max_position_embeddings."""
    tensor_parallel_size: int = 1
    """GPU only: shard the engine over this many GPUs (one process, no torchrun)."""
    enforce_eager: bool = True
    """Run the model eagerly. False compiles it (CUDA graphs on GPU: faster decoding, a slower
    start; on CPU the compile takes about a minute and gains little)."""
    sleep_level: int = 1
    """GPU: what sleep() frees during the update. 1 = the KV cache, with the weights offloaded
    to CPU memory; 2 = the KV cache and the weights (the next sync pushes them again)."""


@dataclass
class RecordsConfig:
    """The fields every record reader shares (``data:`` of sft, rm, dpo)."""

    path: str = ""
    """Training records: .json/.jsonl/.csv/.parquet/.arrow file, a datasets save_to_disk folder, or a hub id."""
    split: str = "train"
    """Split to read from a dataset folder or hub id."""
    eval_path: str = ""
    """Held-out records (same formats); empty means hold out data.eval_fraction of the training rows."""
    eval_split: str = ""
    """Split for eval_path (defaults to data.split)."""
    eval_fraction: float = 0.0
    """Fraction of training rows held out for eval when eval_path is empty."""
    max_length: int = 1024
    """Longest tokenized example (prompt + response; each of chosen and rejected) in tokens."""
    truncation: str = "truncate"
    """Too-long rows: 'truncate' keeps the prompt and cuts the response; 'drop' drops the row (the pair)."""
    skip_bad_rows: bool = False
    """Skip and count malformed rows instead of stopping with an error."""
    prompt_key: str = "prompt"
    """Field holding the prompt (text, or messages for preference rows)."""
    system_prompt: str = ""
    """System message added to chat-templated rows that have none."""
    max_rows: int = 0
    """Read at most this many rows (0 = all)."""


@dataclass
class DataConfig(RecordsConfig):
    response_key: str = "response"
    """Field holding the response text."""
    messages_key: str = "messages"
    """Field holding a chat as a list of {role, content}."""
    chat_template: bool = False
    """Also wrap prompt/response rows in the tokenizer's chat template (chat rows always are)."""


@dataclass
class PreferenceDataConfig(RecordsConfig):
    path: str = ""
    """Preference records (same formats as SFT data): pairs with prompt/chosen/rejected, or KTO rows."""
    chosen_key: str = "chosen"
    """Field holding the preferred response (text, or a conversation ending with it)."""
    rejected_key: str = "rejected"
    """Field holding the dispreferred response."""
    prefix_key: str = "prefix"
    """Step-wise DPO: field with the reasoning steps both responses continue ('initial_reason_steps' also works)."""
    completion_key: str = "completion"
    """KTO: field holding the response of an unpaired row."""
    label_key: str = "label"
    """KTO: field holding true (desirable) or false (undesirable)."""
    chat_template: bool = True
    """Wrap text prompts in the tokenizer's chat template (message prompts always are)."""


@dataclass
class ReasoningGymConfig:
    """task.name=reasoning_gym: reasoning-gym generators as a task (docs/environments.md)."""

    datasets: dict[str, float] = field(default_factory=dict)
    """Dataset name -> weight; several make a weighted mix (empty: {chain_sum: 1})."""
    config: dict[str, Any] = field(default_factory=dict)
    """Dataset name -> its generator options ({chain_sum: {min_terms: 2, max_terms: 3}})."""
    size: int = 2048
    """Training problems generated (task.max_rows caps it)."""
    eval_size: int = 200
    """Held-out problems generated (eval.max_rows / relign eval's task.max_rows cap it)."""
    answer_format: str = "tag"
    """Where the answer is: tag (<answer>...</answer>, reasoning-gym's own) or boxed (the last \\boxed{})."""
    system_prompt: str = "default"
    """A key of reasoning_gym.utils.SYSTEM_PROMPTS, or literal text, or "" for none (task.system_prompt overrides)."""
    score_threshold: float = 1.0
    """score (accuracy) = reward >= this; the reward is reasoning-gym's graded value, partial credit included."""


@dataclass
class GemConfig:
    """task.name=gem: a GEM game as a multi-turn environment (docs/environments.md)."""

    env_id: str = "game:GuessTheNumber-v0-easy"
    """GEM environment id (gem.make)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword options passed to gem.make."""
    size: int = 1024
    """Training episodes (distinct game seeds; task.max_rows caps it)."""
    eval_size: int = 64
    """Held-out episodes (game seeds disjoint from training)."""
    success_reward: float = 1.0
    """score = 1 when an episode ends with a reward >= this."""


@dataclass
class TaskConfig:
    """A task of ``relign rl``, ``relign eval`` and ``relign rest``: built-in or custom, its reward and where it runs."""

    name: str = "gsm8k"
    """Built-in task (gsm8k, math, math500, countdown, calculator, calibration, lc) or 'custom' with path + reward_fn."""
    path: str = ""
    """Prompts: a file, dataset folder or hub id (empty: the task's default source; eval: its shipped test set)."""
    split: str = ""
    """Split to read (empty: the task's default)."""
    max_rows: int = 0
    """Read at most this many prompts (0 = all)."""
    chat: bool = True
    """Wrap prompts in the tokenizer's chat template."""
    system_prompt: str = ""
    """System message for chat prompts."""
    max_prompt_length: int = 512
    """Prompts longer than this (in tokens) are skipped and counted (eval: 0 = no limit)."""
    format_weight: float = 0.0
    """Weight of the task's format reward added to correctness."""
    reward_fn: str = ""
    """Custom reward function 'path/to/file.py:function' (replaces the task's own)."""
    reward_style: str = "auto"
    """How reward_fn is called: auto (from its signature), sample (fn(prompt, response, extra_info))
    or batch (TRL's fn(prompts, completions, **columns) -> list of floats)."""
    reward_timeout: float = 10.0
    """Seconds per reward call; a call that raises or runs longer scores 0 and is counted."""
    reward_workers: int = 2
    """Reward worker processes (0 = in-process, no timeout enforcement)."""
    env: str = ""
    """Multi-turn environment class 'module:Class' or 'file.py:Class' (empty = the task's own, if any; rl only)."""
    extract_fn: str = ""
    """Final-answer extractor 'file.py:function' (response, extra_info) -> str | None for maj@k (built-in tasks have one)."""
    equal_fn: str = ""
    """Answer equivalence 'file.py:function' (a, b) -> bool for maj@k (empty: the task's own, else string equality)."""
    answer_format: str = "boxed"
    """math: what counts as an answer: boxed (only \\boxed{}, what RL trains), boxed_or_final or any (eval; docs/tasks.md)."""
    rg: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """task.name=reasoning_gym: datasets, generator options, sizes, answer format."""
    gem: GemConfig = field(default_factory=GemConfig)
    """task.name=gem: the GEM environment id and its options."""
    features: dict[str, float] = field(default_factory=dict)
    """calibration: room -> q, the probability its hidden answer is 'left' (empty: red 0.2, blue 0.8; docs/calibration.md)."""


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.999
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    schedule: str = "cosine"
    """Learning-rate schedule after warmup: cosine or constant."""
    warmup_steps: int = 0
    """Linear warmup steps (overrides warmup_ratio when > 0)."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of the total steps."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of the peak learning rate."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""


@dataclass
class LoggingConfig:
    progress: bool = True
    """Show a progress bar."""
    tensorboard: bool = True
    """Write TensorBoard events when tensorboard is installed."""
    wandb: bool = False
    """Log to Weights & Biases (pip install 'relign[wandb]')."""
    wandb_project: str = "relign"
    """Weights & Biases project."""
    run_name: str = ""
    """Display name of the run (defaults to the run directory name)."""
    peak_tflops: float = 0.0
    """Peak dense bf16 TFLOP/s of one device, for perf/mfu (model FLOPs / time / devices / peak); 0 = from the
    GPU's name (relign.models.flops.PEAKS). With neither (a CPU, an unknown GPU) runs log no perf/mfu."""


@dataclass
class CheckpointConfig:
    save_every: int = 0
    """Save a checkpoint every N optimizer steps (0 = only at the end)."""
    keep_last: int = 0
    """Keep only the newest K checkpoints (0 = keep all)."""
    save_final: bool = True
    """Save a checkpoint at the end of training."""


@dataclass
class ParallelConfig:
    """How the ranks of a torchrun launch share the model (docs/parallel.md): a (dp, cp, tp)
    mesh, dp = world size / (tp_size x cp_size)."""

    tp_size: int = 1
    """Tensor parallel degree: each decoder layer's heads and MLP width split over this many ranks."""
    cp_size: int = 1
    """Context parallel degree (Ulysses): each sequence split in chunks over this many ranks."""


@dataclass
class PlanConfig:
    """The memory plan a training run checks before it loads any weights (relign plan; docs/plan.md)."""

    check: bool = True
    """Refuse to start when the predicted peak exceeds the device's memory (false: start anyway)."""
    device: str = ""
    """The device to plan for: empty = the run's own (free memory); or cpu, cuda:N, or a named GPU
    (h100, h200, a100-40, a100-80, l40s, rtx4090) to check a run against one without it."""


# --------------------------------------------------------------------------- the fields every recipe repeats
#
# One level of dataclass inheritance (docs/architecture.md, "Configs"): a recipe's ``Config``
# inherits these and redeclares a field whose default differs (its ``optim`` learning rate, say).
# Keys and docs stay where ``relign <recipe> --help`` finds them: ``field_docs`` walks the MRO.


@dataclass
class RunFields:
    """What every run has: its model, how it logs, where it writes, its seed and its device."""

    model: ModelConfig = field(default_factory=ModelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run_dir: str = ""
    """Where config.yaml, metrics.jsonl, checkpoints/ and the run's other files go (empty: runs/<recipe>-<time>)."""
    seed: int = 0
    """Seed for initialisation, data order and sampling."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""


@dataclass
class TrainFields(RunFields):
    """What every training run adds: its optimizer, checkpoints and resume."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    resume: str = "none"
    """'auto' continues from the newest complete checkpoint in run_dir; or a checkpoint path; 'none' starts fresh."""


@dataclass
class StepFields(TrainFields):
    """An offline trainer's length and batches (sft, rm, dpo, verifier)."""

    max_steps: int = 0
    """Optimizer steps to run (0 = epochs x steps per epoch)."""
    epochs: float = 1.0
    """Passes over the training data when max_steps is 0."""
    batch_size: int = 16
    """Examples (rm, dpo: pairs; KTO: examples) per optimizer step, summed over all ranks."""
    micro_batch_size: int = 4
    """Examples (pairs) per forward/backward pass on one rank; gradient accumulation covers the rest."""


@dataclass
class BatchFields(StepFields):
    """...and its held-out evaluation (sft, rm, dpo)."""

    eval_every: int = 0
    """Evaluate on the held-out rows every N steps (0 = only at the end, when there is eval data)."""
    eval_batch_size: int = 16
    """Examples (pairs) per eval forward pass."""


# --------------------------------------------------------------------------- docs


def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the attribute docstring written under it in the class body."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def describe_fields(cls: type, prefix: str = "", defaults: Any = None) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, doc) for every leaf field of a config dataclass. A section's
    defaults are the recipe's (``sft.Config().optim.lr`` is 2e-5, ``OptimConfig().lr`` 1e-5)."""
    rows = []
    docs = field_docs(cls)
    hints = _resolved_hints(cls)
    defaults = cls() if defaults is None else defaults
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints.get(f.name, f.type)
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(describe_fields(type(value), key + ".", value))
            continue
        rows.append((key, _type_name(tp), repr(value), docs.get(f.name, "")))
    return rows


def _resolved_hints(cls: type) -> dict[str, Any]:
    import typing

    try:
        return typing.get_type_hints(cls)
    except Exception:  # pragma: no cover - unresolvable forward refs
        return {}


def format_help(cls: type, command: str, summary: str) -> str:
    rows = describe_fields(cls)
    width = max(len(f"{k}: {t} = {d}") for k, t, d, _ in rows)
    width = min(width, 60)
    lines = [
        f"usage: relign {command} [CONFIG.yaml] [key.sub=value ...] [--dry-run]",
        "",
        summary,
        "",
        "--dry-run prints the resolved config, the data counts and the model size, then exits without training.",
        "",
        "Fields (set them in the YAML or as key.sub=value overrides):",
    ]
    for key, tp, default, doc in rows:
        head = f"{key}: {tp} = {default}"
        lines.append(f"  {head:<{width}}  {doc}" if len(head) <= width else f"  {head}\n  {'':<{width}}  {doc}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- load


def _valid_keys(cls: type, path: str) -> tuple[str, list[str]]:
    """The parent section of a dotted key and the valid keys in it."""
    parts = [p for p in path.split(".") if p]
    klass: Any = cls
    parent = []
    for part in parts[:-1]:
        fields = {f.name: f for f in dataclasses.fields(klass)}
        if part not in fields:
            break
        value = getattr(klass(), part)
        if not dataclasses.is_dataclass(value):
            break
        klass = type(value)
        parent.append(part)
    return ".".join(parent), [f.name for f in dataclasses.fields(klass)]


def _check_sections(base: DictConfig, loaded: dict, source: str, prefix: str = "") -> None:
    """A section (``optim:``) given a plain value in a YAML file. OmegaConf's merge reports it as
    "Merge error: int is not a subclass of OptimConfig" with no key, so it is named here."""
    for name, value in loaded.items():
        node = base.get(name) if name in base else None
        if not isinstance(node, DictConfig) or not dataclasses.is_dataclass(OmegaConf.get_type(node)):
            continue  # unknown keys and plain values: the merge names those itself
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            _check_sections(node, value, source, f"{key}.")
        elif value is None:  # "optim:" with nothing under it
            raise ConfigError(f"bad value for '{key}' in {source}: an empty section (indent 'key: value' lines "
                              f"under '{name}:', or remove the line)")
        else:
            raise ConfigError(f"bad value for '{key}' in {source}: {value!r} where a section of keys goes "
                              f"(indented 'key: value' lines under '{name}:')")


def _explain(cls: type, err: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    if isinstance(err, ConfigKeyError) or "not in" in str(err):
        parent, valid = _valid_keys(cls, key)
        leaf = key.split(".")[-1]
        close = difflib.get_close_matches(leaf, valid, n=1)
        hint = f" (did you mean '{(parent + '.' if parent else '') + close[0]}'?)" if close else ""
        where = f"under '{parent}'" if parent else "at the top level"
        return ConfigError(
            f"unknown key '{key}' in {source}{hint}; valid keys {where}: {', '.join(valid)}"
        )
    if isinstance(err, ValidationError):
        msg = str(err).splitlines()[0]
        return ConfigError(f"bad value for '{key}' in {source}: {msg}")
    return ConfigError(f"{source}: {str(err).splitlines()[0]}")


def _yaml_problem(err: Exception) -> str:
    """A YAML syntax error as one line with where it is: PyYAML's own text is several lines, and
    its first ("while parsing a block mapping") names neither the line nor what is wrong."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or not problem:
        return str(err).splitlines()[0]
    context = getattr(err, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def _unset_is_empty(defaults: DictConfig, key: str) -> bool:
    """Whether ``key`` is a string field whose default is '' (its "not set"), so that null means ''."""
    node = defaults
    try:
        for part in key.split("."):  # OmegaConf's public select() gives the value, not the field's type
            if not isinstance(node, DictConfig):
                return False
            node = node._get_node(part)
    except OmegaConfBaseException:
        return False
    return node is not None and not isinstance(node, DictConfig) and node._metadata.ref_type is str and node._value() == ""


def load_config(cls: type, path: str | os.PathLike | None = None, overrides: list[str] | tuple = ()):
    """Build a config object of dataclass ``cls`` from a YAML preset plus dotted overrides.

    Raises ConfigError with one readable line on an unknown key, a wrong type or a missing file.
    """
    base = OmegaConf.structured(cls)
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = OmegaConf.load(p)
        except Exception as e:  # yaml syntax
            raise ConfigError(f"cannot parse {p}: {_yaml_problem(e)}") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"{p}: the top level must be a mapping of keys")
        _check_sections(base, OmegaConf.to_container(loaded), str(p))
        try:
            base = OmegaConf.merge(base, loaded)
        except OmegaConfBaseException as e:
            raise _explain(cls, e, str(p)) from None
    defaults = OmegaConf.structured(cls)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key.sub=value")
        key, _, value = item.partition("=")
        if value.strip() in ("", "null", "~") and _unset_is_empty(defaults, key):
            item = f"{key}=''"  # "key=" and "key=null" clear a string whose default is '' (not set): no path, no spec
        try:
            base = OmegaConf.merge(base, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            if not getattr(e, "full_key", None):
                e.full_key = key  # type: ignore[attr-defined]
            if isinstance(e, ValidationError) and not item.partition("=")[2].strip():
                # "key=" parses as null; OmegaConf's "Incompatible value 'None'" does not say that
                raise ConfigError(f"bad value for '{key}' in override '{item}': empty (null), and '{key}' needs a "
                                  "value; give one, or leave the override out for the default") from None
            raise _explain(cls, e, f"override '{item}'") from None
    try:
        obj = OmegaConf.to_object(base)
    except OmegaConfBaseException as e:
        raise _explain(cls, e, str(path or "config")) from None
    return obj


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
