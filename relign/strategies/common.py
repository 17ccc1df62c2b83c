"""What the strategies share: checking the scorer, scoring in batches with per-problem failure,
building candidates, and choosing the answer."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..envs.tasks import Problem
from ..rollout.prefixes import Cost
from ..rollout.steps import step_ends
from .base import Budget, Candidate, SearchResult
from .scorers import aggregate_step_scores, check_reference
from .voting import argmax_index, majority, vote, weighted_vote

log = logging.getLogger(__name__)

SELECTIONS = ("first", "vote", "argmax", "weighted_vote")


class ScorerFailed(Exception):
    """A scorer raised on one problem's solutions; that problem's result is marked failed."""


def check_scorer(name: str, scorer, task, *, needs_scorer: bool, allow_reference: bool) -> None:
    if needs_scorer and scorer is None:
        raise ValueError(f"strategy {name} ranks solutions and needs a scorer (scorer=verifier|rm|prm, or rule where allowed)")
    check_reference(scorer, task, allow_reference)


def answer_of(task, text: str, extra_info: dict) -> str | None:
    """The task's extracted final answer; an extractor that raises gives None (the answer is
    missing, which counts as wrong, and the search goes on)."""
    try:
        return task.extract_answer(text, extra_info)
    except Exception as e:  # noqa: BLE001 - user extractor
        log.warning("answer extractor raised %s: %s", type(e).__name__, e)
        return None


def equal_fn(task) -> Callable[[str, str], bool]:
    def equal(a: str, b: str) -> bool:
        try:
            return task.answers_equal(a, b)
        except Exception:  # noqa: BLE001 - user equivalence: different answers
            return False

    return equal if getattr(task, "equal_spec", None) else operator.eq


def step_texts(token_ids: Sequence[int], tokenizer, delimiter: str, cache: dict[int, str] | None = None) -> list[str]:
    """The response cut into its steps' texts (what a PRM reads), from the exact ids."""
    ends = step_ends(token_ids, tokenizer, delimiter, cache=cache)
    starts = [0, *ends[:-1]]
    return [tokenizer.decode(list(token_ids[s:e]), skip_special_tokens=True) for s, e in zip(starts, ends)] or [""]


@dataclass
class StepSearch:
    """What a search over reasoning steps (step_beam, mcts) is set with, beside its own knobs."""

    tokenizer: object = None
    width: int = 4
    """Children per expansion (MCTS); next steps proposed per kept beam (step_beam's M)."""
    temperature: float = 0.7
    top_p: float = 1.0
    delimiter: str = "\n"
    """Where a step ends."""
    step_max_tokens: int = 128
    """Longest step; a longer one is cut and the next expansion continues it."""
    max_new_tokens: int = 512
    """Longest generation to the end (a rollout, the last step at max_depth, the finishing one)."""
    max_depth: int = 16
    """Steps on a path; the step that reaches max_depth is generated to the end."""
    aggregate: str = "last"
    """How a partial solution's step scores become one (``scorers.aggregate_step_scores``)."""
    allow_reference: bool = False
    """Let a scorer read the gold answer (training-time data generation only; never in eval)."""
    answer_marker: str | None = None
    """Overrides the task's answer marker (what makes a step final)."""

    def final_marker(self, task) -> str:
        """The text that makes a step final: this search's, else the task's; a tree search cannot run without one."""
        marker = self.answer_marker or getattr(task, "answer_marker", None)
        if not marker:
            raise ValueError(f"{getattr(self, 'name', 'search')} needs the task's answer marker to tell a final step (task "
                             f"'{getattr(task, 'name', '?')}' has none): set search.answer_marker (e.g. '####' or '\\\\boxed')")
        return marker


@dataclass
class ScoreJob:
    owner: int
    """Index of the problem in the batch."""
    steps: list[str]


