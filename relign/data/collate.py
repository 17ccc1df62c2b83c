"""Batches: deterministic, resumable sampling; padding and padding-free packing.

Padded micro-batch:  input_ids / attention_mask / loss_mask / segment_ids  [B, T_max]
Packed micro-batch:  input_ids / position_ids / loss_mask / segment_ids    [1, sum T_i]
                     + packing (``Packing``: where the sequences lie) and keep [K]
  position_ids restart at 0 for each example, and no attention mask: the attention runs
  example by example (flash-attention's varlen kernel, or relign.models.varlen), so no token
  attends across examples and no compute goes to padding. Without either, transformers builds
  a dense block-diagonal mask from the position ids (sum T_i^2 -> (sum T_i)^2).

The collator knows every length on the host, so it also writes them down as the varlen kernel
takes them (``Packing``: cumulative lengths, a constant maximum length, the key/value gather
index of continuations) and which positions the LM head must score (``keep``): the forward then
reads nothing back from the device to find the sequences.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Packing:
    """Where the sequences of a packed row lie, as ``torch.nn.attention.varlen.varlen_attn`` and
    transformers' flash-attention kwargs take them (``cu_seq_lens_q/k``, ``max_length_q/k``).

    Sequence i's queries are the row's tokens ``cu_seq_lens_q[i] .. cu_seq_lens_q[i + 1] - 1``.
    Its keys are the same tokens, or, for a *continuation* of an earlier sequence's first s
    tokens (a group's response after its shared prompt), those s tokens then its own: the keys
    are gathered from the row by ``kv_index`` and bounded by ``cu_seq_lens_k``. A continuation
    has fewer queries than keys; its causal mask is aligned at the bottom right (query j sees
    keys up to s + j: the prefix and its own tokens up to itself), as flash-attention aligns it.
    The maximum lengths are only a bound on the kernel's grid: a constant (``data.max_length``)
    keeps a compiled graph from specializing on each micro-batch's longest sequence."""

    cu_seq_lens_q: torch.Tensor  # [N + 1] int32
    cu_seq_lens_k: torch.Tensor  # [N + 1] int32 (the same tensor when there are no continuations)
    max_length_q: int
    max_length_k: int
    kv_index: torch.Tensor | None = None  # [T_k] long: the row's column of each key; None: the keys are the row

    def to(self, device, non_blocking: bool = False) -> Packing:
        mv = lambda t: t.to(device, non_blocking=non_blocking) if t is not None else None  # noqa: E731
        cu_q = mv(self.cu_seq_lens_q)
        cu_k = cu_q if self.cu_seq_lens_k is self.cu_seq_lens_q else mv(self.cu_seq_lens_k)
        return Packing(cu_q, cu_k, self.max_length_q, self.max_length_k, mv(self.kv_index))


def pack_rows(lens: Sequence[int], starts: Sequence[int] | None = None, *, max_length: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, Packing]:
    """Right-padded rows as one packed row, on the host: (row [S], col [S], Packing).

    Row i packs its columns ``starts[i] .. lens[i] - 1`` (default: all of them); ``col`` is also
    each token's position id. A row with ``starts[i] = s > 0`` continues the first s tokens of
    its root, the latest earlier row packed from column 0 (which must hold s tokens): it attends
    to them and to itself, causally, as if it followed them in its own row. So a group's rows
    ``[prompt | response_j]`` packed from ``P - 1`` after the first run the prompt once (each
    repeats the prompt's last token, whose logits score its response's first). ``max_length``:
    the constant bound on any sequence's length (0: this row's longest)."""
    lens = [int(n) for n in lens]
    starts = [0] * len(lens) if starts is None else [int(s) for s in starts]
    counts = [n - s for n, s in zip(lens, starts)]
    if any(c < 1 for c in counts):
        raise ValueError(f"every packed row needs a token: lengths {lens}, starts {starts}")
    row = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(counts))
    first = torch.tensor(counts).cumsum(0) - torch.tensor(counts)  # each row's first packed column
    col = torch.arange(sum(counts)) + torch.repeat_interleave(torch.tensor(starts) - first, torch.tensor(counts))
    cu_q = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32)
    max_q = max(max_length, max(counts))
    if not any(starts):
        return row, col, Packing(cu_q, cu_q, max_q, max_q)
    keys, klens, root = [], [], None
    for i, (s, c) in enumerate(zip(starts, counts)):
        a = int(first[i])
        if s == 0:
            root = i
        elif root is None or lens[root] < s:
            raise ValueError(f"row {i} continues {s} tokens of a root row, but no earlier row packed from column 0 "
                             f"holds them")
        else:
            keys.append(torch.arange(int(first[root]), int(first[root]) + s))  # the root's first s tokens
        keys.append(torch.arange(a, a + c))  # then its own
        klens.append(s + c)
    cu_k = torch.tensor([0, *itertools.accumulate(klens)], dtype=torch.int32)
    return row, col, Packing(cu_q, cu_k, max_q, max(max_length, max(klens)), torch.cat(keys))


def keep_index(targets: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """The packed row's positions whose next token is a target (``targets`` [S], host): the
    positions whose logits ``token_logps`` computes (``logits_to_keep``), found on the host."""
    t = torch.as_tensor(targets)
    return (t[1:] != 0).nonzero().squeeze(-1)


def pack_collate(examples: Sequence[Any], segment_offset: int = 0, *, max_length: int = 0) -> dict[str, Any]:
    """Concatenate ``examples`` into one row [1, sum T_i] with per-example position ids, its
    ``packing`` and the LM head's ``keep`` positions (see the module's docstring)."""
    ids, mask, seg = [], [], []
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids.extend(e.input_ids)
        mask.extend(e.loss_mask)
        seg.extend([i + segment_offset] * n)
    _, pos, packing = pack_rows([len(e.input_ids) for e in examples], max_length=max_length)
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": pos[None],
        "loss_mask": torch.tensor([mask], dtype=torch.float32),
        "segment_ids": torch.tensor([seg], dtype=torch.long),
        "packing": packing,
        "keep": keep_index(mask),
    }


def to_device(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """Tensors (and ``Packing``) to ``device``; any other value as it is."""
    return {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in batch.items()}
