"""pass@k against hand-computed values, answer extraction per task, eval during training, and the eval loop.

Voting (maj@k) is tested in tests/strategies/test_voting.py, task building and prompt rendering in
tests/envs/test_tasks.py."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from relign.config import ConfigError
from relign.envs.tasks import get_task
from relign.envs.tasks import build_task, render_prompt
from relign.evaluate import PeriodicEval, evaluate, pass_at_k
from relign.recipes.build import engine_for
from relign.recipes.rl_config import EvalDuringTrainingConfig, check_eval_during_training
from relign.rollout.engine import Completion
from relign.strategies.voting import maj_at_k

from .conftest import write_jsonl

# --------------------------------------------------------------------------- pass@k


def _pass_at_k_binomial(n: int, c: int, k: int) -> Fraction:
    """The textbook form 1 - C(n-c, k) / C(n, k), exactly."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_hand_computed():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7; as the product: 1 - (1-2/4)(1-2/5) = 1 - 0.5*0.6 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # n=4, c=1, k=3: 1 - C(3,3)/C(4,3) = 1 - 1/4 = 0.75
    assert pass_at_k(4, 1, 3) == pytest.approx(0.75)
    # k=1 is the fraction correct: n=10, c=3 -> 1 - (1-1/8)(1-1/9)(1-1/10) = 1 - 7/10 = 0.3
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # n=6, c=1, k=2: 1 - C(5,2)/C(6,2) = 1 - 10/15 = 1/3
    assert pass_at_k(6, 1, 2) == pytest.approx(1 / 3)


