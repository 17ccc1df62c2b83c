"""Offline preference optimization: DPO, cDPO, IPO, DPOP, SimPO, ORPO, KTO and step-wise DPO.

    once:   reference log-probs log pi_ref(y | x) of every response (losses with a reference),
            cached in the run directory (reference_logps.safetensors) and reused on resume
    for each step:
        pairs   <- next global batch (deterministic, resumable)
        for each micro-batch:
            log pi(y_w | x), log pi(y_l | x)    one forward; the pair's prompt runs once
            L = loss(policy, reference)          relign.algorithms.preference, one value per pair
            backward(sum L / pairs in the global batch)
        clip grad norm; AdamW step; lr schedule step
        every eval_every: the same losses and preference accuracy on held-out pairs

KTO reads unpaired rows (or splits pairs into a desirable and an undesirable row) and sets its
reference point z0 from mismatched (prompt, completion) pairs of the step's batch. The
reference model is, by default, the policy itself before the first update: its log-probs are
computed before training starts, so no second copy is kept in memory. ``reference=online``
computes them at every step instead (a frozen copy, or with LoRA the base model with the
adapter disabled).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import banner, distributed
from ..algorithms import preference as P
from ..checks import (
    check_choice, check_common, check_divides, check_model_path, check_non_negative, check_positive, check_rows
)
from ..config import BatchFields, ConfigError, OptimConfig, PreferenceDataConfig
from ..data.collate import chunks, shard
from ..data.preference import TRUNCATION, UnpairedExample
from ..models import varlen
from ..models.budget import device_tokens
from ..models.flops import ModelFlops, model_flops
from ..models.loading import load_causal_lm, load_model_tokenizer
from . import RunResult, build, frame
from .pairs import (
    add_sums, average_sums, by_positions, collate_pairs, collate_unpaired, load_examples, micro_batches, sequence_logps
)

REF_FILE = "reference_logps.safetensors"


@dataclass(frozen=True)
class PairLoss:
    """A DPO-family loss on pairs: its function in ``relign.algorithms.preference`` and how it is called."""

    fn: Callable
    """``fn(pc, pr, rc, rr, **options)`` with a reference, else ``fn(pc, pr, **options)``: summed
    (or length-normalized) log-probs [B] in, (per-pair losses [B], metrics) out."""
    options: dict[str, str] = field(default_factory=dict)
    """The function's keyword -> the ``relign dpo`` config field that sets it."""
    reference: bool = True
    """It reads the reference policy's log-probs."""
    length_normalized: bool = False
    """It reads per-token mean log-probs (the sums divided by the response lengths)."""


PAIR_LOSSES: dict[str, PairLoss] = {
    "dpo": PairLoss(P.dpo_loss, {"beta": "beta", "label_smoothing": "label_smoothing"}),
    "sdpo": PairLoss(P.sdpo_loss, {"beta": "beta", "label_smoothing": "label_smoothing"}),  # sums: the differing step
    "ipo": PairLoss(P.ipo_loss, {"beta": "beta"}),
    "dpop": PairLoss(P.dpop_loss, {"beta": "beta", "lambda_dpop": "dpop_lambda"}),
    "simpo": PairLoss(P.simpo_loss, {"beta": "beta", "gamma": "simpo_gamma", "label_smoothing": "label_smoothing"},
                      reference=False, length_normalized=True),
    # ORPO's SFT term is the chosen response's token-mean NLL, -avg_c (orpo_loss's default)
    "orpo": PairLoss(P.orpo_loss, {"lam": "orpo_lambda"}, reference=False, length_normalized=True),
}
LOSSES = (*PAIR_LOSSES, "kto")  # KTO reads unpaired rows: KtoLosses


