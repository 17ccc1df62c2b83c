"""The RL update: log-probs and values of a rollout batch, and the policy and critic steps.

Flat arguments only (no config objects): the recipe builds ``ActorLoss`` and ``Layout`` once
from its config and passes tensors.

Micro-batches are cut by token count. The batch's items (whole groups when their prompt is
computed once, else single sequences) are spread over ranks and micro-batches with
Karmarkar–Karp (``data.balance``), every rank running the same number of passes. Each
micro-batch runs in one of three layouts, all giving the same per-token log-probs:

* ``shared``  rows padded, each group's prompt computed once and its KV cache reused by the
              group's G responses (``shared_prefix_token_logps``; for models ``varlen`` does
              not cover: elsewhere ``packed`` with groups does the same with no padding). A group
              larger than the row budget is split over micro-batches: its prompt runs once, at
              the first part, and its gradient goes back through the prompt once, after the
              last (``GroupPrefix``);
* ``padded``  rows right-padded to the micro-batch's longest row;
* ``packed``  the micro-batch's sequences concatenated in one row with per-sequence position
              ids: no padding at all. Attention runs sequence by sequence (``models.varlen``;
              flash-attention's varlen kernel; else a block-diagonal mask). With ``varlen``
              and groups (``group_size`` > 1), a group's prompt runs once: its other responses
              follow in the row as continuations of it (``varlen.segments``), each repeating
              the prompt's last token, whose logits score the response's first.
              Under context parallel (``parallel.cp_size``) each cp rank runs its chunk of
              the row and every cp rank gets the whole row's results (``models.cp``).

Whatever the layout, results come back in the batch's row layout [n, L], so the losses,
masks and metrics below never see it.

Losses are normalized by counts over the whole mini-batch on all ranks (every rank holds the
whole batch's masks, so the count needs no communication): the summed gradient is that of
the full mini-batch, whatever the micro-batching, packing or number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import distributed
from ..algorithms.aggregation import aggregate, aggregate_count
from ..algorithms.kl import kl_estimate
from ..algorithms.policy_losses import entropy_bonus_loss, gspo_loss, ppo_clip_loss, value_loss
from ..algorithms.trpo import self_kl, surrogate_objective, token_kl, trpo_step
from ..data.balance import micro_batch_plan
from ..data.collate import Packing, keep_index, pack_rows
from ..models import lean
from ..models.cp import packed_token_logps, packed_values
from ..models.logprobs import PromptPrefix, prompt_prefix, response_token_logps, shared_prefix_token_logps, token_logps
from ..optim import clip_gradients
from ..rollout.batch import RolloutBatch

# --------------------------------------------------------------------------- micro-batches


@dataclass(frozen=True)
class Layout:
    """How rows become forward passes: the layout, the group size G, the token and row budgets."""

    kind: str = "padded"
    group_size: int = 1
    max_tokens: int = 0
    """Most tokens (prompt + response, as run) in one micro-batch; 0 = no limit."""
    max_rows: int = 0
    """Most sequences in one micro-batch; 0 = no limit."""
    max_length: int = 0
    """The longest sequence a pass can hold (prompt + response): the varlen kernel's constant bound
    (``data.collate.Packing``); 0 = each micro-batch's own longest."""


@dataclass
class MicroBatch:
    rows: torch.Tensor  # [n] long: rows of the batch
    weight: float = 1.0
    """0: a pass that only keeps this rank in step with the others (FSDP), it adds nothing."""
    part: tuple[int, int] | None = None
    """(i, k): the i-th of k parts of one group split over micro-batches (shared layout)."""

    @property
    def last_part(self) -> bool:
        return self.part is not None and self.part[0] == self.part[1] - 1