def test_pass_at_k_edge_cases():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 0, 5) == 0.0  # c = 0: never
    assert pass_at_k(5, 5, 1) == 1.0 and pass_at_k(5, 5, 5) == 1.0  # c = n: always
    assert pass_at_k(4, 1, 4) == 1.0  # k = n with one correct: the k samples are all of them
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k = 3: every 3-subset holds a correct one
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    for bad in [(5, 2, 0), (5, 2, 6), (5, 6, 1), (5, -1, 1), (0, 0, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_matches_the_binomial_formula():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 40)
        c, k = rng.randint(0, n), rng.randint(1, n)
        assert pass_at_k(n, c, k) == pytest.approx(float(_pass_at_k_binomial(n, c, k)), abs=1e-12)
    # large n, where C(n, k) overflows a float, stays finite and exact to rounding
    assert pass_at_k(200, 10, 100) == pytest.approx(float(_pass_at_k_binomial(200, 10, 100)), abs=1e-12)


# --------------------------------------------------------------------------- answers per task


def test_gsm8k_extraction_and_equivalence():
    t = get_task("gsm8k")
    assert t.extract_answer("so she makes 9 * 2 = 18 dollars.\n#### 1,234.50", {}) == "1234.5"
    assert t.extract_answer("#### $5.00", {}) == "5"
    assert t.extract_answer("the answer is -3", {}) == "-3"  # no ####: the last number
    assert t.extract_answer("no number here", {}) is None
    assert t.answers_equal("5", "5.0") and t.answers_equal("-3", "-3.000")
    assert not t.answers_equal("5", "6")


def test_math_extraction_and_equivalence():
    t = get_task("math500")
    assert t.extract_answer("so \\boxed{\\frac{1}{2}}.", {}) == "\\frac{1}{2}"
    assert t.extract_answer("first \\boxed{1} then \\boxed{2}", {}) == "2"
    assert t.extract_answer("no box, the answer is 3", {}) is None
    assert t.extract_answer("\\boxed{}", {}) is None
    assert t.answers_equal("\\frac{1}{2}", "0.5")
    assert t.answers_equal("\\frac12", "\\dfrac{1}{2}")
    assert not t.answers_equal("2", "3")


def test_countdown_votes_on_the_value_of_a_valid_expression():
    t = get_task("countdown")
    info = {"nums": [3, 5, 7], "target": 6}
    assert t.extract_answer("<answer>(7 - 5) * 3</answer>", info) == "6"
    assert t.extract_answer("<answer>3 * (7 - 5)</answer>", info) == "6"  # another expression, same vote
    assert t.extract_answer("<answer>7 / (5 - 3)</answer>", info) == "7/2"  # exact value
    assert t.extract_answer("<answer>7 - 1</answer>", info) is None  # wrong numbers: no vote
    assert t.extract_answer("<answer>(7 - 5) * 3 = 6</answer>", info) is None  # not an expression
    assert t.extract_answer("no tags", info) is None
    assert t.answers_equal("6", "6") and not t.answers_equal("6", "7/2")


def test_eval_steps_every_n_and_at_the_last_step(tmp_path):
    def steps(every: int, last: int) -> list[int]:
        ev = PeriodicEval(get_task("gsm8k"), [], None, tmp_path, every=every)
        try:
            return [s for s in range(1, last + 1) if ev.due(s, last)]
        finally:
            ev.close()

    assert steps(3, 7) == [3, 6, 7]
    assert steps(1, 3) == [1, 2, 3]
    assert steps(0, 3) == []


def test_eval_during_training_checks():
    check_eval_during_training(EvalDuringTrainingConfig())  # off: nothing to check
    with pytest.raises(ConfigError, match="greedy"):
        check_eval_during_training(EvalDuringTrainingConfig(every=1, n=4))
    with pytest.raises(ConfigError, match="eval.ks"):
        check_eval_during_training(EvalDuringTrainingConfig(every=1, n=2, temperature=1.0, ks=[4]))
    with pytest.raises(ConfigError, match="eval.path"):
        check_eval_during_training(EvalDuringTrainingConfig(every=1), task="custom")
    with pytest.raises(ConfigError, match="multi-turn"):
        check_eval_during_training(EvalDuringTrainingConfig(every=1), task="calculator", env="relign.envs.calculator:CalculatorEnv")


# --------------------------------------------------------------------------- the loop, with scripted completions


class ScriptedEngine:
    """Returns fixed completion texts, prompt by prompt, and records the sampling params."""

    def __init__(self, texts: list[list[str]], finish: list[list[str]] | None = None):
        self.texts, self.finish, self.calls, self.next = texts, finish, [], 0

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params))
        out = []
        for _ in prompts:
            i = self.next
            self.next += 1
            assert len(self.texts[i]) == params.n
            out.append([
                Completion(token_ids=list(range(1 + 4 * i + j)), logps=[0.0] * (1 + 4 * i + j),
                           finish_reason=self.finish[i][j] if self.finish else "stop", text=t)
                for j, t in enumerate(self.texts[i])
            ])
        return out


GSM8K_ROWS = [{"question": "Q18?", "answer": "blah\n#### 18"}, {"question": "Q3?", "answer": "#### 3"}]
SCRIPT = [
    ["#### 18", "#### 5", "#### 5", "nothing"],  # scores 1 0 0 0; answers 18 5 5 -
    ["#### 3", "x 3.0", "#### 4", "#### 3"],  # scores 1 1 0 1 ("3.0" is the last number); answers 3 3 4 3
]


