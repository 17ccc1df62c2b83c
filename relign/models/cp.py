"""Context parallelism, Ulysses-style (``parallel.cp_size``; docs/parallel.md): a packed row split
in contiguous chunks over the cp ranks, attention run over the whole row with the heads split.

Each rank runs the model on its chunk of T/cp tokens: embeddings, norms, MLPs and the LM head
see only that chunk, so their activations are 1/cp of the row's. Attention needs every earlier
token, so before it an all-to-all swaps the sequence split for a head split, (B, H, T/cp, D) ->
(B, H/cp, T, D), and after it the swap is reversed (DeepSpeed-Ulysses; veRL's
``ulysses_sequence_parallel_size``). Both all-to-alls are PyTorch's autograd
one, so the backward swaps the gradients back. The attention between them is relign's varlen
attention (``models.varlen``) on the whole row: it reads the sequences from the whole row's layout
(``data.collate.Packing``, the collator's, or read once from the position ids), which every cp
rank holds and hands to the model as kwargs (each chunk's tokens keep their own position ids, so
RoPE is right and a sequence may cross a chunk boundary). PyTorch's ``context_parallel`` is not
used: it intercepts only the CUDA SDPA kernels (specs/parallel.md).

Ulysses runs only inside ``chunked(...)`` (``cp_token_logps``, ``cp_values``); any other forward of the model
(evaluation, generation) runs on whole rows as before, each cp rank computing the same.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from .. import distributed
from ..data.collate import Packing
from ..errors import ConfigError
from . import varlen
from .logprobs import entropy_from_logits, selective_log_softmax, token_logps, weighted_token_logps
from .tp import check_heads

NAME = "relign_ulysses"
# the cp group while a chunked forward runs
_ACTIVE = contextvars.ContextVar("relign_ulysses_active", default=None)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Block i of dim 0 to rank i, block i of the result from rank i; its backward is the same swap
    of the gradients (functional collectives' autograd all-to-all)."""
    out = all_to_all_single_autograd(x, None, None, group)
    return out.wait() if hasattr(out, "wait") else out


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[B, H, t, D], this rank's chunk of the sequence with all heads -> [B, H/cp, cp * t, D], the
    whole sequence with this rank's heads: head block j goes to rank j, chunk i comes from rank i."""
    B, H, t, D = x.shape
    send = x.reshape(B, cp, H // cp, t, D).transpose(0, 1).contiguous()  # [cp, B, H/cp, t, D]: block j for rank j
    got = _all_to_all(send, group)     # [cp, B, H/cp, t, D]: chunk i from rank i
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * t, D)


