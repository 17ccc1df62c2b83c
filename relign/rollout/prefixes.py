"""Sampling continuations of prefixes, the primitive search, VinePPO and ReST-EM share: one batched engine call for many prefixes, de-duplicated, with every generated token counted.

This is the only place search, VinePPO and ReST-EM talk to the engine: identical prefixes are
sent once (every sample of a question shares s_0; sibling MCTS leaves share their parent), the
engine sees one ``generate`` call with ``n = params.n`` per prefix, and each caller gets the
completions of its prefix back. The generated tokens are the budget unit, so they are added to
the caller's ``Cost`` here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .engine import Completion, SamplingParams


@dataclass
class Cost:
    """What a search spent. ``generated_tokens`` is the budget unit everywhere."""

    generated_tokens: int = 0
    """Tokens the engine generated (expansions, resamples and rollouts), each counted once."""
    prompt_tokens: int = 0
    """Prefix tokens sent to the engine (after de-duplication)."""
    engine_calls: int = 0
    """``engine.generate`` calls this problem took part in (a batched call counts once)."""
    scorer_calls: int = 0
    """Scorer calls this problem took part in."""
    scorer_tokens: int = 0
    """Characters of partial solutions the scorer read (a proxy for its cost; it has its own tokenizer)."""
    wall_s: float = 0.0
    """Seconds of the batched search this problem belonged to."""

    def add(self, other: Cost) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


def continue_prefixes(engine, prefixes: Sequence[Sequence[int]], params: SamplingParams,
                      cost: Cost | Sequence[Cost] | None = None, *, seeds: Sequence[int] | None = None,
                      dedup: bool = True) -> list[list[Completion]]:
    """``params.n`` continuations of every prefix, in order, from one ``engine.generate`` call.

    ``cost``: one ``Cost`` for the whole call, or one per prefix (the owner: a problem in a
    lockstep batch). With owners, a prefix is de-duplicated within its owner only: two problems
    whose prompts tokenize alike are two requests, each sampled with its own seed and charged to
    its own cost, so a problem's result does not depend on what else is in the batch. Every owner
    that took part is charged one engine call. ``seeds``: one per prefix (a duplicate uses the
    seed of its first occurrence); callers derive them from what identifies the request
    (problem, node, attempt), never from its position, so results do not depend on the batch.
    ``dedup=False`` sends every prefix as it is (an ablation: VinePPO's ``dedup``).
    """
    if not prefixes:
        return []
    if seeds is not None and len(seeds) != len(prefixes):
        raise ValueError(f"continue_prefixes: {len(seeds)} seeds for {len(prefixes)} prefixes")
    owners = list(cost) if isinstance(cost, Sequence) else None
    if owners is not None and len(owners) != len(prefixes):
        raise ValueError(f"continue_prefixes: {len(owners)} costs for {len(prefixes)} prefixes")
    first: dict[tuple, int] = {}  # (owner, prefix) -> index into unique
    unique: list[list[int]] = []
    unique_seeds: list[int] = []
    slot: list[int] = []
    for i, p in enumerate(prefixes):
        # a prefix is shared within its owner (a problem), never across owners
        key = ((id(owners[i]) if owners is not None else None), tuple(p)) if dedup else (i,)
        j = first.get(key)
        if j is None:
            j = first[key] = len(unique)
            unique.append(list(p))
            if seeds is not None:
                unique_seeds.append(int(seeds[i]))
        slot.append(j)
    outs = engine.generate(unique, params, seeds=unique_seeds if seeds is not None else None)
    if len(outs) != len(unique):
        raise RuntimeError(f"engine returned {len(outs)} results for {len(unique)} prompts")

    if owners is None:
        if cost is not None:
            cost.engine_calls += 1
            cost.prompt_tokens += sum(len(p) for p in unique)
            cost.generated_tokens += sum(len(c.token_ids) for cs in outs for c in cs)
    else:
        charged: set[int] = set()
        called: set[int] = set()
        for i, j in enumerate(slot):
            c = owners[i]
            if id(c) not in called:  # one engine call per owner, however many prefixes it sent
                called.add(id(c))
                c.engine_calls += 1
            if j not in charged:  # a unique prefix is charged once, to its owner
                charged.add(j)
                c.prompt_tokens += len(unique[j])
                c.generated_tokens += sum(len(x.token_ids) for x in outs[j])
    return [outs[j] for j in slot]
