"""A step's episodes as padded training tensors.

Layout per row: prompt tokens, then response tokens (model and environment), right-padded.
Rows come in groups: rows [g*G, (g+1)*G) are the G episodes of prompt g. Every per-token
tensor is aligned with ``models.logprobs.token_logps``: column t describes token t (its
log-prob, its reward, whether it is trained).

Every rank builds the whole step's batch (the groups are gathered after the rollout): the
token ids are small, and it lets the batch statistics of the advantage estimators and the
loss normalizers be computed on every rank without further communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .multiturn import Episode


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [N, L] long
    attention_mask: torch.Tensor  # [N, L] long
    response_mask: torch.Tensor  # [N, L] float: 1 on model-sampled response tokens that train
    sampling_logps: torch.Tensor  # [N, L] float: engine log-probs on response tokens, 0 elsewhere
    token_rewards: torch.Tensor  # [N, L] float: turn rewards on each turn's last model token (multi-turn)
    last_token: torch.Tensor  # [N] long: column of each row's last model token
    prompt_lens: torch.Tensor  # [N] long: prompt tokens at the start of each row
    seq_lens: torch.Tensor  # [N] long: prompt + response tokens (the row without its padding)
    group_size: int = 1

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


def build_batch(episodes: list[Episode], pad_id: int, device: torch.device | str = "cpu", group_size: int = 1) -> RolloutBatch:
    if not episodes:
        raise ValueError("build_batch needs at least one episode (skip a step whose rollout kept none)")
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
        seq_lens=attn.sum(-1).to(device), group_size=group_size,
    )