def _heads_to_seq(y: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[B, T, H/cp, D], the whole sequence with this rank's heads -> [B, T/cp, H, D], this rank's
    chunk with all heads (the inverse of ``_seq_to_heads``, in the attention output's layout)."""
    B, T, h, D = y.shape
    send = y.reshape(B, cp, T // cp, h, D).transpose(0, 1).contiguous()  # [cp, B, t, H/cp, D]: chunk j for rank j
    got = _all_to_all(send, group)   # [cp, B, t, H/cp, D]: heads block i from rank i
    return got.permute(1, 2, 0, 3, 4).reshape(B, T // cp, cp * h, D)


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function interface (query [B, H, t, D], key/value [B, H_kv, t, D]
    -> ([B, t, H, D], None)); outside ``chunked`` it is varlen attention as it is. Inside, the
    kwargs carry the whole row's layout (``cp_token_logps``), the same on every cp rank."""
    group = _ACTIVE.get()
    if group is None:
        return varlen.varlen_sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    cp = dist.get_world_size(group)
    if kwargs.get("cu_seq_lens_q") is None:
        raise RuntimeError("context parallel attention runs packed rows only: the whole row's layout (varlen.forward_kwargs)")
    q, k, v = (_seq_to_heads(x, group, cp) for x in (query, key, value))
    out, _ = varlen.varlen_sdpa_attention(module, q, k, v, None, **kwargs)  # [B, T, H/cp, D]
    return _heads_to_seq(out, group, cp), None


def enable_ulysses(model, cp_size: int, tp_size: int = 1) -> None:
    """Route ``model``'s attention through ``ulysses_attention``. It wraps relign's varlen SDPA
    (``varlen.enable`` first); any other kernel is refused with the key to change."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == NAME:
        return
    if impl != varlen.NAME:
        raise ConfigError(f"parallel.cp_size={cp_size} wraps relign's varlen SDPA attention (model.attn_implementation=sdpa, "
                          f"packing on, a {'/'.join(varlen.SUPPORTED)} model); it cannot wrap {impl!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    check_heads(model.config, tp_size, cp_size)  # with tp too: each (tp, cp) rank takes whole key-value heads
    AttentionInterface.register(NAME, ulysses_attention)
    varlen.WRAPPERS.add(NAME)  # it runs varlen's attention on the whole row: continuations read as they do there
    AttentionMaskInterface.register(NAME, varlen.packed_mask)
    model.config._attn_implementation = NAME


@contextlib.contextmanager
def chunked(group):
    """Forwards inside run on this rank's chunk of each row, attention over the whole row, whose
    (padded) layout every cp rank holds and passes as kwargs: no exchange of it per layer."""
    token = _ACTIVE.set(group)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def chunk_bounds(T: int, cp: int, c: int) -> tuple[int, int, int]:
    """(padded length, start, end) of chunk ``c`` of a row of T tokens padded to a multiple of cp."""
    n = -(-T // cp)
    return n * cp, c * n, (c + 1) * n


def _chunk(input_ids: torch.Tensor, position_ids: torch.Tensor, group, packing: Packing | None
           ) -> tuple[torch.Tensor, torch.Tensor, Packing, int, int]:
    """This cp rank's chunk [a, e) of the row (ids and position ids), the whole padded row's
    layout, and (a, last): its outputs at columns a .. last - 1 score targets a + 1 .. last
    (the last being the next chunk's first token). A row not a multiple of cp long is padded at
    its end with a sequence of its own (position ids from 0), which no real token attends to.
    ``packing``: the row's layout from its collator; None reads it from the position ids (once)."""
    cp, c = dist.get_world_size(group), dist.get_rank(group)
    B, T = input_ids.shape
    if B != 1:
        raise ValueError(f"context parallel runs one packed row per forward, not {B}")
    packing = varlen.layout_of(position_ids) if packing is None else packing
    Tp, a, e = chunk_bounds(T, cp, c)
    if Tp > T:
        pad = Tp - T
        input_ids = torch.cat([input_ids, input_ids.new_zeros(B, pad)], dim=1)
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device).expand(B, pad)], dim=1)
        packing = _pad_layout(packing, T, pad)
    return input_ids[:, a:e], position_ids[:, a:e], packing, a, min(e, T - 1)


def _pad_layout(p: Packing, T: int, pad: int) -> Packing:
    """``p`` with one more sequence: the ``pad`` tokens after the row's T (device ops only)."""
    end = lambda cu: torch.cat([cu, cu[-1:] + pad])  # noqa: E731
    cu_q = end(p.cu_seq_lens_q)
    if p.kv_index is None:
        return Packing(cu_q, cu_q, max(p.max_length_q, pad), max(p.max_length_k, pad))
    kv = torch.cat([p.kv_index, torch.arange(T, T + pad, device=p.kv_index.device)])
    return Packing(cu_q, end(p.cu_seq_lens_k), max(p.max_length_q, pad), max(p.max_length_k, pad), kv)


def _place(x: torch.Tensor, a: int, last: int, T: int) -> torch.Tensor:
    """[B, last - a] values of targets a + 1 .. last -> [B, T], 0 at every other column."""
    out = x.new_zeros(x.shape[0], T)
    return out.index_copy(1, torch.arange(a + 1, last + 1, device=out.device), x) if last > a else out


def cp_token_logps(model, input_ids: torch.Tensor, position_ids: torch.Tensor, group, *, temperature: float = 1.0,
                   with_entropy: bool = False, entropy_grad: bool = False, packing: Packing | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(x_t | x_<t), entropy or None) [B, T] of packed rows (``token_logps``'s convention:
    column t scores token t) at the targets this cp rank scores, 0 at the others': the rank runs
    its chunk [a, e) of each row, whose logits score tokens a + 1 .. e (every rank holds the
    whole row's ids, so the next chunk's first token needs no exchange). Summed over the cp
    ranks this is the whole row's (``whole_row``), and the sum of the ranks' losses
    backpropagates to the whole row's gradient (the attention all-to-alls carry each token's
    key and value gradients back to its rank)."""
    ids, pos, whole, a, last = _chunk(input_ids, position_ids, group, packing)
    with chunked(group):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False,
                       **varlen.forward_kwargs(model, whole)).logits[:, : max(last - a, 0)]
    T = input_ids.shape[1]
    lp = selective_log_softmax(logits, input_ids[:, a + 1 : last + 1], temperature=temperature)
    ent = None
    if with_entropy:
        ent = _place(entropy_from_logits(logits if entropy_grad else logits.detach(), temperature=temperature), a, last, T)
    return _place(lp.float(), a, last, T), ent


def cp_values(critic, input_ids: torch.Tensor, position_ids: torch.Tensor, group, packing: Packing | None = None
              ) -> torch.Tensor:
    """A ``ValueModel``'s V(x_<t) [B, T] (``values[:, t]`` read off the hidden state at t - 1, as
    its forward aligns them) at this cp rank's targets, 0 at the others' (as ``cp_token_logps``)."""
    ids, pos, whole, a, last = _chunk(input_ids, position_ids, group, packing)
    with chunked(group):
        v = critic(ids, position_ids=pos, shifted=False,
                   **varlen.forward_kwargs(critic, whole))[:, : max(last - a, 0)]  # V after reading each chunk token
    return _place(v, a, last, input_ids.shape[1])


class _SumOverChunks(torch.autograd.Function):
    """Forward: the sum over the cp ranks (each holds its own targets, 0 elsewhere). Backward:
    the gradient as it is. Every cp rank then computes the same loss on the whole row, so the
    gradient of its own targets is already the whole loss's; the other columns were constant 0
    on this rank (Megatron's reduce-from-tensor-parallel-region, over cp)."""

    @staticmethod
    def forward(ctx, x, group):
        return distributed.all_reduce_sum(x, group, host=False)  # feeds the loss's kernels: no host wait in the forward

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def whole_row(x: torch.Tensor | None, group) -> torch.Tensor | None:
    """The whole row's results on every cp rank, from each rank's targets (``cp_token_logps``,
    ``cp_values``); exact (each column is one rank's value plus zeros). For callers whose loss
    and metrics read whole rows (RL); SFT sums its chunks' losses instead."""
    return None if x is None else _SumOverChunks.apply(x, group)


# --------------------------------------------------------------------------- the one packed forward


def packed_token_logps(model, input_ids: torch.Tensor, position_ids: torch.Tensor, packing: Packing, *,
                       target_mask: torch.Tensor, keep: torch.Tensor | None = None, whole: bool = True, **kw
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p, entropy or None) [1, S] of a packed row (``data.collate.pack_rows``' layout), 0 off
    ``target_mask``: every recipe's packed forward. On one process (or with no cp group) one
    ``token_logps`` call with the collator's varlen layout and LM-head positions ``keep``; under
    context parallel (``distributed.cp_group``) this rank's chunk of the row (``cp_token_logps``),
    summed over the cp ranks into the whole row on every rank (``whole``, for a loss and metrics
    that read whole rows: RL, DPO), or left at this rank's targets (``whole=False``: SFT sums its
    ranks' chunk losses). ``kw``: ``temperature``, ``with_entropy``, ``entropy_grad``."""
    group = distributed.cp_group()
    if group is None:
        return token_logps(model, input_ids, position_ids=position_ids, target_mask=target_mask, keep=keep,
                           **varlen.forward_kwargs(model, packing), **kw)
    lp, ent = cp_token_logps(model, input_ids, position_ids, group, packing=packing, **kw)
    if whole:
        lp, ent = whole_row(lp, group), whole_row(ent, group)
    return lp * target_mask, ent * target_mask if ent is not None else None


def packed_weighted_logps(model, input_ids: torch.Tensor, weights: torch.Tensor, position_ids: torch.Tensor,
                          packing: Packing, *, keep: torch.Tensor | None = None) -> torch.Tensor | None:
    """``weighted_token_logps`` (the fused LM head taking SFT's gradients in its forward) of a packed
    row, or None where it does not apply: a model it does not take, or context parallel, whose ranks
    run chunks of the row (``packed_token_logps`` then)."""
    if distributed.cp_group() is not None:
        return None
    return weighted_token_logps(model, input_ids, weights, position_ids=position_ids, keep=keep,
                                **varlen.forward_kwargs(model, packing))


def packed_values(critic, input_ids: torch.Tensor, position_ids: torch.Tensor, packing: Packing) -> torch.Tensor:
    """A ``ValueModel``'s V [1, S] of a packed row on every rank: one forward, or under context parallel
    this rank's chunk summed over the cp ranks (``cp_values``, ``whole_row``)."""
    group = distributed.cp_group()
    if group is None:
        return critic(input_ids, position_ids=position_ids, **varlen.forward_kwargs(critic, packing))
    return whole_row(cp_values(critic, input_ids, position_ids, group, packing), group)
