"""Search strategies on the model-free FakeTreeEngine: selection scores by hand, back-up,
terminal and exhausted nodes, token accounting, de-duplicated engine calls, distinct
expansions, determinism and batch independence, lockstep, budgets, the gold-answer guard,
errors, the serialised tree, and candidate selection (search_and_credit.md 7.1-7.3)."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from relign.rollout.engine import Completion, SamplingParams
from relign.envs.tasks import Problem
from relign.rollout.prefixes import Cost
from relign.strategies.base import Budget, Candidate
from relign.strategies.common import select_candidate
from relign.strategies.mcts import MCTS, Node, Tree, normalized_priors, puct, uct
from relign.strategies.registry import STRATEGIES, make_strategy
from relign.rollout.prefixes import continue_prefixes
from relign.strategies.scorers import TaskRuleScorer, aggregate_step_scores

from .fake_tree_engine import (
    NL,
    PROMPT0,
    STEP0,
    ExactVerifier,
    FakeTokenizer,
    FakeTreeEngine,
    NoisyVerifier,
    OracleValue,
    fake_task,
    random_tree,
    toy_problems,
    trap_engine,
)

TOK = FakeTokenizer()
TASK = fake_task()
MAX_NEW = 64
STEP_MAX = 8  # a toy step is 2 tokens (4 for the last): a tight per-step cap keeps budget bounds tight

# name -> (make_strategy options, scorer factory or None)
SETUPS = {
    "cot": ({}, None),
    "majority": ({"temperature": 1.0}, None),
    "best_of_n": ({"temperature": 1.0}, NoisyVerifier),
    "weighted_majority": ({"temperature": 1.0}, NoisyVerifier),
    "step_beam": ({"temperature": 1.0, "step_max_tokens": STEP_MAX}, lambda t: OracleValue(t, noise_sd=0.2)),
    "mcts": ({"step_max_tokens": STEP_MAX}, NoisyVerifier),
    "mcts_rollout": ({"step_max_tokens": STEP_MAX, "leaf_eval": "rollout", "rollouts": 2}, NoisyVerifier),
}


def _strategy(setup: str, **extra):
    opts, _ = SETUPS[setup]
    name = "mcts" if setup.startswith("mcts") else setup
    return make_strategy(name, TOK, max_new_tokens=MAX_NEW, **{**opts, **extra})


def _run(setup: str, problems, budget: Budget, *, engine=None, seed: int = 0, **extra):
    engine = engine or trap_engine()
    _, make_scorer = SETUPS[setup]
    scorer = make_scorer(engine.trees) if make_scorer else None
    return engine, _strategy(setup, **extra).search(engine, TASK, problems, budget=budget, scorer=scorer, seed=seed)


def _round_max(setup: str) -> int:
    """The most generated tokens one round of one problem can take (the budget's allowed overshoot)."""
    strat = _strategy(setup)
    if setup in ("cot", "majority", "best_of_n", "weighted_majority"):
        return strat.round_size * MAX_NEW
    if setup == "step_beam":  # a round to the end (max_depth), plus a finishing continuation of one beam
        return strat.beams * strat.width * MAX_NEW + MAX_NEW
    # mcts: up to 3 * width step draws, plus the finishing rollout; rollout leaves add K per new child
    out = 3 * strat.width * strat.step_max_tokens + MAX_NEW
    if strat.leaf_eval == "rollout":
        out += strat.width * strat.rollouts * MAX_NEW
    return out


def _completion(tokens: list[int], logp: float = -1.0) -> Completion:
    text = TOK.decode(tokens, skip_special_tokens=True)
    return Completion(token_ids=tokens, logps=[logp] + [0.0] * (len(tokens) - 1), finish_reason="stop",
                      text=text.rstrip("\n"), stop_reason="\n")


def _three_child_tree(Q, P, N, n_parent) -> Tree:
    tree = Tree(Problem(0, [PROMPT0], "Q0:", "Q0:", {}))
    for j in range(3):
        c = tree.add(0, _completion([STEP0 + j, NL]), f"s{j}.\n")
        c.prior, c.N, c.W = P[j], N[j], Q[j] * N[j]
    tree.nodes[0].N = n_parent
    return tree


# --------------------------------------------------------------------------- PUCT / UCT / priors


def test_puct_hand_computed_and_selected():
    # Q = [0.5, 0.2, 0.0], P = [0.5, 0.3, 0.2], N = [3, 1, 0], N_parent = 4, c_puct = 1.25; sqrt(4) = 2:
    #   c0: 0.5 + 1.25 * 0.5 * 2 / (1 + 3) = 0.5 + 0.3125 = 0.8125
    #   c1: 0.2 + 1.25 * 0.3 * 2 / (1 + 1) = 0.2 + 0.375  = 0.575
    #   c2: 0.0 + 1.25 * 0.2 * 2 / (1 + 0) = 0.0 + 0.5    = 0.5     -> c0 is selected
    Q, P, N = [0.5, 0.2, 0.0], [0.5, 0.3, 0.2], [3, 1, 0]
    assert [puct(q, p, 4, n, 1.25) for q, p, n in zip(Q, P, N)] == pytest.approx([0.8125, 0.575, 0.5])
    mcts = MCTS(tokenizer=TOK)  # defaults: puct, c_puct = 1.25
    tree = _three_child_tree(Q, P, N, 4)
    assert [mcts.child_score(tree.nodes[0], tree.nodes[c]) for c in (1, 2, 3)] == pytest.approx([0.8125, 0.575, 0.5])
    assert tree.select(mcts.child_score) == 1  # node 1 is child c0
    # with the priors reversed, P = [0.2, 0.3, 0.5]:
    #   c0: 0.5 + 1.25 * 0.2 * 2 / 4 = 0.625; c1: 0.575; c2: 0.0 + 1.25 * 0.5 * 2 / 1 = 1.25 -> c2
    tree = _three_child_tree(Q, [0.2, 0.3, 0.5], N, 4)
    assert [mcts.child_score(tree.nodes[0], tree.nodes[c]) for c in (1, 2, 3)] == pytest.approx([0.625, 0.575, 1.25])
    assert tree.select(mcts.child_score) == 3


def test_uct_hand_computed_and_selected():
    # UCT, c = 2, N_parent = 4 (ln 4 = 1.386294):
    #   c0: 0.5 + 2 * sqrt(1.386294 / 3) = 0.5 + 2 * 0.679778 = 1.859556
    #   c1: 0.2 + 2 * sqrt(1.386294 / 1) = 0.2 + 2 * 1.177410 = 2.554820
    #   c2: N = 0 -> inf (an unvisited child first)                      -> c2
    assert uct(0.5, 4, 3, 2.0) == pytest.approx(1.859556, abs=1e-6)
    assert uct(0.2, 4, 1, 2.0) == pytest.approx(2.554820, abs=1e-6)
    assert uct(0.0, 4, 0, 2.0) == math.inf
    mcts = MCTS(tokenizer=TOK, rule="uct")
    assert tree_select(mcts, [0.5, 0.2, 0.0], [3, 1, 0]) == 3
    # all visited, N = [3, 1, 1]: c2 = 0.0 + 2.354820 = 2.354820 < c1 = 2.554820 -> c1
    assert tree_select(mcts, [0.5, 0.2, 0.0], [3, 1, 1]) == 2


def tree_select(mcts: MCTS, Q, N) -> int:
    return _three_child_tree(Q, [1 / 3] * 3, N, sum(N) + 1).select(mcts.child_score)


def test_normalized_priors_hand_checked():
    # exp(mean log-prob), normalized: log-probs of probabilities 0.5, 0.25, 0.25 give them back
    assert normalized_priors([math.log(0.5), math.log(0.25), math.log(0.25)]) == pytest.approx([0.5, 0.25, 0.25])
    # [-1, -2]: e^-1 / (e^-1 + e^-2) = 1 / (1 + e^-1) = 0.731059
    assert normalized_priors([-1.0, -2.0]) == pytest.approx([0.731059, 0.268941], abs=1e-6)
    # shift-invariant and stable for very negative log-probs
    assert normalized_priors([-1000.0, -1001.0]) == pytest.approx([0.731059, 0.268941], abs=1e-6)
    assert normalized_priors([]) == []
    assert normalized_priors([-3.0]) == [1.0]


# --------------------------------------------------------------------------- back-up, terminal, exhausted


def test_backup_adds_visits_and_value_along_the_path():
    tree = Tree(Problem(0, [PROMPT0], "Q0:", "Q0:", {}))
    a = tree.add(0, _completion([STEP0, NL]), "s0.\n")
    b = tree.add(0, _completion([STEP0 + 1, NL]), "s1.\n")
    c = tree.add(a.id, _completion([STEP0 + 2, NL]), "s2.\n")
    tree.backup(c.id, 0.6)  # root, a, c: N 1, W 0.6
    tree.backup(a.id, 0.2)  # root, a: N 2, W 0.8
    tree.backup(b.id, 1.0)  # root, b
    got = {n.id: (n.N, n.W) for n in tree.nodes}
    assert got[0] == (3, pytest.approx(1.8))
    assert got[a.id] == (2, pytest.approx(0.8))
    assert got[b.id] == (1, pytest.approx(1.0))
    assert got[c.id] == (1, pytest.approx(0.6))
    assert tree.nodes[0].Q == pytest.approx(0.6) and tree.nodes[a.id].Q == pytest.approx(0.4)
    assert [n.id for n in tree.path(c.id)] == [0, a.id, c.id]
    assert tree.response_ids(c.id) == [STEP0, NL, STEP0 + 2, NL]
    assert Node(9, None, 0, [], "").Q == 0.0  # unvisited


def test_terminal_never_selected_and_exhaustion_propagates():
    mcts = MCTS(tokenizer=TOK)
    # the best-scored child (c0, PUCT 0.8125) is terminal: the next best (c1) is taken
    tree = _three_child_tree([0.5, 0.2, 0.0], [0.5, 0.3, 0.2], [3, 1, 0], 4)
    tree.nodes[1].terminal = True
    assert tree.select(mcts.child_score) == 2
    # c1 expanded with only terminal children: it becomes exhausted, and c2 is taken
    for j in range(2):
        k = tree.add(2, _completion([STEP0 + j, NL]), f"s{j}.\n")
        k.terminal = True
    assert tree.select(mcts.child_score) == 3
    assert tree.nodes[2].exhausted and not tree.nodes[0].exhausted
    # the last live child terminal too: the root is exhausted, select returns None (the tree is done)
    tree.nodes[3].terminal = True
    assert tree.select(mcts.child_score) is None
    assert tree.nodes[0].exhausted
    assert tree.select(mcts.child_score) is None


def test_terminal_nodes_are_never_expanded_in_a_search():
    _, [res] = _run("mcts", toy_problems(1, first=5), Budget(max_simulations=60))
    parents = {n["parent"] for n in res.tree}
    terminals = [n for n in res.tree if n["terminal"]]
    assert terminals
    for n in terminals:
        assert n["id"] not in parents  # never expanded
        assert n["visits"] == 1  # its own back-up only: never selected again
        assert n["answer"] is not None


def test_small_tree_is_searched_to_exhaustion():
    # depth 2, branching 2: 4 leaves; the search stops by itself when the root is exhausted
    eng = FakeTreeEngine(lambda i: random_tree(i, depth=2, branching=2), TOK)
    [res] = make_strategy("mcts", TOK, max_new_tokens=MAX_NEW).search(
        eng, TASK, toy_problems(1), budget=Budget(max_simulations=1000), scorer=ExactVerifier(eng.trees))
    assert len(res.candidates) == 4
    assert sum(n["terminal"] for n in res.tree) == 4 and len(res.tree) == 7
    assert eng.calls < 20


@pytest.mark.parametrize("name,opts", [
    ("mcts", {"max_depth": 2}), ("step_beam", {"max_depth": 2}), ("mcts", {"rule": "uct"}), ("mcts", {"prior": "raw"}),
    ("mcts", {"answer": "visits"}), ("mcts", {"answer": "weighted_vote"}), ("mcts", {"answer": "top_k_vote", "top_k": 2}),
    ("mcts", {"answer": "visits", "leaf_eval": "rollout", "rollouts": 2}), ("step_beam", {"select": "weighted_vote"}),
])
def test_tree_search_variants_run_and_count_tokens(name, opts):
    eng = trap_engine()
    results = make_strategy(name, TOK, max_new_tokens=MAX_NEW, **opts).search(
        eng, TASK, toy_problems(6), budget=Budget(max_generated_tokens=120), scorer=NoisyVerifier(eng.trees))
    assert sum(r.cost.generated_tokens for r in results) == eng.tokens_generated
    for r in results:
        assert r.error is None and r.answer is not None and r.chosen in r.candidates
        if opts.get("max_depth") == 2:  # the step that reaches max_depth runs to the end
            assert all(c.meta["depth"] <= 2 and c.answer is not None for c in r.candidates)
            if r.tree is not None:
                assert max(n["depth"] for n in r.tree) <= 2


# --------------------------------------------------------------------------- token accounting


@pytest.mark.parametrize("setup", list(SETUPS))
def test_generated_tokens_match_the_engine(setup):
    problems = toy_problems(6)
    engine, results = _run(setup, problems, Budget(max_generated_tokens=100))
    assert sum(r.cost.generated_tokens for r in results) == engine.tokens_generated > 0
    for r in results:
        assert r.error is None
        assert 1 <= r.cost.engine_calls <= engine.calls
        assert r.cost.prompt_tokens >= 1
        assert r.candidates


def test_continue_prefixes_dedups_within_an_owner_and_charges_each_owner_its_own():
    eng = trap_engine()
    p0, p1 = [PROMPT0], [PROMPT0 + 1]
    c0, c1, c2 = Cost(), Cost(), Cost()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=MAX_NEW)
    out = continue_prefixes(eng, [p0, p1, p0, p0], params, [c0, c1, c2, c0], seeds=[5, 6, 7, 8])
    # c0's two p0 requests are one; c2's p0 is its own request (its own seed), not c0's samples
    assert eng.calls == 1 and eng.prompts_seen == 3
    assert len(out) == 4 and all(len(x) == 3 for x in out)
    assert out[0] is out[3] and out[2] is not out[0]
    # every owner is charged one engine call and its own prefixes' tokens
    assert (c0.engine_calls, c1.engine_calls, c2.engine_calls) == (1, 1, 1)
    for c, o in ((c0, out[0]), (c1, out[1]), (c2, out[2])):
        assert c.generated_tokens == sum(len(x.token_ids) for x in o) and c.prompt_tokens == 1
    assert c0.generated_tokens + c1.generated_tokens + c2.generated_tokens == eng.tokens_generated
    # a duplicate uses the seed of its first occurrence: the same as p0 alone with seed 5; c2's, seed 7's
    alone = continue_prefixes(trap_engine(), [p0], params, seeds=[5])[0]
    assert [c.token_ids for c in alone] == [c.token_ids for c in out[0]]
    assert [c.token_ids for c in continue_prefixes(trap_engine(), [p0], params, seeds=[7])[0]] == \
        [c.token_ids for c in out[2]]
    # one Cost for the whole call
    c = Cost()
    eng2 = trap_engine()
    continue_prefixes(eng2, [p0, p0, p1], params, c)
    assert (c.engine_calls, c.generated_tokens, c.prompt_tokens) == (1, eng2.tokens_generated, 2)
    assert continue_prefixes(eng2, [], params, c) == [] and eng2.calls == 1


