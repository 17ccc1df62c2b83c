"""Scorers: what ranks complete solutions and guides tree search, behind one protocol.

``score(problems, steps, extra_infos=None) -> list[list[float]]``: for each (partial) solution,
given as its list of step texts, a list of per-step scores. An outcome scorer (rule, verifier,
reward model) scores the solution as a whole and returns one value, the score of its last
step; a process reward model returns one value per step. ``aggregate_step_scores`` turns
either into one number (``last`` works for both).

A scorer receives the problems' ``extra_info`` (which holds the gold answer) only when it says it
reads it (``reads_extra_info``, vetted by ``check_reference``) or the search may read the
reference (``allow_reference``); otherwise empty dicts (``common.score_jobs``).

* ``TaskRuleScorer``: the task's own reward (its correctness ``score``). For a task whose
  reward reads the gold answer this is an oracle: search refuses it unless ``allow_reference``
  (training-time data generation: rStar-Math, VinePPO, ReST-EM). ``relign eval`` never allows it.
* ``VerifierScorer``: relign's generative verifier, P("Yes") (``relign verifier``).
* ``RewardModelScorer``: a Bradley-Terry reward model (``relign rm``).
* ``PRMScorer``: a process reward model in the Math-Shepherd style: a causal LM that reads the
  solution with a ``step_tag`` token after every step and scores each step by
  P(good) / (P(good) + P(bad)) at that tag.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ..envs.reward_fn import normalize_reward
from ..models import reward as reward_models
from ..models.loading import load_causal_lm, load_tokenizer

log = logging.getLogger(__name__)

SCORERS = ("rule", "verifier", "rm", "prm")


@runtime_checkable
class Scorer(Protocol):
    def score(self, problems: list[str], steps: list[list[str]], extra_infos: list[dict] | None = None
              ) -> list[list[float]]:
        """Per-step scores of each (partial) solution, in order."""
        ...


class TaskRuleScorer:
    """The task's reward on the whole response (terminal only: one score, its ``score`` field).

    ``pool``: a ``RewardPool`` for the task (worker processes: a reward that raises or hangs
    scores 0 and is counted); without one the reward runs here and an exception scores 0."""

    needs_reference: bool
    reads_extra_info = True  # its reward reads the problem's givens; check_reference vets the gold answer

    def __init__(self, task, pool=None):
        self.task, self.pool = task, pool
        self.needs_reference = bool(getattr(task, "reward_needs_reference", True))
        self.errors = 0

    def score(self, problems: list[str], steps: list[list[str]], extra_infos: list[dict] | None = None
              ) -> list[list[float]]:
        infos = list(extra_infos) if extra_infos is not None else [{} for _ in problems]
        texts = ["".join(s) for s in steps]
        if self.pool is not None:
            return [[r.score] for r in self.pool.score(list(problems), texts, infos)]
        out = []
        for p, t, info in zip(problems, texts, infos):
            try:
                out.append([normalize_reward(self.task.reward(p, t, info)).score])
            except Exception as e:  # noqa: BLE001 - user reward code: counted, scored 0
                if not self.errors:
                    log.warning("task reward raised %s: %s (scored 0; further errors are only counted)", type(e).__name__, e)
                self.errors += 1
                out.append([0.0])
        return out


class _OutcomeScorer:
    """A learned outcome scorer (``models.reward``) on the joined steps: one score per solution,
    through ``squash`` (a monotone map to [0, 1]) when the model's own scores are unbounded."""

    needs_reference = False

    def __init__(self, inner, squash: Callable[[float], float] | None = None):
        self.inner, self.squash = inner, squash

    def score(self, problems: list[str], steps: list[list[str]], extra_infos: list[dict] | None = None
              ) -> list[list[float]]:
        out = [float(s) for s in self.inner.score(list(problems), ["".join(x) for x in steps])]
        return [[self.squash(s) if self.squash else s] for s in out]


def _sigmoid(r: float) -> float:
    return 1.0 / (1.0 + math.exp(-r)) if r >= 0 else math.exp(r) / (1.0 + math.exp(r))


def VerifierScorer(path: str, **kwargs: Any) -> _OutcomeScorer:  # noqa: N802 - reads as a class
    """relign's generative verifier: P("Yes") that the (partial) solution is correct."""
    return _OutcomeScorer(reward_models.VerifierScorer(path, **kwargs))


def RewardModelScorer(path: str, **kwargs: Any) -> _OutcomeScorer:  # noqa: N802
    """A Bradley-Terry reward model's sigma(r(x, y)): the probability, under the Bradley-Terry model
    it was trained with, that the solution is preferred over one of reward 0.

    Why the sigmoid: r is unbounded and often negative, and a weighted vote (weighted_majority,
    step_beam select=weighted_vote, mcts answer=weighted_vote) sums its weights per answer, so
    raw scores can elect the answer fewer samples agree on (four samples of -1.0 each lose to one
    of -0.8). sigma is monotone: best_of_n, beam ranking and argmax choices are unchanged, and MCTS
    values then lie in [0, 1] like a verifier's P(Yes). (RL's learned reward, ``reward.model``,
    stays the raw r.)"""
    return _OutcomeScorer(reward_models.RewardModelScorer(path, **kwargs), squash=_sigmoid)


