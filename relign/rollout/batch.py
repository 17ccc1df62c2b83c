"""Episodes -> padded training tensors, and micro-batch slicing.

Layout per row: prompt tokens, then response tokens (model and environment), right-padded.
Every per-token tensor is aligned with ``models.logprobs.token_logps``: column t describes
token t (its log-prob, its reward, whether it is trained).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .multiturn import Episode


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [N, L] long
    attention_mask: torch.Tensor  # [N, L] long
    response_mask: torch.Tensor  # [N, L] float: 1 on model-sampled response tokens
    sampling_logps: torch.Tensor  # [N, L] float: engine log-probs on response tokens, 0 elsewhere
    token_rewards: torch.Tensor  # [N, L] float: per-token rewards (turn rewards on turn ends)
    last_token: torch.Tensor  # [N] long: column of each row's last model token
    prompt_lens: torch.Tensor  # [N] long: prompt tokens at the start of each row

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, idx: torch.Tensor | slice) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[idx],
            "attention_mask": self.attention_mask[idx],
            "response_mask": self.response_mask[idx],
            "prompt_lens": self.prompt_lens[idx],
        }


def build_batch(episodes: list[Episode], pad_id: int, device: torch.device | str = "cpu") -> RolloutBatch:
    N = len(episodes)
    L = max(len(e.prompt_ids) + len(e.response_ids) for e in episodes)
    ids = torch.full((N, L), pad_id, dtype=torch.long)
    attn = torch.zeros((N, L), dtype=torch.long)
    rmask = torch.zeros((N, L))
    slog = torch.zeros((N, L))
    rew = torch.zeros((N, L))
    last = torch.zeros(N, dtype=torch.long)
    for i, e in enumerate(episodes):
        p, r = len(e.prompt_ids), len(e.response_ids)
        ids[i, : p + r] = torch.tensor(e.prompt_ids + e.response_ids)
        attn[i, : p + r] = 1
        if r:
            rmask[i, p : p + r] = torch.tensor(e.response_mask, dtype=torch.float32)
            slog[i, p : p + r] = torch.tensor(e.sampling_logps, dtype=torch.float32)
            rew[i, p : p + r] = torch.tensor(e.token_rewards, dtype=torch.float32)
        model_cols = [p + j for j, m in enumerate(e.response_mask) if m]
        last[i] = model_cols[-1] if model_cols else max(p - 1, 0)
    return RolloutBatch(
        input_ids=ids.to(device), attention_mask=attn.to(device), response_mask=rmask.to(device),
        sampling_logps=slog.to(device), token_rewards=rew.to(device), last_token=last.to(device),
        prompt_lens=torch.tensor([len(e.prompt_ids) for e in episodes], dtype=torch.long, device=device),
    )


def micro_slices(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