def test_continue_prefixes_length_mismatch_raises():
    eng = trap_engine()
    params = SamplingParams(n=1, max_new_tokens=8)
    with pytest.raises(ValueError, match="seeds"):
        continue_prefixes(eng, [[PROMPT0], [PROMPT0 + 1]], params, seeds=[1])
    with pytest.raises(ValueError, match="costs"):
        continue_prefixes(eng, [[PROMPT0], [PROMPT0 + 1]], params, [Cost()])
    assert eng.calls == 0


# --------------------------------------------------------------------------- distinct expansions


def test_distinct_expansion_of_a_single_child_node():
    # every node has one child: all width draws are the same step
    width = 4
    for distinct, attempts in ((True, 2), (False, 1)):
        eng = FakeTreeEngine(lambda i: random_tree(i, depth=4, branching=1), TOK)
        [res] = make_strategy("mcts", TOK, max_new_tokens=MAX_NEW, width=width, distinct=distinct).search(
            eng, TASK, toy_problems(1), budget=Budget(max_simulations=1), scorer=ExactVerifier(eng.trees))
        expansions = [(p, n) for p, n in eng.call_log if n == width]  # (the finishing rollout has n = 1)
        # distinct: the first attempt finds the one child, the second finds nothing new and the
        # leaf stops there (at most 3 attempts, 3 * width draws); merged: exactly one attempt
        assert expansions == [(1, width)] * attempts
        assert sum(p * n for p, n in expansions) <= 3 * width
        assert [n["parent"] for n in res.tree] == [None, 0]  # the root got exactly one child


