"""The HF engine's KV cache: layers with room to grow, written in place."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A KV-cache layer with room to grow: each decode step writes its key and value in place and
    attention reads a view of the filled part. The stock ``DynamicLayer`` concatenates, which
    copies the whole cache at every token (15% of a decode step on CPU at 128 new tokens)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0
        self.k_buf = self.v_buf = None

    def _views(self) -> None:
        self.keys, self.values = self.k_buf[:, :, : self.length], self.v_buf[:, :, : self.length]

    def update(self, key_states, value_states, *args, **kwargs):
        dev = key_states.device.type
        if torch.is_autocast_enabled(dev):
            # model.dtype=bf16-mixed: keys come out of RoPE in fp32, values in bf16. Attention
            # casts both to bf16 anyway, so keep them in bf16: the same numbers, half the
            # memory, and no cast of the whole cache at every decode step.
            dtype = torch.get_autocast_dtype(dev)
            key_states, value_states = key_states.to(dtype), value_states.to(dtype)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            B, H, _, D = key_states.shape
            self.k_buf = key_states.new_empty(B, H, self.capacity, D)
            self.v_buf = value_states.new_empty(B, H, self.capacity, D)
        n = key_states.shape[-2]
        if self.length + n > self.k_buf.shape[-2]:  # out of room: double it (amortized O(1) per token)
            more = lambda b: b.new_empty(*b.shape[:2], max(n, b.shape[2]), b.shape[3])  # noqa: E731
            self.k_buf, self.v_buf = torch.cat([self.k_buf, more(self.k_buf)], 2), torch.cat([self.v_buf, more(self.v_buf)], 2)
        self.k_buf[:, :, self.length : self.length + n] = key_states
        self.v_buf[:, :, self.length : self.length + n] = value_states
        self.length += n
        self._views()
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            self.k_buf = self.k_buf.repeat_interleave(repeats, dim=0)
            self.v_buf = self.v_buf.repeat_interleave(repeats, dim=0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self.k_buf, self.v_buf = self.k_buf[indices], self.v_buf[indices]
            self._views()


def growing_cache(config, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` of ``GrowingLayer``s when every layer is a plain full-attention one
    (sliding-window or hybrid models keep the stock layers)."""
    cache = DynamicCache(config=config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingLayer(capacity) for _ in cache.layers]
    return cache


class ForwardKV:
    """The model's own forward as the decode step (architectures ``fast_decode`` does not cover)."""

    def __init__(self, engine, cache: DynamicCache, attn: torch.Tensor):  # engine: the HFEngine whose _forward runs
        self.engine, self.cache, self.attn = engine, cache, attn

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.attn = torch.cat([self.attn, self.attn.new_ones((self.attn.shape[0], 1))], dim=-1)
        return self.engine._forward(tok.unsqueeze(-1), self.attn, pos.unsqueeze(-1), self.cache, prefill=False)

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.attn = self.attn[keep]
