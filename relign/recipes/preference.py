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
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import banner, distributed
from ..algorithms import preference as P
from ..checkpoint import (
    gather_train_state,
    load_model_weights,
    resolve_resume,
    resume_training,
    save_checkpoint,
    save_final,
    seed_everything,
)
from ..config import (
    CheckpointConfig,
    ConfigError,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    PreferenceDataConfig,
    check_choice,
    check_common,
    check_divides,
    check_model_path,
    check_non_negative,
    check_positive,
    check_rows,
)
from ..data.collate import StepSampler, chunks, shard
from ..data.preference import TRUNCATION, UnpairedExample
from ..models import varlen
from ..models.loading import apply_lora, load_causal_lm, load_model_tokenizer, resolve_device, trainable_parameters
from ..optim import build_training, clip_gradients
from ..rundir import open_run
from ..tracking import Tracker, read_metrics
from . import RunResult
from .pairs import add_sums, average_sums, by_positions, collate_pairs, collate_unpaired, load_examples, sequence_logps

LOSSES = ("dpo", "ipo", "dpop", "simpo", "orpo", "kto", "sdpo")
REFERENCE_FREE = ("simpo", "orpo")
REF_FILE = "reference_logps.safetensors"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-7, warmup_ratio=0.1))
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
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
    run_dir: str = ""
    """Where config.yaml, metrics.jsonl, reference log-probs and checkpoints/ go (empty: runs/dpo-<time>)."""
    resume: str = "none"
    """'auto' continues from the newest complete checkpoint in run_dir; or a checkpoint path; 'none' starts fresh."""
    seed: int = 0
    """Seed for initialisation and data order."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    max_steps: int = 0
    """Optimizer steps to run (0 = epochs x steps per epoch)."""
    epochs: float = 1.0
    """Passes over the training data when max_steps is 0."""
    batch_size: int = 16
    """Pairs (KTO: examples) per optimizer step, summed over all ranks."""
    micro_batch_size: int = 4
    """Pairs (KTO: examples) per forward/backward pass on one rank."""
    eval_every: int = 0
    """Evaluate on the held-out pairs every N steps (0 = only at the end, when there is eval data)."""
    eval_batch_size: int = 8
    """Pairs per eval forward pass."""


def _check(cfg: Config) -> None:
    """Every setting that cannot work, before any data or model is read."""
    check_positive(cfg, "batch_size", "micro_batch_size", "eval_batch_size", "epochs", "beta", "kto_desirable_weight",
                   "kto_undesirable_weight")
    check_non_negative(cfg, "max_steps", "eval_every", "dpop_lambda", "simpo_gamma", "orpo_lambda")
    check_divides(cfg, "batch_size", "micro_batch_size", distributed.world_size())
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


# --------------------------------------------------------------------------- the loss


def pair_loss(cfg: Config, pc, pr, nc, nr, rc=None, rr=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses [B] from summed log-probs pc, pr [B], response lengths nc, nr [B] and the
    reference's summed log-probs rc, rr [B] (unused by the reference-free losses)."""
    if cfg.loss in ("dpo", "sdpo"):  # sdpo: the sums cover the differing step only
        fn = P.sdpo_loss if cfg.loss == "sdpo" else P.dpo_loss
        return fn(pc, pr, rc, rr, beta=cfg.beta, label_smoothing=cfg.label_smoothing)
    if cfg.loss == "ipo":
        return P.ipo_loss(pc, pr, rc, rr, beta=cfg.beta)
    if cfg.loss == "dpop":
        return P.dpop_loss(pc, pr, rc, rr, beta=cfg.beta, lambda_dpop=cfg.dpop_lambda)
    avg_c, avg_r = pc / nc.clamp_min(1), pr / nr.clamp_min(1)  # length-normalized log-probs
    if cfg.loss == "simpo":
        return P.simpo_loss(avg_c, avg_r, beta=cfg.beta, gamma=cfg.simpo_gamma, label_smoothing=cfg.label_smoothing)
    return P.orpo_loss(avg_c, avg_r, -avg_c, lam=cfg.orpo_lambda)  # the SFT term is the chosen token-mean NLL


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
    rank, world = distributed.rank(), distributed.world_size()
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