class _OneNewStepEngine:
    """Each call returns n copies of one step, a new one per call: every attempt finds exactly one
    new child, so only the 3-attempt cap stops the resampling."""

    def __init__(self):
        self.call_log: list[tuple[int, int]] = []

    def generate(self, prompts, params, *, seeds=None):
        k = len(self.call_log)
        self.call_log.append((len(prompts), params.n))
        return [[_completion([STEP0 + k, NL]) for _ in range(params.n)] for _ in prompts]


class _ConstScorer:
    needs_reference = False

    def score(self, problems, steps, extra_infos=None):
        return [[0.5] for _ in problems]


def test_distinct_resampling_stops_after_three_attempts():
    eng = _OneNewStepEngine()
    [res] = MCTS(tokenizer=TOK, width=4, max_new_tokens=MAX_NEW).search(
        eng, TASK, toy_problems(1), budget=Budget(max_simulations=1), scorer=_ConstScorer())
    expansions = eng.call_log[:3]
    assert expansions == [(1, 4)] * 3  # 3 attempts of width draws = 3 * width, then it stops
    assert [n["text"] for n in res.tree[1:]] == ["s0.\n", "s1.\n", "s2.\n"]  # 3 distinct children < width
    assert len(eng.call_log) == 4 and eng.call_log[3] == (1, 1)  # then only the finishing rollout