@pytest.mark.parametrize("batch_prompts", [1, 32])
def test_evaluate_metrics_by_hand(tokenizer, tmp_path, batch_prompts):
    task = get_task("gsm8k", chat=False, format_weight=0.1)
    records = task.load(str(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)))
    engine = ScriptedEngine(SCRIPT, finish=[["stop", "length", "stop", "length"], ["stop"] * 4])
    summary, rows = evaluate(engine, tokenizer, task, records, n=4, ks=(1, 2, 4, 8), temperature=1.0,
                             batch_prompts=batch_prompts, seed=7, progress=False)
    # every batch is sampled with its own seed, so the engine's own random stream is not used
    assert [p.seed for _, p in engine.calls] == list(range(7, 7 + len(engine.calls)))
    assert len(engine.calls) == (2 if batch_prompts == 1 else 1)
    # c = 1 and 3 of n = 4
    assert summary["accuracy"] == pytest.approx(4 / 8)
    assert summary["pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    # pass@2: problem 1: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; problem 2: n - c = 1 < 2 -> 1; mean 0.75
    assert summary["pass@2"] == pytest.approx(0.75)
    assert summary["pass@4"] == 1.0
    assert "pass@8" not in summary  # k > n is skipped
    # maj@1: first samples 18 (right), 3 (right) -> 1; maj@2: {18, 5} tie -> 18 (right), {3, 3} -> 1
    # maj@4: {5: 2, 18: 1} -> 5 (wrong); {3: 3, 4: 1} -> 3 (right) -> 0.5
    assert (summary["maj@1"], summary["maj@2"], summary["maj@4"]) == (1.0, 1.0, 0.5)
    assert summary["answered_frac"] == pytest.approx(7 / 8)
    # reward = correct + 0.1 * format (exactly one "####" then a number): 1.1 .1 .1 0 | 1.1 1 .1 1.1 -> 4.6 / 8
    assert summary["reward_mean"] == pytest.approx(4.6 / 8)
    # lengths 1 + 4i + j: 1 2 3 4 | 5 6 7 8
    assert summary["length_mean"] == pytest.approx(4.5) and summary["length_max"] == 8
    assert summary["truncated_frac"] == pytest.approx(2 / 8)
    assert (summary["num_problems"], summary["num_samples"]) == (2, 8)
    assert summary["reward_errors"] == 0 and summary["skipped_long"] == 0

    assert [(r["problem"], r["sample"]) for r in rows] == [(p, s) for p in range(2) for s in range(4)]
    assert [r["extracted"] for r in rows] == ["18", "5", "5", None, "3", "3", "4", "3"]
    assert [r["correct"] for r in rows] == [True, False, False, False, True, True, False, True]
    first, second = rows[:4], rows[4:]
    assert all(r["majority"] == "5" and r["majority_correct"] is False for r in first)
    assert first[0]["votes"] == {"18": 1, "5": 2}
    assert [r["vote"] for r in first] == ["18", "5", "5", None]
    assert second[0]["votes"] == {"3": 3, "4": 1} and second[0]["majority_correct"] is True
    assert first[0]["prompt"].startswith("Q18?") and first[0]["extra_info"] == {"answer": "18"}
    assert first[1]["finish_reason"] == "length" and first[0]["components"] == {"correct": 1.0, "format": 1.0}


def test_evaluate_without_extractor_omits_maj(tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "x"}, {"prompt": "b", "answer": "y"}])
    reward = tmp_path / "r.py"
    reward.write_text("def reward(p, r, e):\n    return float(r == e['answer'])\n")
    task = build_task("custom", path=str(data), reward_fn=str(reward), chat=False)
    engine = ScriptedEngine([["x", "z"], ["z", "z"]])
    summary, rows = evaluate(engine, tokenizer, task, task.load(), n=2, ks=(1, 2), temperature=1.0, progress=False)
    assert not any(k.startswith("maj@") for k in summary) and "answered_frac" not in summary
    assert summary["accuracy"] == 0.25 and summary["pass@2"] == 0.5
    assert all(r["extracted"] is None and r["votes"] is None for r in rows)


def test_evaluate_rejects_greedy_with_many_samples_and_counts_long_prompts(tokenizer, tmp_path):
    task = get_task("gsm8k", chat=False)
    records = task.load(str(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)))
    with pytest.raises(ValueError, match="greedy"):
        evaluate(ScriptedEngine([]), tokenizer, task, records, n=2, temperature=0.0, progress=False)
    short = min(len(render_prompt(tokenizer, r)[1]) for r in records)
    with pytest.raises(ValueError, match="nothing to evaluate"):
        evaluate(ScriptedEngine([]), tokenizer, task, records, max_prompt_length=short - 1, progress=False)


