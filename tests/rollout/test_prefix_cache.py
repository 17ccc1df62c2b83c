"""The HF engine's prefix cache: reused keys/values give what a full prefill gives."""

from __future__ import annotations

import torch

from relign.rollout.engine import SamplingParams
from relign.rollout.hf_engine import HFEngine
from relign.rollout.prefix_cache import PrefixCache

from .conftest import trainer_logps
from .test_hf_engine import prompts  # noqa: F401 - the shared fixture (prompts of different lengths)


def _kv(T: int, H: int = 2, D: int = 4, fill: float = 0.0):
    return [(torch.full((H, T, D), fill), torch.full((H, T, D), fill)) for _ in range(2)]


def test_lookup_takes_the_longest_cached_prefix_and_leaves_one_token():
    c = PrefixCache(max_bytes=1 << 20)
    c.store([1, 2, 3], _kv(3, fill=1.0))
    c.store([1, 2, 3, 4, 5], _kv(5, fill=2.0))
    n, kv = c.lookup([1, 2, 3, 4, 5, 6])
    assert n == 5 and float(kv[0][0][0, 0, 0]) == 2.0
    n, kv = c.lookup([1, 2, 3, 4, 9])  # [1,2,3,4,5] is not a prefix; [1,2,3] is
    assert n == 3 and kv[1][1].shape == (2, 3, 4)
    n, kv = c.lookup([1, 2, 3])  # the whole prompt is cached: all but its last token are reused
    assert n == 2 and kv[0][0].shape[1] == 2
    assert c.lookup([7, 8]) == (0, None) and c.lookup([1]) == (0, None)
    assert (c.hits, c.lookups, c.tokens_reused) == (3, 5, 10)


def test_budget_evicts_least_recently_used():
    one = 2 * 2 * (2 * 4 * 4 * 4)  # 2 layers x (k, v) x H*T*D floats of 4 bytes, T = 4
    c = PrefixCache(max_bytes=2 * one)
    c.store([1, 1, 1, 1], _kv(4))
    c.store([2, 2, 2, 2], _kv(4))
    c.lookup([1, 1, 1, 1, 5])  # touch the first: the second is now the oldest
    c.store([3, 3, 3, 3], _kv(4))
    assert len(c) == 2 and c.bytes == 2 * one
    assert c.lookup([2, 2, 2, 2, 5]) == (0, None) and c.lookup([1, 1, 1, 1, 5])[0] == 4
    c.store([9] * 100, _kv(100))  # bigger than the whole budget: not kept, nothing evicted
    assert len(c) == 2
    c.clear()
    assert len(c) == 0 and c.bytes == 0


def test_cached_prefill_gives_the_same_completions(model, tokenizer, prompts):
    """Prompts that extend earlier ones (as tree search sends them), mixed with new ones in one
    batch: same seeds, same tokens, and log-probs equal to the trainer's to 1e-4."""
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12)
    plain = HFEngine(model, tokenizer, seed=0)
    cached = HFEngine(model, tokenizer, seed=0, prefix_cache_bytes=64 << 20)
    first = plain.generate(prompts, params, seeds=list(range(len(prompts))))
    assert cached.generate(prompts, params, seeds=list(range(len(prompts)))) == first
    assert len(cached.prefix_cache) == len(prompts) and cached.prefix_cache.hits == 0
    # round two: each prompt extended by its first completion, plus one prompt never seen
    longer = [p + g[0].token_ids for p, g in zip(prompts, first)] + [prompts[0][:3] + prompts[1]]
    seeds = [100 + i for i in range(len(longer))]
    want = plain.generate(longer, params, seeds=seeds)
    got = cached.generate(longer, params, seeds=seeds)
    # whole prompts are the keys: the four extensions hit, the new prompt (which only shares a
    # part of prompts[0]) is computed in full, in the same batch
    assert cached.prefix_cache.hits == len(longer) - 1
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
    flat_p = [p for p, g in zip(longer, got) for _ in g]
    ref = trainer_logps(model, flat_p, [c.token_ids for g in got for c in g], 1.0)
    worst = max(abs(a - b) for c, r in zip([c for g in got for c in g], ref) for a, b in zip(c.logps, r))
    assert worst < 1e-4, worst


def test_new_weights_clear_the_cache(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer, seed=0, prefix_cache_bytes=64 << 20)
    engine.generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=2))
    assert len(engine.prefix_cache)
    engine.load_weights(model.named_parameters())
    assert len(engine.prefix_cache) == 0
    engine.generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=2))
    engine.sleep()
    assert len(engine.prefix_cache) == 0
