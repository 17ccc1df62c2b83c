"""Step-level beam search guided by a scorer (search-and-learn ``beam_search``; Snell et al. 2024,
arXiv 2408.03314): the baseline MCTS must beat, and per token often the stronger one.

Each round, for every problem of the batch in one engine call: every kept beam proposes
``width`` next steps (the first round: the prompt proposes ``beams * width``), each stopped
at the step delimiter; the scorer reads every partial solution (one batched call); complete
solutions (answer marker or EOS) are set aside as candidates; the best ``beams`` of the rest
are kept. The last round (at ``max_depth`` or ``budget.max_simulations``) generates to the end. A
round starts only if, judged by the previous round, it stays within the token budget; a
question left with no complete solution then continues its best beam once to the end. The answer is the best-scored
complete solution (``select=argmax``) or a score-weighted vote (``weighted_vote``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..envs.tasks import Problem
from ..rollout.engine import SamplingParams, derive_seed
from ..rollout.prefixes import Cost, continue_prefixes
from .base import Budget, Candidate, SearchResult
from .common import BudgetClock, ScoreJob, StepSearch, answer_of, check_scorer, score_jobs, select_results, step_texts

_FINISH = 0xF1515  # seed tag of the finishing continuation


@dataclass
class _Beam:
    ids: list[int]
    score: float | None = None
    depth: int = 0
    rank: tuple[int, int] = (0, 0)
    """(parent beam's rank, sample): breaks score ties the same way whatever the batch."""


@dataclass
class BeamOptions:
    """Step beam's own knobs: the config section ``search.beam.*`` of ``relign eval``."""

    beams: int = 4
    """Beams kept after each round (search-and-learn's N / M)."""
    select: str = "argmax"
    """The answer among complete beams: argmax or weighted_vote."""


@dataclass
class StepBeam(BeamOptions, StepSearch):
    name: str = "step_beam"

    def __post_init__(self) -> None:
        if self.beams < 1 or self.width < 1 or self.max_depth < 1 or self.step_max_tokens < 1:
            raise ValueError("step_beam beams, width, max_depth and step_max_tokens must be >= 1")
        if self.select not in ("argmax", "weighted_vote"):
            raise ValueError(f"step_beam select={self.select!r}; choose argmax or weighted_vote")

    def search(self, engine, task, problems: list[Problem], *, budget: Budget, scorer=None, seed: int = 0
               ) -> list[SearchResult]:
        check_scorer(self.name, scorer, task, needs_scorer=True, allow_reference=self.allow_reference)
        marker = self.final_marker(task)
        t0 = time.perf_counter()
        cache: dict[int, str] = {}
        costs = [Cost() for _ in problems]
        clocks = [BudgetClock(budget) for _ in problems]
        active: list[list[_Beam]] = [[_Beam([])] for _ in problems]
        done: list[list[Candidate]] = [[] for _ in problems]
        last_round = [0] * len(problems)  # tokens the previous round cost
        failed: dict[int, str] = {}
        while True:
            # a round starts only if, judged by the previous one, it stays within the token budget
            live = [i for i in range(len(problems)) if i not in failed and active[i] and len(done[i]) < self.beams * self.width
                    and clocks[i].allows(costs[i], last_round[i])]
            if not live:
                break
            spent0 = [c.generated_tokens for c in costs]
            proposals = self._propose(engine, problems, live, active, clocks, costs, seed, marker)
            jobs = [ScoreJob(i, step_texts(b.ids, self.tokenizer, self.delimiter, cache)) for i, b, *_ in proposals]
            scores = score_jobs(scorer, problems, jobs, costs, failed, self.aggregate, allow_reference=self.allow_reference)
            kept: dict[int, list[_Beam]] = {i: [] for i in live}
            for (i, beam, terminal, text, finish), s in zip(proposals, scores):
                if i in failed:
                    continue
                beam.score = s
                if terminal:
                    done[i].append(Candidate(beam.ids, text, answer_of(task, text, problems[i].extra_info), score=s,
                                             finish_reason=finish, meta={"kind": "beam", "depth": beam.depth}))
                else:
                    kept[i].append(beam)
            for i in live:
                ranked = sorted(kept[i], key=lambda b: (-(b.score if b.score is not None else float("-inf")), b.rank))
                active[i] = ranked[: self.beams]
                last_round[i] = costs[i].generated_tokens - spent0[i]
                clocks[i].rounds += 1
        self._finish(engine, task, problems, active, done, costs, failed, seed, scorer, cache)
        return select_results(done, costs, failed, self.select, task, time.perf_counter() - t0)

    def _propose(self, engine, problems: list[Problem], live: list[int], active: list[list[_Beam]],
                 clocks: list[BudgetClock], costs: list[Cost], seed: int, marker: str) -> list[tuple]:
        """Every live beam's next steps, one engine call per kind of step (a step, or the last
        one at max_depth / max_simulations, which runs to the end): (problem, beam, terminal, text, finish)."""
        asks: dict[tuple[int, bool], list[tuple[int, int, _Beam]]] = {}  # (n, final) -> (problem, beam rank, beam)
        for i in live:
            b = clocks[i].budget
            final = clocks[i].rounds + 1 >= self.max_depth or (
                b.max_simulations is not None and clocks[i].rounds + 1 >= b.max_simulations)
            n = self.width if clocks[i].rounds else self.beams * self.width  # the prompt proposes for every beam
            for j, beam in enumerate(active[i]):
                asks.setdefault((n, final), []).append((i, j, beam))
        proposals = []
        for (n, final), reqs in asks.items():
            params = SamplingParams(n=n, temperature=self.temperature, top_p=self.top_p,
                                    max_new_tokens=self.max_new_tokens if final else self.step_max_tokens,
                                    stop=[] if final else [self.delimiter])
            prefixes = [problems[i].prompt_ids + beam.ids for i, _, beam in reqs]
            # seeded by (problem, round, beam rank): not by the request's place in the batch
            seeds = [derive_seed(seed, problems[i].id, clocks[i].rounds, j) for i, j, _ in reqs]
            outs = continue_prefixes(engine, prefixes, params, [costs[i] for i, _, _ in reqs], seeds=seeds)
            for (i, j, beam), completions in zip(reqs, outs):
                for k, c in enumerate(completions):
                    ids = beam.ids + list(c.token_ids)
                    text = self.tokenizer.decode(ids, skip_special_tokens=True)
                    ended = c.finish_reason == "stop" and not isinstance(c.stop_reason, str)  # EOS, not the delimiter
                    step = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                    terminal = final or ended or marker in step or len(ids) >= self.max_new_tokens
                    proposals.append((i, _Beam(ids, depth=beam.depth + 1, rank=(j, k)), terminal, text, c.finish_reason))
        proposals.sort(key=lambda x: (x[0], x[1].rank))  # the same order whatever the batch's grouping
        return proposals

    def _finish(self, engine, task, problems: list[Problem], active: list[list[_Beam]], done: list[list[Candidate]],
                costs: list[Cost], failed: dict[int, str], seed: int, scorer, cache: dict[int, str]) -> None:
        """A question whose budget ran out before any beam finished continues its best beam once
        to the end (the one expansion it may spend over the budget), scored like any candidate."""
        asks = [i for i in range(len(problems)) if i not in failed and not done[i] and active[i]]
        if not asks:
            return
        params = SamplingParams(n=1, temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens)
        outs = continue_prefixes(engine, [problems[i].prompt_ids + active[i][0].ids for i in asks], params,
                                 [costs[i] for i in asks], seeds=[derive_seed(seed, problems[i].id, _FINISH) for i in asks])
        finished = [(i, active[i][0].ids + list(c[0].token_ids), c[0].finish_reason) for i, c in zip(asks, outs)]
        jobs = [ScoreJob(i, step_texts(ids, self.tokenizer, self.delimiter, cache)) for i, ids, _ in finished]
        scores = score_jobs(scorer, problems, jobs, costs, failed, self.aggregate, allow_reference=self.allow_reference)
        for (i, ids, finish), s in zip(finished, scores):
            if i not in failed:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                done[i].append(Candidate(ids, text, answer_of(task, text, problems[i].extra_info), score=s,
                                         finish_reason=finish, meta={"kind": "finish", "depth": active[i][0].depth}))