def _reference(cfg: Config, policy, sets: dict[str, list], *, run_dir: Path, resuming: bool, load: dict, pack: bool,
               share: bool, pad_id: int, device) -> tuple[torch.nn.Module | None, dict[str, torch.Tensor], float]:
    """(reference model or None, cached reference log-probs per set, seconds spent computing them).

    ``reference=precompute`` (the default): each set's log-probs once, before the first update,
    saved in the run directory (read back when its fingerprint matches). ``online``: a frozen
    reference model, or none under LoRA (the policy with its adapter off is the reference)."""
    m = cfg.model
    ref_key = "ref_model" if cfg.ref_model else "model.path"  # the key a load error names
    if cfg.loss in REFERENCE_FREE:
        return None, {}, 0.0
    if cfg.reference == "precompute":
        fp = _fingerprint(cfg, sets)
        cached = load_reference_cache(run_dir / REF_FILE, fp)
        if cached is not None:
            return None, {k: v.to(device) for k, v in cached.items()}, 0.0
        # the starting policy is the reference unless another model is named; on resume
        # (cache lost) the policy has moved, so the reference is loaded from its path
        t_ref = time.perf_counter()
        scorer = policy
        if cfg.ref_model or resuming:
            scorer = _load_reference(cfg, ref_key, load, pack=pack, share=share)
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
        return None, ref_cache, ref_seconds
    if not m.lora.enabled or cfg.ref_model:
        return _load_reference(cfg, ref_key, load, pack=pack, share=share).eval().requires_grad_(False), {}, 0.0
    return None, {}, 0.0


def _load_reference(cfg: Config, key: str, load: dict, *, pack: bool, share: bool) -> torch.nn.Module:
    """The reference model, set up like the policy (a ``ref_model`` of another architecture that
    cannot run varlen's continuations scores shared prompts in padded rows: ``sequence_logps``)."""
    model = load_causal_lm(cfg.ref_model or cfg.model.path, key=key, **load)
    if pack:
        varlen.choose([model], cfg.model.attn_implementation, packing=cfg.packing, share=share)
    return model


# Metric names of the loss functions' per-pair values, where they differ from the logged ones.
METRIC_NAMES = {"margins": "rewards/margins", "accuracy": "rewards/accuracy", "penalty": "dpop/penalty",
                "log_odds_ratio": "orpo/log_odds_ratio"}


def _average(sums: dict[str, torch.Tensor], n: float, prefix: str, *, kto: bool, device) -> dict[str, float]:
    """The step's metrics; KTO's rewards are averaged over their own class's count."""
    def own_count(key: str) -> str | None:
        return "count/" + key.split("/")[1].removesuffix("_sum") if kto and key.startswith("rewards/") else None

    return average_sums(sums, n, prefix, device=device, names=METRIC_NAMES, denominator=own_count)


