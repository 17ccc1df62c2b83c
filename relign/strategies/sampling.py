"""Strategies that sample whole solutions and then pick one: cot, majority, best_of_n, weighted_majority.

They differ only in how the answer is chosen (``common.select_candidate``):

* ``cot`` — chain-of-thought prompting (Wei et al. 2022): one sampled solution, its answer.
* ``majority`` — self-consistency (Wang et al. 2023, arXiv 2203.11171): the most common answer.
* ``best_of_n`` — rank N samples with a verifier or reward model and keep the best
  (Cobbe et al. 2021, arXiv 2110.14168; search-and-learn ``best_of_n``: ``agg=last``, argmax).
* ``weighted_majority`` — vote with the scorer's scores as weights (Uesato et al. 2022,
  arXiv 2211.14275; Li et al. 2023 "step-aware verifier"; search-and-learn ``weighted``).

Samples are drawn in rounds of ``round_size`` per problem, every problem of the batch in the
same engine call. A round starts only while the problem's budget is not spent, so the tokens
reported exceed ``budget.max_generated_tokens`` by at most one round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..envs.tasks import Problem
from ..rollout.engine import SamplingParams, derive_seed
from ..rollout.prefixes import Cost, continue_prefixes
from .base import Budget, Candidate, SearchResult
from .common import BudgetClock, ScoreJob, answer_of, check_scorer, score_jobs, select_results, step_texts


@dataclass
class SampleAndSelect:
    """N independent samples per problem, then ``select`` (see the module docstring)."""

    name: str
    select: str
    tokenizer: object
    needs_scorer: bool = False
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 512
    stop: tuple[str, ...] = ()
    round_size: int = 4
    """Samples per problem per engine call."""
    delimiter: str = "\n"
    """Where a PRM scorer's steps end."""
    aggregate: str = "last"
    """How per-step scores become one (``last`` for outcome scorers)."""
    allow_reference: bool = False
    """Let a scorer read the gold answer (training-time data generation only; never in eval)."""
    samples_cap: int | None = None
    """A fixed number of samples whatever the budget (cot: 1)."""

    def search(self, engine, task, problems: list[Problem], *, budget: Budget, scorer=None, seed: int = 0
               ) -> list[SearchResult]:
        check_scorer(self.name, scorer, task, needs_scorer=self.needs_scorer, allow_reference=self.allow_reference)
        if self.round_size < 1:
            raise ValueError(f"round_size must be >= 1, got {self.round_size}")
        if self.samples_cap is not None:
            budget = Budget(max_samples=min(self.samples_cap, budget.max_samples or self.samples_cap))
        t0 = time.perf_counter()
        costs = [Cost() for _ in problems]
        cands: list[list[Candidate]] = [[] for _ in problems]
        clocks = [BudgetClock(budget) for _ in problems]
        failed: dict[int, str] = {}
        cache: dict[int, str] = {}
        while True:
            live = [i for i, p in enumerate(problems) if i not in failed and clocks[i].allows(costs[i])]
            if not live:
                break
            # a round of n samples per live problem; a sample cap can make the last round smaller
            by_n: dict[int, list[int]] = {}
            for i in live:
                left = (budget.max_samples - clocks[i].samples) if budget.max_samples is not None else self.round_size
                by_n.setdefault(min(self.round_size, left), []).append(i)
            new: list[tuple[int, Candidate]] = []
            for n, idx in sorted(by_n.items()):
                params = SamplingParams(n=n, temperature=self.temperature, top_p=self.top_p,
                                        max_new_tokens=self.max_new_tokens, stop=list(self.stop))
                seeds = [derive_seed(seed, problems[i].id, clocks[i].rounds) for i in idx]
                outs = continue_prefixes(engine, [problems[i].prompt_ids for i in idx], params, [costs[i] for i in idx],
                                         seeds=seeds)
                for i, completions in zip(idx, outs):
                    for j, c in enumerate(completions):
                        cand = Candidate(token_ids=list(c.token_ids), text=c.text,
                                         answer=answer_of(task, c.text, problems[i].extra_info), finish_reason=c.finish_reason,
                                         meta={"kind": "sample", "round": clocks[i].rounds, "sample": j})
                        new.append((i, cand))
                    clocks[i].rounds += 1
                    clocks[i].samples += len(completions)
            if scorer is not None:
                jobs = [ScoreJob(i, step_texts(c.token_ids, self.tokenizer, self.delimiter, cache)) for i, c in new]
                scores = score_jobs(scorer, problems, jobs, costs, failed, self.aggregate,
                                    allow_reference=self.allow_reference)
                for (_, c), s in zip(new, scores):
                    c.score = s
            for i, c in new:
                cands[i].append(c)
        return select_results(cands, costs, failed, self.select, task, time.perf_counter() - t0)
