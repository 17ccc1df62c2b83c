"""MCTS over reasoning steps: PUCT with a log-prob prior, distinct expansions and a pluggable
leaf evaluation, every tree of the batch advanced in lockstep (search_and_credit.md §7.3).

The common core of TS-LLM (Feng et al. 2023), AlphaMath (Chen et al. 2024), OpenR and
rStar-Math (Guan et al. 2025). One round, for every unfinished tree at once::

    select    from the root, while the node is expanded, the live child with the largest
              Q(c) + c_puct * P(c) * sqrt(N(parent)) / (1 + N(c))          (AlphaMath's PUCT)
              or, with rule="uct", Q(c) + c * sqrt(ln N(parent) / N(c))      (rStar, c = 2);
              terminal and exhausted children are skipped (rStar-Math select_child)
    expand    `width` continuations of the leaf's prefix that stop at the step delimiter, in
              ONE engine call for all trees; identical steps (same token ids) are re-drawn,
              up to 3 * width draws, and only distinct children are kept. A child whose text
              holds the task's answer marker, or that ends in EOS, is terminal.
    evaluate  leaf_eval="scorer": one batched scorer call on every new child's partial solution;
              leaf_eval="rollout": K continuations of each new child to the end (one engine call),
              scored, V = their mean (VinePPO's Monte-Carlo value; rStar-Math's data mode)
    back up   every new child c counts as one visit: N += 1 and W += v(c) from c to the root,
              so Q = W / N is the mean evaluation below a node

    P(c) is exp(mean token log-prob of c's step), normalized over the siblings (AlphaMath uses
    the unnormalized value; ``prior="raw"`` gives that).

The answer: ``best_terminal`` (the best-scored complete solution, ties by visits), ``visits``
(follow the most-visited child), ``weighted_vote`` or ``top_k_vote`` (rStar-Math) over the
complete solutions. Every node goes into ``SearchResult.tree`` for the report.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ..envs.tasks import Problem
from ..rollout.engine import Completion, SamplingParams, derive_seed
from ..rollout.prefixes import Cost, continue_prefixes
from .base import Budget, Candidate, SearchResult
from .common import (
    BudgetClock, ScoreJob, StepSearch, answer_of, check_scorer, equal_fn, score_jobs, select_candidate, step_texts
)
from .voting import majority, vote

RULES = ("puct", "uct")
LEAF_EVALS = ("scorer", "rollout")
ANSWER_RULES = ("best_terminal", "visits", "weighted_vote", "top_k_vote")
_ROLLOUT, _FINISH = 0x5EED, 0xF1515  # seed tags of a node's rollouts (expansions use the attempt number)


@dataclass
class Node:
    id: int
    parent: int | None
    depth: int
    token_ids: list[int]
    """This node's step (the engine's ids, stop-string tokens included)."""
    text: str
    logp_mean: float = 0.0
    prior: float = 1.0
    N: int = 0
    W: float = 0.0
    value: float | None = None
    terminal: bool = False
    exhausted: bool = False
    answer: str | None = None
    children: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def Q(self) -> float:  # noqa: N802 - the paper's symbol
        return self.W / self.N if self.N else 0.0


def puct(q: float, prior: float, n_parent: int, n_child: int, c_puct: float) -> float:
    """AlphaMath's PUCT score: Q + c_puct * P * sqrt(N_parent) / (1 + N_child)."""
    return q + c_puct * prior * math.sqrt(n_parent) / (1 + n_child)


def uct(q: float, n_parent: int, n_child: int, c: float) -> float:
    """UCT (rStar): Q + c * sqrt(ln N_parent / N_child); an unvisited child comes first."""
    if n_child == 0:
        return math.inf
    return q + c * math.sqrt(math.log(max(n_parent, 1)) / n_child)


def normalized_priors(logp_means: list[float]) -> list[float]:
    """P(c) proportional to exp(mean token log-prob of c's step), normalized over siblings."""
    if not logp_means:
        return []
    m = max(logp_means)
    w = [math.exp(x - m) for x in logp_means]
    z = sum(w)
    return [x / z for x in w]


