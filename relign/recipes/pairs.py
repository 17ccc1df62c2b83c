"""What the reward-model and preference recipes share: reading pair data with its held-out
split, collating pairs, and summed response log-probs with the prompt run once per pair."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import distributed
from ..config import PreferenceDataConfig
from ..data.balance import micro_batch_plan
from ..data.collate import chunks, keep_index, pack_rows
from ..data.pointwise import build_point_examples
from ..data.preference import PairExample, UnpairedExample, build_pair_examples, build_unpaired_examples
from ..data.stats import announce
from ..errors import ConfigError
from ..models import varlen
from ..models.cp import packed_token_logps
from ..models.logprobs import shared_prefix_token_logps, token_logps


def load_examples(d: PreferenceDataConfig, tok, *, unpaired: bool = False, points: bool = False, seed: int = 0,
                  step_eos: bool = False):
    """(train, eval, data metrics) from ``data.path`` and ``data.eval_path`` or a held-out fraction; no usable
    training row is a ConfigError. Rows are pairs, or ``unpaired`` (KTO) or ``points`` (rm loss=bce:
    prompt, response, label in [0, 1])."""
    common = dict(max_length=d.max_length, truncation=d.truncation, skip_bad_rows=d.skip_bad_rows, prompt_key=d.prompt_key,
                  chat_template=d.chat_template, system_prompt=d.system_prompt, max_rows=d.max_rows)
    if points:
        build = build_point_examples
        common.update(label_key=d.label_key)
    elif unpaired:
        build = build_unpaired_examples
        common.update(chosen_key=d.chosen_key, rejected_key=d.rejected_key, completion_key=d.completion_key,
                      label_key=d.label_key)
    else:
        common.update(chosen_key=d.chosen_key, rejected_key=d.rejected_key)
        build = build_pair_examples
        common.update(prefix_key=d.prefix_key, step_eos=step_eos)
    train, stats = build(d.path, tok, split=d.split, key="data.path", **common)
    announce(stats)
    metrics = stats.as_metrics()
    if not train:
        raise ConfigError(f"data.path={d.path}: no usable rows ({metrics['data/rows']:.0f} read, "
                          f"{metrics['data/dropped_too_long']:.0f} longer than data.max_length={d.max_length}, "
                          f"{metrics['data/bad_rows']:.0f} bad)")
    held_out: list = []
    if d.eval_path:
        held_out, estats = build(d.eval_path, tok, split=d.eval_split or d.split, key="data.eval_path", **common)
        announce(estats)
        metrics.update(estats.as_metrics("data/eval_"))
    elif d.eval_fraction > 0:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
        n_eval = max(1, int(len(train) * d.eval_fraction))
        held_out = [train[i] for i in order[:n_eval]]
        train = [train[i] for i in sorted(order[n_eval:])]
    return train, held_out, metrics


def add_sums(sums: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    """Accumulate a micro-batch's per-pair values (or their sums), summed and detached, into
    the step's sums."""
    for k, v in values.items():
        total = v.detach().float().sum()
        sums[k] = sums[k] + total if k in sums else total


def average_sums(sums: dict[str, torch.Tensor], n: float, prefix: str, *, device, names: dict[str, str],
                 denominator: Callable[[str], str | None] = lambda key: None) -> dict[str, float]:
    """The step's metrics: each sum averaged over the global batch (all ranks), ``n`` pairs on
    this rank. A key's ``_sum`` suffix is dropped and ``names`` renames it; ``count/*`` keys are
    denominators only: ``denominator(key)`` names the one a key is averaged over instead of the
    pair count (KTO's rewards, over their own class's examples)."""
    keys = sorted(sums)
    vec = distributed.all_reduce_sum(torch.stack([sums[k] for k in keys] + [torch.tensor(float(n), device=device)]))
    totals = dict(zip(keys, vec[:-1].tolist()))
    out = {}
    for k, v in totals.items():
        if k.startswith("count/"):
            continue
        count = totals[own] if (own := denominator(k)) is not None else vec[-1].item()
        name = k.removesuffix("_sum")
        out[prefix + names.get(name, name)] = v / max(count, 1.0)
    return out


def by_positions(examples: Sequence, idx: Sequence[int], *, share_prompt: bool) -> list[int]:
    """``idx`` ordered by the positions each example's forward computes, so that consecutive
    micro-batches hold examples of similar length and pad less. The losses are per pair and
    the step's normalizer is fixed, so the order changes only float rounding: on the shipped
    Orca pairs (8 pairs = 2 micro-batches of 4) it cuts the positions computed per step by 9%.
    A pair in the shared layout costs its prompt once plus twice its longer response (both are
    padded to the micro-batch's longest); a pair of full rows, twice its longer row."""
    def cost(i: int) -> int:
        e = examples[i]
        if isinstance(e, PairExample):
            longest = max(len(e.chosen_ids), len(e.rejected_ids))
            return e.prompt_len + 2 * (longest - e.prompt_len) if share_prompt else 2 * longest
        return len(e.input_ids)

    return sorted(idx, key=lambda i: (cost(i), i))


def packed_tokens(e, *, share_prompt: bool) -> int:
    """The tokens an example puts in a packed row: a pair's two rows, or with ``share_prompt`` its
    prompt once and the rejected response continuing it from the prompt's last token
    (``varlen.segments``); an unpaired row, its own length."""
    if isinstance(e, PairExample):
        both = len(e.chosen_ids) + len(e.rejected_ids)
        return both - (e.prompt_len - 1 if share_prompt else 0)
    return len(e.input_ids)


