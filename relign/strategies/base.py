"""The types every strategy shares: a problem, a budget, a candidate, a result.

The budget unit is the *generated token* (rollouts and expansions included), so strategies of
different shapes are compared at equal compute (search_and_credit.md, bottom line 4).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


@dataclass
class Problem:
    """One problem as every strategy sees it: rendered and tokenized once (``envs.tasks.encode_problems``)."""

    id: int
    """Stable identity (the record's index in its file): seeds derive from it, never from the
    problem's position in a batch, so results do not depend on the batch composition."""
    prompt_ids: list[int]
    """The rendered prompt (chat template applied) as token ids: what the engine continues."""
    prompt_text: str
    """The rendered prompt as text (what a rule reward receives as ``prompt``)."""
    question: str
    """The problem as the user wrote it, without chat markup (what a learned scorer reads)."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """The task's ground truth (the gold answer): used to grade, never to search unless allowed."""


@dataclass
class Budget:
    """Per-problem limits; a strategy stops a problem at the first one reached.

    A strategy checks the budget before each round, so the generated tokens it reports exceed
    ``max_generated_tokens`` by at most one round (one expansion) of one problem. Tree
    strategies judge a round by the previous one's cost and stop before it would cross the
    budget; a tree left without a complete solution then spends one finishing continuation.
    """

    max_generated_tokens: int | None = None
    """Generated tokens per problem (equal-compute comparisons use this)."""
    max_samples: int | None = None
    """Full-trajectory cap (cot, majority, best_of_n, weighted_majority)."""
    max_simulations: int | None = None
    """Rounds of a tree strategy (MCTS simulations, step-beam depth)."""

    def __post_init__(self) -> None:
        for name in ("max_generated_tokens", "max_samples", "max_simulations"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"budget.{name} must be a positive integer (or unset), got {v!r}")
        if self.max_generated_tokens is None and self.max_samples is None and self.max_simulations is None:
            raise ValueError("a budget needs at least one of budget.max_generated_tokens, budget.max_samples, "
                             "budget.max_simulations")


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


@dataclass
class Candidate:
    """A complete solution a strategy reached (a sample, a finished beam, a terminal node)."""

    token_ids: list[int]
    """The response's exact token ids (the engine's, never re-tokenized)."""
    text: str
    answer: str | None
    """The task's extracted final answer (None: the response gives none)."""
    score: float | None = None
    """The scorer's aggregated score (None: no scorer)."""
    step_scores: list[float] | None = None
    finish_reason: str = "stop"
    meta: dict[str, Any] = field(default_factory=dict)
    """Where it came from: depth, visits, q, prior, node id, kind (sample, beam, terminal, rollout)."""


@dataclass
class SearchResult:
    answer: str | None
    """The strategy's final answer (None: no candidate gave one)."""
    chosen: Candidate | None
    """The candidate the answer came from (for a vote: the first candidate of the winning answer)."""
    candidates: list[Candidate]
    """Every complete solution reached."""
    cost: Cost
    tree: list[dict[str, Any]] | None = None
    """Serialisable nodes for the report's tree view (tree strategies only)."""
    error: str | None = None
    """Set when the problem failed (a scorer raised): the result counts as wrong and the eval goes on."""


class Strategy(Protocol):
    name: str

    def search(self, engine, task, problems: list[Problem], *, budget: Budget, scorer=None,
               seed: int = 0) -> list[SearchResult]:
        """One result per problem, in order; every engine call batched across the problems."""
        ...
