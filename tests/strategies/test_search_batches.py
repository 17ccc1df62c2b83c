"""A search's result for a problem does not depend on the other problems of its lockstep batch
(relign.rollout.prefixes.continue_prefixes, which every strategy samples through).

The promise: each problem is sampled with its own seed stream (seeds derive from the problem's
id) and pays for its own samples. Two problems whose prompts tokenize alike (the same question
asked twice, or two questions whose chat-rendered prompts coincide) must not share one engine
request: the second would get the first's samples, drawn with the first's seeds, for free. The
engine here draws a sample from its seed alone, so the test knows what each problem must get."""

from __future__ import annotations

import random

from relign.envs.tasks import Problem
from relign.rollout.engine import Completion
from relign.strategies.base import Budget
from relign.strategies.registry import make_strategy

PROMPT = [5, 6, 7]


class _Task:
    name, answer_marker, equal_spec, reward_needs_reference = "toy", None, None, False

    def extract_answer(self, text: str, extra_info: dict) -> str | None:
        return text

    def answers_equal(self, a: str, b: str) -> bool:
        return a == b


class _SeededEngine:
    """Sample j of a prompt drawn with seed s: the answer random.Random(s)'s j-th draw of 0..9."""

    def __init__(self):
        self.requests: list[tuple[tuple[int, ...], int]] = []

    def generate(self, prompts, params, *, seeds=None):
        self.requests += list(zip(map(tuple, prompts), seeds))
        out = []
        for seed in seeds:
            rng = random.Random(seed)
            out.append([Completion([20 + j], [-1.0], "stop", str(rng.randrange(10))) for j in range(params.n)])
        return out


def _search(problems: list[Problem]):
    engine = _SeededEngine()
    strategy = make_strategy("majority", None, round_size=4, max_new_tokens=2)
    return engine, strategy.search(engine, _Task(), problems, budget=Budget(max_samples=8), seed=3)


def test_a_problem_gets_its_own_samples_beside_a_problem_with_the_same_prompt():
    a, b = Problem(0, list(PROMPT), "Q", "Q", {}), Problem(1, list(PROMPT), "Q", "Q", {})
    _, [alone] = _search([b])
    engine, [_, beside] = _search([a, b])
    # the same samples, the same answer and the same cost as when it was searched alone
    assert [c.text for c in beside.candidates] == [c.text for c in alone.candidates]
    assert beside.answer == alone.answer
    assert beside.cost.generated_tokens == alone.cost.generated_tokens == 8
    # every round sent both problems' prompts, each with its own seed
    assert len(engine.requests) == 4 and len({seed for _, seed in engine.requests}) == 4
