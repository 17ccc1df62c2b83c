"""Batches: deterministic, resumable sampling; padding and padding-free packing.

Padded micro-batch:  input_ids / attention_mask / loss_mask / segment_ids  [B, T_max]
Packed micro-batch:  input_ids / position_ids / loss_mask / segment_ids    [1, sum T_i]
  position_ids restart at 0 for each example, and no attention mask: the attention runs
  example by example (flash-attention's varlen kernel, or relign.models.varlen with SDPA), so
  no token attends across examples and no compute goes to padding. Without either,
  transformers builds a dense block-diagonal mask from the position ids (sum T_i^2 -> (sum T_i)^2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class StepSampler:
    """Global batches of example indices, reshuffled every epoch from ``seed + epoch``.

    The state is two integers (epoch, position), so a resumed run sees exactly the batches
    the interrupted one would have seen. A short tail of an epoch is dropped.
    """

    def __init__(self, num_examples: int, batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if num_examples < batch_size:
            raise ValueError(f"{num_examples} training examples are fewer than one batch of {batch_size}")
        self.n, self.batch_size, self.seed, self.shuffle = num_examples, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._perm: list[int] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.n // self.batch_size

    @property
    def drawn(self) -> int:
        """Items handed out so far, over all epochs: a batch's item j is draw ``drawn + j``.
        A draw index names one sampling of one example, the same on every rank and after a
        resume (RL seeds each prompt's completions with it)."""
        return self.epoch * self.steps_per_epoch * self.batch_size + self.position

    def _order(self) -> list[int]:
        if self._perm is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._perm = torch.randperm(self.n, generator=g).tolist()
            else:
                self._perm = list(range(self.n))
        return self._perm

    def next(self) -> list[int]:
        if self.position + self.batch_size > self.n:
            self.epoch, self.position, self._perm = self.epoch + 1, 0, None
        batch = self._order()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._perm = int(state["epoch"]), int(state["position"]), None


def shard(items: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """This rank's share of a global batch (strided, so shares differ by at most one)."""
    return list(items[rank::world_size])


def chunks(items: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def pad_collate(examples: Sequence[Any], pad_id: int, segment_offset: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad ``examples`` (objects with input_ids / loss_mask lists) into [B, T_max]."""
    T = max(len(e.input_ids) for e in examples)
    B = len(examples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(e.loss_mask, dtype=torch.float32)
    segment_ids = (torch.arange(B) + segment_offset).unsqueeze(-1).expand(B, T).contiguous()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, "segment_ids": segment_ids}


def pack_collate(examples: Sequence[Any], segment_offset: int = 0) -> dict[str, torch.Tensor]:
    """Concatenate ``examples`` into one row [1, sum T_i] with per-example position ids."""
    ids, pos, mask, seg = [], [], [], []
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids.extend(e.input_ids)
        pos.extend(range(n))
        mask.extend(e.loss_mask)
        seg.extend([i + segment_offset] * n)
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([pos], dtype=torch.long),
        "loss_mask": torch.tensor([mask], dtype=torch.float32),
        "segment_ids": torch.tensor([seg], dtype=torch.long),
    }


def to_device(batch: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
