"""The built-in engine: batched sampling with a KV cache on a transformers model.

Why our own loop instead of ``model.generate``: we need the sampling log-probs of exactly the
distribution the trainer recomputes, per-call seeds, stop strings, and rows that leave the
batch when they finish; and ``generate``'s per-step overhead dominates small-model rollouts.

* Each distinct prompt is prefilled once; the cache is then repeated ``n`` times, so a group
  of ``n`` samples costs one prefill.
* Finished rows are dropped from the batch (and the KV cache) once enough of them finish, so
  long tails do not keep paying for short completions.
* Sampling is inverse-CDF with one uniform per row and token. With ``seeds`` (one per
  prompt) every row draws its uniforms from its own stream, ``derive_seed(seed, sample)``,
  so a prompt's completions do not depend on the other prompts in the call (nor on the
  rank that samples it). Without, rows share the engine's ``torch.Generator``, whose state
  is saved and restored with the run's checkpoints.
* In one process the engine holds the policy module itself: training updates are visible to
  the next rollout, and ``load_weights`` finds the trainer's own tensors and copies nothing.
  Under torchrun the policy is sharded, so each rank's engine holds a full replica and
  ``load_weights`` copies the gathered parameters into it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..models.logprobs import kv_cache_kwargs, right_pad, token_logps
from .engine import Completion, SamplingParams, check_generate_args, derive_seed, eos_token_ids
from .fast_decode import FastDecoder, unsupported_reason
from .fingerprint import Fingerprint, fingerprint, output_head
from .prefix_cache import PrefixCache


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    banned: list[int] | None = None,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [R, V]. Returns (tokens [R], logps [R]).

    The reported log-prob is log softmax(logits / T) at the sampled token, before top-k/top-p
    truncation or banned tokens: the trainer recomputes that same quantity from the same
    weights, so the two agree (tested to 1e-4 in fp32). Greedy (T = 0) reports T = 1.
    ``uniforms`` [R] in [0, 1): the draws to use (per-row streams); else drawn from ``generator``.
    """
    logits = logits.float()
    # x / 1 is x exactly: at T = 1 (RL rollouts, evals) the division is a pass over [R, V] for nothing
    scaled = logits / temperature if temperature > 0 and temperature != 1.0 else logits
    if temperature > 0 and not (banned or (top_k and top_k < logits.shape[-1]) or top_p < 1.0):
        # Plain sampling, the rollouts' case: one softmax gives both the CDF and the sampled
        # token's log-prob, log p(token); log_softmax and then exp would be two passes over the
        # vocabulary where one does. The same tokens; the log-prob differs by float rounding.
        probs = torch.softmax(scaled, dim=-1)
        tokens = _inverse_cdf(probs, uniforms, generator)
        return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()
    logps_all = torch.log_softmax(scaled, dim=-1)
    masked = scaled
    if banned:
        masked = masked.clone()
        masked[:, banned] = float("-inf")
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
        tokens = _inverse_cdf(torch.softmax(masked, dim=-1), uniforms, generator)
    return tokens, logps_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor | None, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] by inverse-CDF sampling: one uniform per row.
    torch.multinomial draws per vocabulary entry and was the largest cost of a decode step
    after the forward on CPU."""
    cdf = probs.cumsum(-1)
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=cdf.dtype)
    u = uniforms.to(cdf.device, cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


class GrowingLayer(DynamicLayer):
    """A KV-cache layer with room to grow: each decode step writes its key and value in place and
    attention reads a view of the filled part. The stock ``DynamicLayer`` concatenates, which
    copies the whole cache at every token (15% of a decode step on CPU at 128 new tokens)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0
        self.k_buf = self.v_buf = None

    def _views(self) -> None:
        self.keys, self.values = self.k_buf[:, :, : self.length], self.v_buf[:, :, : self.length]

    def update(self, key_states, value_states, *args, **kwargs):
        dev = key_states.device.type
        if torch.is_autocast_enabled(dev):
            # model.dtype=bf16-mixed: keys come out of RoPE in fp32, values in bf16. Attention
            # casts both to bf16 anyway, so keep them in bf16: the same numbers, half the
            # memory, and no cast of the whole cache at every decode step.
            dtype = torch.get_autocast_dtype(dev)
            key_states, value_states = key_states.to(dtype), value_states.to(dtype)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            B, H, _, D = key_states.shape
            self.k_buf = key_states.new_empty(B, H, self.capacity, D)
            self.v_buf = value_states.new_empty(B, H, self.capacity, D)
        n = key_states.shape[-2]
        if self.length + n > self.k_buf.shape[-2]:  # out of room: double it (amortized O(1) per token)
            more = lambda b: b.new_empty(*b.shape[:2], max(n, b.shape[2]), b.shape[3])  # noqa: E731
            self.k_buf, self.v_buf = torch.cat([self.k_buf, more(self.k_buf)], 2), torch.cat([self.v_buf, more(self.v_buf)], 2)
        self.k_buf[:, :, self.length : self.length + n] = key_states
        self.v_buf[:, :, self.length : self.length + n] = value_states
        self.length += n
        self._views()
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            self.k_buf = self.k_buf.repeat_interleave(repeats, dim=0)
            self.v_buf = self.v_buf.repeat_interleave(repeats, dim=0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self.k_buf, self.v_buf = self.k_buf[indices], self.v_buf[indices]
            self._views()


def growing_cache(config, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` of ``GrowingLayer``s when every layer is a plain full-attention one
    (sliding-window or hybrid models keep the stock layers)."""
    cache = DynamicCache(config=config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingLayer(capacity) for _ in cache.layers]
    return cache


class HFEngine:
    """Batched sampling on a transformers causal LM (see the module docstring)."""

    weight_format = "trainer"
    """``load_weights`` takes the trainer's parameter names (the engine holds the policy module or a replica)."""

    def __init__(self, model, tokenizer, *, max_batch_rows: int = 256, seed: int = 0, compact_fraction: float = 0.25,
                 prefix_cache_bytes: int = 0, fast_decode: bool = True):
        self.model = model
        # decode steps outside transformers' forward where the architecture allows (fast_decode.py)
        self.fast = FastDecoder(model) if fast_decode and unsupported_reason(model) is None else None
        # keys/values of earlier prompts, for prompts that extend them (tree search); 0 = off
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self.compact_fraction = compact_fraction
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_ids = eos_token_ids(tokenizer, model)
        eos = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)

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

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])

    def weight_fingerprint(self) -> Fingerprint:
        """The fingerprint of the engine's own model (rollout/fingerprint.py), parameter by parameter as it
        holds them: the decode step reads these tensors (its fused copies are made from them at every call)."""
        head, tied = output_head(self.model)
        return Fingerprint(fingerprint(self.model.named_parameters(), head=head, tied=tied))

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
                # the decode step's weight copies, made after the last update and dropped with this call
                weights = self.fast.weights() if self.fast is not None else None
                for start in range(0, len(prompts), per_chunk):
                    chunk_seeds = seeds[start : start + per_chunk] if seeds is not None else None
                    rows = self._generate_chunk(prompts[start : start + per_chunk], params, n, gen, chunk_seeds, weights)
                    out.extend(rows[i * n : (i + 1) * n] for i in range(len(rows) // n))
        finally:
            self.model.train(was_training)
        return out

    def _row_uniforms(self, seeds: list[int], n: int, steps: int) -> torch.Tensor:
        """[P * n, steps] uniforms, row i * n + j from the stream of ``derive_seed(seeds[i], j)``."""
        rows = [torch.rand(steps, generator=torch.Generator().manual_seed(derive_seed(s, j))) for s in seeds for j in range(n)]
        return torch.stack(rows).to(self.device)

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, n: int, gen,
                        seeds: list[int] | None, weights) -> list[Completion]:
        dev = self.device
        P = len(prompts)
        cache = growing_cache(self.model.config, max(len(p) for p in prompts) + params.max_new_tokens)
        if self.prefix_cache is not None and all(isinstance(x, GrowingLayer) for x in cache.layers):
            logits, attn, next_pos = self._prefill_cached(prompts, cache, params.max_new_tokens)
        else:
            L = max(len(p) for p in prompts)
            input_ids = torch.full((P, L), self.pad_id, dtype=torch.long, device=dev)
            attn = torch.zeros((P, L), dtype=torch.long, device=dev)
            for i, p in enumerate(prompts):  # left padding: every row's next token is at column L
                input_ids[i, L - len(p):] = torch.tensor(p, device=dev)
                attn[i, L - len(p):] = 1
            pos = (attn.cumsum(-1) - 1).clamp_min(0)
            logits = self._forward(input_ids, attn, pos, cache, prefill=True)
            next_pos = pos[:, -1] + 1
        if n > 1:  # one prefill per prompt, then n copies of its cache
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            attn = attn.repeat_interleave(n, dim=0)
            next_pos = next_pos.repeat_interleave(n, dim=0)

        R = P * n
        fast = weights is not None and all(isinstance(layer, GrowingLayer) for layer in cache.layers)
        stop_ids = set() if params.ignore_eos else set(self.eos_ids)
        stop_ids.update(params.stop_token_ids)
        banned_until_min = sorted(stop_ids)
        stops = [s for s in params.stop if s]
        tail = max((len(s) for s in stops), default=0) + 8
        tokens_out: list[list[int]] = [[] for _ in range(R)]
        logps_out: list[list[float]] = [[] for _ in range(R)]
        finish: list[str | None] = [None] * R
        reason: list[str | int | None] = [None] * R
        active = torch.arange(R, device=dev)  # batch position -> row id
        pending = 0  # finished rows still in the batch
        # per-row streams: each row's t-th uniform is fixed by its seed, whatever else is in the batch
        U = self._row_uniforms(seeds, n, params.max_new_tokens) if seeds is not None and params.temperature > 0 else None

        for t in range(params.max_new_tokens):
            banned = banned_until_min if t < params.min_new_tokens else None
            tok, lp = sample_tokens(
                logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, banned=banned, generator=gen,
                uniforms=U[active, t] if U is not None else None,
            )
            tok_l, lp_l, rows = tok.tolist(), lp.tolist(), active.tolist()
            last = t + 1 == params.max_new_tokens
            for b, r in enumerate(rows):
                if finish[r] is not None:
                    continue
                tokens_out[r].append(tok_l[b])
                logps_out[r].append(lp_l[b])
                if tok_l[b] in stop_ids:
                    finish[r], reason[r] = "stop", tok_l[b]
                elif stops and t + 1 >= params.min_new_tokens:
                    text = self.tokenizer.decode(tokens_out[r][-tail:], skip_special_tokens=True)
                    hit = next((s for s in stops if s in text), None)
                    if hit is not None:
                        finish[r], reason[r] = "stop", hit
                if finish[r] is None and last:
                    finish[r] = "length"
                if finish[r] is not None:
                    pending += 1
            if last or all(finish[r] is not None for r in rows):
                break
            if pending >= max(1, int(self.compact_fraction * len(rows))):
                keep = torch.tensor([b for b, r in enumerate(rows) if finish[r] is None], device=dev)
                cache.batch_select_indices(keep)
                active, tok, attn, next_pos = active[keep], tok[keep], attn[keep], next_pos[keep]
                pending = 0
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=-1)
            if fast:
                bias = torch.zeros(attn.shape, dtype=torch.float32, device=dev).masked_fill_(attn == 0, float("-inf"))
                logits = self.fast.step(tok, next_pos, bias, cache, weights)
            else:
                logits = self._forward(tok.unsqueeze(-1), attn, next_pos.unsqueeze(-1), cache, prefill=False)
            next_pos = next_pos + 1

        return [self._completion(tokens_out[r], logps_out[r], finish[r] or "length", reason[r], stops) for r in range(R)]

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