# --------------------------------------------------------------------------- the loop, with a real tiny model

TOY_REWARD = '''
def reward(prompt, response, extra_info):
    return 1.0 if response.startswith(" ") else 0.0


def first_char(response, extra_info):
    return response[:1] or None
'''


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from relign.models.loading import load_causal_lm, load_tokenizer

    return load_causal_lm(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))


def _toy_task(tmp_path):
    data = write_jsonl(tmp_path / "toy.jsonl", [{"prompt": f"Write something {i}:"} for i in range(6)])
    reward = tmp_path / "toy_reward.py"
    reward.write_text(TOY_REWARD)
    return build_task("custom", path=str(data), reward_fn=f"{reward}:reward", chat=False, extract_fn=f"{reward}:first_char")


def test_evaluate_tiny_model_numbers_are_consistent(tiny, tmp_path):
    model, tok = tiny
    task = _toy_task(tmp_path)
    records = task.load()
    n = 4
    summary, rows = evaluate(engine_for("hf", model, tok, max_batch_rows=256, seed=3), tok, task, records, n=n, ks=(1, 2, 4),
                             temperature=1.0, max_new_tokens=4, batch_prompts=4, seed=3, progress=False)
    assert len(rows) == len(records) * n
    scores = [r["score"] for r in rows]
    assert summary["accuracy"] == pytest.approx(sum(scores) / len(scores))
    assert summary["pass@1"] == pytest.approx(summary["accuracy"])  # binary scores
    by_problem = [rows[i : i + n] for i in range(0, len(rows), n)]
    assert summary["pass@4"] == pytest.approx(sum(any(r["correct"] for r in p) for p in by_problem) / len(by_problem))
    maj = [maj_at_k([r["extracted"] for r in p], [r["correct"] for r in p], 4) for p in by_problem]
    assert summary["maj@4"] == pytest.approx(sum(maj) / len(maj))
    assert 0 < summary["accuracy"] < 1  # the toy task is solved sometimes: the check above is not vacuous
    assert summary["length_max"] <= 4 and summary["length_mean"] == pytest.approx(sum(r["length"] for r in rows) / len(rows))
    assert summary["truncated_frac"] == pytest.approx(sum(r["finish_reason"] == "length" for r in rows) / len(rows))

    # the same seed gives the same samples, and a shared engine's random stream is left alone
    from relign.rollout.hf_engine import HFEngine

    engine = HFEngine(model, tok, seed=123)
    state = engine.generator.get_state().clone()
    model.train()
    again, rows2 = evaluate(engine, tok, task, records, n=n, ks=(1, 2, 4), temperature=1.0, max_new_tokens=4,
                            batch_prompts=4, seed=3, progress=False, reward_workers=1)
    assert [r["response"] for r in rows2] == [r["response"] for r in rows] and again == summary
    assert torch.equal(engine.generator.get_state(), state)
    assert model.training  # the engine restores train mode after sampling


def test_evaluate_greedy_single_sample(tiny, tmp_path):
    model, tok = tiny
    task = _toy_task(tmp_path)
    summary, rows = evaluate(engine_for("hf", model, tok, max_batch_rows=256, seed=0), tok, task, task.load(), n=1, ks=(1,),
                             temperature=0.0, max_new_tokens=3, progress=False)
    assert summary["pass@1"] == pytest.approx(summary["accuracy"]) and summary["maj@1"] == pytest.approx(summary["accuracy"])
    _, rows_again = evaluate(engine_for("hf", model, tok, max_batch_rows=256, seed=99), tok, task, task.load(), n=1, ks=(1,),
                             temperature=0.0, max_new_tokens=3, seed=99, progress=False)
    assert [r["response"] for r in rows] == [r["response"] for r in rows_again]  # greedy ignores the seed