class PreferenceLosses:
    """The per-pair (per-example for KTO) losses of the policy on the rows of a data set, with
    their reference log-probs: cached (``reference=precompute``), from a frozen reference
    model, or from the policy with its LoRA adapter off."""

    def __init__(self, cfg: Config, policy, sets: dict[str, list], *, ref_model, ref_cache: dict[str, torch.Tensor],
                 pad_id: int, device, pack: bool, share: bool):
        self.cfg, self.policy, self.sets = cfg, policy, sets
        self.ref_model, self.ref_cache, self.pad_id, self.device = ref_model, ref_cache, pad_id, device
        self.kto = cfg.loss == "kto"
        self.packed = pack
        self.share = share

    @torch.no_grad()
    def reference_logps(self, name: str, idx: list[int], mb: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Reference summed log-probs of these rows: cached, or computed now (``reference=online``)."""
        if self.cfg.loss in REFERENCE_FREE:
            return None
        if self.ref_cache:
            r = self.ref_cache[name][idx]
            return r.flatten() if r.dim() == 2 else r  # pairs: interleaved like the rows
        share = self.share and "kl" not in name
        if self.ref_model is not None:
            return sequence_logps(self.ref_model, mb, share_prompt=share, packed=self.packed)[0]
        with self.policy.disable_adapter():  # LoRA: the reference is the base model, no second copy
            out = sequence_logps(self.policy, mb, share_prompt=share, packed=self.packed)[0]
        distributed.reshard(self.policy)  # a forward with no backward (see distributed.reshard)
        return out

    def kto_z0(self, name: str, idx: list[int]) -> torch.Tensor:
        """KTO's reference point from this step's mismatched pairs, the same on every rank."""
        exs, dev = self.sets[name + "_kl"], self.device
        total = torch.zeros(2, device=dev)
        with torch.no_grad():
            parts = list(chunks(by_positions(exs, idx, share_prompt=False), self.cfg.micro_batch_size))
            for part, real in distributed.lockstep(parts, filler=[0]):
                mb = collate_unpaired([exs[i] for i in part], self.pad_id, dev)
                pol = sequence_logps(self.policy, mb, share_prompt=False, packed=self.packed)[0]
                ref = self.reference_logps(name + "_kl", part, mb)
                if real:  # else forwards only to keep the ranks in step
                    total += torch.stack([(pol - ref).sum(), torch.tensor(float(len(part)), device=dev)])
        distributed.reshard(self.policy)  # forwards with no backward (see distributed.reshard)
        total = distributed.all_reduce_sum(total)
        return (total[0] / total[1].clamp_min(1)).clamp_min(0.0)  # max(0, mean log ratio), detached

    def of(self, name: str, idx: list[int], z0=None) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
        """(per-pair losses, per-pair metric sums, tokens run) of the rows ``idx`` of set ``name``."""
        cfg, exs = self.cfg, self.sets[name]
        if self.kto:
            mb = collate_unpaired([exs[i] for i in idx], self.pad_id, self.device)
            logps, lengths = sequence_logps(self.policy, mb, share_prompt=False, packed=self.packed)
            losses, met = P.kto_loss(logps, self.reference_logps(name, idx, mb), mb["labels"], z0, beta=cfg.beta,
                                     desirable_weight=cfg.kto_desirable_weight, undesirable_weight=cfg.kto_undesirable_weight)
            d = met["is_desirable"]
            out = {"rewards/desirable_sum": (met["rewards"] * d).sum(), "rewards/undesirable_sum": (met["rewards"] * (1 - d)).sum(),
                   "count/desirable": d.sum(), "count/undesirable": (1 - d).sum(), "logps/mean_sum": logps.detach().sum()}
            return losses, out, float(lengths.sum() + mb["attention_mask"].sum())
        mb = collate_pairs([exs[i] for i in idx], self.pad_id, self.device)
        logps, lengths = sequence_logps(self.policy, mb, share_prompt=self.share, packed=self.packed)
        ref = self.reference_logps(name, idx, mb)
        pc, pr, nc, nr = logps[0::2], logps[1::2], lengths[0::2], lengths[1::2]
        losses, met = pair_loss(cfg, pc, pr, nc, nr, ref[0::2] if ref is not None else None, ref[1::2] if ref is not None else None)
        out = {f"{k}_sum": v.sum() for k, v in met.items()}
        # does the policy itself rank the chosen response higher (summed log-prob, as a sampler would)?
        out["logps/accuracy_sum"] = (pc > pr).float().sum()
        out["logps/chosen_sum"], out["logps/rejected_sum"] = pc.detach().sum(), pr.detach().sum()
        return losses, out, float(mb["attention_mask"].sum())

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """eval/* over this rank's share of the eval set, averaged over all ranks."""
        cfg, eval_set = self.cfg, self.sets["eval"]
        self.policy.eval()
        mine = shard(list(range(len(eval_set))), distributed.rank(), distributed.world_size())
        z0 = self.kto_z0("eval", mine) if self.kto else None
        sums: dict[str, torch.Tensor] = {}
        parts = distributed.lockstep(list(chunks(by_positions(eval_set, mine, share_prompt=self.share), cfg.eval_batch_size)),
                                     filler=[0])
        with banner.progress(len(parts), f"{cfg.loss} eval", enabled=cfg.logging.progress, leave=False, delay=3.0) as bar:
            for part, real in parts:
                losses, met, _ = self.of("eval", part, z0)
                if real:  # else a forward only to keep the ranks in step
                    add_sums(sums, {"loss_sum": losses, **met})
                bar.update()
        self.policy.train()
        distributed.reshard(self.policy)
        return _average(sums, float(len(mine)), "eval/", kto=self.kto, device=self.device)


# --------------------------------------------------------------------------- training


def train(cfg: Config) -> RunResult:
    t_start = time.perf_counter()
    distributed.init()
    _check(cfg)
    device = resolve_device(cfg.device)
    rank, world = distributed.rank(), distributed.world_size()
    seed_everything(cfg.seed)
    run_dir = open_run(cfg, "dpo")  # a fresh directory unless resuming the same run (relign.rundir)
    kto = cfg.loss == "kto"

    # ---- data and model
    m = cfg.model
    tok = load_model_tokenizer(m)
    train_set, eval_set, data_metrics = load_examples(cfg.data, tok, unpaired=kto, seed=cfg.seed, step_eos=cfg.step_eos)
    if not train_set:
        raise ConfigError(f"data.path={cfg.data.path}: no usable rows ({data_metrics['data/rows']:.0f} read, "
                          f"{data_metrics['data/dropped_too_long']:.0f} longer than data.max_length={cfg.data.max_length}, "
                          f"{data_metrics['data/bad_rows']:.0f} bad)")
    if kto:
        data_metrics["data/desirable"] = float(sum(e.label for e in train_set))
        data_metrics["data/undesirable"] = float(sum(not e.label for e in train_set))
    sets: dict[str, list] = {"train": train_set, "eval": eval_set}
    if kto:
        sets.update(train_kl=kl_examples(train_set, cfg.data.max_length), eval_kl=kl_examples(eval_set, cfg.data.max_length) if eval_set else [])
    check_rows(len(train_set), cfg.batch_size, what=f"data.path={cfg.data.path}")
    steps_per_epoch = len(train_set) // cfg.batch_size  # StepSampler drops an epoch's short tail
    total_steps = cfg.max_steps or max(1, int(math.ceil(cfg.epochs * steps_per_epoch)))
    unit = "examples" if kto else "pairs"
    run_facts = dict(  # for the start banner and --dry-run
        run_dir=run_dir, device=device,
        data=banner.data_line(int(data_metrics["data/rows"] + data_metrics.get("data/eval_rows", 0)), len(train_set),
                              len(eval_set), made="examples" if kto else ""),
        steps=banner.steps_line(total_steps, max_steps=cfg.max_steps, epochs=cfg.epochs, steps_per_epoch=steps_per_epoch,
                                batch=f"{cfg.batch_size} {unit}"),
    )
    banner.dry_run("dpo", cfg, **run_facts)  # --dry-run stops here, before any weights are read
    load = dict(dtype=m.dtype, attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code, device=device)
    policy = load_causal_lm(m.path, gradient_checkpointing=m.gradient_checkpointing, lean_activations=m.lean_activations,
                            **load)
    # packed rows run sequence by sequence (relign.models.varlen); a pair's prompt runs once, its
    # rejected response continuing it in the packed row where varlen applies, else both
    # responses in padded rows against its KV cache
    pack, share = varlen.choose([policy], m.attn_implementation, packing=cfg.packing, share=cfg.share_prompt and not kto)
    if m.lora.enabled:
        policy = apply_lora(policy, r=m.lora.r, alpha=m.lora.alpha, dropout=m.lora.dropout, target_modules=m.lora.target_modules)
    banner.start("dpo", cfg, model=policy, **run_facts)
    pad_id = tok.pad_token_id

    # ---- reference log-probs: once, before the first update, cached in the run directory
    ckpt = resolve_resume(cfg.resume, run_dir)
    ref_model, ref_cache, ref_seconds = _reference(cfg, policy, sets, run_dir=run_dir, resuming=ckpt is not None, load=load,
                                                   pack=pack, share=share, pad_id=pad_id, device=device)

    if ckpt is not None:
        load_model_weights(policy, ckpt)
    policy = distributed.wrap_fsdp(policy)

    sampler = StepSampler(len(train_set), cfg.batch_size, seed=cfg.seed)
    o = cfg.optim
    optimizer, scheduler = build_training(policy, o, total_steps)
    start_step = resume_training(ckpt, policy, optimizer, scheduler, sampler)

    def save(step: int) -> None:
        model_sd, optim_sd = gather_train_state(policy, optimizer)  # collective under FSDP
        if distributed.is_main():
            save_checkpoint(run_dir, step, model=policy, tokenizer=tok, state_dict=model_sd,
                            tensors={"optimizer": optim_sd, "scheduler": scheduler.state_dict()},
                            state={"sampler": sampler.state_dict(), "recipe": "dpo", "loss": cfg.loss},
                            keep_last=cfg.checkpoint.keep_last)
        distributed.barrier()

    losses = PreferenceLosses(cfg, policy, sets, ref_model=ref_model, ref_cache=ref_cache, pad_id=pad_id, device=device,
                              pack=pack, share=share)

    lg = cfg.logging
    bar = ("train/loss", "train/rewards/accuracy", "train/rewards/margins", "perf/pairs_per_s") if not kto else \
        ("train/loss", "train/kl", "train/rewards/desirable", "train/rewards/undesirable")
    tracker = Tracker(run_dir, total_steps=total_steps, start_step=start_step, desc=cfg.loss, bar_keys=bar, progress=lg.progress,
                      tensorboard=lg.tensorboard, wandb=lg.wandb, wandb_project=lg.wandb_project, run_name=lg.run_name)
    if start_step == 0:  # with the reference precompute's time (0: none, or read from the run's cache)
        tracker.log(0, data_metrics | {"time/reference_s": ref_seconds}, advance=False)
    else:
        tracker.write(f"resumed from {ckpt} at step {start_step}")

    params = trainable_parameters(policy)
    metrics: dict[str, float] = {}
    for step in range(start_step + 1, total_steps + 1):
        t0 = time.perf_counter()
        mine = shard(sampler.next(), rank, world)
        n_global = float(cfg.batch_size)
        z0 = losses.kto_z0("train", mine) if kto else None
        sums: dict[str, torch.Tensor] = {}
        tokens = 0.0
        # similar lengths in a micro-batch pad less; the order within a step changes only rounding
        for part in chunks(by_positions(train_set, mine, share_prompt=share), cfg.micro_batch_size):
            per_pair, met, ntok = losses.of("train", part, z0)
            # one normalizer for the whole step on every rank: the summed gradient is that of
            # the mean loss over the global batch (x world: FSDP averages gradients over ranks)
            (per_pair.sum() / n_global * world).backward()
            tokens += ntok
            add_sums(sums, {"loss_sum": per_pair, **met})
        grad_norm = clip_gradients(params, o.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        seconds = time.perf_counter() - t0
        tokens = distributed.all_reduce_sum(torch.tensor(tokens, device=device)).item()
        metrics = _average(sums, float(len(mine)), "train/", kto=kto, device=device)
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr,
                        "train/epoch": sampler.epoch + sampler.position / max(1, sampler.n),
                        "perf/tokens_per_s": tokens / max(seconds, 1e-9), "perf/pairs_per_s": n_global / max(seconds, 1e-9)})
        if kto:
            metrics["train/kl"] = float(z0)
        if eval_set and ((cfg.eval_every and step % cfg.eval_every == 0) or step == total_steps):
            metrics.update(losses.evaluate())
        tracker.log(step, metrics)
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
            save(step)

    last = save_final(run_dir, save, total_steps=total_steps, start_step=start_step, save_final=cfg.checkpoint.save_final)
    tracker.close()
    history = read_metrics(run_dir) if distributed.is_main() else []
    distributed.barrier()
    watch = ("train/loss", "train/kl", "eval/loss") if kto else \
        ("train/loss", "train/rewards/accuracy", "train/rewards/margins", "eval/loss", "eval/rewards/accuracy")
    banner.end("dpo", run_dir=run_dir, seconds=time.perf_counter() - t_start, metrics=metrics, keys=watch, checkpoint=last)
    return RunResult(run_dir=run_dir, steps=total_steps, metrics=metrics, checkpoint=last, history=history)