@dataclass
class Config(BatchFields):
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-7, warmup_ratio=0.1))
    eval_batch_size: int = 8
    """Pairs per eval forward pass."""
    loss: str = "dpo"
    """dpo (label_smoothing > 0: cDPO), ipo, dpop, simpo, orpo, kto or sdpo (step-wise DPO)."""
    beta: float = 0.1
    """beta: strength of the KL regularization (dpo, ipo, dpop, kto, sdpo); SimPO's reward scale (use ~2.0)."""
    label_smoothing: float = 0.0
    """Assumed label-flip probability eps in [0, 0.5) for dpo/sdpo/simpo (conservative DPO)."""
    dpop_lambda: float = 50.0
    """DPOP: weight of the penalty on the chosen log-prob falling below the reference."""
    simpo_gamma: float = 0.5
    """SimPO: target reward margin gamma."""
    orpo_lambda: float = 0.1
    """ORPO: weight lambda of the odds-ratio term added to the chosen response's NLL."""
    kto_desirable_weight: float = 1.0
    """KTO: weight w_D of desirable examples."""
    kto_undesirable_weight: float = 1.0
    """KTO: weight w_U of undesirable examples."""
    reference: str = "precompute"
    """precompute (once before training, cached in the run directory) or online (every step)."""
    ref_model: str = ""
    """Reference model (empty: the starting policy, model.path; with LoRA the adapter-free base)."""
    step_eos: bool = False
    """sdpo: end each chosen/rejected step with the end token (off: the step continues into the answer)."""
    share_prompt: bool = True
    """Run each pair's prompt once for both responses (same log-probs, less compute)."""
    packing: bool = False
    """Run each micro-batch as one padding-free row, attention sequence by sequence; with share_prompt a pair's
    rejected response continues its prompt in the row (prompt once; needs relign's varlen attention, else the
    prompt runs twice). Same log-probs."""
    max_tokens_per_micro: int | None = None
    """Token budget of one packed forward/backward pass on one rank (where the pairs run packed: packing=true, or a
    shared prompt on relign's varlen attention): this rank's pairs are cut into balanced passes of at most this many
    tokens and micro_batch_size no longer counts; 0 = off (micro_batch_size pairs per pass); null = by device: off on
    the CPU, on CUDA 32768 or what free memory holds if less."""


def _check(cfg: Config) -> None:
    """Every setting that cannot work, before any data or model is read."""
    check_positive(cfg, "batch_size", "micro_batch_size", "eval_batch_size", "epochs", "beta", "kto_desirable_weight",
                   "kto_undesirable_weight")
    check_non_negative(cfg, "max_steps", "eval_every", "dpop_lambda", "simpo_gamma", "orpo_lambda")
    if cfg.max_tokens_per_micro is not None:
        check_non_negative(cfg, "max_tokens_per_micro")
    check_divides(cfg, "batch_size", "micro_batch_size", distributed.data_size())
    check_common(cfg)
    check_choice("loss", cfg.loss, LOSSES)
    check_choice("reference", cfg.reference, ("precompute", "online"))
    check_choice("data.truncation", cfg.data.truncation, TRUNCATION)
    if not cfg.data.path:
        raise ConfigError("missing value for 'data.path': give a preference file, a dataset folder or a hub id")
    if not 0.0 <= cfg.label_smoothing < 0.5:
        raise ConfigError(f"label_smoothing={cfg.label_smoothing} must lie in [0, 0.5)")
    check_model_path("model.path", cfg.model.path)
    check_model_path("ref_model", cfg.ref_model, required=False)


def needs_reference(loss: str) -> bool:
    return loss == "kto" or PAIR_LOSSES[loss].reference


def pair_loss(row: PairLoss, pc, pr, nc, nr, rc=None, rr=None, **options) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses [B] of ``row`` from summed log-probs pc, pr [B], response lengths nc, nr [B]
    and the reference's summed log-probs rc, rr [B] (unused by the reference-free losses);
    ``options`` are the loss function's own keywords (beta, ...)."""
    if row.length_normalized:
        pc, pr = pc / nc.clamp_min(1), pr / nr.clamp_min(1)
    return row.fn(pc, pr, rc, rr, **options) if row.reference else row.fn(pc, pr, **options)


