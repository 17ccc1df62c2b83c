"""Sampling one token per row from the logits, with the log-prob the trainer recomputes.

The HF engine's decode step (``rollout/hf_engine.py``) calls ``sample_tokens`` once per step, on
the device, with the call's settings fixed: temperature, top-k, top-p, the ``min_new_tokens`` ban.
Inverse-CDF sampling with one uniform per row lets each prompt draw from its own stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    banned: list[int] | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    ban_now: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [R, V]. Returns (tokens [R], logps [R]).

    The reported log-prob is log softmax(logits / T) at the sampled token, before top-k/top-p
    truncation or banned tokens: the trainer recomputes that same quantity from the same
    weights, so the two agree (tested to 1e-4 in fp32). Greedy (T = 0) reports T = 1.
    ``uniforms`` [R] in [0, 1): the draws to use (per-row streams); else drawn from ``generator``.
    ``banned``: token ids, or a bool mask [V], that cannot be sampled; ``ban_now`` (a bool tensor
    of one element): apply the ban only while it is true, decided on the device (the engine's
    ``min_new_tokens``), with the same tokens and log-probs as passing ``banned`` or not.
    """
    logits = logits.float()
    # x / 1 is x exactly: at T = 1 (RL rollouts, evals) the division is a pass over [R, V] for nothing
    scaled = logits / temperature if temperature > 0 and temperature != 1.0 else logits
    plain = temperature > 0 and not ((top_k and top_k < logits.shape[-1]) or top_p < 1.0)
    if isinstance(banned, list):
        banned = _ban_mask(banned, logits.shape[-1], logits.device) if banned else None
    if plain and banned is None:
        # Plain sampling, the rollouts' case: one softmax gives both the CDF and the sampled
        # token's log-prob, log p(token); log_softmax and then exp would be two passes over the
        # vocabulary where one does. The same tokens; the log-prob differs by float rounding.
        probs = torch.softmax(scaled, dim=-1)
        tokens = _inverse_cdf(probs, uniforms, generator)
        return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()
    logps_all = torch.log_softmax(scaled, dim=-1)
    masked = scaled
    if banned is not None:
        masked = masked.masked_fill(banned if ban_now is None else banned & ban_now, float("-inf"))
    if temperature <= 0:
        tokens = masked.argmax(dim=-1)
    else:
        if top_k and top_k < masked.shape[-1]:
            kth = torch.topk(masked, top_k, dim=-1).values[:, -1:]
            masked = masked.masked_fill(masked < kth, float("-inf"))
        if top_p < 1.0:
            sorted_logits, order = torch.sort(masked, descending=True, dim=-1)
            probs = torch.softmax(sorted_logits, dim=-1)
            # drop a token when the mass *before* it already reaches top_p (the first always stays)
            drop = (probs.cumsum(-1) - probs) >= top_p
            drop[..., 0] = False  # the most likely token always stays (top_p = 0 means greedy-like)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            masked = torch.full_like(masked, float("-inf")).scatter(-1, order, sorted_logits)
        probs = torch.softmax(masked, dim=-1)
        tokens = _inverse_cdf(probs, uniforms, generator)
        if plain and ban_now is not None:
            # the ban lifted (min_new_tokens reached): the plain path's log-prob, as without a ban
            picked = logps_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            return tokens, torch.where(ban_now, picked, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log())
    return tokens, logps_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _ban_mask(ids: list[int], vocab: int, device) -> torch.Tensor:
    return torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, torch.tensor(ids, device=device), True)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor | None, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] by inverse-CDF sampling: one uniform per row.
    torch.multinomial draws per vocabulary entry and was the largest cost of a decode step
    after the forward on CPU."""
    cdf = probs.cumsum(-1)
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=cdf.dtype)
    u = uniforms.to(cdf.device, cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


@dataclass
class DecodeSampler:
    """A call's sampling settings, fixed for every step of it (a captured step bakes them in)."""

    temperature: float
    top_k: int
    top_p: float
    ban: bool  # the stop ids are banned while fewer than min_new_tokens are out (``hf_engine._Rows.ban``)
    uniforms: bool  # a step reads its uniforms from ``hf_engine._Rows.U`` (else draws them from ``generator``)
    generator: torch.Generator | None

    def key(self) -> tuple:
        return self.temperature, self.top_k, self.top_p, self.ban, self.uniforms