# --------------------------------------------------------------------------- determinism, batch independence


def _key(r):
    cost = dataclasses.asdict(r.cost)
    cost.pop("wall_s")
    return (r.answer, r.error, cost, r.tree, [(c.token_ids, c.answer, c.score) for c in r.candidates])


@pytest.mark.parametrize("setup", ["mcts", "step_beam", "best_of_n", "mcts_rollout"])
def test_same_results_alone_batched_and_shuffled(setup):
    problems = toy_problems(6, first=10)
    budget = Budget(max_generated_tokens=100)

    def run(ps, seed=3):
        _, rs = _run(setup, ps, budget, seed=seed)
        return {p.id: _key(r) for p, r in zip(ps, rs)}

    batched = run(problems)
    alone = {}
    for p in problems:
        alone.update(run([p]))
    shuffled = list(problems)
    random.Random(1).shuffle(shuffled)
    assert alone == batched
    assert run(shuffled) == batched
    assert run(problems) == batched  # same seed, same trees and answers
    if setup.startswith("mcts"):
        assert all(k[3] is not None and len(k[3]) > 1 for k in batched.values())
    other = run(problems, seed=4)
    assert [k[4] for k in other.values()] != [k[4] for k in batched.values()]  # another seed, other samples


# --------------------------------------------------------------------------- lockstep