# --------------------------------------------------------------------------- reference log-probs


def kl_examples(examples: list[UnpairedExample], max_length: int) -> list[UnpairedExample]:
    """KTO's mismatched pairs: prompt i with the completion of an example of another prompt.

    KTO's reference point z0 estimates KL(pi || pi_ref) from completions that do not answer
    their prompt (Ethayarajh et al. 2024, "KTO", arXiv 2402.01306; TRL's KTOTrainer rotates a
    batch's completions by one, ``_get_kl_dataset``). A shift by one is wrong here: pairs split
    into a desirable and an undesirable row come out as [A+, A-, B+, B-, ...], so i + 1 is often
    the same prompt's other answer, a matched pair. The completions are therefore shifted by the
    smallest offset s in [1, n) that gives no row a completion of its own prompt (prompts
    compared by token ids; s = 2 for split pairs). When no single shift works (irregular data)
    each row takes the next example, cyclically, with a different prompt.

    The pairing is fixed by the data order (not by the batch), so the reference log-probs of
    these rows can be computed once like the others (the cache fingerprint covers the ids)."""
    if not examples:
        return []
    prompts: dict[tuple[int, ...], int] = {}
    group = [prompts.setdefault(tuple(e.input_ids[: e.prompt_len]), len(prompts)) for e in examples]  # prompt id per row
    n = len(examples)
    if len(prompts) < 2:
        raise ConfigError("KTO needs at least two distinct prompts to build the mismatched (prompt, completion) pairs of "
                          f"its KL reference point; these {n} examples share one prompt (a held-out set: raise "
                          "data.eval_fraction or give data.eval_path)")

    def smallest_shift() -> int | None:
        g = torch.tensor(group)
        if torch.bincount(g).max() * 2 > n:  # one prompt holds most rows: every shift maps one onto itself
            return None
        return next((s for s in range(1, n) if not (g == g.roll(-s)).any()), None)  # g.roll(-s)[i] = g[i + s]

    def next_other_prompt(i: int) -> int:
        return next((i + k) % n for k in range(1, n) if group[(i + k) % n] != group[i])

    s = smallest_shift()
    out = []
    for i, e in enumerate(examples):
        o = examples[(i + s) % n if s is not None else next_other_prompt(i)]
        ids = (e.input_ids[: e.prompt_len] + o.input_ids[o.prompt_len :])[:max_length]
        mask = ([0] * e.prompt_len + o.loss_mask[o.prompt_len :])[:max_length]
        out.append(UnpairedExample(ids, mask, e.prompt_len, o.label))
    return out


@torch.no_grad()
def score_examples(model, examples: list, *, paired: bool, batch_size: int, pad_id: int, device, share_prompt: bool,
                   packed: bool = False, progress: bool = False, desc: str = "reference log-probs") -> torch.Tensor:
    """Summed log-probs of every example ([N, 2] chosen/rejected for pairs, [N] otherwise),
    this rank computing its strided share and the ranks summing the results."""
    rank, world = distributed.data_rank(), distributed.data_size()
    n = len(examples)
    out = torch.zeros((n, 2) if paired else (n,), device=device)
    was_training = model.training
    model.eval()
    parts = list(chunks(by_positions(examples, range(rank, n, world), share_prompt=share_prompt and paired), batch_size))
    parts = distributed.lockstep(parts, filler=[0])
    # a pass over the whole data set before the first step: minutes on a real model, so it shows
    with banner.progress(len(parts), desc, enabled=progress) as bar:
        for idx, real in parts:
            if paired:
                s, _ = sequence_logps(model, collate_pairs([examples[i] for i in idx], pad_id, device), share_prompt=share_prompt,
                                      packed=packed)
                s = s.view(-1, 2)
            else:
                s, _ = sequence_logps(model, collate_unpaired([examples[i] for i in idx], pad_id, device), share_prompt=False,
                                      packed=packed)
            if real:  # else a forward only to keep the ranks in step
                out[idx] = s
            bar.update()
    model.train(was_training)
    return distributed.all_reduce_sum(out)


