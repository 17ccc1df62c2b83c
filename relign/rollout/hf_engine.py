"""The built-in engine: batched sampling with a KV cache on a transformers model.

Why our own loop instead of ``model.generate``: we need the sampling log-probs of exactly the
distribution the trainer recomputes, per-call seeds, stop strings, and rows that leave the
batch when they finish; and ``generate``'s per-step overhead dominates small-model rollouts.

* Each distinct prompt is prefilled once; the cache is then repeated ``n`` times, so a group
  of ``n`` samples costs one prefill.
* A decode step reads nothing back to the host (``_iteration``): the sampled tokens and their
  log-probs go into buffers on the device, the positions, the written column and the
  ``min_new_tokens`` ban are tensors there too. The host reads the new tokens every
  ``DecodePlan.read_every`` steps (every step on a CPU, where a read costs nothing; every 16
  under a CUDA graph, where each read waits for the device), and only then checks stop
  tokens and stop strings, keeps a finished row's tokens up to its stop, and compacts.
* Finished rows are dropped from the batch (and the KV cache) once enough of them finish, so
  long tails do not keep paying for short completions. Under static shapes a chunk runs at
  one of a few row counts (``DecodePlan.row_buckets``): rows left over stay in, masked.
* Sampling is inverse-CDF with one uniform per row and token. With ``seeds`` (one per
  prompt) every row draws its uniforms from its own stream, ``derive_seed(seed, sample)``,
  so a prompt's completions do not depend on the other prompts in the call (nor on the
  rank that samples it). Without, rows share the engine's ``torch.Generator``, whose state
  is saved and restored with the run's checkpoints: on the CPU each step draws one uniform
  per row in the batch (as the engine always did); under static shapes the uniforms of the
  whole call are drawn at its start, [rows, tokens], so a step draws nothing (another stream
  from the same generator, equally valid).
* In one process the engine holds the policy module itself: training updates are visible to
  the next rollout, and ``load_weights`` finds the trainer's own tensors and copies nothing.
  Under torchrun the policy is sharded, so each rank's engine holds a full replica and
  ``load_weights`` copies the gathered parameters into it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import torch
from transformers import DynamicCache

from ..errors import ConfigError
from ..models.logprobs import kv_cache_kwargs, right_pad, token_logps
from .engine import Completion, Engine, SamplingParams, check_generate_args, derive_seed, eos_token_ids
from .fast_decode import (DecodePlan, FastDecoder, StaticKV, Weights, device_peaks, lora_refusal, roofline_seconds,
                          unsupported_reason)
from .fingerprint import Fingerprint, fingerprint, output_head
from .kv_cache import ForwardKV, GrowingLayer, growing_cache
from .prefix_cache import PrefixCache
from .sampling import DecodeSampler, sample_tokens


class _Rows:
    """A chunk's per-row decode state on the device, dim 0 the batch position: the token each row
    feeds the next step and its position; the sampled tokens and log-probs [R, T]; the uniforms
    [R, T]; ``t`` [1], the index of the next sample; the ban of the stop ids [V] and ``min_new`` [1]."""

    PER_ROW = ("tok", "pos", "U", "out_tok", "out_lp")

    def __init__(self, R: int, T: int, V: int, device):
        self.tok = torch.zeros(R, dtype=torch.long, device=device)
        self.pos = torch.zeros(R, dtype=torch.long, device=device)
        self.U = torch.zeros(R, T, dtype=torch.float32, device=device)
        self.out_tok = torch.zeros(R, T, dtype=torch.long, device=device)
        self.out_lp = torch.zeros(R, T, dtype=torch.float32, device=device)
        self.t = torch.zeros(1, dtype=torch.long, device=device)
        self.ban = torch.zeros(V, dtype=torch.bool, device=device)
        self.min_new = torch.zeros(1, dtype=torch.long, device=device)

    def select(self, keep: torch.Tensor) -> None:
        for name in self.PER_ROW:
            setattr(self, name, getattr(self, name).index_select(0, keep))

    def copy_rows(self, src: _Rows, keep: torch.Tensor) -> None:
        n = keep.shape[0]
        for name in self.PER_ROW:
            s = getattr(src, name).index_select(0, keep)
            getattr(self, name)[:n, ...].copy_(s if s.dim() == 1 else s[:, : getattr(self, name).shape[1]])
        for name in ("t", "ban", "min_new"):
            getattr(self, name).copy_(getattr(src, name))


class _Slot:
    """Static shapes: one (rows, capacity) bucket's buffers and captured steps, kept across calls."""

    def __init__(self, rows: _Rows, kv: StaticKV):
        self.rows, self.kv, self.steps = rows, kv, {}