def test_mcts_lockstep_engine_calls():
    S = 6
    problems = toy_problems(16)

    def calls(ps, distinct):
        eng = trap_engine()
        MCTS(tokenizer=TOK, distinct=distinct, max_new_tokens=MAX_NEW).search(
            eng, TASK, ps, budget=Budget(max_simulations=S), scorer=NoisyVerifier(eng.trees))
        return eng.calls

    # merged duplicates: one call per round (+ at most one finishing rollout), whatever the batch
    batch = calls(problems, False)
    singles = [calls([p], False) for p in problems]
    assert batch == max(singles)
    assert S <= batch <= S + 1
    # distinct: up to 3 attempts per round (+ the finishing rollout), far fewer than 16 separate searches
    batch = calls(problems, True)
    singles = [calls([p], True) for p in problems]
    assert max(singles) <= batch <= 3 * S + 1
    assert batch * 4 < sum(singles)


def test_majority_lockstep_engine_calls():
    eng = trap_engine()
    results = make_strategy("majority", TOK, max_new_tokens=MAX_NEW, round_size=4).search(
        eng, TASK, toy_problems(16), budget=Budget(max_samples=8))
    assert eng.calls == 2 and eng.call_log == [(16, 4), (16, 4)]
    assert all(len(r.candidates) == 8 and r.cost.engine_calls == 2 for r in results)
    # a sample cap that is not a multiple of the round: the last round is smaller
    eng = trap_engine()
    results = make_strategy("majority", TOK, max_new_tokens=MAX_NEW, round_size=4).search(
        eng, TASK, toy_problems(16), budget=Budget(max_samples=6))
    assert eng.call_log == [(16, 4), (16, 2)]
    assert all(len(r.candidates) == 6 for r in results)


