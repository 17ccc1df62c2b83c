"""The types every strategy shares: a problem, a budget, a candidate, a result.

The budget unit is the *generated token* (rollouts and expansions included), so strategies of
different shapes are compared at equal compute (search_and_credit.md, bottom line 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..envs.tasks import Problem
from ..rollout.prefixes import Cost


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