def _fingerprint(cfg: Config, sets: dict[str, list]) -> str:
    """What the cached reference log-probs depend on: the reference model, the loss (its rows) and every row's ids."""
    h = hashlib.sha256()
    h.update(json.dumps([cfg.ref_model or cfg.model.path, cfg.loss, cfg.step_eos]).encode())
    for name, exs in sorted(sets.items()):
        h.update(name.encode())
        for e in exs:
            for ids in (getattr(e, "chosen_ids", None), getattr(e, "rejected_ids", None), getattr(e, "input_ids", None)):
                if ids is not None:
                    h.update(len(ids).to_bytes(4, "little"))
                    h.update(bytes(str(ids), "ascii"))
    return h.hexdigest()


def load_reference_cache(path: Path, fingerprint: str) -> dict[str, torch.Tensor] | None:
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("fingerprint") != fingerprint:
            return None
        return {k: f.get_tensor(k) for k in f.keys()}


def save_reference_cache(path: Path, tensors: dict[str, torch.Tensor], fingerprint: str) -> None:
    """Atomic: written to a temporary name, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata={"fingerprint": fingerprint})
    os.replace(tmp, path)


class Reference:
    """Reference summed log-probs of rows: cached (``reference=precompute``), from a frozen
    reference model, from the policy with its LoRA adapter off, or none (reference-free losses)."""

    def __init__(self, *, cache: dict[str, torch.Tensor] | None = None, model=None, policy=None, packed: bool = False,
                 share: bool = False, needed: bool = True):
        self.cache, self.model, self.policy = cache or {}, model, policy
        self.packed, self.share, self.needed = packed, share, needed

    @torch.no_grad()
    def logps(self, name: str, idx: list[int], mb: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if not self.needed:
            return None
        if self.cache:
            r = self.cache[name][idx]
            return r.flatten() if r.dim() == 2 else r  # pairs: interleaved like the rows
        share = self.share and "kl" not in name
        if self.model is not None:
            return sequence_logps(self.model, mb, share_prompt=share, packed=self.packed)[0]
        with self.policy.disable_adapter():  # LoRA: the reference is the base model, no second copy
            out = sequence_logps(self.policy, mb, share_prompt=share, packed=self.packed)[0]
        distributed.reshard(self.policy)  # a forward with no backward (see distributed.reshard)
        return out


def _reference(cfg: Config, policy, sets: dict[str, list], *, run_dir: Path, resuming: bool, device, pack: bool,
               share: bool, pad_id: int) -> tuple[Reference, float]:
    """(the reference, seconds spent computing its log-probs).

    ``reference=precompute`` (the default): each set's log-probs once, before the first update,
    saved in the run directory (read back when its fingerprint matches). ``online``: a frozen
    reference model, or under LoRA the policy with its adapter off (``Reference``)."""
    m = cfg.model
    if not needs_reference(cfg.loss):
        return Reference(needed=False), 0.0
    if cfg.reference == "precompute":
        fp = _fingerprint(cfg, sets)
        cached = load_reference_cache(run_dir / REF_FILE, fp)
        if cached is not None:
            return Reference(cache={k: v.to(device) for k, v in cached.items()}), 0.0
        # the starting policy is the reference unless another model is named; on resume
        # (cache lost) the policy has moved, so the reference is loaded from its path
        t_ref = time.perf_counter()
        scorer = _load_reference(cfg, device, pack=pack, share=share) if cfg.ref_model or resuming else policy
        ref_cache = {}
        for name, exs in sets.items():
            if exs:
                ref_cache[name] = score_examples(scorer, exs, paired=cfg.loss != "kto", batch_size=cfg.eval_batch_size,
                                                 pad_id=pad_id, device=device, share_prompt=share, packed=pack,
                                                 progress=cfg.logging.progress, desc=f"{cfg.loss} reference ({name})")
        del scorer
        ref_seconds = time.perf_counter() - t_ref
        if distributed.is_main():
            save_reference_cache(run_dir / REF_FILE, ref_cache, fp)
        return Reference(cache=ref_cache), ref_seconds
    if not m.lora.enabled or cfg.ref_model:
        model = _load_reference(cfg, device, pack=pack, share=share).eval().requires_grad_(False)
        return Reference(model=model, packed=pack, share=share), 0.0
    return Reference(policy=policy, packed=pack, share=share), 0.0


def _load_reference(cfg: Config, device, *, pack: bool, share: bool) -> torch.nn.Module:
    """The reference model, set up like the policy (a ``ref_model`` of another architecture that
    cannot run varlen's continuations scores shared prompts in padded rows: ``sequence_logps``)."""
    m = cfg.model
    model = load_causal_lm(cfg.ref_model or m.path, key="ref_model" if cfg.ref_model else "model.path", dtype=m.dtype,
                           attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code, device=device)
    if pack:
        varlen.choose([model], m.attn_implementation, packing=cfg.packing, share=share)
    frame.context_parallel(cfg, model)
    return model


# --------------------------------------------------------------------------- the losses

# Metric names of the loss functions' per-pair values, where they differ from the logged ones.
METRIC_NAMES = {"margins": "rewards/margins", "accuracy": "rewards/accuracy", "penalty": "dpop/penalty",
                "log_odds_ratio": "orpo/log_odds_ratio"}


class PairLosses:
    """The per-pair losses of the policy on rows of a pair set, with their metric sums."""

    def __init__(self, cfg: Config, policy, sets: dict[str, list], reference: Reference, *, pad_id: int, device,
                 packed: bool, share: bool):
        self.row = PAIR_LOSSES[cfg.loss]
        self.options = {arg: getattr(cfg, key) for arg, key in self.row.options.items()}
        self.policy, self.sets, self.reference = policy, sets, reference
        self.pad_id, self.device, self.packed, self.share = pad_id, device, packed, share

    def prepare(self, name: str, idx: list[int]) -> None:
        """Nothing to compute per step before the micro-batches (KTO: its z0)."""
        return None

    def of(self, name: str, idx: list[int], _=None) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
        """(per-pair losses, per-pair metric sums, tokens run) of the rows ``idx`` of set ``name``."""
        mb = collate_pairs([self.sets[name][i] for i in idx], self.pad_id, self.device)
        logps, lengths = sequence_logps(self.policy, mb, share_prompt=self.share, packed=self.packed)
        ref = self.reference.logps(name, idx, mb)
        pc, pr, nc, nr = logps[0::2], logps[1::2], lengths[0::2], lengths[1::2]
        rc, rr = (ref[0::2], ref[1::2]) if ref is not None else (None, None)
        losses, met = pair_loss(self.row, pc, pr, nc, nr, rc, rr, **self.options)
        out = {f"{k}_sum": v.sum() for k, v in met.items()}
        # does the policy itself rank the chosen response higher (summed log-prob, as a sampler would)?
        out["logps/accuracy_sum"] = (pc > pr).float().sum()
        out["logps/chosen_sum"], out["logps/rejected_sum"] = pc.detach().sum(), pr.detach().sum()
        return losses, out, float(mb["attention_mask"].sum())

    def average(self, sums: dict[str, torch.Tensor], n: float, prefix: str) -> dict[str, float]:
        return average_sums(sums, n, prefix, device=self.device, names=METRIC_NAMES)


class KtoLosses:
    """KTO's per-example losses on unpaired rows, with its reference point z0 from the step's
    mismatched (prompt, completion) pairs (``kl_examples``)."""

    def __init__(self, cfg: Config, policy, sets: dict[str, list], reference: Reference, *, pad_id: int, device,
                 packed: bool, share: bool = False):
        self.beta, self.w_d, self.w_u = cfg.beta, cfg.kto_desirable_weight, cfg.kto_undesirable_weight
        self.micro_batch_size = cfg.micro_batch_size
        self.policy, self.sets, self.reference = policy, sets, reference
        self.pad_id, self.device, self.packed, self.share = pad_id, device, packed, False

    def prepare(self, name: str, idx: list[int]) -> torch.Tensor:
        """KTO's reference point from this step's mismatched pairs, the same on every rank."""
        exs, dev = self.sets[name + "_kl"], self.device
        total = torch.zeros(2, device=dev)
        with torch.no_grad():
            parts = list(chunks(by_positions(exs, idx, share_prompt=False), self.micro_batch_size))
            for part, real in distributed.lockstep(parts, filler=[0]):
                mb = collate_unpaired([exs[i] for i in part], self.pad_id, dev)
                pol = sequence_logps(self.policy, mb, share_prompt=False, packed=self.packed)[0]
                ref = self.reference.logps(name + "_kl", part, mb)
                if real:  # else forwards only to keep the ranks in step
                    total += torch.stack([(pol - ref).sum(), torch.tensor(float(len(part)), device=dev)])
        distributed.reshard(self.policy)  # forwards with no backward (see distributed.reshard)
        total = distributed.all_reduce_sum(total)
        return (total[0] / total[1].clamp_min(1)).clamp_min(0.0)  # max(0, mean log ratio), detached

    def of(self, name: str, idx: list[int], z0) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
        """(per-example losses, metric sums, tokens run) of the rows ``idx`` of set ``name``."""
        mb = collate_unpaired([self.sets[name][i] for i in idx], self.pad_id, self.device)
        logps, lengths = sequence_logps(self.policy, mb, share_prompt=False, packed=self.packed)
        losses, met = P.kto_loss(logps, self.reference.logps(name, idx, mb), mb["labels"], z0, beta=self.beta,
                                 desirable_weight=self.w_d, undesirable_weight=self.w_u)
        d = met["is_desirable"]
        out = {"rewards/desirable_sum": (met["rewards"] * d).sum(), "rewards/undesirable_sum": (met["rewards"] * (1 - d)).sum(),
               "count/desirable": d.sum(), "count/undesirable": (1 - d).sum(), "logps/mean_sum": logps.detach().sum()}
        return losses, out, float(lengths.sum() + mb["attention_mask"].sum())

    def average(self, sums: dict[str, torch.Tensor], n: float, prefix: str) -> dict[str, float]:
        """The step's metrics; the rewards of each class are averaged over that class's count."""
        def own_count(key: str) -> str | None:
            return "count/" + key.split("/")[1].removesuffix("_sum") if key.startswith("rewards/") else None

        return average_sums(sums, n, prefix, device=self.device, names=METRIC_NAMES, denominator=own_count)


@torch.no_grad()
def evaluate(losses: PairLosses | KtoLosses, *, batch_size: int, progress: bool, desc: str) -> dict[str, float]:
    """eval/* over this rank's share of the eval set, averaged over all ranks."""
    eval_set, policy = losses.sets["eval"], losses.policy
    policy.eval()
    mine = shard(list(range(len(eval_set))), distributed.data_rank(), distributed.data_size())
    ctx = losses.prepare("eval", mine)
    sums: dict[str, torch.Tensor] = {}
    parts = distributed.lockstep(list(chunks(by_positions(eval_set, mine, share_prompt=losses.share), batch_size)), filler=[0])
    with banner.progress(len(parts), f"{desc} eval", enabled=progress, leave=False, delay=3.0) as bar:
        for part, real in parts:
            per_pair, met, _ = losses.of("eval", part, ctx)
            if real:  # else a forward only to keep the ranks in step
                add_sums(sums, {"loss_sum": per_pair, **met})
            bar.update()
    policy.train()
    distributed.reshard(policy)
    return losses.average(sums, float(len(mine)), "eval/")


# --------------------------------------------------------------------------- training


def _load_sets(cfg: Config, tok) -> tuple[dict[str, list], dict[str, float]]:
    """The train and eval sets (KTO: unpaired rows, and their mismatched pairs ``*_kl``) and the data counts."""
    kto = cfg.loss == "kto"
    train_set, eval_set, data_metrics = load_examples(cfg.data, tok, unpaired=kto, seed=cfg.seed, step_eos=cfg.step_eos)
    sets: dict[str, list] = {"train": train_set, "eval": eval_set}
    if kto:
        data_metrics["data/desirable"] = float(sum(e.label for e in train_set))
        data_metrics["data/undesirable"] = float(sum(not e.label for e in train_set))
        sets.update(train_kl=kl_examples(train_set, cfg.data.max_length),
                    eval_kl=kl_examples(eval_set, cfg.data.max_length) if eval_set else [])
    check_rows(len(train_set), cfg.batch_size, what=f"data.path={cfg.data.path}")
    return sets, data_metrics


def step_flops(shape: ModelFlops | None, sets: dict[str, list], idx: list[int], *, kto: bool, share: bool) -> float:
    """Model FLOPs of one training step on the rows ``idx`` (``models.flops``): forward and
    backward of each pair (its prompt once when the run shares it, the LM head at the response
    tokens), or of each KTO row plus the no-grad forward of its mismatched pair (the reference
    point z0)."""
    if shape is None:
        return 0.0
    def row(e) -> float:  # a KTO row: causal on its own, the LM head at its completion
        return shape.sequence(len(e), sum(e.loss_mask[1:]))

    if kto:
        return sum(3 * row(sets["train"][i]) + row(sets["train_kl"][i]) for i in idx)
    pairs = [sets["train"][i] for i in idx]
    return sum(3 * shape.group(e.prompt_len, (len(e.chosen_ids) - e.prompt_len, len(e.rejected_ids) - e.prompt_len),
                               shared=share) for e in pairs)


def accumulate(losses: PairLosses | KtoLosses, mine: list[int], z0, *, batch_size: int, micro_batch_size: int,
               max_tokens: int) -> tuple[dict[str, torch.Tensor], float]:
    """Forward/backward this rank's examples ``mine`` of the step in micro-batches; returns the
    step's metric sums and the tokens run. Similar lengths in a micro-batch pad less, and the order
    within a step changes only rounding. Under a token budget the ranks may cut different counts: a
    rank with fewer runs passes that count zero (FSDP's collectives)."""
    sums: dict[str, torch.Tensor] = {}
    tokens = 0.0
    parts = micro_batches(losses.sets["train"], mine, share_prompt=losses.share, micro_batch_size=micro_batch_size,
                          max_tokens=max_tokens)
    for part, real in distributed.lockstep(parts, filler=mine[:1]) if max_tokens else [(p, True) for p in parts]:
        per_pair, met, ntok = losses.of("train", part, z0)
        # one normalizer for the whole step on every rank: the summed gradient is that of
        # the mean loss over the global batch (x world: FSDP averages gradients over ranks)
        (per_pair.sum() * float(real) / batch_size * distributed.grad_scale()).backward()
        if real:
            tokens += ntok
            add_sums(sums, {"loss_sum": per_pair, **met})
    return sums, tokens


def train(cfg: Config) -> RunResult:
    run = frame.open(cfg, "dpo", check=_check)
    kto, m = cfg.loss == "kto", cfg.model
    tok = load_model_tokenizer(m)
    sets, data_metrics = _load_sets(cfg, tok)
    train_set, eval_set = sets["train"], sets["eval"]
    total_steps, per_epoch = frame.schedule(cfg, len(train_set))
    facts = frame.offline_facts(run, total_steps, per_epoch, data_metrics, train=len(train_set), eval_rows=len(eval_set),
                                unit="examples" if kto else "pairs", made="examples" if kto else "")
    banner.dry_run("dpo", cfg, **facts)  # --dry-run stops here, before any weights are read
    policy = build.load_policy(m, run.device)
    # packed rows run sequence by sequence (relign.models.varlen); a pair's prompt runs once, its
    # rejected response continuing it in the packed row where varlen applies, else both
    # responses in padded rows against its KV cache
    pack, share = varlen.choose([policy], m.attn_implementation, packing=cfg.packing, share=cfg.share_prompt and not kto)
    frame.context_parallel(cfg, policy)
    banner.start("dpo", cfg, model=policy, **facts)
    # ---- reference log-probs: once, before the first update (from the starting weights), cached in the run directory
    ckpt = frame.checkpoint_to_resume(run)
    reference, ref_seconds = _reference(cfg, policy, sets, run_dir=run.run_dir, resuming=ckpt is not None, device=run.device,
                                        pack=pack, share=share, pad_id=tok.pad_token_id)
    t = frame.trainable(run, policy, ckpt=ckpt, rows=len(train_set), batch_size=cfg.batch_size, total_steps=total_steps)
    save = frame.saver(run, t, tok, state={"loss": cfg.loss})
    # packed passes of a token budget sized for the device (off on the CPU: micro_batch_size pairs per pass)
    max_tokens = device_tokens(cfg.max_tokens_per_micro, t.model, run.device, cpu=0,
                               checkpointing=m.gradient_checkpointing) if pack else 0
    losses = (KtoLosses if kto else PairLosses)(cfg, t.model, sets, reference, pad_id=tok.pad_token_id, device=run.device,
                                                packed=pack, share=share)
    bar = ("train/loss", "train/kl", "train/rewards/desirable", "train/rewards/undesirable") if kto else \
        ("train/loss", "train/rewards/accuracy", "train/rewards/margins", "perf/pairs_per_s", "perf/mfu")
    # a fresh run's step 0 also logs the reference precompute's time (0: none, or read from the run's cache)
    tracker = frame.tracker(run, t, desc=cfg.loss, bar_keys=bar, first=data_metrics | {"time/reference_s": ref_seconds})
    metrics: dict[str, float] = {}
    shape = model_flops(policy)
    for step in frame.steps(t):
        t0 = time.perf_counter()
        mine = shard(t.sampler.next(), run.rank, run.world)
        z0 = losses.prepare("train", mine)  # KTO's reference point; None for pairs
        sums, tokens = accumulate(losses, mine, z0, batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
                                  max_tokens=max_tokens)
        step_metrics = frame.optimizer_step(t, cfg.optim.max_grad_norm)
        seconds = time.perf_counter() - t0
        work = torch.tensor([tokens, step_flops(shape, sets, mine, kto=kto, share=share)], dtype=torch.float64,
                            device=run.device)
        tokens, flops = distributed.all_reduce_sum(work).tolist()
        metrics = {**losses.average(sums, float(len(mine)), "train/"), **step_metrics, "train/epoch": frame.epoch(t),
                   "perf/tokens_per_s": tokens / max(seconds, 1e-9), "perf/pairs_per_s": cfg.batch_size / max(seconds, 1e-9),
                   **frame.mfu(run, flops, seconds)}
        if kto:
            metrics["train/kl"] = float(z0)
        if eval_set and frame.eval_due(step, cfg.eval_every, total_steps):
            metrics.update(evaluate(losses, batch_size=cfg.eval_batch_size, progress=cfg.logging.progress, desc=cfg.loss))
        frame.log(run, tracker, save, step, metrics)
    last = frame.save_last(run, t, save)
    tracker.close()
    watch = ("train/loss", "train/kl", "eval/loss") if kto else \
        ("train/loss", "train/rewards/accuracy", "train/rewards/margins", "eval/loss", "eval/rewards/accuracy")
    return frame.close(run, metrics=metrics, keys=watch, steps=total_steps, checkpoint=last)