# --------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("B", [20, 50, 120])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_generated_tokens_within_budget_plus_one_round(setup, B):
    _, results = _run(setup, toy_problems(8), Budget(max_generated_tokens=B))
    bound = B + _round_max(setup)
    for r in results:
        assert r.error is None
        if setup == "cot":  # one sample whatever the budget
            assert 1 <= r.cost.generated_tokens <= MAX_NEW and len(r.candidates) == 1
            continue
        assert r.cost.generated_tokens <= bound, (r.cost, bound)
        if setup in ("majority", "best_of_n", "weighted_majority"):
            assert r.cost.generated_tokens >= 0.5 * B  # the budget is actually used


def test_sample_cap_and_simulation_budgets():
    _, results = _run("best_of_n", toy_problems(4), Budget(max_samples=5))
    assert all(len(r.candidates) == 5 for r in results)
    # whichever limit is reached first stops the problem
    _, results = _run("majority", toy_problems(4), Budget(max_samples=100, max_generated_tokens=30))
    assert all(len(r.candidates) == 4 for r in results)  # one round of 4 crosses 30 tokens
    eng, results = _run("mcts", toy_problems(4), Budget(max_simulations=3), distinct=False)
    assert eng.calls <= 4  # 3 rounds, plus at most one finishing rollout


# --------------------------------------------------------------------------- the gold-answer guard


