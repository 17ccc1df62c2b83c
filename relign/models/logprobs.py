"""Per-token log-probabilities and entropy with no fp32 [tokens x vocabulary] kept for the backward.

``log_softmax(logits.float(), -1).gather(...)`` materialises a [B, T, V] fp32 tensor and keeps it
for the backward: for a 150k vocabulary and 8k tokens that is 4.9 GB. Here (``models.fused_ce``)
the rows run in chunks through one autograd function that saves only the logits the model
returned and an fp32 log-sum-exp per token (stage a), and ``token_logps`` goes one step further
where the model is a plain Hugging Face causal LM: it runs the decoder stack and applies the LM
head itself, chunk by chunk, so the logits never exist (stage b).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import fused_ce, precision
from .fused_ce import DEFAULT_CHUNK_TOKENS


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


def logps_and_entropy(logits: torch.Tensor, index: torch.Tensor, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, *,
                      temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(logits / T)[..., index], entropy or None), both shaped like ``index``, in one
    read of the logits per chunk. fp32 (fp64 for fp64 logits); the entropy is detached unless
    ``entropy_grad``. logits: [..., V]; index: [...] (same leading shape). Differentiable; the
    backward keeps the logits (no copy) and an fp32 log-sum-exp per row (``fused_ce``)."""
    shape = index.shape
    lp, ent = fused_ce.log_softmax_gather(logits.reshape(-1, logits.shape[-1]), index.reshape(-1),
                                          temperature=temperature, chunk_tokens=chunk_tokens,
                                          with_entropy=with_entropy, entropy_grad=entropy_grad)
    return lp.reshape(shape), ent.reshape(shape) if ent is not None else None


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, *, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / T)[..., index] computed chunk by chunk. Returns fp32 (fp64 for fp64
    logits), shape of ``index``. logits: [..., V]; index: [...] (same leading shape).
    Differentiable (see ``logps_and_entropy``)."""
    return logps_and_entropy(logits, index, chunk_tokens, temperature=temperature)[0]


def entropy_from_logits(
    logits: torch.Tensor, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, *, temperature: float = 1.0
) -> torch.Tensor:
    """Entropy H = -sum softmax(x) log softmax(x) of each row, chunked, fp32. Shape
    logits.shape[:-1]; differentiable when the logits require a gradient."""
    index = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return logps_and_entropy(logits, index, chunk_tokens, temperature=temperature, with_entropy=True,
                             entropy_grad=logits.requires_grad)[1]


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
    lp, e = logps_and_entropy(logits, target, chunk_tokens, temperature=temperature, with_entropy=with_entropy,
                              entropy_grad=entropy_grad)
    logps = torch.nn.functional.pad(lp[:, :-1], (1, 0), value=0.0)
    ent = torch.nn.functional.pad(e[:, :-1], (1, 0), value=0.0) if e is not None else None
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


def _kept_columns(target_mask: torch.Tensor | None, T: int, keep: torch.Tensor | None = None) -> torch.Tensor | None:
    """The positions p whose next token p + 1 is a target in some row ([K], sorted), or None when
    that is every position (or none): then the head runs at all of them. ``keep``: those positions
    as the caller knows them on the host (``data.collate.keep_index``; a superset is fine, the other
    rows' non-targets are zeroed anyway); else they are found on the device (one sync)."""
    if target_mask is None or T < 2:
        return None
    if keep is None:
        keep = target_mask[:, 1:].bool().any(0).nonzero().squeeze(-1)  # positions p predicting p + 1
    return keep if 0 < keep.numel() < T - 1 else None


def head_dtype(model: torch.nn.Module, weight: torch.Tensor) -> torch.dtype:
    """The dtype the model's own LM head would compute its logits in: the autocast dtype where
    one is on (``bf16-mixed`` runs the forward under it), else the weight's."""
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return precision.compute_dtype(model)


def _hidden_states(backbone: torch.nn.Module, input_ids, attention_mask, position_ids, **kwargs) -> torch.Tensor:
    """The decoder stack's last hidden states [B, T, d] (after the final norm): what the LM head reads."""
    return backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                    **kwargs).last_hidden_state


