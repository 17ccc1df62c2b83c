"""Per-token log-probabilities and entropy without a full-batch fp32 log-softmax.

``log_softmax(logits.float(), -1).gather(...)`` materialises a [B, T, V] fp32 tensor (and keeps
it for backward): for a 150k vocabulary and 8k tokens that is 4.9 GB. Here the rows are
processed in chunks; for fp32/fp64 logits we use ``x_y - logsumexp(x)`` directly, and for
bf16/fp16 logits each chunk is upcast on its own, so the peak extra memory is one chunk.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

DEFAULT_CHUNK_TOKENS = 4096


@functools.cache
def _cache_name() -> str:
    # transformers 5.24 renamed the forward keyword and the output field that carry the KV cache
    # from `past_key_values` to `cache`; the old keyword still works until 5.40 but warns on
    # every run, so pass whichever name the installed version declares.
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def kv_cache_kwargs(kv_cache) -> dict:
    """``{name: kv_cache}`` for a transformers model's forward, under the installed version's name."""
    return {_cache_name(): kv_cache}


def returned_kv_cache(out):
    """The KV cache a transformers model's forward returned (``out.cache``, or ``out.past_key_values``
    before transformers 5.24)."""
    return getattr(out, _cache_name())


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> fp32; fp32 and fp64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, *, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits)[..., index] computed chunk by chunk. Returns fp32 (fp64 for fp64
    logits), shape of ``index``.

    logits: [..., V]; index: [...] (same leading shape). ``temperature`` divides the logits
    chunk by chunk (no full-size scaled copy). Differentiable.
    """
    shape = index.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_index = index.reshape(-1)
    out = []
    for start in range(0, flat_index.numel(), chunk_tokens):
        chunk = _upcast(flat_logits[start : start + chunk_tokens])
        if temperature != 1.0:
            chunk = chunk / temperature
        idx = flat_index[start : start + chunk_tokens]
        picked = chunk.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    if not out:
        return torch.zeros(shape, dtype=torch.float32, device=logits.device)
    return torch.cat(out).reshape(shape)


def entropy_from_logits(
    logits: torch.Tensor, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, *, temperature: float = 1.0
) -> torch.Tensor:
    """Entropy H = logsumexp(x) - sum softmax(x) * x of each row, chunked, fp32. Shape logits.shape[:-1]."""
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for start in range(0, flat.shape[0], chunk_tokens):
        chunk = _upcast(flat[start : start + chunk_tokens])
        if temperature != 1.0:
            chunk = chunk / temperature
        p = torch.softmax(chunk, dim=-1)
        out.append(torch.logsumexp(chunk, dim=-1) - (p * chunk).sum(-1))
    if not out:
        return torch.zeros(shape, dtype=torch.float32, device=logits.device)
    return torch.cat(out).reshape(shape)