@pytest.mark.parametrize("name", ["mcts", "best_of_n", "step_beam", "weighted_majority"])
def test_rule_scorer_on_a_reference_reward_needs_allow_reference(name):
    scorer = TaskRuleScorer(TASK)
    assert TASK.reward_needs_reference
    with pytest.raises(ValueError, match="allow_reference"):
        make_strategy(name, TOK, max_new_tokens=MAX_NEW).search(trap_engine(), TASK, toy_problems(2),
                                                                 budget=Budget(max_generated_tokens=40), scorer=scorer)
    results = make_strategy(name, TOK, max_new_tokens=MAX_NEW, allow_reference=True).search(
        trap_engine(), TASK, toy_problems(2), budget=Budget(max_generated_tokens=40), scorer=scorer)
    assert all(r.error is None and r.candidates for r in results)
    # a task whose reward does not read the gold answer is accepted as it is
    free = dataclasses.replace(TASK, reward_needs_reference=False)
    results = make_strategy(name, TOK, max_new_tokens=MAX_NEW).search(
        trap_engine(), free, toy_problems(2), budget=Budget(max_generated_tokens=40), scorer=TaskRuleScorer(free))
    assert all(r.error is None and r.candidates for r in results)
    # a rule-scored best terminal is correct whenever a correct candidate was reached
    for r in results:
        if any(c.answer == "A0" for c in r.candidates) and name != "weighted_majority":
            assert r.answer == "A0"


# --------------------------------------------------------------------------- errors


def test_unknown_strategy_and_options():
    with pytest.raises(ValueError) as e:
        make_strategy("nope", TOK)
    for name in STRATEGIES:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="mcts"):
        make_strategy("mcts", TOK, no_such_option=1)
    with pytest.raises(ValueError, match="rule"):
        make_strategy("mcts", TOK, rule="nope")
    with pytest.raises(ValueError, match="scorer"):
        make_strategy("best_of_n", TOK).search(trap_engine(), TASK, toy_problems(1), budget=Budget(max_samples=2))


@pytest.mark.parametrize("kwargs", [{"max_generated_tokens": 0}, {"max_generated_tokens": -5}, {"max_samples": 0},
                                    {"max_simulations": -1}, {"max_samples": 2.5}, {"max_samples": True}, {}])
def test_bad_budgets_raise(kwargs):
    with pytest.raises(ValueError, match="budget"):
        Budget(**kwargs)


@pytest.mark.parametrize("name", ["mcts", "step_beam"])
def test_tree_search_needs_an_answer_marker(name):
    task = dataclasses.replace(TASK, answer_marker=None)
    with pytest.raises(ValueError, match="search.answer_marker"):
        make_strategy(name, TOK).search(trap_engine(), task, toy_problems(1), budget=Budget(max_simulations=2),
                                        scorer=_ConstScorer())
    # the strategy's own answer_marker overrides the task's
    results = make_strategy(name, TOK, answer_marker="####", max_new_tokens=MAX_NEW).search(
        trap_engine(), task, toy_problems(1), budget=Budget(max_simulations=2), scorer=_ConstScorer())
    assert results[0].error is None


class _RaisesOnQ3:
    """A scorer that fails on problem 3's solutions only."""

    needs_reference = False

    def __init__(self, inner):
        self.inner = inner

    def score(self, problems, steps, extra_infos=None):
        if "Q3:" in problems:
            raise RuntimeError("boom on Q3")
        return self.inner.score(problems, steps, extra_infos)


@pytest.mark.parametrize("setup", ["best_of_n", "mcts", "mcts_rollout", "step_beam"])
def test_a_failing_scorer_marks_only_its_problem(setup):
    problems = toy_problems(6)
    budget = Budget(max_generated_tokens=60)
    engine = trap_engine()
    strat = _strategy(setup)
    results = strat.search(engine, TASK, problems, budget=budget, scorer=_RaisesOnQ3(SETUPS[setup][1](engine.trees)))
    assert [r.error is not None for r in results] == [p.question == "Q3:" for p in problems]
    assert "boom on Q3" in results[3].error and results[3].answer is None
    # the others are as if problem 3 were not there
    others = [p for p in problems if p.id != 3]
    _, clean = _run(setup, others, budget)
    assert [_key(r) for r in clean] == [_key(r) for i, r in enumerate(results) if i != 3]


# --------------------------------------------------------------------------- the serialised tree


