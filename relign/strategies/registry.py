"""Strategies by name: one table row each (a plain dict, DESIGN.md principle 5).

A row says which class searches, how ``SampleAndSelect`` picks its answer, whether the strategy
ranks solutions (it needs a scorer) or grows a tree of steps (it needs the task's answer
marker), and, when it has knobs of its own, the config section that holds them
(``search.<section>.*`` in ``relign eval``, the dataclass its class inherits them from). A new
strategy is its file plus one row here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .beam import BeamOptions, StepBeam
from .mcts import MCTS, MctsOptions
from .sampling import SampleAndSelect


@dataclass(frozen=True)
class Spec:
    cls: type
    """The strategy's dataclass; ``make_strategy`` passes it the options its fields name."""
    select: str = ""
    """``SampleAndSelect``'s rule: first, vote, argmax or weighted_vote."""
    samples_cap: int | None = None
    """A fixed number of samples whatever the budget (cot: 1)."""
    scorer: bool = False
    """It ranks solutions: it needs a scorer (verifier, rm, prm, or a rule reward where allowed)."""
    tree: bool = False
    """It grows a tree of steps: a step holding the answer marker is final, so it needs one."""
    section: str = ""
    """Its own knobs' config section, ``search.<section>.*`` ("" = none)."""
    options: type | None = None
    """The dataclass of that section (the strategy's class inherits its fields)."""


STRATEGIES: dict[str, Spec] = {
    "cot": Spec(SampleAndSelect, select="first", samples_cap=1),
    "majority": Spec(SampleAndSelect, select="vote"),
    "best_of_n": Spec(SampleAndSelect, select="argmax", scorer=True),
    "weighted_majority": Spec(SampleAndSelect, select="weighted_vote", scorer=True),
    "step_beam": Spec(StepBeam, scorer=True, tree=True, section="beam", options=BeamOptions),
    "mcts": Spec(MCTS, scorer=True, tree=True, section="mcts", options=MctsOptions),
}


def make_strategy(name: str, tokenizer, **options: Any):
    """A strategy by name, with its options (unknown options for that strategy are an error)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    spec = STRATEGIES[name]
    fixed: dict[str, Any] = {}
    if spec.cls is SampleAndSelect:
        fixed = dict(name=name, select=spec.select, needs_scorer=spec.scorer, samples_cap=spec.samples_cap)
    try:
        return spec.cls(tokenizer=tokenizer, **fixed, **options)
    except TypeError as e:  # an option that strategy does not have
        raise ValueError(f"strategy {name}: {e}") from None


def options_for(name: str, shared: dict[str, Any], sections: dict[str, Any]) -> dict[str, Any]:
    """The options of strategy ``name`` from the knobs every strategy may read (``shared``: those
    its class has a field for) and its own section's values (``sections[spec.section]``)."""
    spec = STRATEGIES[name]
    accepted = {f.name for f in dataclasses.fields(spec.cls)}
    own = dataclasses.asdict(sections[spec.section]) if spec.section else {}
    return {**{k: v for k, v in shared.items() if k in accepted}, **own}


__all__ = ["STRATEGIES", "Spec", "make_strategy", "options_for"]