def score_jobs(scorer, problems: Sequence[Problem], jobs: list[ScoreJob], costs: Sequence[Cost], failed: dict[int, str],
               aggregate: str, *, allow_reference: bool = False) -> list[float | None]:
    """Score every job in one scorer call (batched across problems) and aggregate its step scores.

    A problem's ``extra_info`` holds its gold answer: a scorer receives it only when the search
    may read the reference (``allow_reference``: training-time data generation) or when the
    scorer declares it reads a problem's givens and has passed ``check_reference``
    (``reads_extra_info``: the task's own rule reward, whose task needs no gold answer or was
    allowed one). Any other scorer, a learned one or a user's, gets empty dicts: it cannot read
    the answer in eval, by accident or not.

    If the call raises, each problem's jobs are scored on their own so the error is pinned on
    the problems that cause it: those are recorded in ``failed`` (problem index -> message) and
    their jobs get None; the others are scored normally.
    """
    if not jobs:
        return []
    live = [i for i, j in enumerate(jobs) if j.owner not in failed]
    out: list[float | None] = [None] * len(jobs)

    givens = allow_reference or getattr(scorer, "reads_extra_info", False)

    def call(idx: list[int]) -> list[list[float]]:
        ps = [problems[jobs[i].owner] for i in idx]
        infos = [p.extra_info if givens else {} for p in ps]
        res = scorer.score([p.question for p in ps], [jobs[i].steps for i in idx], infos)
        if len(res) != len(idx):
            raise ValueError(f"scorer returned {len(res)} results for {len(idx)} solutions")
        return res

    def charge(idx: list[int]) -> None:
        for o in {jobs[i].owner for i in idx}:
            costs[o].scorer_calls += 1
        for i in idx:
            costs[jobs[i].owner].scorer_tokens += sum(len(s) for s in jobs[i].steps)

    try:
        charge(live)
        results = call(live)
        for i, r in zip(live, results):
            out[i] = aggregate_step_scores(r, aggregate)
        return out
    except Exception as e:  # noqa: BLE001 - pin it on the problems that cause it
        log.warning("scorer raised %s: %s; scoring problem by problem", type(e).__name__, e)
    for owner in sorted({jobs[i].owner for i in live}):
        idx = [i for i in live if jobs[i].owner == owner]
        try:
            for i, r in zip(idx, call(idx)):
                out[i] = aggregate_step_scores(r, aggregate)
        except Exception as e:  # noqa: BLE001
            failed[owner] = f"scorer raised {type(e).__name__}: {e}"
    return out


def select_candidate(cands: Sequence[Candidate], how: str, equal: Callable[[str, str], bool] = operator.eq) -> int | None:
    """Index of the chosen candidate: ``first``; ``vote`` (self-consistency, Wang et al. 2023:
    the first candidate of the most common answer); ``argmax`` (best-of-N: the highest score);
    ``weighted_vote`` (the answer with the largest summed score; Li et al. 2023, Uesato et al.
    2022). Candidates without an answer do not vote."""
    if not cands:
        return None
    if how == "first":
        return 0
    answers = [c.answer for c in cands]
    if how == "vote":
        winner = majority(vote(answers, equal))
        return winner[0] if winner else None
    if how == "argmax":
        return argmax_index([c.score for c in cands])
    if how == "weighted_vote":
        winner = weighted_vote(answers, [c.score for c in cands], equal)
        if not winner:
            return None
        return max(winner, key=lambda i: (cands[i].score or 0.0, -i))  # the best-scored candidate of that answer
    raise ValueError(f"unknown selection {how!r}; choose one of {', '.join(SELECTIONS)}")


def select_results(cands: Sequence[list[Candidate]], costs: Sequence[Cost], failed: dict[int, str], how: str, task,
                   wall_s: float) -> list[SearchResult]:
    """One result per problem: the candidate ``select_candidate`` picks by ``how`` (none for a problem
    whose scorer failed, with its error), and the batch's wall time on every cost."""
    equal, results = equal_fn(task), []
    for i, (found, cost) in enumerate(zip(cands, costs)):
        cost.wall_s = wall_s
        if i in failed:
            results.append(SearchResult(None, None, found, cost, error=failed[i]))
            continue
        k = select_candidate(found, how, equal)
        chosen = found[k] if k is not None else None
        results.append(SearchResult(chosen.answer if chosen else None, chosen, found, cost))
    return results


@dataclass
class BudgetClock:
    """Whether a problem may start another round under its ``Budget``."""

    budget: Budget
    rounds: int = 0
    samples: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def allows(self, cost: Cost, next_round: int = 0) -> bool:
        """Another round fits: ``next_round`` is the expected tokens of it (0: any start below the budget)."""
        b = self.budget
        if b.max_generated_tokens is not None and cost.generated_tokens + next_round >= max(b.max_generated_tokens, 1):
            return False
        if b.max_samples is not None and self.samples >= b.max_samples:
            return False
        return not (b.max_simulations is not None and self.rounds >= b.max_simulations)