def token_logps(model: torch.nn.Module, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, temperature: float = 1.0, with_entropy: bool = False,
                entropy_grad: bool = False, target_mask: torch.Tensor | None = None,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, fused_head: bool = True, keep: torch.Tensor | None = None,
                **model_kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the model and return (logps [B, T], entropy [B, T] or None), see shifted_token_logps.

    ``target_mask`` [B, T]: score only these tokens (the rest get 0). The LM head and the
    softmax then run only at the positions that predict them (``logits_to_keep`` with an
    index tensor), which skips the prompt: for a 150k vocabulary the head is a large share of
    the compute and its logits most of the activation memory. ``keep``: those positions, where
    the caller knows them on the host (``_kept_columns``). ``model_kwargs`` go to the model's
    forward (a packed row's layout: ``varlen.forward_kwargs``).

    ``fused_head`` (stage b, ``models.fused_ce``): where the model is a plain Hugging Face causal
    LM (``fused_ce.head_of``), run its decoder stack and apply the LM head here, one chunk of
    positions at a time, so no [B, T, V] logits exist; the backward recomputes each chunk's
    logits (one more product with the head's weight). Same numbers as the model's own head, to
    float rounding. Elsewhere, or with ``fused_head=False``, the model's logits go through the
    chunked log-softmax that keeps only them and a log-sum-exp per token (stage a).

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
    B, T = input_ids.shape
    keep = _kept_columns(target_mask, T, keep)
    kw = dict(temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad, chunk_tokens=chunk_tokens)
    parts = fused_ce.head_of(model) if fused_head else None
    if parts is not None:  # stage b: no logits
        backbone, weight = parts
        hidden = _hidden_states(backbone, input_ids, attention_mask, position_ids, **model_kwargs)
        cols = keep if keep is not None else torch.arange(max(T - 1, 0), device=input_ids.device)
        h = hidden[:, cols]  # [B, K, d]: position p predicts token p + 1
        targets = input_ids[:, cols + 1].reshape(-1)
        lp, e = fused_ce.linear_log_softmax_gather(h.reshape(-1, h.shape[-1]), weight, targets,
                                                   dtype=head_dtype(model, weight), **kw)
        return _placed(lp.view(B, -1), e.view(B, -1) if e is not None else None, cols, T, target_mask)
    if keep is not None:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                    logits_to_keep=keep, **model_kwargs)
        logits = out.logits  # [B, K, V]
        if logits.shape[1] == keep.numel():
            lp, e = logps_and_entropy(logits, input_ids[:, keep + 1], **kw)
            return _placed(lp, e, keep, T, target_mask)
        # a model that ignores index-tensor logits_to_keep: fall through to the full path
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                **model_kwargs)
    logps, ent = shifted_token_logps(out.logits, input_ids, **kw)
    if target_mask is not None:  # every column was a target somewhere: still 0 at this row's non-targets
        on = target_mask.to(logps.dtype)
        logps, ent = logps * on, ent * on if ent is not None else None
    return logps, ent


def _placed(lp: torch.Tensor, ent: torch.Tensor | None, cols: torch.Tensor, T: int, target_mask: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) [B, K] of the tokens after positions ``cols`` back in the [B, T]
    layout (column p + 1 scores token p + 1; column 0 and every column not kept are 0), zero at
    each row's non-targets: kept columns are shared by the rows."""
    B = lp.shape[0]
    on = target_mask[:, cols + 1].to(lp.dtype) if target_mask is not None else None
    place = lambda x: x.new_zeros(B, T).index_copy(1, cols + 1, x * on if on is not None else x)  # noqa: E731
    return place(lp), place(ent) if ent is not None else None


def weighted_token_logps(model: torch.nn.Module, input_ids: torch.Tensor, weights: torch.Tensor, *,
                         attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS, keep: torch.Tensor | None = None,
                         **model_kwargs) -> torch.Tensor | None:
    """S = sum_{b,t} weights[b, t] * log p(x_t | x_<t) (``token_logps``'s alignment), for a loss
    that is a fixed weighted sum of log-probs (SFT: ``aggregate(-logps, ...)`` is -S for the
    weights of its reduction). The fused head (``fused_ce.LinearWeightedSum``) computes the
    gradients in the forward, so no logits exist and none are recomputed. Returns None where the
    model is not a plain causal LM (``fused_ce.head_of``): the caller then takes ``token_logps``."""
    parts = fused_ce.head_of(model)
    if parts is None:
        return None
    if attention_mask is not None and position_ids is None and right_padded(attention_mask):
        attention_mask = None
    B, T = input_ids.shape
    backbone, weight = parts
    hidden = _hidden_states(backbone, input_ids, attention_mask, position_ids, **model_kwargs)
    keep = _kept_columns(weights != 0, T, keep)
    cols = keep if keep is not None else torch.arange(max(T - 1, 0), device=input_ids.device)
    h = hidden[:, cols]
    s, _ = fused_ce.linear_weighted_sum(h.reshape(-1, h.shape[-1]), weight, input_ids[:, cols + 1].reshape(-1),
                                        weights[:, cols + 1].reshape(-1), dtype=head_dtype(model, weight),
                                        chunk_tokens=chunk_tokens)
    return s


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
    lp, ent = logps_and_entropy(logits, resp_ids, chunk_tokens, temperature=temperature, with_entropy=with_entropy,
                                entropy_grad=entropy_grad)  # [N, R]
    # back to the full-row layout
    # Padding positions of a row with a short prompt can point past column L - 1: scatter into a
    # wider buffer and cut it, so they never land on (and overwrite) a real token's column.
    cols = torch.tensor(plen, device=dev).unsqueeze(-1) + torch.arange(R, device=dev).unsqueeze(0)
    keep = resp_mask.bool()
    logps = lp.new_zeros(N, L + R).scatter(1, cols, lp * keep)[:, :L]
    entropy = ent.new_zeros(N, L + R).scatter(1, cols, ent * keep)[:, :L] if ent is not None else None
    return logps, entropy