class PRMScorer:
    """A process reward model (Math-Shepherd, Wang et al. 2024): step i's score is
    P(good) / (P(good) + P(bad)) at the ``step_tag`` token placed after step i.

    The tag must be one token in the PRM's tokenizer, and the text the steps come from must be
    split where the PRM was trained to see tags (the lesson of trl#2577): the search splits at
    its ``delimiter`` and this scorer appends ``step_tag`` to each step, with the step's own
    trailing whitespace stripped (as Math-Shepherd's data has "step ки\\n").
    """

    needs_reference = False

    def __init__(self, path: str, *, step_tag: str = " ки", good_token: str = "+", bad_token: str = "-", device="cpu",
                 batch_size: int = 8, max_length: int = 2048, dtype: str = "fp32", trust_remote_code: bool = False):
        self.tok = load_tokenizer(path, trust_remote_code=trust_remote_code)
        self.model = load_causal_lm(path, dtype=dtype, trust_remote_code=trust_remote_code, device=device)
        self.model.eval().requires_grad_(False)
        self.device, self.batch_size, self.max_length, self.step_tag = device, batch_size, max_length, step_tag
        ids = {name: self.tok(t, add_special_tokens=False)["input_ids"]
               for name, t in (("step_tag", step_tag), ("good_token", good_token), ("bad_token", bad_token))}
        bad = {k: v for k, v in ids.items() if len(v) != 1}
        if bad:
            raise ValueError(f"PRM {path}: {', '.join(f'{k} {v!r}' for k, v in bad.items())} must each be exactly one token "
                             f"of its tokenizer (got ids {bad}); set scorer step_tag / good_token / bad_token to its tags")
        self.tag_id, self.good_id, self.bad_id = ids["step_tag"][0], ids["good_token"][0], ids["bad_token"][0]

    def encode(self, problem: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        """(ids, positions of the step tags): problem, then each step followed by its tag."""
        ids = self.tok(problem + " ", add_special_tokens=True)["input_ids"]
        tags = []
        for s in steps:
            ids += self.tok(s.rstrip(), add_special_tokens=False)["input_ids"]
            tags.append(len(ids))
            ids.append(self.tag_id)
            if s != s.rstrip():
                ids += self.tok(s[len(s.rstrip()):], add_special_tokens=False)["input_ids"]
        return ids, tags

    @torch.no_grad()
    def score(self, problems: list[str], steps: list[list[str]], extra_infos: list[dict] | None = None
              ) -> list[list[float]]:
        rows = [self.encode(p, s) for p, s in zip(problems, steps)]
        out: list[list[float]] = []
        for i in range(0, len(rows), self.batch_size):
            # too long: keep the end, where the step tags are (the problem's start is cut instead)
            chunk = [(r[-self.max_length:], [t - max(0, len(r) - self.max_length) for t in tags]) for r, tags in
                     rows[i : i + self.batch_size]]
            T = max(len(r) for r, _ in chunk)
            ids = torch.full((len(chunk), T), self.tok.pad_token_id or 0, dtype=torch.long)
            mask = torch.zeros((len(chunk), T), dtype=torch.long)
            for b, (r, _) in enumerate(chunk):
                ids[b, : len(r)], mask[b, : len(r)] = torch.tensor(r), 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits.float()
            pair = torch.log_softmax(logits[..., [self.good_id, self.bad_id]], dim=-1)[..., 0].exp().cpu()  # [B, T]
            for b, (_, tags) in enumerate(chunk):
                # the tag's own position predicts the label token that follows it
                out.append([float(pair[b, t]) if t >= 0 else 0.0 for t in tags])  # a tag cut off with the start: 0
        return out


def load_scorer(name: str, *, task=None, path: str = "", pool=None, device="cpu", step_tag: str = " ки",
                batch_size: int = 16, dtype: str = "fp32", trust_remote_code: bool = False):
    """A scorer by name (``rule``, ``verifier``, ``rm``, ``prm``); the learned ones load ``path``."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; choose one of {', '.join(SCORERS)}")
    if name == "rule":
        if task is None:
            raise ValueError("scorer=rule needs the task")
        return TaskRuleScorer(task, pool)
    if not path:
        raise ValueError(f"scorer={name} needs scorer_path (a {name} checkpoint folder)")
    if not Path(path).expanduser().exists() and not looks_like_hub_id(path):
        raise FileNotFoundError(f"scorer_path {path!r} does not exist")
    common = dict(device=device, batch_size=batch_size, dtype=dtype, trust_remote_code=trust_remote_code)
    if name == "verifier":
        return VerifierScorer(path, **common)
    if name == "rm":
        return RewardModelScorer(path, **common)
    return PRMScorer(path, step_tag=step_tag, **common)


def looks_like_hub_id(path: str) -> bool:
    """``org/name`` with no local meaning: a hub id (loading it needs the network)."""
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~"))


def check_reference(scorer, task, allow_reference: bool) -> None:
    """The gold-answer guard: refuse a scorer that reads the reference answer unless allowed."""
    if scorer is not None and getattr(scorer, "needs_reference", False) and not allow_reference:
        raise ValueError(
            f"scorer=rule on task '{getattr(task, 'name', '?')}' reads the gold answer (the task's reward needs the "
            "reference), so search would see the answer it is graded on. Use a learned scorer (verifier, rm, prm), or "
            "allow_reference=True for training-time data generation (never in eval)")


def aggregate_step_scores(step_scores: Sequence[float], how: str = "last") -> float:
    """One score from per-step scores: ``last`` (outcome; ORM-style), ``min`` (Math-Shepherd: a
    solution is as good as its worst step), ``prod`` (Lightman et al.: the probability every
    step is right) or ``mean``. An empty list scores 0."""
    if how not in AGGREGATIONS:
        raise ValueError(f"unknown step-score aggregation {how!r}; choose one of {', '.join(AGGREGATIONS)}")
    if not step_scores:
        return 0.0
    xs = [float(x) for x in step_scores]
    if how == "last":
        return xs[-1]
    if how == "min":
        return min(xs)
    if how == "mean":
        return sum(xs) / len(xs)
    out = 1.0
    for x in xs:
        out *= x
    return out


AGGREGATIONS = ("last", "min", "prod", "mean")
