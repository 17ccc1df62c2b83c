"""Every strategy on the trap tree of search_and_credit.md §7.3, at equal generated tokens.

The trap: a policy that puts 0.6 of its mass on a branch that ends in a systematic wrong
answer W (P(C) = 0.28, P(W) = 0.54 overall), so self-consistency converges on W as its
budget grows, while a search guided by an informative scorer finds C. The engine is the
model-free ``FakeTreeEngine`` (tests/strategies/fake_tree_engine.py): exact, deterministic,
seconds on a CPU. A toy step is 2 generated tokens (4 for the final one), so a budget of
384 tokens is the spec's "192 steps".

    python bench/search_toy.py [--problems 400] [--budgets 48 96 192 384] [--json bench/results/search_toy.json]

Scorers (the spec's simulation): the noisy verifier scores a complete solution N(0.7, 0.2) if
correct else N(0.4, 0.2), a partial one p_correct + N(0, 0.2); the value model is
p_correct + N(0, 0.2); "exact" uses the true values.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relign.strategies.base import Budget  # noqa: E402
from relign.strategies.registry import make_strategy  # noqa: E402
from tests.strategies.fake_tree_engine import (  # noqa: E402
    ExactVerifier, FakeTokenizer, NoisyVerifier, OracleValue, fake_task, toy_problems, trap_engine,
)

LONG = 64  # max_new_tokens of a whole toy solution (at most 14 tokens)
ROWS = [  # (label, strategy, options, scorer)
    ("self-consistency (maj@N)", "majority", {"temperature": 1.0}, None),
    ("best-of-N, noisy verifier", "best_of_n", {"temperature": 1.0}, "noisy"),
    ("weighted majority, noisy verifier", "weighted_majority", {"temperature": 1.0}, "noisy"),
    ("step beam (4 x 4), noisy value", "step_beam", {"temperature": 1.0}, "value"),
    ("MCTS, merged expansions, noisy verifier", "mcts", {"distinct": False}, "noisy"),
    ("MCTS, distinct expansions, noisy verifier", "mcts", {}, "noisy"),
    ("MCTS, rollout leaves (K=2), noisy verifier", "mcts", {"leaf_eval": "rollout", "rollouts": 2}, "noisy"),
    ("best-of-N, exact verifier", "best_of_n", {"temperature": 1.0}, "exact"),
    ("MCTS, distinct expansions, exact verifier", "mcts", {}, "exact"),
]


def run(strategy: str, options: dict, scorer: str | None, budget: int, problems: int) -> dict:
    engine = trap_engine()
    trees = engine.trees
    s = {"noisy": NoisyVerifier(trees), "value": OracleValue(trees, noise_sd=0.2), "exact": ExactVerifier(trees), None: None}[scorer]
    t0 = time.perf_counter()
    res = make_strategy(strategy, FakeTokenizer(), max_new_tokens=LONG, **options).search(
        engine, fake_task(), toy_problems(problems), budget=Budget(max_generated_tokens=budget), scorer=s, seed=0)
    acc = sum(r.answer == "A0" for r in res) / len(res)
    return {"accuracy": acc, "se": math.sqrt(acc * (1 - acc) / len(res)),
            "tokens_per_question": sum(r.cost.generated_tokens for r in res) / len(res),
            "engine_calls": engine.calls, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=400)
    ap.add_argument("--budgets", type=int, nargs="+", default=[48, 96, 192, 384])
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    table = []
    print(f"| strategy | {' | '.join(f'{b} tokens' for b in a.budgets)} |")
    print("|---|" + "---|" * len(a.budgets))
    for label, strategy, options, scorer in ROWS:
        cells = [run(strategy, options, scorer, b, a.problems) for b in a.budgets]
        table.append({"strategy": label, "cells": dict(zip(map(str, a.budgets), cells))})
        print(f"| {label} | " + " | ".join(f"{c['accuracy']:.3f} ({c['tokens_per_question']:.0f})" for c in cells) + " |")
    print(f"\naccuracy over {a.problems} problems (SE <= {0.5 / math.sqrt(a.problems):.3f}); "
          "in parentheses: generated tokens per question")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d", time.gmtime()), "command": " ".join(sys.argv),
                                            "problems": a.problems, "rows": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
