"""The fake tree engine: the trap tree's statistics, exact log-probs, the Completion contract,
per-prompt seeds, malformed prefixes, counters, and the toy scorers / task."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from relign.rollout.engine import Engine, SamplingParams
from relign.envs.tasks import Problem

from .fake_tree_engine import (
    ANS0,
    CORRECT,
    EOS,
    HASH,
    NL,
    PROMPT0,
    STEP0,
    STRADDLE,
    WRONG,
    ExactVerifier,
    FakeTokenizer,
    FakeTreeEngine,
    NoisyVerifier,
    OracleValue,
    TreeBank,
    fake_task,
    random_tree,
    temper,
    toy_answer,
    toy_problems,
    trap_engine,
    trap_tree,
    trap_trees,
)


def _answer_of(c) -> int:
    return int(c.text.rsplit("#### A", 1)[1])


def test_trap_tree_overall_probabilities():
    trees = [trap_tree(i, seed=0) for i in range(400)]
    pc = [t.p_correct() for t in trees]
    pw = [t.p_answer((), WRONG) for t in trees]
    for vals, target in ((pc, 0.28), (pw, 0.54)):
        se = statistics.stdev(vals) / math.sqrt(len(vals))
        assert abs(statistics.mean(vals) - target) <= 3 * se + 1e-3
    t = trees[0]
    assert t.probs(()) == pytest.approx([0.6, 0.25, 0.15])
    # the systematic answer only lives under root child 0; scattered ones only under 1 and 2
    assert {t.leaf_answer(p) for p in t.leaves() if p[0] == 0} <= {CORRECT, WRONG}
    assert WRONG not in {t.leaf_answer(p) for p in t.leaves() if p[0] != 0}
    assert all(2 <= t.leaf_answer(p) < 52 for p in t.leaves() if t.leaf_answer(p) not in (CORRECT, WRONG))
    # p_correct is the recursion over children, and answer_probs sums to 1
    for path in [(), (1,), (2, 0, 1)]:
        assert t.p_correct(path) == pytest.approx(sum(q * t.p_correct(path + (j,)) for j, q in enumerate(t.probs(path))))
    assert sum(t.answer_probs(()).values()) == pytest.approx(1.0)
    assert t.answer_probs((), 0.5)[CORRECT] == pytest.approx(t.p_correct((), 0.5))
    # same seed, same tree; another seed, another tree
    assert trap_tree(7).probs((1, 2)) == trap_tree(7).probs((1, 2))
    assert trap_tree(7).probs((1, 2)) != trap_tree(7, seed=1).probs((1, 2))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("path", [(), (1, 0)])
def test_sampled_answer_frequency_matches_p_correct(path, temperature):
    tree = trap_tree(3)
    eng = FakeTreeEngine({3: tree}, FakeTokenizer(), seed=0)
    n = 3000
    [comps] = eng.generate([tree.prefix_ids(path)], SamplingParams(n=n, temperature=temperature), seeds=[11])
    freq = sum(_answer_of(c) == CORRECT for c in comps) / n
    p = tree.p_correct(path, temperature)
    assert abs(freq - p) <= 3 * math.sqrt(p * (1 - p) / n) + 1e-9
    # every completion is a legal continuation that reaches a leaf
    for c in comps[:50]:
        leaf = tree.parse(tree.response_ids(path)[:] + c.token_ids)
        assert tree.is_leaf(leaf) and tree.leaf_answer(leaf) == _answer_of(c)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_logps_are_exact(temperature):
    tree = trap_tree(5)
    eng = FakeTreeEngine({5: tree})
    start = (2,)
    [comps] = eng.generate([tree.prefix_ids(start)], SamplingParams(n=20, temperature=temperature), seeds=[1])
    for c in comps:
        leaf = tree.parse(tree.response_ids(start) + c.token_ids)
        expect = 0.0
        for d in range(len(start), tree.depth):
            q = temper(tree.probs(leaf[:d]), temperature)
            expect += math.log(q[leaf[d]])
        assert sum(c.logps) == pytest.approx(expect, abs=1e-12)
        for tok, lp in zip(c.token_ids, c.logps):
            if tok in (NL, HASH, EOS) or tok >= ANS0:
                assert lp == 0.0
            else:
                assert lp < 0.0
        assert len(c.logps) == len(c.token_ids)


def test_greedy_follows_argmax_and_reports_t1_logps():
    tree = trap_tree(9)
    eng = FakeTreeEngine({9: tree})
    [[c1, c2]] = eng.generate([tree.prefix_ids()], SamplingParams(n=2, temperature=0.0))
    assert c1.token_ids == c2.token_ids
    path = tree.parse(c1.token_ids)
    for d in range(tree.depth):
        p = tree.probs(path[:d])
        assert path[d] == max(range(3), key=lambda j: p[j])
        assert c1.logps[2 * d] == pytest.approx(math.log(p[path[d]]))


def test_stop_newline_contract():
    tree = trap_tree(0)
    eng = FakeTreeEngine({0: tree})
    [comps] = eng.generate([tree.prefix_ids()], SamplingParams(n=8, stop=["\n"]), seeds=[0])
    for c in comps:
        assert len(c.token_ids) == 2 and c.token_ids[-1] == NL and STEP0 <= c.token_ids[0] < STEP0 + 3
        assert c.finish_reason == "stop" and c.stop_reason == "\n"
        assert c.text == f"s{c.token_ids[0] - STEP0}." and "\n" not in c.text
    # the final step has no newline: it runs to EOS
    [comps] = eng.generate([tree.prefix_ids((0, 1, 2, 0, 1))], SamplingParams(n=4, stop=["\n"]), seeds=[0])
    for c in comps:
        assert len(c.token_ids) == 4 and c.token_ids[-1] == EOS and c.stop_reason == EOS
        assert c.text.endswith(f"#### A{_answer_of(c)}") and "<eos>" not in c.text
    # a general stop string, cut from the text while its tokens stay
    [[c]] = eng.generate([tree.prefix_ids((0, 1, 2, 0, 1))], SamplingParams(stop=["####"]), seeds=[0])
    assert c.token_ids[-1] == HASH and c.text.endswith(".") and c.stop_reason == "####"
    # stop token ids
    [[c]] = eng.generate([tree.prefix_ids()], SamplingParams(stop_token_ids=[NL]), seeds=[0])
    assert c.token_ids[-1] == NL and c.stop_reason == NL and c.finish_reason == "stop" and c.text.endswith("\n")


def test_eos_contract_and_length():
    tree = trap_tree(1)
    eng = FakeTreeEngine({1: tree})
    [comps] = eng.generate([tree.prefix_ids()], SamplingParams(n=5), seeds=[2])
    for c in comps:
        assert len(c.token_ids) == 2 * 5 + 4 and c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        assert c.finish_reason == "stop" and c.stop_reason == EOS
        assert c.text == FakeTokenizer().decode(c.token_ids, skip_special_tokens=True)
        assert c.text.count("\n") == 5 and toy_answer(c.text) == f"A{_answer_of(c)}"
    [comps] = eng.generate([tree.prefix_ids()], SamplingParams(n=5, max_new_tokens=3), seeds=[2])
    for c in comps:
        assert len(c.token_ids) == 3 and c.finish_reason == "length" and c.stop_reason is None
        assert c.token_ids[1] == NL and STEP0 <= c.token_ids[2] < STEP0 + 3  # cut mid-step
    # EOS exactly at the limit is a stop, not a length
    [[c]] = eng.generate([tree.prefix_ids((0,) * 5)], SamplingParams(max_new_tokens=4), seeds=[0])
    assert c.finish_reason == "stop" and c.token_ids[-1] == EOS


def test_per_prompt_seeds_are_independent_of_the_batch():
    eng = trap_engine(engine_seed=0)
    a, b, c = [PROMPT0 + 4], [PROMPT0 + 5, STEP0 + 1, NL], [PROMPT0 + 4, STEP0, NL]
    p = SamplingParams(n=6)
    r1 = eng.generate([a, b, c], p, seeds=[10, 20, 30])
    r2 = eng.generate([c, a], p, seeds=[30, 10])
    r3 = eng.generate([a], p, seeds=[10])
    ids = lambda row: [x.token_ids for x in row]  # noqa: E731
    assert ids(r1[0]) == ids(r2[1]) == ids(r3[0])
    assert ids(r1[2]) == ids(r2[0])
    assert len({tuple(x) for x in ids(r1[0])}) > 1  # the n completions differ
    assert ids(eng.generate([a], p, seeds=[11])[0]) != ids(r3[0])
    # params.seed: reproducible; the engine's own stream: moves on, and state_dict restores it
    assert ids(eng.generate([a], SamplingParams(n=6, seed=3))[0]) == ids(eng.generate([a], SamplingParams(n=6, seed=3))[0])
    state = eng.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    x = ids(eng.generate([a], p)[0])
    y = ids(eng.generate([a], p)[0])
    assert x != y
    eng.load_state_dict(state)
    assert ids(eng.generate([a], p)[0]) == x


@pytest.mark.parametrize("bad", [
    [],
    [STEP0, NL],  # no prompt token
    [PROMPT0 + 1, STEP0],  # ends mid-step
    [PROMPT0 + 1, STEP0, HASH],  # a final step at depth 1
    [PROMPT0 + 1, NL],  # NL without a step
    [PROMPT0 + 1, STEP0 + 3, NL],  # child 3 of a 3-ary tree
    [PROMPT0 + 1, STEP0, NL, NL],
    [PROMPT0 + 1, STRADDLE],
    [PROMPT0 + 1, 10 ** 6],  # unknown id
    [PROMPT0 + 1, STEP0, NL, PROMPT0 + 1],
])
def test_malformed_prefix_raises(bad):
    eng = trap_engine()
    with pytest.raises(ValueError):
        eng.generate([[PROMPT0], bad], SamplingParams())
    assert eng.calls == 0 and eng.tokens_generated == 0


def test_complete_prefix_and_unsupported_params_raise():
    tree = trap_tree(1)
    eng = FakeTreeEngine({1: tree})
    with pytest.raises(ValueError):
        eng.generate([tree.prefix_ids((0,) * 6)], SamplingParams())
    with pytest.raises(ValueError):  # the final step must carry the leaf's own answer
        tree.parse([STEP0] + [NL, STEP0] * 4 + [NL, STEP0, HASH, ANS0 + 50, EOS])
    with pytest.raises(NotImplementedError):
        eng.generate([[PROMPT0 + 1]], SamplingParams(ignore_eos=True))
    with pytest.raises(NotImplementedError):
        eng.generate([[PROMPT0 + 1]], SamplingParams(min_new_tokens=2))
    with pytest.raises(ValueError):
        eng.generate([[PROMPT0 + 1]], SamplingParams(), seeds=[1, 2])
    assert eng.node_of(tree.prefix_ids((2, 1))) == (1, (2, 1))


def test_counters_and_protocol():
    eng = trap_engine()
    assert isinstance(eng, Engine)
    r1 = eng.generate([[PROMPT0], [PROMPT0 + 1]], SamplingParams(n=3, stop=["\n"]), seeds=[0, 1])
    r2 = eng.generate([[PROMPT0 + 2]], SamplingParams(n=2))
    assert eng.calls == 2 and eng.prompts_seen == 3 and eng.call_log == [(2, 3), (1, 2)]
    assert eng.tokens_generated == sum(len(c.token_ids) for r in (r1, r2) for row in r for c in row) == 2 * 6 + 2 * 14
    eng.sleep()
    assert eng.sleeping
    eng.wake()
    eng.load_weights([("w", torch.zeros(1))])
    assert eng.weight_loads == 1 and not eng.sleeping


def test_top_k_top_p_sample_inside_the_nucleus():
    tree = trap_tree(0)
    eng = FakeTreeEngine({0: tree})
    [comps] = eng.generate([tree.prefix_ids()], SamplingParams(n=50, top_k=1, stop=["\n"]), seeds=[0])
    assert {c.token_ids[0] for c in comps} == {STEP0}
    assert comps[0].logps[0] == pytest.approx(math.log(0.6))  # reported before truncation
    [comps] = eng.generate([tree.prefix_ids()], SamplingParams(n=200, top_p=0.7, stop=["\n"]), seeds=[0])
    assert {c.token_ids[0] for c in comps} == {STEP0, STEP0 + 1}


def test_tokenizer():
    tok = FakeTokenizer()
    ids = [PROMPT0 + 12, STEP0 + 2, NL, STEP0, HASH, ANS0 + 7, EOS]
    assert tok.decode(ids) == "Q12:s2.\ns0.#### A7<eos>"
    assert tok.decode(ids, skip_special_tokens=True) == "Q12:s2.\ns0.#### A7"
    assert tok.decode([STRADDLE]) == ".\n\n"
    assert tok.encode(tok.decode(ids)) == ids
    assert tok.encode("s1..\n\n") == [STEP0 + 1, STRADDLE]
    with pytest.raises(ValueError):
        tok.decode([10 ** 6])


def test_random_tree():
    t = random_tree(2, seed=1, depth=3, branching=4, p_correct=0.5)
    assert len(t.leaves()) == 4 ** 3 and len(t.prefix_ids((3, 3, 3))) == 1 + 2 + 2 + 4
    assert sum(t.probs((1,))) == pytest.approx(1.0)
    eng = FakeTreeEngine({2: t})
    [[c]] = eng.generate([[PROMPT0 + 2]], SamplingParams(), seeds=[0])
    assert len(c.token_ids) == 8


def test_scorers():
    trees = trap_trees(0)
    t = trees(4)
    path = (1, 0, 2, 2, 1, 0)
    steps = t.step_texts(path)
    assert steps[0] == "s1.\n" and steps[-1].startswith("s0.#### A")
    correct = t.leaf_answer(path) == CORRECT
    exact = ExactVerifier(trees)
    [vals] = exact.score(["Q4:"], [steps])
    assert vals[:-1] == pytest.approx([t.p_correct(path[: d + 1]) for d in range(5)])
    assert vals[-1] == (1.0 if correct else 0.0)
    # lenient parsing: stripped steps, several steps in one piece, a rendered prompt
    [vals2] = exact.score(["Problem Q4: solve"], [[s.strip() for s in steps]])
    assert vals2 == vals
    assert exact.score(["Q4:"], [["s1.\ns0.\n"]]) == [[t.p_correct((1, 0))]]
    assert exact.score(["Q4:"], [[]]) == [[]]
    assert exact.calls == 4 and exact.scored == 4
    with pytest.raises(ValueError):
        exact.score(["Q4:"], [["s1.\n", "hello"]])
    with pytest.raises(ValueError):
        exact.score(["Q4:"], [["s1.#### A0"]])  # an answer before the leaves

    oracle0 = OracleValue(trees, noise_sd=0.0)
    assert oracle0.score(["Q4:"], [steps]) == [vals]
    noisy = OracleValue(trees, noise_sd=0.2, seed=3)
    a = noisy.score(["Q4:", "Q4:"], [steps[:2], steps])
    assert a[0] == a[1][:2]  # the same node always gets the same noise
    assert a[0] != vals[:2]
    assert OracleValue(trees, noise_sd=0.2, seed=4).score(["Q4:"], [steps[:2]])[0] != a[0]

    # NoisyVerifier: terminal means 0.7 (C) / 0.4 (wrong), sd 0.2
    ver = NoisyVerifier(trees, seed=0)
    tc, tw = [], []
    for i in range(150):
        ti = trees(i)
        for leaf in ti.leaves()[::40]:
            s = ver.score([f"Q{i}:"], [ti.step_texts(leaf)])[0][-1]
            (tc if ti.leaf_answer(leaf) == CORRECT else tw).append(s)
    for xs, mean in ((tc, 0.7), (tw, 0.4)):
        assert abs(statistics.mean(xs) - mean) <= 3 * 0.2 / math.sqrt(len(xs))
        assert 0.15 <= statistics.stdev(xs) <= 0.25
    part = [ver.score([f"Q{i}:"], [["s1.\n", "s0.\n"]])[0][-1] - trees(i).p_correct((1, 0)) for i in range(300)]
    assert abs(statistics.mean(part)) <= 3 * 0.2 / math.sqrt(300)
    assert 0.15 <= statistics.stdev(part) <= 0.25


def test_fake_task_and_problems():
    task = fake_task()
    assert task.answer_marker == "####" and task.reward_needs_reference
    t = trap_tree(0)
    good = [p for p in t.leaves() if t.leaf_answer(p) == CORRECT][0]
    bad = [p for p in t.leaves() if t.leaf_answer(p) != CORRECT][0]
    text = "".join(t.step_texts(good))
    assert task.extract_answer(text, {}) == "A0"
    assert task.reward("Q0:", text, {"answer": "A0"}) == 1.0
    assert task.reward("Q0:", "".join(t.step_texts(bad)), {"answer": "A0"}) == 0.0
    assert task.extract_answer("s0.\n", {}) is None
    probs = toy_problems(3, first=5)
    assert [p.id for p in probs] == [5, 6, 7] and isinstance(probs[0], Problem)
    assert probs[1].prompt_ids == [PROMPT0 + 6] and probs[1].question == "Q6:" == probs[1].prompt_text
    assert probs[0].extra_info == {"answer": "A0"}
    assert TreeBank({0: t})(0) is t
