"""VinePPO's Monte-Carlo step values on the model-free tree engine, and the step advantages by hand."""

from __future__ import annotations

import math

import pytest
import torch

from relign.algorithms.advantages import step_to_token_advantages, vine_step_advantages, vine_step_values
from relign.rollout.engine import SamplingParams
from relign.rollout.vine import AdaptiveK, VineEpisode, mc_step_values

from ..strategies.fake_tree_engine import (
    CORRECT_TEXT, NL, STRADDLE, FakeTokenizer, FakeTreeEngine, TreeBank, random_tree, step_token, toy_reward,
)

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=64)


def _score(prompts, responses, infos, completion_ids):
    return [toy_reward(p, r, i) for p, r, i in zip(prompts, responses, infos)]


def _episode(tree, path) -> VineEpisode:
    return VineEpisode([tree.prefix_ids()[0]], tree.response_ids(path), f"Q{tree.problem}:", {"answer": CORRECT_TEXT})


# --------------------------------------------------------------------------- the arithmetic (spec §7.4)


def test_step_advantages_by_hand():
    # V = [0.5, 0.25, 0.6] and V_3 = 0, r = [0, 0, 1]:
    # A_0 = 0 + 0.25 - 0.5 = -0.25;  A_1 = 0 + 0.6 - 0.25 = 0.35;  A_2 = 1 + 0 - 0.6 = 0.4
    r = [0.0, 0.0, 1.0]
    V = vine_step_values([0.5, 0.25, 0.6], r)
    assert V == [0.5, 0.25, 0.6, 0.0]
    assert vine_step_advantages(V, r) == pytest.approx([-0.25, 0.35, 0.4])
    # max_steps = 1: V_2 is not estimated and is backfilled to r_2 + V_3 = 1.0, so
    # A_1 = 0 + 1.0 - 0.25 = 0.75 and A_2 = 1 + 0 - 1.0 = 0.0
    V = vine_step_values([0.5, 0.25, None], r)
    assert V == [0.5, 0.25, 1.0, 0.0]
    assert vine_step_advantages(V, r) == pytest.approx([-0.25, 0.75, 0.0])


def test_each_token_gets_its_steps_advantage_and_a_straddling_token_closes_its_step():
    tok = FakeTokenizer()
    # step 1 = [s0, ".\n\n"] (the straddling token ends it), step 2 = [s1, NL], step 3 = [s2]
    ids = [step_token(0), STRADDLE, step_token(1), NL, step_token(2)]
    from relign.rollout.steps import step_ends

    ends = step_ends(ids, tok, "\n")
    assert ends == [2, 4, 5]
    out = step_to_token_advantages([-0.25, 0.35, 0.4], ends, len(ids))
    assert torch.allclose(out, torch.tensor([-0.25, -0.25, 0.35, 0.35, 0.4]))
    with pytest.raises(ValueError):
        step_to_token_advantages([0.1], [2, 4], 4)


# --------------------------------------------------------------------------- Monte-Carlo values


def test_estimates_are_unbiased_for_every_state_of_a_tree():
    """K = 400 continuations from every state of a depth-3 tree: each estimate lies within
    3 standard errors of the state's true value (every leaf's path covers every state)."""
    bank = TreeBank({0: random_tree(0, seed=3, depth=3, branching=3)})
    tree = bank(0)
    engine = FakeTreeEngine(bank)
    episodes = [_episode(tree, leaf) for leaf in tree.leaves()]
    values, stats = mc_step_values(engine, FakeTokenizer(), episodes, score=_score, params=PARAMS, k=400, seed=0)
    checked = 0
    for leaf, v in zip(tree.leaves(), values):
        assert len(v.ends) == 3 and v.offset == 1
        for d, est in enumerate(v.mc):
            truth = tree.p_correct(leaf[:d])
            assert abs(est - truth) <= 3 * math.sqrt(truth * (1 - truth) / 400) + 1e-9, (leaf[:d], est, truth)
            checked += 1
    assert checked == 27 * 3
    assert stats["vine/unique_states"] == 1 + 3 + 9  # the 13 internal nodes, each sent once
    # one call per remaining budget: the states at depth 0, 1 and 2 hold 0, 2 and 4 response tokens
    assert engine.calls == 3 and stats["vine/engine_calls"] == 3


