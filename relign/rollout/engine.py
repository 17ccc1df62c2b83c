"""What every inference engine takes and returns, and the protocol it follows.

Token ids flow through unchanged from the engine to the trainer: completions carry the exact
sampled ids, and nobody decodes and re-encodes a response.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


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
    """Seed for this call; None continues the engine's own random stream."""


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


@runtime_checkable
class Engine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt (given as token ids), in prompt order."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Receive updated policy weights (a no-op for an engine that shares the policy's)."""
        ...

    def sleep(self) -> None:
        """Free memory between rollouts (no-op where not needed)."""
        ...

    def wake(self) -> None:
        ...