def micro_batches(examples: Sequence, idx: Sequence[int], *, share_prompt: bool, micro_batch_size: int,
                  max_tokens: int = 0) -> list[list[int]]:
    """This rank's examples ``idx`` cut into the micro-batches of a step, in ``by_positions``'
    order: ``micro_batch_size`` at a time, or (``max_tokens`` > 0, packed rows) passes of at most
    ``max_tokens`` packed tokens with near-equal sums (``data.balance.micro_batch_plan``; an
    example longer than the budget runs alone). The step's normalizer is the batch size, so how
    the pairs are cut changes only float rounding."""
    order = by_positions(examples, idx, share_prompt=share_prompt)
    if max_tokens <= 0:
        return list(chunks(order, micro_batch_size))
    plan = micro_batch_plan([packed_tokens(examples[i], share_prompt=share_prompt) for i in order],
                            max_tokens=max_tokens)[0]
    return [[order[j] for j in part] for part in plan]


def _pad(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), T), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), T), dtype=torch.float32)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.tensor(mask, dtype=torch.float32)
    return input_ids, attention_mask, loss_mask


def collate_pairs(pairs: Sequence[PairExample], pad_id: int, device) -> dict:
    """Rows interleaved ``[c_0, r_0, c_1, r_1, ...]``, right-padded: one forward for the whole
    micro-batch, and each consecutive two rows share a prompt (``prompt_lens``). ``lengths``:
    each row's (tokens, prompt tokens) on the host, from which a packed layout is cut."""
    rows = [r for p in pairs for r in ((p.chosen_ids, p.chosen_mask), (p.rejected_ids, p.rejected_mask))]
    input_ids, attention_mask, loss_mask = _pad(rows, pad_id)
    prompt_lens = torch.tensor([p.prompt_len for p in pairs for _ in (0, 1)], dtype=torch.long)
    margins = torch.tensor([p.margin for p in pairs], dtype=torch.float32)
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, "prompt_lens": prompt_lens,
           "margins": margins}
    lengths = [(len(ids), p.prompt_len) for p in pairs for ids in (p.chosen_ids, p.rejected_ids)]
    return {**{k: v.to(device) for k, v in out.items()}, "lengths": lengths}


def collate_unpaired(examples: Sequence[UnpairedExample], pad_id: int, device) -> dict:
    input_ids, attention_mask, loss_mask = _pad([(e.input_ids, e.loss_mask) for e in examples], pad_id)
    labels = torch.tensor([e.label for e in examples], dtype=torch.bool)
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, "labels": labels}
    return {**{k: v.to(device) for k, v in out.items()}, "lengths": [(len(e.input_ids), e.prompt_len) for e in examples]}


def sequence_logps(model, mb: dict, *, share_prompt: bool, packed: bool = False, max_length: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs and response lengths, both [N] (fp32).

    ``packed``: the micro-batch's rows run as one padding-free row with per-row position ids,
    attention sequence by sequence (``relign.models.varlen``, or flash-attention's varlen
    kernel). With ``share_prompt`` too (pairs), where the model runs ``varlen``'s attention, each
    pair's rejected row continues its chosen row's prompt: it packs only the prompt's last token
    and its response, so nothing is padded and each prompt runs once. Else, unpacked,
    ``share_prompt``: the two rows of a pair run their common prompt once against a KV cache
    (``shared_prefix_token_logps`` with groups of 2); otherwise the rows run whole, padded, and
    the LM head is applied to the targets only. All give the same log-probs."""
    mask = mb["loss_mask"]
    if packed and share_prompt and not varlen.active(model):  # it would read a continuation as a sequence of its own
        packed = False
    if packed:  # laid out on the host from the collator's lengths: the forward reads nothing back
        lens, plens = zip(*mb["lengths"])
        # rows [c_0, r_0, c_1, r_1, ...]: with share_prompt each r_i continues c_i's prompt
        starts = [max(p - 1, 0) if share_prompt and i % 2 else 0 for i, p in enumerate(plens)]
        row, col, packing = pack_rows(lens, starts, max_length=max_length)
        first = torch.ones_like(row, dtype=torch.bool)
        first[1:] = row[1:] != row[:-1]
        keep = keep_index((col >= torch.tensor(plens)[row]) & ~first)  # responses only: a superset of the targets
        row, col, first = (x.to(mask.device, non_blocking=True) for x in (row, col, first))
        packing, keep = packing.to(mask.device, non_blocking=True), keep.to(mask.device, non_blocking=True)
        target = (mask[row, col] * ~first)[None]  # a packed sequence's first token is scored against another: never a target
        # under context parallel each cp rank runs its chunk of the row, and every one gets the whole row
        logps, _ = packed_token_logps(model, mb["input_ids"][row, col][None], col[None], packing, target_mask=target,
                                      keep=keep)
        sums = torch.zeros(mask.shape[0], dtype=logps.dtype, device=logps.device).index_add(0, row, (logps * target)[0])
        return sums, mask.sum(-1)
    if share_prompt:
        logps, _ = shared_prefix_token_logps(model, mb["input_ids"], mb["attention_mask"], mb["prompt_lens"], 2)
    else:
        logps, _ = token_logps(model, mb["input_ids"], attention_mask=mb["attention_mask"], target_mask=mask)
    return (logps * mask).sum(-1), mask.sum(-1)