def test_tree_serializes_with_a_chosen_chain():
    _, results = _run("mcts", toy_problems(4), Budget(max_generated_tokens=150))
    for r in results:
        json.loads(json.dumps(r.tree))
        assert r.tree[0]["id"] == 0 and r.tree[0]["parent"] is None
        ids = [n["id"] for n in r.tree]
        assert ids == list(range(len(ids)))
        by_id = {n["id"]: n for n in r.tree}
        for n in r.tree[1:]:
            assert 0 <= n["parent"] < n["id"]
            assert n["depth"] == by_id[n["parent"]]["depth"] + 1
        chosen = [n for n in r.tree if n["chosen"]]
        assert r.chosen is not None and chosen
        # the chosen nodes are exactly the path from the root to the chosen candidate's node
        end = max(chosen, key=lambda n: n["depth"])
        chain, v = [], end["id"]
        while v is not None:
            chain.append(v)
            v = by_id[v]["parent"]
        assert sorted(chain) == sorted(n["id"] for n in chosen)
        assert end["id"] == r.chosen.meta["node"]
        assert [n["depth"] for n in sorted(chosen, key=lambda n: n["depth"])] == list(range(len(chosen)))
        # the chosen candidate's ids are the steps along that chain
        assert TOK.decode(r.chosen.token_ids, skip_special_tokens=True).startswith(
            "".join(by_id[v]["text"] for v in reversed(chain)))


# --------------------------------------------------------------------------- selection and aggregation


def _cands(answers, scores):
    return [Candidate(token_ids=[], text="", answer=a, score=s) for a, s in zip(answers, scores)]


def test_select_candidate_hand_checked():
    answers = ["5", "7", "5", None, "7", "7"]
    scores = [0.3, 0.2, 0.9, 1.0, 0.4, 0.1]
    cands = _cands(answers, scores)
    assert select_candidate(cands, "first") == 0
    # vote: "7" has 3 votes (1, 4, 5), "5" 2, None does not vote -> the first "7"
    assert select_candidate(cands, "vote") == 1
    # argmax: the highest score, whatever the answer
    assert select_candidate(cands, "argmax") == 3
    # weighted_vote: "5" = 0.3 + 0.9 = 1.2 > "7" = 0.2 + 0.4 + 0.1 = 0.7 -> the best-scored "5"
    assert select_candidate(cands, "weighted_vote") == 2
    # a task equivalence merges "5" and "5.0": "7" (2 votes) then ties with "5" (2), and the tie
    # goes to the answer seen first
    eq = lambda a, b: float(a) == float(b)  # noqa: E731
    c2 = _cands(["5", "7", "5.0", "7"], [0.1, 0.1, 0.1, 0.1])
    assert select_candidate(c2, "vote") == 1
    assert select_candidate(c2, "vote", eq) == 0
    c3 = _cands(["7", "5", "5.0"], [0.1, 0.1, 0.1])
    assert select_candidate(c3, "vote") == 0 and select_candidate(c3, "vote", eq) == 1
    assert select_candidate([], "argmax") is None
    assert select_candidate(_cands([None, None], [None, None]), "vote") is None
    assert select_candidate(_cands(["1", "2"], [None, None]), "argmax") is None
    with pytest.raises(ValueError, match="argmax"):
        select_candidate(cands, "nope")


def test_aggregate_step_scores_hand_checked():
    xs = [0.9, 0.5, 0.8]
    assert aggregate_step_scores(xs, "last") == 0.8
    assert aggregate_step_scores(xs) == 0.8
    assert aggregate_step_scores(xs, "min") == 0.5
    assert aggregate_step_scores(xs, "prod") == pytest.approx(0.36)
    assert aggregate_step_scores(xs, "mean") == pytest.approx(2.2 / 3)
    for how in ("last", "min", "prod", "mean"):
        assert aggregate_step_scores([], how) == 0.0
        assert aggregate_step_scores([0.25], how) == 0.25
    with pytest.raises(ValueError, match="last"):
        aggregate_step_scores(xs, "max")