class Tree:
    """One problem's search tree (node 0 is the prompt)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.nodes = [Node(0, None, 0, [], "")]
        self.candidates: list[Candidate] = []

    def path(self, v: int) -> list[Node]:
        out = []
        while v is not None:
            out.append(self.nodes[v])
            v = self.nodes[v].parent
        return out[::-1]

    def response_ids(self, v: int) -> list[int]:
        return [t for n in self.path(v) for t in n.token_ids]

    def add(self, parent: int, c: Completion, text: str) -> Node:
        p = self.nodes[parent]
        node = Node(len(self.nodes), parent, p.depth + 1, list(c.token_ids), text,
                    logp_mean=sum(c.logps) / len(c.logps) if c.logps else 0.0, finish_reason=c.finish_reason)
        self.nodes.append(node)
        p.children.append(node.id)
        return node

    def backup(self, v: int, value: float) -> None:
        for n in self.path(v):
            n.N += 1
            n.W += value

    def select(self, score) -> int | None:
        """The leaf to expand: descend by ``score(parent, child)`` over live children; a node
        whose children are all terminal or exhausted is exhausted itself. None: the tree is done."""
        while not self.nodes[0].exhausted:
            v = 0
            while self.nodes[v].children:
                live = [c for c in self.nodes[v].children if not self.nodes[c].terminal and not self.nodes[c].exhausted]
                if not live:
                    self.nodes[v].exhausted = True
                    break
                v = max(live, key=lambda c: (score(self.nodes[v], self.nodes[c]), -c))
            else:
                return v
        return None

    def to_records(self, chosen: set[int]) -> list[dict]:
        return [{"id": n.id, "parent": n.parent, "depth": n.depth, "text": n.text, "visits": n.N, "q": n.Q,
                 "prior": n.prior, "value": n.value, "terminal": n.terminal, "answer": n.answer,
                 "tokens": len(n.token_ids), "chosen": n.id in chosen} for n in self.nodes]


@dataclass
class MctsOptions:
    """MCTS's own knobs: the config section ``search.mcts.*`` of ``relign eval``."""

    rule: str = "puct"
    """MCTS selection: puct (AlphaMath) or uct (rStar)."""
    c_puct: float = 1.25
    """PUCT exploration weight (AlphaMath, TS-LLM's pb_c_init)."""
    c_uct: float = 2.0
    """UCT exploration weight."""
    prior: str = "normalized"
    """MCTS prior: exp(mean step log-prob), normalized over siblings or raw (AlphaMath)."""
    distinct: bool = True
    """Re-draw duplicate steps (up to 3 x width draws); false merges them (fewer children)."""
    leaf_eval: str = "scorer"
    """MCTS leaf value: scorer (one scorer call per round), or rollout (K continuations to the end, scored)."""
    rollouts: int = 4
    """K of leaf_eval=rollout: the rollouts per new child."""
    answer: str = "best_terminal"
    """MCTS answer: best_terminal, visits, weighted_vote or top_k_vote."""
    top_k: int = 4
    """Candidates that vote with answer=top_k_vote."""