def test_identical_states_are_sent_once():
    """8 samples of one prompt share s_0: it is estimated once (counted in engine prompts)."""
    bank = TreeBank({0: random_tree(0, seed=1, depth=2, branching=2)})
    tree = bank(0)
    paths = [tree.leaves()[i % len(tree.leaves())] for i in range(8)]
    out = {}
    for dedup, want in ((True, 1 + 2), (False, 8 * 2)):
        engine = FakeTreeEngine(bank)
        values, stats = mc_step_values(engine, FakeTokenizer(), [_episode(tree, p) for p in paths], score=_score,
                                       params=PARAMS, k=3, dedup=dedup)
        assert stats["vine/states"] == 16 and stats["vine/unique_states"] == want
        assert engine.calls == 2 and engine.prompts_seen == want  # s_0 and s_1 hold different budgets
        assert engine.tokens_generated == stats["vine/mc_tokens"]
        out[dedup] = values
    # de-duplicated, the same state always gets the same estimate (seeds come from its tokens); without
    # de-duplication its first copy gets that same estimate (tests/rollout/test_vine_budget.py: the others
    # are independent samples)
    assert len({tuple(v.mc) for v, p in zip(out[True], paths) if p == paths[0]}) == 1
    # (paths 0 .. 3 are the 4 leaves: s_0 is first sent for path 0, s_1 under branch 0 for path 0, under branch 1 for path 2)
    assert out[False][0].mc == out[True][0].mc and out[False][2].mc[1] == out[True][2].mc[1]


def test_max_steps_leaves_the_tail_unestimated():
    bank = TreeBank({0: random_tree(0, seed=2, depth=4, branching=2)})
    tree = bank(0)
    values, stats = mc_step_values(FakeTreeEngine(bank), FakeTokenizer(), [_episode(tree, tree.leaves()[0])], score=_score,
                                   params=PARAMS, k=2, max_steps=1)
    assert len(values[0].mc) == 4 and values[0].mc[2:] == [None, None] and None not in values[0].mc[:2]
    assert stats["vine/states"] == 2


def test_adaptive_k_stops_at_10_when_certain_and_at_30_when_not():
    k = AdaptiveK()
    assert k.more(0.0, 10) == 0 and k.more(1.0, 10) == 0  # a zero-width interval: stop at 10
    assert k.more(0.5, 10) == 4 and k.more(0.5, 26) == 4 and k.more(0.5, 30) == 0
    bank = TreeBank({0: random_tree(0, seed=1, depth=1, branching=2)})
    tree = bank(0)
    for score, want in ((lambda p, r, i, ids: [1.0] * len(r), 10),
                        (lambda p, r, i, ids: [float(n % 2) for n in range(len(r))], 30)):
        engine = FakeTreeEngine(bank)
        values, stats = mc_step_values(engine, FakeTokenizer(), [_episode(tree, tree.leaves()[0])], score=score,
                                       params=PARAMS, adaptive=k)
        assert sum(n * prompts for prompts, n in engine.call_log) == want  # continuations of the one state


def test_vine_estimator_wiring_by_hand():
    """The recipe's estimator: row 0 has 3 steps (V̂ = 0.5, 0.25, 0.6; reward 1) after a 2-token
    prompt, row 1 one step (V̂ = 0.5; reward 0); token advantages before whitening are
    [-0.25, -0.25, 0.35, 0.4] and [-0.5, -0.5], then whitened over the 6 response tokens."""
    from relign.algorithms.advantages import masked_whiten
    from relign.recipes.rl_advantages import ESTIMATORS, AdvantageOptions, Rewards
    from relign.rollout.vine import StepValues

    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]], dtype=torch.float32)
    values = [StepValues(2, [2, 3, 4], [0.5, 0.25, 0.6]), StepValues(4, [2], [0.5])]
    seq = torch.tensor([1.0, 0.0])
    r = Rewards(seq=seq, token=torch.zeros(2, 6), terms=seq[:, None], term_weights=torch.ones(1))
    est = ESTIMATORS["vine"]
    assert est.values == "monte_carlo" and not est.compares_samples
    a, returns = est.fn(r, mask, values, AdvantageOptions(group_size=1))
    raw = torch.tensor([[0, 0, -0.25, -0.25, 0.35, 0.4], [0, 0, 0, 0, -0.5, -0.5]])
    assert returns is None and torch.allclose(a, masked_whiten(raw, mask) * mask, atol=1e-6)
    assert torch.all(a[mask == 0] == 0)
