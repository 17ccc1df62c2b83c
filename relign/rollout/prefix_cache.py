"""Keys and values of prompts the engine has seen, reused when a later prompt extends one.

Tree search asks the engine, round after round, to continue prefixes that extend the ones it
prefilled before: the question, then the question plus a step, then plus two. Without a cache
every round prefills the whole question again; on a CPU that prefill, not the decoding, is
most of a search's time (bench/search_mcts.py). vLLM's automatic prefix caching does the same
job with paged blocks; this is the simple version for the built-in engine: whole prompts as
keys, least recently used out first, a byte budget.

The entries hold keys and values computed with the engine's current weights, so the engine
clears the cache whenever its weights change (``load_weights``) and when it sleeps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys [H, T, D], values [H, T, D]) of one prompt."""


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self._lengths: dict[int, int] = {}  # entry length -> how many entries have it
        self.bytes = 0
        self.hits = self.lookups = self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.bytes = 0

    def lookup(self, prompt: Sequence[int]) -> tuple[int, KV | None]:
        """(ℓ, kv) for the longest cached prompt that ``prompt`` starts with, cut so that at least
        one token of ``prompt`` is left to compute (its logits start the completion); (0, None)."""
        self.lookups += 1
        for n in sorted(self._lengths, reverse=True):
            if n > len(prompt):
                continue
            key = tuple(prompt[:n])
            kv = self._entries.get(key)
            if kv is None:
                continue
            self._entries.move_to_end(key)
            used = min(n, len(prompt) - 1)
            if used <= 0:
                return 0, None
            self.hits += 1
            self.tokens_reused += used
            return used, [(k[:, :used], v[:, :used]) for k, v in kv]
        return 0, None

    def store(self, prompt: Sequence[int], kv: KV) -> None:
        """Keep ``kv`` (already a copy the caller will not change) for ``prompt``; evict the
        least recently used entries beyond the byte budget. An entry larger than the budget is not kept."""
        key = tuple(prompt)
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if size > self.max_bytes:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = kv
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1
        self.bytes += size
        while self.bytes > self.max_bytes:
            old, old_kv = self._entries.popitem(last=False)
            self.bytes -= sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in old_kv)
            self._lengths[len(old)] -= 1
            if not self._lengths[len(old)]:
                del self._lengths[len(old)]
