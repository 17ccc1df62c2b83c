"""What every inference engine takes and returns, and the protocol it follows.

Token ids flow through unchanged from the engine to the trainer: completions carry the exact
sampled ids, and nobody decodes and re-encodes a response.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from .fingerprint import Fingerprint

ENGINES = ("hf", "vllm")  # rollout.engine: the built-in HF engine, or vLLM (relign.recipes.build.engine_for builds them)


@dataclass
class SamplingParams:
    n: int = 1
    """Completions per prompt (the group size G)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 = off)."""
    max_new_tokens: int = 256
    """Longest completion in tokens; longer ones end with finish_reason 'length'."""
    min_new_tokens: int = 0
    """Forbid stopping before this many tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends once the text contains one (the text is cut before it)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end generation (the tokenizer's EOS always does unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating through EOS (benchmarks use this to fix the number of tokens)."""
    seed: int | None = None
    """Seed for this call; None continues the engine's own random stream (``seeds=`` of
    ``Engine.generate`` gives each prompt its own stream instead)."""


@dataclass
class Completion:
    token_ids: list[int]
    """Sampled ids, including the EOS / stop-string tokens that ended the completion."""
    logps: list[float]
    """log pi(token) under the temperature-scaled model distribution (no top-p/top-k
    renormalisation): the quantity the trainer recomputes as sampling_logps."""
    finish_reason: str
    """'stop' (EOS, stop token or stop string) or 'length' (hit max_new_tokens)."""
    text: str
    """Decoded text without special tokens, cut before a matched stop string."""
    stop_reason: str | int | None = None
    """The stop string or token id that ended the completion, if any."""


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (a base seed, a prompt's draw index, a sample, a turn ...).

    splitmix64 over the parts, so nearby inputs give unrelated streams and the result does not
    depend on Python's hash randomisation. Seeds derived from what identifies a sample (not
    from the rank or the batch it happens to be in) make rollouts independent of how the
    prompts are spread over ranks and engine calls.
    """
    mask = (1 << 64) - 1
    z = 0x9E3779B97F4A7C15
    for p in parts:
        z = (z + (int(p) & mask) + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
    return z >> 1


def check_generate_args(prompts: list[list[int]], seeds: list[int] | None) -> None:
    """What every engine's ``generate`` refuses: an empty prompt, a seed list of the wrong length."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"seeds: {len(seeds)} seeds for {len(prompts)} prompts")


def eos_token_ids(tokenizer, model=None) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS and the model's generation-config
    EOS ids (chat models often list their end-of-turn token only there)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, (list, tuple)):
        ids.update(gen_eos)
    return sorted(ids)


@runtime_checkable
class Engine(Protocol):
    """What the recipes need from an inference engine (the built-in HF engine, vLLM, ...)."""

    weight_format: str
    """What ``load_weights`` takes (``rollout.weights``): 'trainer' (the trainable parameters
    under the trainer's names) or 'checkpoint' (every parameter under its checkpoint name,
    LoRA merged)."""

    weights_stale: bool = False
    """The engine dropped its weights while asleep (vLLM at sleep level 2), so they must be loaded
    again before it generates. The default (an engine class that subclasses ``Engine``): never."""

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, seeds: list[int] | None = None
    ) -> list[list[Completion]]:
        """``params.n`` completions for each prompt (given as token ids), in prompt order.

        ``seeds``: one seed per prompt. Prompt i's completions then depend only on its ids,
        ``params`` and ``seeds[i]``, not on which other prompts share the call: the RL recipe
        seeds each prompt by its draw index, so 1 rank and N ranks sample the same tokens.
        """
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Receive the policy's updated weights, ``(name, full tensor)`` with the trainer's
        parameter names. An engine that holds the trainer's own parameter tensors may skip the
        copy (it must say so); every other engine copies."""
        ...

    def sleep(self) -> None:
        """Free memory for the update (the KV cache, or the weights of a colocated engine).
        A no-op where there is nothing to free (both engines on CPU)."""
        ...

    def wake(self) -> None:
        """Take back what ``sleep`` released, before the next ``load_weights`` / ``generate``."""
        ...

    def close(self) -> None:
        """Free the engine's memory; after the run's last collective (vLLM's shutdown destroys
        the process group)."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The engine's own state a checkpoint must keep (its unseeded random stream)."""
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        ...

    def weight_fingerprint(self) -> Fingerprint | None:
        """Sums over a fixed slice of every weight the engine computes with, after its own cast
        (``rollout/fingerprint.py``), or None where it cannot read them back. The RL recipe's sync
        check compares it with the trainer's after every weight sync; an engine that returns None
        gets the probe's log-prob check only. The default (an engine class that subclasses
        ``Engine``): None."""
        return None

    def perf_metrics(self) -> dict[str, float]:
        """The engine's own speed figures since the last call (``perf/*`` keys; the RL recipe logs
        them with each step), e.g. the HF engine's ``perf/decode_bw_frac`` on a GPU. The default
        (an engine class that subclasses ``Engine``): none."""
        return {}

    def score_tokens(self, sequences: list[list[int]]) -> list[list[float]] | None:
        """log p(x_t | x_<t) of every token after the first of each sequence, at temperature 1, with
        the engine's own weights and kernels, or None where it cannot. The RL recipe's sync check
        (``rollout/sync_check.py``) compares it with the trainer after every weight sync; an engine
        that returns None is not probed. The default (an engine class that subclasses ``Engine``): None."""
        return None

    def shares_policy(self, policy: torch.nn.Module) -> bool:
        """Whether the engine samples from ``policy``'s own parameter tensors (then a sync copies
        nothing and the sync check does not apply). The default (an engine class that subclasses
        ``Engine``): False, an engine of its own weights."""
        return False