@dataclass
class MCTS(MctsOptions, StepSearch):
    """PUCT over steps, batched in lockstep across problems (see the module docstring)."""

    name: str = "mcts"

    def __post_init__(self) -> None:
        for name, value, allowed in (("rule", self.rule, RULES), ("leaf_eval", self.leaf_eval, LEAF_EVALS),
                                     ("answer", self.answer, ANSWER_RULES), ("prior", self.prior, ("normalized", "raw"))):
            if value not in allowed:
                raise ValueError(f"mcts {name}={value!r}; choose one of {', '.join(allowed)}")
        if self.width < 1 or self.rollouts < 1 or self.max_depth < 1 or self.step_max_tokens < 1 or self.top_k < 1:
            raise ValueError("mcts width, rollouts, max_depth, step_max_tokens and top_k must be >= 1")

    # ------------------------------------------------------------------ selection score
    def child_score(self, parent: Node, child: Node) -> float:
        if self.rule == "uct":
            return uct(child.Q, parent.N, child.N, self.c_uct)
        return puct(child.Q, child.prior, parent.N, child.N, self.c_puct)

    # ------------------------------------------------------------------ the search
    def search(self, engine, task, problems: list[Problem], *, budget: Budget, scorer=None, seed: int = 0
               ) -> list[SearchResult]:
        check_scorer(self.name, scorer, task, needs_scorer=True, allow_reference=self.allow_reference)
        marker = self.final_marker(task)
        # per-search state (one search at a time per strategy object)
        self._task, self._marker, self._cache = task, marker, {}
        t0 = time.perf_counter()
        trees = [Tree(p) for p in problems]
        costs = [Cost() for _ in problems]
        clocks = [BudgetClock(budget) for _ in problems]
        last_round = [0] * len(problems)  # generated tokens of each tree's previous round
        failed: dict[int, str] = {}
        while True:
            leaves = {}
            for i, tree in enumerate(trees):
                # a round starts only if it would not cross the token budget (judged by the last
                # round's cost), so the one overshoot allowed is the finishing rollout below
                if i in failed or not clocks[i].allows(costs[i], last_round[i]):
                    continue
                v = tree.select(self.child_score)
                if v is not None:
                    leaves[i] = v
            if not leaves:
                break
            spent = {i: costs[i].generated_tokens for i in leaves}
            new = self._expand(engine, trees, leaves, costs, seed)
            self._evaluate(engine, scorer, trees, problems, new, costs, failed, seed)
            for i in leaves:
                clocks[i].rounds += 1
                last_round[i] = costs[i].generated_tokens - spent[i]
        self._finish(engine, scorer, trees, problems, costs, failed, seed)
        wall = time.perf_counter() - t0
        equal = equal_fn(task)
        results = []
        for i, tree in enumerate(trees):
            costs[i].wall_s = wall
            if i in failed:
                results.append(SearchResult(None, None, tree.candidates, costs[i], tree.to_records(set()), error=failed[i]))
                continue
            k = self._choose(tree, equal)
            chosen = tree.candidates[k] if k is not None else None
            path = set()
            if chosen is not None and "node" in chosen.meta:
                path = {n.id for n in tree.path(chosen.meta["node"])}
            results.append(SearchResult(chosen.answer if chosen else None, chosen, tree.candidates, costs[i],
                                        tree.to_records(path)))
        return results

    def _expand(self, engine, trees: list[Tree], leaves: dict[int, int], costs: list[Cost], seed: int
                ) -> dict[int, list[int]]:
        """Expand every selected leaf in lockstep; returns problem index -> new child ids.

        Each attempt draws ``width`` steps for every leaf still short of ``width`` distinct
        children, in one engine call per kind of step (a normal step, or the last one at
        ``max_depth``, which runs to the end). At most three attempts (3 * width draws), and a
        leaf stops early when an attempt brings nothing new (its children are all found)."""
        new: dict[int, list[int]] = {i: [] for i in leaves}
        seen: dict[int, set[tuple[int, ...]]] = {i: set() for i in leaves}
        step = SamplingParams(n=self.width, temperature=self.temperature, top_p=self.top_p,
                              max_new_tokens=self.step_max_tokens, stop=[self.delimiter])
        final = SamplingParams(n=self.width, temperature=self.temperature, top_p=self.top_p,
                               max_new_tokens=self.max_new_tokens)
        pending = list(leaves)
        for attempt in range(3 if self.distinct else 1):
            if not pending:
                break
            found = dict.fromkeys(pending, 0)
            for params, idx in ((step, [i for i in pending if trees[i].nodes[leaves[i]].depth + 1 < self.max_depth]),
                                (final, [i for i in pending if trees[i].nodes[leaves[i]].depth + 1 >= self.max_depth])):
                if not idx:
                    continue
                prefixes = [trees[i].problem.prompt_ids + trees[i].response_ids(leaves[i]) for i in idx]
                seeds = [derive_seed(seed, trees[i].problem.id, leaves[i], attempt) for i in idx]
                outs = continue_prefixes(engine, prefixes, params, [costs[i] for i in idx], seeds=seeds)
                for i, completions in zip(idx, outs):
                    for c in completions:
                        key = tuple(c.token_ids)
                        if not key or key in seen[i] or len(new[i]) >= self.width:
                            continue  # a duplicate step (or an empty one) is not a new child
                        seen[i].add(key)
                        found[i] += 1
                        new[i].append(self._child(trees[i], leaves[i], c, final=params is final).id)
            pending = [i for i in pending if len(new[i]) < self.width and found[i]]
        for i, kids in new.items():
            tree = trees[i]
            if not kids:  # nothing came back: nothing more to find below this leaf
                tree.nodes[leaves[i]].exhausted = True
                continue
            priors = normalized_priors([tree.nodes[c].logp_mean for c in kids]) if self.prior == "normalized" else \
                [math.exp(tree.nodes[c].logp_mean) for c in kids]
            for c, p in zip(kids, priors):
                tree.nodes[c].prior = p
        return new

    def _child(self, tree: Tree, parent: int, c: Completion, *, final: bool) -> Node:
        """A new child; terminal when its step holds the answer marker, ends in EOS (or a stop
        token, not the delimiter), or is the last step of a path (``final``)."""
        text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        node = tree.add(parent, c, text)
        ended = c.finish_reason == "stop" and not isinstance(c.stop_reason, str)
        node.terminal = self._marker in text or ended or final
        return node

    def _evaluate(self, engine, scorer, trees: list[Tree], problems: list[Problem], new: dict[int, list[int]],
                  costs: list[Cost], failed: dict[int, str], seed: int) -> None:
        """Give every new child its value v, back it up, and record terminal children as candidates."""
        decode = self.tokenizer
        jobs: list[ScoreJob] = []
        targets: list[tuple[int, int, str]] = []  # (problem, node, 'node' | 'rollout:k')
        rollout_done: dict[tuple[int, int], list[tuple[list[int], str, str]]] = {}
        if self.leaf_eval == "rollout":
            asks = [(i, v) for i, kids in new.items() for v in kids if not trees[i].nodes[v].terminal]
            rollout_done.update(self._rollouts(engine, trees, asks, self.rollouts, costs, seed, _ROLLOUT))
        for i, kids in new.items():
            if i in failed:
                continue
            tree = trees[i]
            for v in kids:
                node = tree.nodes[v]
                if node.terminal or self.leaf_eval == "scorer":
                    ids = tree.response_ids(v)
                    jobs.append(ScoreJob(i, step_texts(ids, decode, self.delimiter, self._cache)))
                    targets.append((i, v, "node"))
                else:
                    for k, (ids, _, _) in enumerate(rollout_done[(i, v)]):
                        jobs.append(ScoreJob(i, step_texts(ids, decode, self.delimiter, self._cache)))
                        targets.append((i, v, f"rollout:{k}"))
        scores = score_jobs(scorer, problems, jobs, costs, failed, self.aggregate, allow_reference=self.allow_reference)
        values: dict[tuple[int, int], list[float]] = {}
        for (i, v, what), s in zip(targets, scores):
            if i in failed or s is None:
                continue
            values.setdefault((i, v), []).append(s)
            if what.startswith("rollout:"):
                ids, text, finish = rollout_done[(i, v)][int(what.split(":")[1])]
                trees[i].candidates.append(Candidate(ids, text, answer_of(self._task, text, problems[i].extra_info),
                                                     score=s, finish_reason=finish,
                                                     meta={"kind": "rollout", "node": v, "depth": trees[i].nodes[v].depth}))
        for i, kids in new.items():
            if i in failed:
                continue
            tree = trees[i]
            for v in kids:
                vals = values.get((i, v))
                if not vals:
                    continue
                node = tree.nodes[v]
                node.value = sum(vals) / len(vals)
                tree.backup(v, node.value)
                if node.terminal:
                    text = decode.decode(tree.response_ids(v), skip_special_tokens=True)
                    node.answer = answer_of(self._task, text, problems[i].extra_info)
                    tree.candidates.append(Candidate(tree.response_ids(v), text, node.answer, score=node.value,
                                                     finish_reason=node.finish_reason or "stop",
                                                     meta={"kind": "terminal", "node": v, "depth": node.depth}))

    def _rollouts(self, engine, trees: list[Tree], asks: list[tuple[int, int]], k: int, costs: list[Cost], seed: int,
                  tag: int) -> dict[tuple[int, int], list[tuple[list[int], str, str]]]:
        """``k`` continuations to the end from each (problem, node), in one engine call:
        (problem, node) -> [(response ids, text, finish reason)]."""
        if not asks:
            return {}
        params = SamplingParams(n=k, temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens)
        prefixes = [trees[i].problem.prompt_ids + trees[i].response_ids(v) for i, v in asks]
        seeds = [derive_seed(seed, trees[i].problem.id, v, tag) for i, v in asks]
        outs = continue_prefixes(engine, prefixes, params, [costs[i] for i, _ in asks], seeds=seeds)
        done = {}
        for (i, v), completions in zip(asks, outs):
            base = trees[i].response_ids(v)
            done[(i, v)] = [(ids, self.tokenizer.decode(ids, skip_special_tokens=True), c.finish_reason)
                            for c in completions for ids in [base + list(c.token_ids)]]
        return done

    def _finish(self, engine, scorer, trees: list[Tree], problems: list[Problem], costs: list[Cost],
                failed: dict[int, str], seed: int) -> None:
        """A tree that stopped without reaching a complete solution (a small budget, scorer
        leaves) finishes its most promising path: from the root, follow the child with the
        best Q to a leaf, and continue it once to the end. It is scored like any candidate."""
        asks = []
        for i, tree in enumerate(trees):
            if i in failed or tree.candidates or len(tree.nodes) == 1:
                continue
            v = 0
            while tree.nodes[v].children:
                v = max(tree.nodes[v].children, key=lambda c: (tree.nodes[c].Q, tree.nodes[c].N, -c))
            asks.append((i, v))
        done = self._rollouts(engine, trees, asks, 1, costs, seed, _FINISH)
        jobs = [ScoreJob(i, step_texts(done[(i, v)][0][0], self.tokenizer, self.delimiter, self._cache)) for i, v in asks]
        scores = score_jobs(scorer, problems, jobs, costs, failed, self.aggregate, allow_reference=self.allow_reference)
        for (i, v), s in zip(asks, scores):
            if i in failed:
                continue
            ids, text, finish = done[(i, v)][0]
            trees[i].candidates.append(Candidate(ids, text, answer_of(self._task, text, problems[i].extra_info), score=s,
                                                 finish_reason=finish,
                                                 meta={"kind": "finish", "node": v, "depth": trees[i].nodes[v].depth}))

    def _choose(self, tree: Tree, equal) -> int | None:
        cands = tree.candidates
        if not cands:
            return None
        visits = [tree.nodes[c.meta["node"]].N if c.meta.get("kind") == "terminal" else 0 for c in cands]
        if self.answer == "best_terminal":
            return max(range(len(cands)), key=lambda k: (_score(cands[k]), visits[k], -k))
        if self.answer == "weighted_vote":
            return select_candidate(cands, "weighted_vote", equal)
        if self.answer == "top_k_vote":
            top = sorted(range(len(cands)), key=lambda k: (-_score(cands[k]), k))[: self.top_k]
            winner = majority(vote([cands[k].answer for k in top], equal))
            return top[winner[0]] if winner else None
        # visits: follow the most-visited child from the root to a terminal node
        v = 0
        while tree.nodes[v].children:
            v = max(tree.nodes[v].children, key=lambda c: (tree.nodes[c].N, tree.nodes[c].Q, -c))
        at = [k for k, c in enumerate(cands) if c.meta.get("node") == v and c.meta.get("kind") == "terminal"]
        if at:
            return at[0]
        under = [k for k, c in enumerate(cands) if c.meta.get("node") == v]  # rollouts from that leaf
        pool = under or list(range(len(cands)))
        return max(pool, key=lambda k: (_score(cands[k]), -k))


def _score(c: Candidate) -> float:
    """A candidate's score for ranking; an unscored one ranks last (below any negative reward)."""
    return c.score if c.score is not None else -math.inf
