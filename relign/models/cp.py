"""Context parallelism, Ulysses-style (``parallel.cp_size``; docs/parallel.md): a packed row split
in contiguous chunks over the cp ranks, attention run over the whole row with the heads split.

Each rank runs the model on its chunk of T/cp tokens: embeddings, norms, MLPs and the LM head
see only that chunk, so their activations are 1/cp of the row's. Attention needs every earlier
token, so before it an all-to-all swaps the sequence split for a head split, (B, H, T/cp, D) ->
(B, H/cp, T, D), and after it the swap is reversed (DeepSpeed-Ulysses; veRL's
``ulysses_sequence_parallel_size``). Both all-to-alls are PyTorch's autograd
one, so the backward swaps the gradients back. The attention between them is relign's varlen
SDPA (``models.varlen``) on the whole row: it reads the sequences from the whole row's position
ids, which every cp rank holds (each chunk's tokens keep their own position ids, so RoPE is right
and a sequence may cross a chunk boundary). PyTorch's ``context_parallel`` is not used: it intercepts
only the CUDA SDPA kernels (specs/parallel.md).

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
from ..errors import ConfigError
from . import varlen
from .logprobs import entropy_from_logits, selective_log_softmax
from .tp import check_heads

NAME = "relign_ulysses"
# (the cp group, the whole rows' position ids) while a chunked forward runs
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
    -> ([B, t, H, D], None)); outside ``chunked`` it is varlen SDPA as it is."""
    active = _ACTIVE.get()
    if active is None:
        return varlen.varlen_sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    group, whole = active
    cp = dist.get_world_size(group)
    if attention_mask is not None:
        raise RuntimeError("context parallel attention runs packed rows only: position ids and no attention mask")
    kwargs["position_ids"] = whole  # the whole row's: its sequence boundaries (every cp rank holds them)
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
def chunked(group, position_ids: torch.Tensor):
    """Forwards inside run on this rank's chunk of each row, attention over the whole row, whose
    (padded) ``position_ids`` every cp rank holds: no exchange of them per layer."""
    token = _ACTIVE.set((group, position_ids))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def chunk_bounds(T: int, cp: int, c: int) -> tuple[int, int, int]:
    """(padded length, start, end) of chunk ``c`` of a row of T tokens padded to a multiple of cp."""
    n = -(-T // cp)
    return n * cp, c * n, (c + 1) * n


def _chunk(input_ids: torch.Tensor, position_ids: torch.Tensor, group
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """This cp rank's chunk [a, e) of each row (ids and position ids), the whole padded rows'
    position ids, and (a, last): its outputs at columns a .. last - 1 score targets a + 1 .. last
    (the last being the next chunk's first token). A row not a multiple of cp long is padded at
    its end with a sequence of its own (position ids from 0), which no real token attends to."""
    cp, c = dist.get_world_size(group), dist.get_rank(group)
    B, T = input_ids.shape
    Tp, a, e = chunk_bounds(T, cp, c)
    if Tp > T:
        pad = Tp - T
        input_ids = torch.cat([input_ids, input_ids.new_zeros(B, pad)], dim=1)
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device).expand(B, pad)], dim=1)
    return input_ids[:, a:e], position_ids[:, a:e], position_ids, a, min(e, T - 1)


def _place(x: torch.Tensor, a: int, last: int, T: int) -> torch.Tensor:
    """[B, last - a] values of targets a + 1 .. last -> [B, T], 0 at every other column."""
    out = x.new_zeros(x.shape[0], T)
    return out.index_copy(1, torch.arange(a + 1, last + 1, device=out.device), x) if last > a else out


def cp_token_logps(model, input_ids: torch.Tensor, position_ids: torch.Tensor, group, *, temperature: float = 1.0,
                   with_entropy: bool = False, entropy_grad: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(x_t | x_<t), entropy or None) [B, T] of packed rows (``token_logps``'s convention:
    column t scores token t) at the targets this cp rank scores, 0 at the others': the rank runs
    its chunk [a, e) of each row, whose logits score tokens a + 1 .. e (every rank holds the
    whole row's ids, so the next chunk's first token needs no exchange). Summed over the cp
    ranks this is the whole row's (``whole_row``), and the sum of the ranks' losses
    backpropagates to the whole row's gradient (the attention all-to-alls carry each token's
    key and value gradients back to its rank)."""
    ids, pos, whole, a, last = _chunk(input_ids, position_ids, group)
    with chunked(group, whole):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, : max(last - a, 0)]
    T = input_ids.shape[1]
    lp = selective_log_softmax(logits, input_ids[:, a + 1 : last + 1], temperature=temperature)
    ent = None
    if with_entropy:
        ent = _place(entropy_from_logits(logits if entropy_grad else logits.detach(), temperature=temperature), a, last, T)
    return _place(lp.float(), a, last, T), ent


def cp_values(critic, input_ids: torch.Tensor, position_ids: torch.Tensor, group) -> torch.Tensor:
    """A ``ValueModel``'s V(x_<t) [B, T] (``values[:, t]`` read off the hidden state at t - 1, as
    its forward aligns them) at this cp rank's targets, 0 at the others' (as ``cp_token_logps``)."""
    ids, pos, whole, a, last = _chunk(input_ids, position_ids, group)
    with chunked(group, whole):
        v = critic(ids, position_ids=pos, shifted=False)[:, : max(last - a, 0)]  # V after reading each chunk token
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