class GroupPrefix:
    """The prompt of a group split over micro-batches. The first part runs the prompt once and
    keeps its keys and values; every part's responses attend to detached copies (leaves), whose
    gradients add up over the parts; ``finish`` then back-propagates the sum through the prompt,
    once. The gradient equals that of the whole group in one pass (tested)."""

    def __init__(self):
        self.graph: PromptPrefix | None = None
        self.leaves: PromptPrefix | None = None

    def get(self, model, batch: RolloutBatch, rows: torch.Tensor) -> PromptPrefix:
        if self.graph is None:
            head = batch.rows(rows[:1])
            self.graph = prompt_prefix(model, head["input_ids"], head["attention_mask"], head["prompt_lens"])
            self.leaves = self.graph.leaves() if torch.is_grad_enabled() else self.graph
        return self.leaves

    def finish(self) -> None:
        """After the group's last part: the prompt's backward (nothing to do without gradients)."""
        if self.graph is not None and self.leaves is not self.graph:
            self.graph.backward_from(self.leaves)
        self.graph = self.leaves = None


def plan(batch: RolloutBatch, rows: torch.Tensor, layout: Layout) -> list[MicroBatch]:
    """This rank's micro-batches of ``rows`` (whole groups for the shared layout)."""
    G = layout.group_size if layout.kind != "padded" else 1
    items = rows.view(-1, G)  # [n_items, G]
    seq = batch.seq_lens[items]  # [n_items, G]
    # positions as computed: a shared prompt once, and its G responses padded to the longest
    # (shared), or each response plus the prompt's last token again (packed)
    prompt = batch.prompt_lens[items[:, 0]]  # [n_items]
    resp = seq - prompt.unsqueeze(-1)
    if G == 1:
        sizes = seq[:, 0].tolist()
    elif layout.kind == "packed":
        sizes = (prompt + resp.sum(-1) + G - 1).tolist()
    else:
        sizes = (prompt + G * resp.amax(-1)).tolist()
    max_items = max(1, layout.max_rows // G) if layout.max_rows else 0
    mine = micro_batch_plan(sizes, ranks=distributed.data_size(), max_tokens=layout.max_tokens, max_items=max_items)
    mine = mine[distributed.data_rank()]
    smallest = min(range(len(sizes)), key=lambda i: (sizes[i], i))
    out = [MicroBatch(items[part].flatten()) if part else MicroBatch(items[smallest], weight=0.0) for part in mine]
    if G > 1 and layout.max_rows and G > layout.max_rows:
        # one group per micro-batch (max_items = 1) is more rows than the budget: split it in k
        # parts of at most max_rows (the same k on every rank: every rank runs the same passes);
        # a packed part runs the prompt again, a shared one reuses it (GroupPrefix)
        k = math.ceil(G / layout.max_rows)
        shared = layout.kind == "shared"
        out = [MicroBatch(rows, m.weight, part=(i, k) if shared else None) for m in out
               for i, rows in enumerate(m.rows.tensor_split(k))]
    return out


# --------------------------------------------------------------------------- forward passes


class Packed(NamedTuple):
    """A micro-batch's rows as one packed row [1, S] (``_packed``)."""

    ids: torch.Tensor  # [1, S]
    pos: torch.Tensor  # [1, S] position ids
    response_mask: torch.Tensor  # [1, S]
    where: torch.Tensor  # [2, S]: (row, column) of each packed token, to scatter results back
    packing: Packing  # where its sequences lie (varlen attention)
    keep: torch.Tensor  # [K]: the positions whose next token is a response token (the LM head's)


def _packed(batch: RolloutBatch, rows: torch.Tensor, G: int, max_length: int = 0) -> Packed:
    """The rows' real tokens in one row, laid out on the host from the rows' lengths (one read
    of them per micro-batch, none in the forward). With groups of ``G > 1`` a row after the
    first of its group packs only its prompt's last token and its response, which continue the
    group's prompt (``data.collate.pack_rows``): each prompt runs once."""
    dev = batch.input_ids.device
    at, lens, plens = torch.stack([rows.to(dev), batch.seq_lens[rows], batch.prompt_lens[rows]]).tolist()
    starts = None
    if G > 1:  # a group's rows are consecutive in the batch
        starts = [max(p - 1, 0) if i and r // G == at[i - 1] // G else 0 for i, (r, p) in enumerate(zip(at, plens))]
    row_of, col, packing = pack_rows(lens, starts, max_length=max_length)
    keep = keep_index(col >= torch.tensor(plens)[row_of])  # prompt tokens are never scored: a superset of the targets
    where = torch.stack([row_of, col]).to(dev, non_blocking=True)
    r = rows.to(dev)[where[0]]
    return Packed(batch.input_ids[r, where[1]][None], where[1][None], batch.response_mask[r, where[1]][None], where,
                  packing.to(dev, non_blocking=True), keep.to(dev, non_blocking=True))


def forward_logps(model, batch: RolloutBatch, rows: torch.Tensor, layout: Layout, *, temperature: float,
                  with_entropy: bool = False, entropy_grad: bool = False, prefix: GroupPrefix | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of the rows, [n, L] in the batch's row layout, 0 outside
    the response tokens. ``prefix``: the rows are a part of one group, whose prompt it holds."""
    L = batch.input_ids.shape[1]
    kw = dict(temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)
    if prefix is not None:
        mb = batch.rows(rows)
        pre = prefix.get(model, batch, rows).repeat(len(rows))
        lp, ent = response_token_logps(model, pre, mb["input_ids"], mb["attention_mask"], mb["prompt_lens"], **kw)
        on = mb["response_mask"]
        return lp * on, ent * on if ent is not None else None
    if layout.kind == "shared" and layout.group_size > 1:
        mb = batch.rows(rows)
        lp, ent = shared_prefix_token_logps(model, mb["input_ids"], mb["attention_mask"], mb["prompt_lens"],
                                            layout.group_size, **kw)
        on = mb["response_mask"]  # the whole response span is scored: keep the model's tokens only (not an env's)
        return lp * on, ent * on if ent is not None else None
    if layout.kind == "packed":
        p = _packed(batch, rows, layout.group_size, layout.max_length)
        # [1, S]; under context parallel each cp rank runs its chunk and every one gets the whole row
        lp, ent = packed_token_logps(model, p.ids, p.pos, p.packing, target_mask=p.response_mask, keep=p.keep, **kw)
        # a packed segment's first token is scored against the previous segment: never a target
        back = lambda x: x.new_zeros(len(rows), L).index_put((p.where[0], p.where[1]), x[0] * p.response_mask[0])  # noqa: E731
        return back(lp), back(ent) if ent is not None else None
    # padded: right padding under causal attention needs no mask; cut to the longest row
    width = int(batch.seq_lens[rows].max())
    lp, ent = token_logps(model, batch.input_ids[rows, :width], target_mask=batch.response_mask[rows, :width], **kw)
    pad = lambda x: F.pad(x, (0, L - width)) if x is not None else None  # noqa: E731
    return pad(lp), pad(ent)


def forward_values(critic, batch: RolloutBatch, rows: torch.Tensor, layout: Layout) -> torch.Tensor:
    """V(s_t) [n, L] of the rows (the critic has no shared-prompt path: shared runs padded)."""
    L = batch.input_ids.shape[1]
    if layout.kind == "packed":
        p = _packed(batch, rows, layout.group_size, layout.max_length)
        v = packed_values(critic, p.ids, p.pos, p.packing)  # [1, S]
        return v.new_zeros(len(rows), L).index_put((p.where[0], p.where[1]), v[0] * p.response_mask[0])
    width = int(batch.seq_lens[rows].max())
    return F.pad(critic(batch.input_ids[rows, :width]), (0, L - width))


@torch.no_grad()
def score_logps(model, batch: RolloutBatch, micro: list[MicroBatch], layout: Layout, *, temperature: float) -> torch.Tensor:
    """log pi(y_t) [N, L] of the whole batch on every rank: each rank scores its micro-batches,
    and the ranks' rows are summed together (each row belongs to exactly one rank)."""
    out = torch.zeros(batch.input_ids.shape, device=batch.input_ids.device)
    prefix = GroupPrefix()
    for m in micro:
        lp, _ = forward_logps(model, batch, m.rows, layout, temperature=temperature, prefix=prefix if m.part else None)
        if m.weight:
            out[m.rows] = lp
        if m.last_part:
            prefix.finish()
    distributed.reshard(model)  # a forward with no backward: see distributed.reshard
    return distributed.all_reduce_sum(out)


@torch.no_grad()
def score_values(critic, batch: RolloutBatch, micro: list[MicroBatch], layout: Layout) -> torch.Tensor:
    """V(s_t) [N, L] of the whole batch on every rank (as ``score_logps``)."""
    out = torch.zeros(batch.input_ids.shape, device=batch.input_ids.device)
    for m in micro:
        v = forward_values(critic, batch, m.rows, layout)
        if m.weight:
            out[m.rows] = v
    distributed.reshard(critic)
    return distributed.all_reduce_sum(out)


# --------------------------------------------------------------------------- the losses


def _gspo(logps, old_logps, advantages, mask, *, clip_low, clip_high, dual_clip):
    """GSPO uses one advantage per sequence: the (constant) per-token advantage of the row."""
    seq_a = (advantages * mask).sum(-1) / mask.sum(-1).clamp_min(1)
    return gspo_loss(logps, old_logps, seq_a, mask, clip_low=clip_low, clip_high=clip_high)


def _ppo_clip(logps, old_logps, advantages, mask, *, clip_low, clip_high, dual_clip):
    return ppo_clip_loss(logps, old_logps, advantages, clip_low=clip_low, clip_high=clip_high,
                         dual_clip=dual_clip if dual_clip > 0 else None)


@dataclass(frozen=True)
class PolicyLoss:
    """A policy surrogate: ``fn(logps, old_logps, advantages, mask, *, clip_low, clip_high, dual_clip) ->
    (loss [n, L], info)`` (``relign.algorithms.policy_losses``), and the reduction it needs, if any."""

    fn: Callable
    agg: str = ""
    """The ``algorithm.loss_agg`` its objective is defined with ("" = any)."""
    why: str = ""
    """Why it needs that reduction (the config error says it)."""


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": PolicyLoss(_ppo_clip),
    "gspo": PolicyLoss(_gspo, agg="seq-mean-token-mean",
                       why="GSPO's objective is the mean over sequences of the sequence-level clipped term"),
}


@dataclass(frozen=True)
class ActorLoss:
    """The per-token actor loss: policy surrogate (times the TIS weight), + beta * KL when the KL
    is a loss term, - the entropy bonus; reduced with ``agg`` over the mini-batch. With its own
    ``kl_agg`` the KL term is reduced apart: beta * aggregate(KL, kl_agg) is added to the
    reduced policy loss (VinePPO's reference: the clamped k3 summed over each sequence's tokens,
    averaged over sequences, beside a token-mean policy term)."""

    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 0.0
    kl_coef: float = 0.0
    """beta of the KL term in the loss (0: the KL is not in the loss)."""
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    agg: str = "token-mean"
    max_len: int = 0
    """The constant L of seq-mean-token-sum-norm (the longest possible response)."""
    kl_agg: str = ""
    """How the KL term is reduced ("": with the policy term, per token under ``agg``)."""
    kl_clamp: float = 0.0
    """Clamp each token's KL estimate to [0, kl_clamp] in the loss (0: off); actor/kl logs it unclamped."""

    @property
    def kl_apart(self) -> bool:
        """Whether the KL term is reduced on its own (``kl_agg`` set and not ``agg``)."""
        return self.kl_coef > 0 and bool(self.kl_agg) and self.kl_agg != self.agg

    def __call__(self, logps, old_logps, advantages, mask, *, ref_logps=None, entropy=None, tis=None):
        """logps, old_logps, advantages, mask, ref_logps, entropy, tis: [n, L]. Returns (loss [n, L], info);
        with ``kl_apart``, info["kl_loss"] [n, L] is the KL term to reduce with ``kl_agg``."""
        loss, info = POLICY_LOSSES[self.policy_loss].fn(logps, old_logps, advantages, mask, clip_low=self.clip_low,
                                                         clip_high=self.clip_high, dual_clip=self.dual_clip)
        if tis is not None:
            loss = loss * tis
        if ref_logps is not None:
            kl = kl_estimate(logps, ref_logps, self.kl_estimator)
            info["kl"] = kl.detach()
            if self.kl_clamp > 0:
                kl = kl.clamp(0.0, self.kl_clamp)
            if self.kl_apart:
                info["kl_loss"] = kl
            elif self.kl_coef > 0:
                loss = loss + self.kl_coef * kl
        if self.entropy_coef > 0:
            loss = loss + self.entropy_coef * entropy_bonus_loss(entropy)
        return loss, info

    def inert_rows(self, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[N] bool: rows whose loss is 0 with a 0 gradient, whatever the policy: A = 0 on every
        response token, and no KL or entropy term. Both surrogates are A times a function of
        the ratio (PPO-clip, dual clip, GSPO, times a TIS weight), so such a row adds nothing to
        the update but the cost of its forward and backward."""
        if self.kl_coef > 0 or self.entropy_coef > 0:
            return torch.zeros(advantages.shape[0], dtype=torch.bool, device=advantages.device)
        return (advantages * mask).abs().sum(-1) == 0


class Stats:
    """Metric sums over this rank's tokens, reduced over ranks once at the end of the step."""

    def __init__(self):
        self.sums: dict[str, list[float]] = {}  # key -> [sum, count]
        self.values: dict[str, list[float]] = {}  # key -> already global values (one per update)
        self.maxes: dict[str, float] = {}  # key -> this rank's largest value

    def add_masked(self, key: str, x: torch.Tensor, mask: torch.Tensor, weight: float = 1.0) -> None:
        if weight:
            s = self.sums.setdefault(key, [0.0, 0.0])
            s[0] += float((x * mask).sum())
            s[1] += float(mask.sum())

    def add_max(self, key: str, x: torch.Tensor, mask: torch.Tensor) -> None:
        if mask.any():
            self.maxes[key] = max(self.maxes.get(key, float("-inf")), float(x[mask.bool()].max()))

    def add_min(self, key: str, x: torch.Tensor, mask: torch.Tensor) -> None:
        if mask.any():  # kept negated: the smallest value is the largest of the negations
            self.maxes[f"-{key}"] = max(self.maxes.get(f"-{key}", float("-inf")), float(-x[mask.bool()].min()))

    def add(self, key: str, value: float) -> None:
        self.values.setdefault(key, []).append(float(value))

    def reduce(self) -> dict[str, float]:
        out = {k: sum(v) if k.endswith(("skipped_updates", "empty_updates")) else sum(v) / len(v) for k, v in self.values.items()}
        if self.sums:
            keys = sorted(self.sums)
            t = distributed.all_reduce_sum(torch.tensor([self.sums[k] for k in keys], dtype=torch.float64))
            out.update({k: float(s / c) for k, (s, c) in zip(keys, t.tolist()) if c > 0})
        if self.maxes:  # every rank reduces the same keys (a rank without tokens sends -inf)
            keys = sorted(self.maxes)
            t = distributed.all_reduce_max(torch.tensor([self.maxes[k] for k in keys], dtype=torch.float64))
            out.update((k[1:], -v) if k.startswith("-") else (k, v) for k, v in zip(keys, t.tolist()))
        return out


def behaviour_stats(stats: Stats, w: torch.Tensor, over: torch.Tensor, prox_logps, batch: RolloutBatch, *, mode: str
                    ) -> None:
    """The behaviour weights over every response token of the batch: their mean and spread, the share
    capped (truncate) or masked (mask), and actor/behav_kl = mean(log pi_behav - log pi_prox), the k1
    estimate of KL(pi_behav || pi_prox) from the behaviour policy's own samples."""
    m = batch.response_mask
    stats.add_masked("actor/behav_is_mean", w, m)
    # the spread from the deviations d = w - 1 in float64: E[w^2] - E[w]^2 of weights within 1e-7 of
    # 1 cancels to float32 noise (a "std" of 3e-4 for weights that differ by 5e-7)
    d = w.double() - 1.0
    stats.add_masked("actor/behav_is_dev_mean", d, m)
    stats.add_masked("actor/behav_is_dev_sq_mean", d * d, m)
    stats.add_max("actor/behav_is_max", w, m)
    stats.add_masked(f"actor/behav_is_{'capped' if mode == 'truncate' else 'masked'}_frac", over.float(), m)
    stats.add_masked("actor/behav_kl", batch.sampling_logps - prox_logps, m)


def behaviour_spread(out: dict[str, float]) -> None:
    """actor/behav_is_std = sqrt(E[d^2] - E[d]^2), d = w - 1, from ``behaviour_stats``'s reduced sums."""
    if "actor/behav_is_dev_sq_mean" in out:
        d_mean, d_sq = out.pop("actor/behav_is_dev_mean"), out.pop("actor/behav_is_dev_sq_mean")
        out["actor/behav_is_std"] = math.sqrt(max(0.0, d_sq - d_mean**2))


def _step(optimizer, scheduler, params, max_grad_norm: float, loss_finite: bool, stats: Stats, prefix: str) -> bool:
    """Clip, then step unless the loss or the gradient is not finite (the NaN guard keeps the
    last good weights). The schedule advances either way: it counts planned updates, so the
    last one is at the schedule's end whatever was skipped."""
    gn = clip_gradients(params, max_grad_norm)
    ok = loss_finite and math.isfinite(gn)
    if ok:
        optimizer.step()
    else:
        stats.add(f"{prefix}/skipped_updates", 1.0)
    stats.add(f"{prefix}/grad_norm", gn)
    if scheduler is not None:
        stats.add(f"{prefix}/lr", scheduler.get_last_lr()[0])
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return ok


def _live_groups(rows: torch.Tensor, inert: torch.Tensor, G: int) -> torch.Tensor:
    """``rows`` (whole groups of G) without the groups whose every row is inert."""
    if G < 1 or len(rows) % G:
        G = 1
    groups = rows.view(-1, G)
    return groups[~inert[groups].all(-1)].flatten()


def _zero_grads(params: list[torch.Tensor]) -> None:
    """An update whose every row was skipped: the gradient it would have computed, exactly 0
    (AdamW still steps: its moments decay and the weight decay applies)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def update_policy(policy, optimizer, scheduler, params, batch: RolloutBatch, mini_batches: list[torch.Tensor],
                  layout: Layout, loss_fn: ActorLoss, *, advantages, old_logps=None, ref_logps=None, tis=None,
                  temperature: float = 1.0, max_grad_norm: float = 1.0, skip_inert: bool = False) -> tuple[Stats, int]:
    """One optimizer step per mini-batch (rows [m], whole groups): the clipped policy loss over
    this rank's micro-batches, normalized by the mini-batch's global count.

    ``old_logps`` None: the batch serves one update, so the log-probs of the sampling policy
    are the current ones, detached (the ratio is 1 and its gradient exact). ``skip_inert``:
    groups whose rows add nothing to the gradient (``ActorLoss.inert_rows``: all rewards equal
    under a group baseline, and no KL or entropy term) are not run; the normalizer still counts
    them, so the update is the same. Returns the metrics and the number of updates skipped by
    the NaN guard."""
    mask, scale = batch.response_mask, distributed.grad_scale()
    stats, skipped = Stats(), 0
    inert = loss_fn.inert_rows(advantages, mask)
    stats.add("actor/zero_adv_frac", float(inert.float().mean()) if len(inert) else 0.0)
    for b_rows in mini_batches:
        if len(b_rows) == 0:  # dynamic sampling kept fewer groups than there are mini-batches
            stats.add("actor/empty_updates", 1.0)
            if scheduler is not None:
                scheduler.step()
            continue
        normalizer = aggregate_count(mask[b_rows], loss_fn.agg, max_len=loss_fn.max_len)
        kl_normalizer = aggregate_count(mask[b_rows], loss_fn.kl_agg, max_len=loss_fn.max_len) if loss_fn.kl_apart else None
        loss_sum = torch.zeros((), dtype=torch.float64, device=mask.device)  # stays on device: no sync per micro-batch
        prefix = GroupPrefix()
        run_rows = _live_groups(b_rows, inert, batch.group_size) if skip_inert else b_rows
        stats.add("actor/skipped_rows_frac", 1.0 - len(run_rows) / len(b_rows))
        micro = plan(batch, run_rows, layout) if len(run_rows) else []
        if not micro:
            _zero_grads(params)
        for m in micro:
            mb_rows = m.rows
            mb_mask = mask[mb_rows]  # [n, L]
            logps, ent = forward_logps(policy, batch, mb_rows, layout, temperature=temperature, with_entropy=True,
                                       entropy_grad=loss_fn.entropy_coef > 0, prefix=prefix if m.part else None)
            old = old_logps[mb_rows] if old_logps is not None else logps.detach()
            loss_tok, info = loss_fn(logps, old, advantages[mb_rows], mb_mask, entropy=ent,
                                     ref_logps=ref_logps[mb_rows] if ref_logps is not None else None,
                                     tis=tis[mb_rows] if tis is not None else None)
            loss = aggregate(loss_tok, mb_mask, loss_fn.agg, normalizer, max_len=loss_fn.max_len)
            if loss_fn.kl_apart:  # beta * the KL term under its own reduction, over the same mini-batch
                loss = loss + loss_fn.kl_coef * aggregate(info["kl_loss"], mb_mask, loss_fn.kl_agg, kl_normalizer,
                                                          max_len=loss_fn.max_len)
            loss = loss * m.weight
            (loss * scale).backward()  # FSDP averages gradients over its ranks (dp x cp): make it their sum
            if m.last_part:  # the group's prompt: its backward, once
                prefix.finish()
            loss_sum += loss.detach().double()
            stats.add_masked("actor/entropy", ent.detach(), mb_mask, m.weight)
            stats.add_masked("actor/clip_frac", info["clipped"], mb_mask, m.weight)
            if "kl" in info:
                stats.add_masked("actor/kl", info["kl"], mb_mask, m.weight)
            if tis is not None:  # off-policy: pi_theta / pi_prox, exactly 1 before the first update of the step
                stats.add_max("actor/ratio_max", info["ratio"], mb_mask)
                stats.add_min("actor/ratio_min", info["ratio"], mb_mask)
            if old_logps is None:  # one update: these are still the sampling policy's log-probs
                gap = (batch.sampling_logps[mb_rows] - logps.detach()).abs()
                stats.add_masked("actor/logp_mismatch", gap, mb_mask, m.weight)
                stats.add_max("actor/logp_mismatch_max", gap, mb_mask)
        loss_total = float(distributed.all_reduce_sum(loss_sum))  # the mini-batch's loss, all ranks
        stats.add("actor/loss", loss_total)
        skipped += not _step(optimizer, scheduler, params, max_grad_norm, math.isfinite(loss_total), stats, "actor")
    return stats, skipped


def update_critic(critic, optimizer, params, batch: RolloutBatch, mini_batches: list[torch.Tensor], layout: Layout, *,
                  old_values, returns, value_clip: float = 0.0, max_grad_norm: float = 1.0) -> Stats:
    """One critic step per mini-batch: the (clipped) value loss, token-mean over the mini-batch."""
    mask, scale = batch.response_mask, distributed.grad_scale()
    stats = Stats()
    for b_rows in mini_batches:
        if len(b_rows) == 0:
            continue
        normalizer = aggregate_count(mask[b_rows], "token-mean")
        loss_sum = torch.zeros((), dtype=torch.float64, device=mask.device)  # stays on device: no sync per micro-batch
        for m in plan(batch, b_rows, layout):
            v = forward_values(critic, batch, m.rows, layout)
            vl = value_loss(v, old_values[m.rows], returns[m.rows], clip=value_clip or None)
            loss = aggregate(vl, mask[m.rows], "token-mean", normalizer) * m.weight
            (loss * scale).backward()
            loss_sum += loss.detach().double()
        loss_total = float(distributed.all_reduce_sum(loss_sum))
        stats.add("critic/value_loss", loss_total)
        _step(optimizer, None, params, max_grad_norm, math.isfinite(loss_total), stats, "critic")
    return stats


# --------------------------------------------------------------------------- TRPO (update=trpo)


def trpo_update(policy, params: list[torch.Tensor], batch: RolloutBatch, advantages: torch.Tensor,
                old_logps: torch.Tensor | None, *, temperature: float, max_kl: float, damping: float, cg_iters: int,
                backtrack_ratio: float, max_backtracks: int, fvp_subsample: int) -> Stats:
    """One TRPO step (``algorithms.trpo.trpo_step``) of the trainable ``params`` on the whole batch.

    The surrogate is the token-mean of A_t · π(y_t) / π_old(y_t) over every response token of
    the batch. Only the Fisher-vector product subsamples (the Hessian of KL(stop_grad(π) ‖ π)
    on every ``fvp_subsample``-th sequence, as openai/baselines' ``trpo_mpi`` does with
    ``arr[::5]``): the line search measures KL(π_old ‖ π_new) as a token-mean over every response
    token of every row, from the whole batch's old full-vocabulary log-probs kept here, so an
    accepted step is in the trust region for the batch, not just for the subsample, and
    ``trpo/kl`` logs that KL. One forward holds the whole batch's logits [N, L, V]: this is for
    tiny models and small trainable sets (LoRA).
    """
    ids, attn, mask = batch.input_ids, batch.attention_mask, batch.response_mask
    target, m = ids[:, 1:], mask[:, 1:]  # position t of the shifted tensors predicts token t + 1
    sub = torch.arange(0, batch.size, max(1, fvp_subsample), device=ids.device)

    def logits(rows) -> torch.Tensor:  # [n, L - 1, V] at the rollout's temperature
        return policy(input_ids=ids[rows], attention_mask=attn[rows], use_cache=False).logits[:, :-1].float() / temperature

    def logps(rows) -> torch.Tensor:  # [n, L - 1]
        return torch.log_softmax(logits(rows), -1).gather(-1, target[rows].unsqueeze(-1)).squeeze(-1)

    every = torch.arange(batch.size, device=ids.device)
    with torch.no_grad():
        old_all = torch.log_softmax(logits(every), -1)  # [N, L - 1, V]: the trust region is the batch's
        old = old_logps[:, 1:] if old_logps is not None else old_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)

    def surrogate() -> torch.Tensor:
        return surrogate_objective(logps(every), old, advantages[:, 1:], m)

    def candidate() -> tuple[float, float]:  # one forward of the whole batch gives the surrogate and the KL
        new_all = torch.log_softmax(logits(every), -1)
        new = new_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        return surrogate_objective(new, old, advantages[:, 1:], m).item(), token_kl(old_all, new_all, m).item()

    # the Fisher-vector product differentiates twice: the fused attention kernels (flash, memory
    # efficient) and the lean MLP's backward have no double backward; PyTorch's math kernel and
    # autograd's own ops do
    with sdpa_kernel([SDPBackend.MATH]), lean.plain():
        out = trpo_step(params, surrogate, lambda: self_kl(logits(sub), m[sub]), candidate_fn=candidate, max_kl=max_kl,
                        damping=damping, cg_iters=cg_iters, backtrack_ratio=backtrack_ratio,
                        max_backtracks=max_backtracks)
    stats = Stats()
    for k, v in out.items():
        if isinstance(v, float):
            stats.add(k, v)
    stats.add("actor/grad_norm", out["trpo/grad_norm"])
    return stats