class HFEngine(Engine):
    """Batched sampling on a transformers causal LM (see the module docstring)."""

    weight_format = "trainer"
    """``load_weights`` takes the trainer's parameter names (the engine holds the policy module or a replica)."""

    MAX_SLOTS = 8  # static shapes: (rows, capacity) buckets kept, the least recently used dropped first

    def __init__(self, model, tokenizer, *, max_batch_rows: int = 256, seed: int = 0, compact_fraction: float = 0.25,
                 prefix_cache_bytes: int = 0, fast_decode: bool = True, decode: DecodePlan | None = None):
        self.model = model
        if fast_decode and (refusal := lora_refusal(model)) is not None:
            raise ConfigError(refusal)
        # decode steps outside transformers' forward where the architecture allows (fast_decode.py)
        self.fast = FastDecoder(model) if fast_decode and unsupported_reason(model) is None else None
        # keys/values of earlier prompts, for prompts that extend them (tree search); 0 = off
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self.compact_fraction = compact_fraction
        self.device = next(model.parameters()).device
        self.plan = decode if decode is not None else DecodePlan.for_device(self.device)
        if self.fast is not None and not self.fast.capturable and self.plan.capture != "none":
            self.plan = dataclasses.replace(self.plan, capture="none")  # static shapes, eager (fast_decode.capturable)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_ids = eos_token_ids(tokenizer, model)
        eos = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
        # static shapes: the weight copies and the bucket buffers live across calls (graphs read them)
        self._weights: Weights | None = None
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._graph_pool = None
        # perf/decode_bw_frac on a GPU of known peaks: [roofline seconds, decode seconds, tokens] since last asked
        self._peaks = device_peaks(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        self._perf = [0.0, 0.0, 0]

    # ------------------------------------------------------------------ protocol
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each named tensor into the engine's parameter of that name. A tensor that *is*
        that parameter (the engine shares the trainer's module, one process) is not copied.
        Returns the number of tensors copied."""
        params = dict(self.model.named_parameters())
        copied = 0
        if self.prefix_cache is not None:  # cached keys/values belong to the old weights
            self.prefix_cache.clear()
        with torch.no_grad():
            for name, tensor in named_tensors:
                p = params.get(name)
                if p is None:
                    raise KeyError(f"engine has no parameter {name!r}")
                if p.data_ptr() != tensor.data_ptr():
                    p.copy_(tensor.to(p.device, p.dtype))
                    copied += 1
        return copied

    def sleep(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        pass

    def close(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self._slots.clear()  # static shapes: the kept buffers, their captured steps and the weight copies
        self._weights = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])

    def weight_fingerprint(self) -> Fingerprint:
        """The fingerprint of the engine's own model (rollout/fingerprint.py), parameter by parameter as it
        holds them: the decode step reads these tensors (its fused copies are made from them at every call)."""
        head, tied = output_head(self.model)
        return Fingerprint(fingerprint(self.model.named_parameters(), head=head, tied=tied))

    def shares_policy(self, policy: torch.nn.Module) -> bool:
        """The engine's model holds every one of ``policy``'s parameter tensors (one process, no copy)."""
        engine_ptrs = {p.data_ptr() for p in self.model.parameters()}
        return all(p.data_ptr() in engine_ptrs for p in policy.parameters())

    def score_tokens(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probs of each sequence's tokens after the first, from one padded forward of the engine's model."""
        if not sequences:
            return []
        ids, mask = right_pad(sequences, self.pad_id, self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                logps, _ = token_logps(self.model, ids, attention_mask=mask)
        finally:
            self.model.train(was_training)
        return [logps[i, 1 : len(seq)].float().tolist() for i, seq in enumerate(sequences)]

    def perf_metrics(self) -> dict[str, float]:
        """On a GPU whose peaks are known (``models.flops.PEAKS``), for the decode steps since
        the last call: ``perf/decode_bw_frac``, the roofline's time for the tokens kept (every weight
        and each live row's cached keys and values read once per step, or the FLOPs at peak,
        whichever is longer) over the time the steps took; and ``perf/decode_tokens_per_s``.
        Empty elsewhere (a CPU has no bandwidth figure here)."""
        bound, seconds, tokens = self._perf
        self._perf = [0.0, 0.0, 0]
        if seconds <= 0:
            return {}
        return {"perf/decode_bw_frac": bound / seconds, "perf/decode_tokens_per_s": tokens / seconds}

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seeds: list[int] | None = None
                 ) -> list[list[Completion]]:
        if not prompts:
            return []
        check_generate_args(prompts, seeds)
        gen = self.generator
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        n = max(1, params.n)
        per_chunk = max(1, self.max_batch_rows // n)
        out: list[list[Completion]] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                weights = self._decode_weights()
                for start in range(0, len(prompts), per_chunk):
                    chunk_seeds = seeds[start : start + per_chunk] if seeds is not None else None
                    rows = self._generate_chunk(prompts[start : start + per_chunk], params, n, gen, chunk_seeds, weights)
                    out.extend(rows[i * n : (i + 1) * n] for i in range(len(rows) // n))
        finally:
            self.model.train(was_training)
        return out

    def _decode_weights(self) -> Weights | None:
        """This call's weight copies, written after the last update: fresh ones on the CPU (dropped
        with the call), the kept buffers rewritten in place under static shapes."""
        if self.fast is None:
            return None
        if not self.plan.static:
            return self.fast.weights()
        if self._weights is None:
            self._weights = self.fast.weights()
        else:
            self._weights.refresh()
        return self._weights

    def _row_uniforms(self, seeds: list[int], n: int, steps: int) -> torch.Tensor:
        """[P * n, steps] uniforms, row i * n + j from the stream of ``derive_seed(seeds[i], j)``."""
        rows = [torch.rand(steps, generator=torch.Generator().manual_seed(derive_seed(s, j))) for s in seeds for j in range(n)]
        return torch.stack(rows).to(self.device)

    def _prefill(self, prompts: list[list[int]], cache: DynamicCache, room: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(last logits [P, V], attention mask [P, L], next positions [P]) of the prompts, left-padded
        so that every row's next token goes to column L."""
        if self.prefix_cache is not None and all(isinstance(x, GrowingLayer) for x in cache.layers):
            return self._prefill_cached(prompts, cache, room)
        dev, P, L = self.device, len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((P, L), self.pad_id, dtype=torch.long, device=dev)
        attn = torch.zeros((P, L), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):  # left padding: every row's next token is at column L
            input_ids[i, L - len(p):] = torch.tensor(p, device=dev)
            attn[i, L - len(p):] = 1
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        logits = self._forward(input_ids, attn, pos, cache, prefill=True)
        return logits, attn, pos[:, -1] + 1

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, n: int, gen,
                        seeds: list[int] | None, weights: Weights | None) -> list[Completion]:
        """``n`` completions of each prompt: the prefill, the decode buffers filled from it, the first
        sample from its logits, then the decode loop."""
        dev, P, T = self.device, len(prompts), params.max_new_tokens
        if T <= 0:  # nothing to sample (and no prefill to pay for)
            return [self._completion([], [], "length", None, []) for _ in range(P * n)]
        static = weights is not None and self.plan.static
        cache = growing_cache(self.model.config, max(len(p) for p in prompts) + (0 if static else T))
        logits, attn, next_pos = self._prefill(prompts, cache, 0 if static else T)
        fast = weights is not None and all(isinstance(layer, GrowingLayer) for layer in cache.layers)
        static = static and fast
        Lp, R = attn.shape[1], P * n
        Rb = self.plan.bucket(R) if static else R
        # batch position -> prompt; rows past R fill the bucket: copies of the first, masked out below
        rep = torch.arange(P, device=dev).repeat_interleave(n)
        rep = torch.cat([rep, rep.new_zeros(Rb - R)])
        sampler, uniforms, stop_ids = self._chunk_sampler(params, seeds, n, R, gen, static)
        slot, rows, kv = self._decode_buffers(cache, attn, rep, n, T, logits.shape[-1], static, fast)
        self._start_rows(rows, next_pos, rep, uniforms, stop_ids, params.min_new_tokens, sampler)
        del cache  # the decode step writes into ``kv`` from here on
        self._sample_into(rows, logits.index_select(0, rep), sampler)  # the first token, from the prefill's logits
        if self._peaks is not None and dev.type == "cuda":
            torch.cuda.synchronize(dev)  # the decode's time apart from the prefill's
        start = time.perf_counter()

        stops = [s for s in params.stop if s]
        tokens_out, logps_out, finish, reason = self._decode(slot, rows, kv, weights, sampler, Lp, R, Rb, T, static,
                                                             stop_ids, stops, params.min_new_tokens)
        if self._peaks is not None and weights is not None:
            self._count_perf(time.perf_counter() - start, [len(p) for p in prompts for _ in range(n)],
                             [len(x) for x in tokens_out], weights)
        return [self._completion(tokens_out[r], logps_out[r], finish[r] or "length", reason[r], stops) for r in range(R)]

    def _chunk_sampler(self, params: SamplingParams, seeds: list[int] | None, n: int, R: int, gen, static: bool
                       ) -> tuple[DecodeSampler, torch.Tensor | None, set[int]]:
        """The chunk's (sampler, uniforms [R, T] or None, stop token ids); the uniforms are drawn here."""
        uniforms = None
        if params.temperature > 0 and seeds is not None:  # per-row streams: row r's t-th uniform is fixed by its seed
            uniforms = self._row_uniforms(seeds, n, params.max_new_tokens)
        elif params.temperature > 0 and static:  # the call's draws at once: a step draws nothing
            uniforms = torch.rand(R, params.max_new_tokens, generator=gen, device=self.device)
        stop_ids = set() if params.ignore_eos else set(self.eos_ids)
        stop_ids.update(params.stop_token_ids)
        ban = params.min_new_tokens > 0 and bool(stop_ids)
        sampler = DecodeSampler(params.temperature, params.top_k, params.top_p, ban, uniforms is not None,
                           None if uniforms is not None else gen)
        return sampler, uniforms, stop_ids

    def _decode_buffers(self, cache: DynamicCache, attn: torch.Tensor, rep: torch.Tensor, n: int, T: int, V: int,
                        static: bool, fast: bool) -> tuple[_Slot | None, _Rows, StaticKV | ForwardKV]:
        """(slot, rows, kv) of the decode, batch position b from prompt ``rep[b]``: under static shapes the
        bucket's kept buffers, filled from the prefill's ``cache``; else fresh rows over the cache itself."""
        dev, (P, Lp), Rb = self.device, attn.shape, rep.shape[0]
        if static:  # the bucket's kept buffers, filled from the prefill
            # + 4: room for a capture's warm-up steps
            slot = self._slot(Rb, self.plan.capacity(Lp + T + 4), cache.layers[0].k_buf.dtype)
            slot.kv.fill([x.k_buf for x in cache.layers], [x.v_buf for x in cache.layers], rep,
                         attn.index_select(0, rep).bool())
            return slot, slot.rows, slot.kv
        rows = _Rows(Rb, T, V, dev)
        if n > 1:  # one prefill per prompt, then n copies of its cache
            cache.batch_repeat_interleave(n)
        if fast:
            cap = cache.layers[0].k_buf.shape[2]
            ok = torch.cat([attn.bool(), attn.new_ones((P, cap - Lp), dtype=torch.bool)], dim=-1).index_select(0, rep)
            kv = StaticKV([x.k_buf for x in cache.layers], [x.v_buf for x in cache.layers], ok,
                          torch.tensor([Lp], device=dev))
        else:
            kv = ForwardKV(self, cache, attn.index_select(0, rep))
        return None, rows, kv

    def _start_rows(self, rows: _Rows, next_pos: torch.Tensor, rep: torch.Tensor, uniforms: torch.Tensor | None,
                    stop_ids: set[int], min_new: int, sampler: DecodeSampler) -> None:
        """Each row's state before its first sample: its next position, its uniforms, the stop ids' ban."""
        rows.pos[: rep.shape[0]].copy_(next_pos.index_select(0, rep))
        rows.t.zero_()
        if uniforms is not None:
            R, T = uniforms.shape
            rows.U[:R, :T].copy_(uniforms)
        if sampler.ban:
            rows.ban.zero_().index_fill_(0, torch.tensor(sorted(stop_ids), device=self.device), True)
            rows.min_new.fill_(min_new)

    def _decode(self, slot: _Slot | None, rows: _Rows, kv, weights: Weights | None, sampler: DecodeSampler, Lp: int,
                R: int, Rb: int, T: int, static: bool, stop_ids: set[int], stops: list[str], min_new: int
                ) -> tuple[list[list[int]], list[list[float]], list[str | None], list[str | int | None]]:
        """The decode loop after the first sample: (tokens, log-probs, finish, reason) of each row. The
        host reads the samples every ``plan.read_every`` steps, then drops the finished rows once enough are."""
        tail = max((len(s) for s in stops), default=0) + 8
        ids = list(range(R)) + [-1] * (Rb - R)  # batch position -> row id (-1: a filler)
        tokens_out: list[list[int]] = [[] for _ in range(R)]
        logps_out: list[list[float]] = [[] for _ in range(R)]
        finish: list[str | None] = [None] * R
        reason: list[str | int | None] = [None] * R
        k, read, made = self.plan.read_every, 0, 1  # samples read by the host, samples made
        step = self._stepper(slot, rows, kv, weights, sampler, Lp)
        while True:
            if made - read >= k or made == T:
                # the host's one read of these steps: their tokens and log-probs (float64 holds both exactly)
                block = torch.stack((rows.out_tok[:, read:made].double(), rows.out_lp[:, read:made].double())).tolist()
                for b, r in enumerate(ids):
                    if r >= 0 and finish[r] is None:
                        self._take(r, read, block[0][b], block[1][b], tokens_out, logps_out, finish, reason, stop_ids,
                                   stops, tail, min_new, made == T)
                read = made
                alive = [b for b, r in enumerate(ids) if r >= 0 and finish[r] is None]
                if made == T or not alive:
                    break
                if len(ids) - len(alive) >= max(1, int(self.compact_fraction * len(ids))):
                    size = self.plan.bucket(len(alive)) if static else len(alive)
                    if size < len(ids):
                        keep = alive + [alive[0]] * (size - len(alive))
                        slot, rows, kv = self._compact(slot, rows, kv, keep)
                        ids = [ids[b] for b in alive] + [-1] * (size - len(alive))
                        step = self._stepper(slot, rows, kv, weights, sampler, Lp)
            step(made)  # one decode step: sample ``made``
            made += 1
        return tokens_out, logps_out, finish, reason

    def _take(self, r: int, t0: int, toks: list[float], lps: list[float], tokens_out, logps_out, finish, reason,
              stop_ids: set[int], stops: list[str], tail: int, min_new: int, last: bool) -> None:
        """Row ``r``'s samples t0, t0 + 1, ... as read from the device: kept up to the first stop
        token, or the token that completes a stop string (not before ``min_new`` tokens), or to the end."""
        toks = list(map(int, toks))
        if not stops:  # the common case: one scan for a stop token, then the kept slice at once
            j = next((j for j, tok in enumerate(toks) if tok in stop_ids), None)
            cut = len(toks) if j is None else j + 1
            tokens_out[r].extend(toks[:cut])
            logps_out[r].extend(lps[:cut])
            if j is not None:
                finish[r], reason[r] = "stop", toks[j]
        else:
            for j, tok in enumerate(toks):
                tokens_out[r].append(tok)
                logps_out[r].append(lps[j])
                if tok in stop_ids:
                    finish[r], reason[r] = "stop", tok
                    break
                if t0 + j + 1 >= min_new:
                    text = self.tokenizer.decode(tokens_out[r][-tail:], skip_special_tokens=True)
                    hit = next((s for s in stops if s in text), None)
                    if hit is not None:
                        finish[r], reason[r] = "stop", hit
                        break
        if finish[r] is None and last:
            finish[r] = "length"

    def _sample_into(self, rows: _Rows, logits: torch.Tensor, sampler: DecodeSampler) -> None:
        """Sample ``rows.t`` from ``logits`` into the rows' buffers, on the device."""
        u = rows.U.index_select(1, rows.t).squeeze(1) if sampler.uniforms else None
        tok, lp = sample_tokens(logits, temperature=sampler.temperature, top_k=sampler.top_k, top_p=sampler.top_p,
                                banned=rows.ban if sampler.ban else None, ban_now=rows.t < rows.min_new if sampler.ban else None,
                                generator=sampler.generator, uniforms=u)
        rows.out_tok.index_copy_(1, rows.t, tok.unsqueeze(1))
        rows.out_lp.index_copy_(1, rows.t, lp.unsqueeze(1).float())
        rows.tok.copy_(tok)
        rows.t.add_(1)

    def _iteration(self, rows: _Rows, kv, weights: Weights | None, sampler: DecodeSampler, span: int, filled: bool = False
                   ) -> None:
        """One decode step on the device: the forward of each row's last token, then the next sample.
        Nothing is read back to the host (``torch.compile(..., fullgraph=True)`` traces it whole)."""
        if weights is not None:
            logits = self.fast.step(rows.tok, rows.pos, kv, weights, span, filled=filled)
        else:
            logits = kv.step(rows.tok, rows.pos)
        rows.pos.add_(1)
        self._sample_into(rows, logits, sampler)

    def _stepper(self, slot: _Slot | None, rows: _Rows, kv, weights, sampler: DecodeSampler, Lp: int):
        """``step(made)``: run the decode step that makes sample ``made``. Eager: attention over the
        filled columns (Lp + made). Static shapes: over the whole capacity, the step captured once
        per bucket and sampling settings (``DecodePlan.capture``) and replayed."""
        if slot is None:
            return lambda made: self._iteration(rows, kv, weights, sampler, Lp + made, filled=True)
        run = slot.steps.get(sampler.key())
        if run is None:
            run = slot.steps[sampler.key()] = self._capture(slot, weights, sampler)
        return lambda made: run()

    def _capture(self, slot: _Slot, weights, sampler: DecodeSampler):
        """The bucket's step as ``DecodePlan.capture`` runs it: the eager step, or the replay of a CUDA
        graph of it. On a CPU a captured plan runs its warm-up and then the eager step (the twin the
        tests compare)."""
        fn = lambda: self._iteration(slot.rows, slot.kv, weights, sampler, slot.kv.capacity)  # noqa: E731
        mode = self.plan.capture
        if mode == "none":
            return fn
        if mode == "reduce-overhead":  # torch.compile's own CUDA graphs: each call is a real step
            # the buffers it writes in place keep their addresses (else its graphs are skipped for mutated inputs)
            for t in [*(getattr(slot.rows, n) for n in (*_Rows.PER_ROW, "t", "ban", "min_new")), *slot.kv.tensors(),
                      *weights.tensors()]:
                torch._dynamo.mark_static_address(t)
            return torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
        if mode == "compile":  # one compiled decoder layer serves all of them; the graph holds the whole step
            self.fast.compile_layers()
        cuda = self.device.type == "cuda"
        # a warm-up run (it compiles, under 'compile') moves the state on by a step: put it back after
        # the capture, which itself runs nothing; the columns it wrote are written again before anything reads them
        state = [slot.rows.tok, slot.rows.pos, slot.rows.t, slot.kv.col]
        saved = [x.clone() for x in state]
        side = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            fn()
        run = fn
        if cuda:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: with rollout.overlap=thread the trainer's thread keeps using the device meanwhile
            with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
                fn()
            run = graph.replay
        for x, s in zip(state, saved):
            x.copy_(s)
        return run

    def _slot(self, R: int, capacity: int, dtype: torch.dtype) -> _Slot:
        """The kept buffers of ``R`` rows and ``capacity`` columns (made on first use)."""
        key = (R, capacity)
        slot = self._slots.pop(key, None)
        if slot is None:
            while len(self._slots) >= self.MAX_SLOTS:
                self._slots.pop(next(iter(self._slots)))
            f = self.fast
            kv = StaticKV.empty(f.layers, R, f.Hkv, capacity, f.D, dtype, self.device)
            slot = _Slot(_Rows(R, capacity, self._weights.lm[0].shape[1], self.device), kv)
        self._slots[key] = slot  # the most recently used last
        return slot

    def _compact(self, slot: _Slot | None, rows: _Rows, kv, keep: list[int]):
        """Keep batch positions ``keep``: (slot, rows, kv) after. Under static shapes the rows move
        into the buffers of the smaller bucket (``len(keep)`` rows)."""
        idx = torch.tensor(keep, device=self.device)
        if slot is None:
            rows.select(idx)
            kv.select(idx)
            return None, rows, kv
        new = self._slot(len(keep), slot.kv.capacity, slot.kv.k[0].dtype)
        new.rows.copy_rows(rows, idx)
        new.kv.copy_rows(kv, idx)
        return new, new.rows, new.kv

    def _count_perf(self, seconds: float, prompt_lens: list[int], lengths: list[int], weights: Weights) -> None:
        """Add this chunk's decode steps to ``perf_metrics``: step s (1 <= s < the longest completion)
        runs the rows that keep a token s, over their prompt and s tokens of context."""
        f, T = self.fast, max(lengths)
        elt = weights.lm[0].element_size()
        alive, context = [0] * (T + 1), [0] * (T + 1)
        for plen, n in zip(prompt_lens, lengths):  # rows alive at step s: those with n > s
            alive[n] += 1
            context[n] += plen
        bound, rows_left, ctx_left = 0.0, sum(alive), sum(context)
        for s in range(1, T):
            rows_left, ctx_left = rows_left - alive[s], ctx_left - context[s]  # rows with n > s
            bound += roofline_seconds(rows=rows_left, context=ctx_left + s * rows_left, weight_bytes=weights.nbytes(),
                                      weight_params=weights.nbytes() // elt, kv_bytes_per_token=2 * f.layers * f.Hkv * f.D * elt,
                                      attn_flops_per_token=4 * f.H * f.D * f.layers, flops_per_s=self._peaks[0],
                                      bytes_per_s=self._peaks[1])
        self._perf[0] += bound
        self._perf[1] += seconds
        self._perf[2] += sum(lengths)

    def _prefill_cached(self, prompts: list[list[int]], cache: DynamicCache, max_new_tokens: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill with the prefix cache: each prompt's longest cached prefix is copied into the
        KV cache and only the rest is computed. Returns (last logits, attention mask, next positions).

        Row layout (Lp = the longest reused prefix, Ls = the longest rest)::

            [pad .. cached prefix (ℓ_i)] [pad .. rest of the prompt]      every row ends at column Lp + Ls
             <----------- Lp ----------> <------------ Ls ---------->

        The pads between the two parts are masked out and the positions run on from ℓ_i, so each
        row computes what the whole prompt would (to fp32 rounding). Every prompt's keys and
        values are then stored for the prompts that will extend it.
        """
        dev, P = self.device, len(prompts)
        hits = [self.prefix_cache.lookup(p) for p in prompts]
        Lp = max(n for n, _ in hits)
        rest = [p[n:] for p, (n, _) in zip(prompts, hits)]
        Ls = max(len(r) for r in rest)
        if Lp:  # the reused keys/values, right-aligned in the first Lp columns
            H, D = next(kv for _, kv in hits if kv is not None)[0][0].shape[::2]
            for li, layer in enumerate(cache.layers):
                ref = next(kv for _, kv in hits if kv is not None)[li][0]
                layer.lazy_initialization(ref, ref)
                layer.k_buf = ref.new_zeros(P, H, Lp + Ls + max_new_tokens, D)
                layer.v_buf = ref.new_zeros(P, H, Lp + Ls + max_new_tokens, D)
                for i, (n, kv) in enumerate(hits):
                    if n:
                        layer.k_buf[i, :, Lp - n : Lp] = kv[li][0]
                        layer.v_buf[i, :, Lp - n : Lp] = kv[li][1]
                layer.length = Lp
                layer._views()
        input_ids = torch.full((P, Ls), self.pad_id, dtype=torch.long, device=dev)
        attn = torch.zeros((P, Lp + Ls), dtype=torch.long, device=dev)
        pos = torch.zeros((P, Ls), dtype=torch.long, device=dev)
        for i, ((n, _), r) in enumerate(zip(hits, rest)):
            input_ids[i, Ls - len(r):] = torch.tensor(r, device=dev)
            attn[i, Lp - n : Lp] = 1
            attn[i, Lp + Ls - len(r):] = 1
            pos[i, Ls - len(r):] = torch.arange(n, n + len(r), device=dev)
        logits = self._forward(input_ids, attn, pos, cache, prefill=True)
        for i, ((n, _), p) in enumerate(zip(hits, prompts)):
            cols = torch.cat([torch.arange(Lp - n, Lp, device=dev), torch.arange(Lp + Ls - len(rest[i]), Lp + Ls, device=dev)])
            self.prefix_cache.store(p, [(layer.k_buf[i][:, cols].clone(), layer.v_buf[i][:, cols].clone())
                                        for layer in cache.layers])
        next_pos = torch.tensor([len(p) for p in prompts], device=dev)
        return logits, attn, next_pos

    def _forward(self, ids, attn, pos, cache, *, prefill: bool) -> torch.Tensor:
        kwargs = {"logits_to_keep": 1} if prefill else {}
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **kwargs, **kv_cache_kwargs(cache))
        return out.logits[:, -1]

    def _completion(self, ids: list[int], logps: list[float], finish: str, reason, stops: list[str]) -> Completion:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if isinstance(reason, str):
            text = text[: text.find(reason)] if reason in text else text
        return Completion(token_ids=ids, logps=logps, finish_reason=finish, text=text, stop_reason=reason)