def shifted_token_logps(logits: torch.Tensor, input_ids: torch.Tensor, *, temperature: float = 1.0,
                        with_entropy: bool = False, entropy_grad: bool = False,
                        chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Align next-token predictions with the tokens they score.

    Returns ``logps`` [B, T] with ``logps[:, t] = log p(input_ids[:, t] | input_ids[:, :t])``
    and ``logps[:, 0] = 0`` (nothing predicts the first token), so a ``response_mask`` over
    token positions lines up with it directly. Same layout for the entropy, which is detached
    unless ``entropy_grad`` (an entropy bonus needs its gradient).
    """
    # Score every position against the next token (a dummy 0 after the last) and drop the
    # last column afterwards: slicing logits[:, :-1] first would make a non-contiguous view
    # that the chunked reshape copies whole ([B, T, V], kept for backward).
    target = torch.nn.functional.pad(input_ids[:, 1:], (0, 1))
    lp = selective_log_softmax(logits, target, chunk_tokens, temperature=temperature)[:, :-1]
    logps = torch.nn.functional.pad(lp, (1, 0), value=0.0)
    ent = None
    if with_entropy:
        src = logits if entropy_grad else logits.detach()
        e = entropy_from_logits(src, chunk_tokens, temperature=temperature)[:, :-1]
        ent = torch.nn.functional.pad(e, (1, 0), value=0.0)
    return logps, ent


def right_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows as one right-padded batch: (input_ids [B, T], attention_mask [B, T])."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row of a [B, T] 0/1 mask is ones then zeros (no pad before a real token)."""
    m = attention_mask.bool()
    return bool((m[:, 1:] <= m[:, :-1]).all())


def token_logps(model: torch.nn.Module, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, temperature: float = 1.0, with_entropy: bool = False,
                entropy_grad: bool = False, target_mask: torch.Tensor | None = None,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, keep: torch.Tensor | None = None,
                **model_kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the model and return (logps [B, T], entropy [B, T] or None), see shifted_token_logps.

    ``target_mask`` [B, T]: score only these tokens (the rest get 0). The LM head and the
    softmax then run only at the positions that predict them (``logits_to_keep`` with an
    index tensor), which skips the prompt: for a 150k vocabulary the head is a large share of
    the compute and its logits most of the activation memory. ``keep``: those positions, where
    the caller knows them on the host (``data.collate.keep_index``; a superset is fine, the
    other rows' non-targets are zeroed anyway); else they are found on the device (one sync).
    ``model_kwargs`` go to the model's forward (a packed row's layout: ``varlen.forward_kwargs``).

    For packed rows pass ``position_ids`` that restart at 0 for each example and no
    attention mask: attention then runs example by example (``relign.models.varlen``, or
    flash-attention's varlen kernel; otherwise transformers builds a block-diagonal causal
    mask). The first token of each packed example is scored against the previous example;
    callers mask it out.

    A right-padded ``attention_mask`` (each row's ones before its zeros) is dropped: under causal
    attention a real token never sees the pads after it, and its positions are 0, 1, ... either
    way, so the mask changes no real token's output. Without it, SDPA takes its causal kernel and
    grouped K/V heads stay unrepeated (transformers repeats them whenever a mask is given): on
    CPU, 15% less attention time and no saved [B, H, L, D] copies of K and V per layer.
    """
    if attention_mask is not None and position_ids is None and right_padded(attention_mask):
        attention_mask = None
    if target_mask is not None and input_ids.shape[1] > 1:
        if keep is None:
            keep = target_mask[:, 1:].bool().any(0).nonzero().squeeze(-1)  # positions p predicting p + 1
        if 0 < keep.numel() < input_ids.shape[1] - 1:
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                        logits_to_keep=keep, **model_kwargs)
            logits = out.logits  # [B, K, V]
            if logits.shape[1] == keep.numel():
                B, T = input_ids.shape
                lp = selective_log_softmax(logits, input_ids[:, keep + 1], chunk_tokens, temperature=temperature)
                on = target_mask[:, keep + 1].to(lp.dtype)  # kept columns are shared by the rows: zero the others' non-targets
                logps = lp.new_zeros(B, T).index_copy(1, keep + 1, lp * on)
                ent = None
                if with_entropy:
                    e = entropy_from_logits(logits if entropy_grad else logits.detach(), chunk_tokens, temperature=temperature)
                    ent = e.new_zeros(B, T).index_copy(1, keep + 1, e * on)
                return logps, ent
            # a model that ignores index-tensor logits_to_keep: fall through to the full path
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                **model_kwargs)
    logps, ent = shifted_token_logps(
        out.logits, input_ids, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
        chunk_tokens=chunk_tokens,
    )
    if target_mask is not None:  # every column was a target somewhere: still 0 at this row's non-targets
        on = target_mask.to(logps.dtype)
        logps, ent = logps * on, ent * on if ent is not None else None
    return logps, ent


def shared_prefix_token_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              prompt_lens: torch.Tensor, group_size: int, *, temperature: float = 1.0,
                              with_entropy: bool = False, entropy_grad: bool = False,
                              chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logps`` for rows that come in groups sharing one prompt, computing each prompt once.

    input_ids / attention_mask [N, L]: rows ``[prompt | response | pad]``, right-padded, in
    groups of ``group_size`` consecutive rows with the same prompt (GRPO/RLOO batches);
    prompt_lens [N]. The prompts of the groups run once (left-padded) and fill a KV cache,
    which is repeated ``group_size`` times; the responses then run against it. Attention,
    positions and therefore log-probs are those of the full rows (tested to 1e-5, gradients
    included: autograd sums the G branches into the shared prompt). With prompts of P tokens
    and responses of R, the forward covers N/G * P + N * R tokens instead of N * (P + R).

    Returns logps (and entropy) [N, L] in the full-row layout, 0 outside the responses.
    """
    heads = list(range(0, input_ids.shape[0], group_size))
    prefix = prompt_prefix(model, input_ids[heads], attention_mask[heads], prompt_lens[heads])
    return response_token_logps(model, prefix.repeat(group_size), input_ids, attention_mask, prompt_lens,
                                temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
                                chunk_tokens=chunk_tokens)


@dataclass
class PromptPrefix:
    """What the responses of a group need from their prompt: its keys and values in every layer
    ([n, H_kv, P, D], the prompts left-padded to P columns), their mask [n, P], and the logits of
    the prompt's last position [n, 1, V] (they score each response's first token)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor
    first: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values, self.first]

    def repeat(self, times: int) -> PromptPrefix:
        """Each prompt ``times`` times in a row (a group's rows); differentiable, autograd sums the copies."""
        rep = lambda x: x.repeat_interleave(times, dim=0)  # noqa: E731
        return PromptPrefix([rep(k) for k in self.keys], [rep(v) for v in self.values], rep(self.mask), rep(self.first))

    def leaves(self) -> PromptPrefix:
        """Detached copies that collect their own gradients: the responses' backward passes
        stop here, and ``backward_from`` later sends the summed gradient through the prompt once."""
        leaf = lambda x: x.detach().requires_grad_(x.requires_grad)  # noqa: E731
        return PromptPrefix([leaf(k) for k in self.keys], [leaf(v) for v in self.values], self.mask, leaf(self.first))

    def backward_from(self, leaves: PromptPrefix) -> None:
        """Back-propagate the gradients the ``leaves`` collected through this prefix's graph."""
        pairs = [(t, x.grad) for t, x in zip(self.tensors(), leaves.tensors()) if t.requires_grad and x.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def prompt_prefix(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  prompt_lens: torch.Tensor) -> PromptPrefix:
    """Run the prompts of rows ``[prompt | ...]`` (one row per group) once, left-padded so that
    every prompt ends at the last column, and keep their keys and values."""
    from transformers import DynamicCache

    plen = prompt_lens.tolist()
    P = max(plen)
    pre_ids = input_ids.new_zeros(len(plen), P)
    pre_mask = attention_mask.new_zeros(len(plen), P)
    for g, n in enumerate(plen):
        pre_ids[g, P - n:] = input_ids[g, :n]
        pre_mask[g, P - n:] = 1
    cache = DynamicCache(config=getattr(model, "config", None))
    pre_pos = (pre_mask.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=pre_ids, attention_mask=pre_mask, position_ids=pre_pos, use_cache=True, logits_to_keep=1,
                **kv_cache_kwargs(cache))
    layers = returned_kv_cache(out).layers
    return PromptPrefix([x.keys for x in layers], [x.values for x in layers], pre_mask, out.logits[:, -1:])


def response_token_logps(model: torch.nn.Module, prefix: PromptPrefix, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor, prompt_lens: torch.Tensor, *, temperature: float = 1.0,
                         with_entropy: bool = False, entropy_grad: bool = False,
                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) [N, L] of the responses of rows ``[prompt | response | pad]``,
    run against ``prefix`` (one prompt per row, already repeated), in the full-row layout."""
    from transformers import DynamicCache

    N, L = input_ids.shape
    dev = input_ids.device
    plen = prompt_lens.tolist()
    rows_len = attention_mask.sum(-1).tolist()
    R = max(1, max(n - p for n, p in zip(rows_len, plen)))
    # responses, right-padded
    resp_ids = input_ids.new_zeros(N, R)
    resp_mask = attention_mask.new_zeros(N, R)
    for i in range(N):
        n = rows_len[i] - plen[i]
        resp_ids[i, :n] = input_ids[i, plen[i] : rows_len[i]]
        resp_mask[i, :n] = 1
    cache = DynamicCache(config=getattr(model, "config", None))
    for li, (k, v) in enumerate(zip(prefix.keys, prefix.values)):
        cache.update(k, v, li)
    full_mask = torch.cat([prefix.mask, resp_mask], dim=-1)
    pos = torch.tensor(plen, device=dev).unsqueeze(-1) + torch.arange(R, device=dev).unsqueeze(0)
    out = model(input_ids=resp_ids, attention_mask=full_mask, position_ids=pos, use_cache=True, **kv_cache_kwargs(cache))
    logits = torch.cat([prefix.first, out.logits[:, :-1]], dim=1)  # [N, R, V]: position j predicts response token j
    lp = selective_log_softmax(logits, resp_ids, chunk_tokens, temperature=temperature)  # [N, R]
    ent = entropy_from_logits(logits if entropy_grad else logits.detach(), chunk_tokens, temperature=temperature) if with_entropy else None
    # back to the full-row layout
    # Padding positions of a row with a short prompt can point past column L - 1: scatter into a
    # wider buffer and cut it, so they never land on (and overwrite) a real token's column.
    cols = torch.tensor(plen, device=dev).unsqueeze(-1) + torch.arange(R, device=dev).unsqueeze(0)
    keep = resp_mask.bool()
    logps = lp.new_zeros(N, L + R).scatter(1, cols, lp * keep)[:, :L]
    entropy = ent.new_zeros(N, L + R).scatter(1, cols, ent * keep)[:, :L] if ent is not None else None
    return logps, entropy
