"""Strategies by name (a plain dict, DESIGN.md principle 5)."""

from __future__ import annotations

from typing import Any

from .beam import StepBeam
from .mcts import MCTS
from .sampling import SampleAndSelect

STRATEGIES = ("cot", "majority", "best_of_n", "weighted_majority", "step_beam", "mcts")
NEEDS_SCORER = {"best_of_n", "weighted_majority", "step_beam", "mcts"}
TREE = {"step_beam", "mcts"}

_SAMPLING = {  # name -> (selection, needs a scorer, fixed sample count)
    "cot": ("first", False, 1),
    "majority": ("vote", False, None),
    "best_of_n": ("argmax", True, None),
    "weighted_majority": ("weighted_vote", True, None),
}


def make_strategy(name: str, tokenizer, **options: Any):
    """A strategy by name, with its options (unknown options for that strategy are an error)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    try:
        if name in _SAMPLING:
            select, needs, cap = _SAMPLING[name]
            return SampleAndSelect(name=name, select=select, tokenizer=tokenizer, needs_scorer=needs, samples_cap=cap, **options)
        if name == "step_beam":
            return StepBeam(tokenizer=tokenizer, **options)
        return MCTS(tokenizer=tokenizer, **options)
    except TypeError as e:  # an option that strategy does not have
        raise ValueError(f"strategy {name}: {e}") from None
