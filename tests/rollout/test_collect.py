"""The rollout collector (relign.rollout.collect): a step's groups, and DAPO's dynamic sampling.

The engine here is scripted (completion j of every prompt is the text "j") and the reward reads
the prompt: a "mixed" prompt rewards only its completion "0", a "flat" one rewards nothing. So
which groups carry a signal is known from the data alone, and the test works out, with its own
copy of the sampler, which prompts the collector must draw, keep and drop, and in what order."""

from __future__ import annotations

import pytest

from relign.data.collate import StepSampler
from relign.envs.base import make_custom_task
from relign.envs.rewards import RewardPool
from relign.rollout.collect import RolloutCollector
from relign.rollout.engine import Completion, SamplingParams, derive_seed

from ..conftest import write_jsonl

G = 4
MIXED = {1, 6, 9}  # prompts whose group has reward variance (the rest: every reward 0)
N_PROMPTS = 10


class ScriptedEngine:
    """Completion j of every prompt is the text "j"; records every call's prompts and seeds."""

    def __init__(self, tokenizer):
        self.tok, self.calls = tokenizer, []

    def generate(self, prompts, params, *, seeds=None):
        self.calls.append((list(map(tuple, prompts)), list(seeds)))
        ids = [self.tok(str(j), add_special_tokens=False)["input_ids"] for j in range(params.n)]
        return [[Completion(ids[j], [-1.0] * len(ids[j]), "stop", str(j)) for j in range(params.n)] for _ in prompts]


@pytest.fixture()
def collector(tokenizer, tmp_path):
    rows = [{"prompt": f"{'mixed' if i in MIXED else 'flat'} prompt number {i}"} for i in range(N_PROMPTS)]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    reward = tmp_path / "reward.py"
    reward.write_text("def reward(prompt, response, extra_info):\n"
                      "    return float(prompt.startswith('mixed') and response == '0')\n")
    task = make_custom_task(str(data), f"{reward}:reward")
    engine = ScriptedEngine(tokenizer)
    c = RolloutCollector(tokenizer, engine, task.load(), sampling=SamplingParams(n=G, max_new_tokens=4),
                         pool=RewardPool.from_task(task, num_workers=0), seed=7)
    yield c, engine
    c.close()


def _prompt_index(collector: RolloutCollector, prompt_ids) -> int:
    return next(i for i, (_, ids, _) in enumerate(collector.records) if tuple(ids) == tuple(prompt_ids))


def _draws(batch: int, batches: int) -> list[list[int]]:
    """The prompts a fresh sampler (seed 0) hands out, batch by batch: the test's own copy."""
    s = StepSampler(N_PROMPTS, batch, seed=0)
    return [s.next() for _ in range(batches)]


@pytest.mark.parametrize("max_rounds", [1, 2, 5])
def test_dynamic_sampling_keeps_the_groups_with_a_signal_in_draw_order(collector, max_rounds):
    c, engine = collector
    want_groups = 2
    kept = c.collect(StepSampler(N_PROMPTS, want_groups, seed=0), want_groups, True, max_rounds)

    # independently: draw batches until two mixed prompts are found or the rounds run out
    expected, rounds, dropped = [], 0, 0
    for batch in _draws(want_groups, max_rounds):
        if len(expected) >= want_groups:
            break
        rounds += 1
        expected += [i for i in batch if i in MIXED]
        dropped += sum(i not in MIXED for i in batch)
    expected = expected[:want_groups]
    # seed 0 draws [4, 1], [7, 5], [3, 9], ...: one round keeps [1], two still [1], three find 9
    assert expected == ([1] if max_rounds < 3 else [1, 9])

    got = [_prompt_index(c, g.prompt_ids) for g in kept]
    assert got == expected
    assert [g.draw for g in kept] == sorted(g.draw for g in kept)  # draw order
    for g in kept:  # every kept group has reward variance: one completion ("0") is right
        assert [e.reward for e in g.episodes] == [1.0] + [0.0] * (G - 1)
    assert len(engine.calls) == rounds and c.last["rounds"] == rounds
    metrics = c.step_metrics(kept)
    assert metrics["rollout/rounds"] == rounds
    assert metrics.get("rollout/filtered_groups", 0.0) == dropped


def test_without_dynamic_sampling_one_batch_is_the_step_and_seeds_follow_the_draws(collector):
    c, engine = collector
    sampler = StepSampler(N_PROMPTS, 3, seed=0)
    first = c.collect(sampler, 3, False, 5)
    second = c.collect(sampler, 3, False, 5)
    batches = _draws(3, 2)
    assert [_prompt_index(c, g.prompt_ids) for g in first] == batches[0]
    assert [_prompt_index(c, g.prompt_ids) for g in second] == batches[1]  # flat groups stay: nothing is dropped
    assert [g.draw for g in first + second] == list(range(6))
    # each prompt's completions are seeded by its draw index, whatever batch it is in
    assert [seed for _, seeds in engine.calls for seed in seeds] == [derive_seed(7, d) for d in range(6)]
    assert c.last["rounds"] == 1.0 and "rollout/filtered_groups" not in c.step_metrics(second)
