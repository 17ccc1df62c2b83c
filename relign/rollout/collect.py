"""Turn a step's prompts into scored groups of episodes: prompts -> rollout -> rewards.

Single-turn: ``engine.generate`` samples G completions per prompt; the task's reward function
scores them in a ``RewardPool`` (worker processes, so a reward that raises or hangs gives 0
and is counted, and the run goes on). Multi-turn: the environment's ``step`` gives the
rewards (``multiturn.run_episodes``).

Under torchrun every rank draws the same prompts from the sampler, samples its own share
with its own engine and scores it; the groups are then gathered so that every rank holds the
whole step in draw order. Each prompt's completions are seeded by its draw index (not by the
rank or the batch it lands in), so 1 rank and N ranks sample the same tokens.

With DAPO's dynamic sampling, groups whose rewards are all equal carry no signal: they are
dropped and more prompts are drawn, up to ``max_rounds`` generation batches per step.

A reward function that fails is never silent: when more than half of a step's rewards raise or
time out, a warning with the first error's message goes to the log (and to stderr if logging
would not show it); when every reward of the run's first step fails, the run stops with a
``ConfigError`` naming ``task.reward_fn`` and that message (a broken function, not bad luck).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import distributed, watchdog
from ..algorithms.shaping import zero_variance_groups
from ..config import ConfigError
from ..data.collate import StepSampler
from ..envs.tasks import problem_text, render_prompt
from .engine import SamplingParams, derive_seed
from .multiturn import Episode, episode_from_completion, run_episodes

log = logging.getLogger(__name__)


@dataclass
class Group:
    prompt_text: str
    prompt_ids: list[int]
    extra_info: dict[str, Any]
    episodes: list[Episode]
    problem: str = ""
    """The problem as the user wrote it (the last user message, or the raw prompt), without any chat markup."""
    draw: int = 0
    """The sampler's draw index of this prompt (its completions are seeded from it)."""


class RolloutCollector:
    """Prompts of one task, the engine that samples them, and the rewards that score them.

    ``records`` are task records (``Task.load``); ``pool`` scores single-turn completions
    (``None`` with an ``env``, whose ``step`` gives the rewards). ``term_weights``: the reward
    as a weighted sum of named terms (``Task.term_weights``), which GDPO normalizes one by one.
    """

    def __init__(
        self,
        tokenizer,
        engine,
        records: list[dict],
        *,
        sampling: SamplingParams,
        pool=None,
        env=None,
        term_weights: dict[str, float] | None = None,
        max_turns: int = 1,
        max_response_tokens: int = 0,
        max_prompt_length: int = 512,
        seed: int = 0,
        scorer=None,
        scorer_weight: float = 1.0,
        rule_weight: float = 1.0,
    ):
        self.tok, self.engine, self.sampling, self.pool, self.env = tokenizer, engine, sampling, pool, env
        # learned reward (reward model / verifier): reward = rule_weight * rule + scorer_weight * model
        self.scorer, self.scorer_weight, self.rule_weight = scorer, scorer_weight, rule_weight
        # reward = sum_k w_k * terms[k]; names the task does not weigh count with the rule's weight
        self.task_terms = list(term_weights or {})
        self.default_weight = rule_weight if scorer is not None else 1.0
        self.term_weights = {k: self.default_weight * w for k, w in (term_weights or {}).items()}
        if scorer is not None:
            self.term_weights["model"] = scorer_weight
        self.max_turns = max_turns
        # the episode's token budget after the prompt (model + environment tokens); one turn: max_new_tokens
        self.max_response_tokens = max_response_tokens or sampling.max_new_tokens * max_turns
        self.seed = seed
        # Render and tokenize every prompt once; prompts too long to leave room are skipped.
        self.records: list[tuple[str, list[int], dict]] = []
        self.problems: list[str] = []
        self.skipped_long = 0
        for rec in records:
            text, ids = render_prompt(tokenizer, rec)
            if len(ids) > max_prompt_length:
                self.skipped_long += 1
                continue
            self.records.append((text, ids, rec.get("extra_info", {})))
            self.problems.append(problem_text(rec))
        self._filtered = 0
        self._collected = 0  # steps collected by this process (the first one may stop the run)
        self._first_error: str | None = None  # this step's first reward failure message, on this rank
        self._last_stats = dict(self.pool.stats) if self.pool else {}
        self.last: dict[str, float] = {}
        """Statistics of the last ``collect``: rounds, dropped groups, seconds generating / scoring."""

    def __len__(self) -> int:
        return len(self.records)

    # ------------------------------------------------------------------ rollout
    def rollout(self, indices: list[int], draws: list[int]) -> list[Group]:
        """Sample and score the groups of these prompts (on this process)."""
        texts = [self.records[i][0] for i in indices]
        ids = [self.records[i][1] for i in indices]
        infos = [self.records[i][2] for i in indices]
        problems = [self.problems[i] for i in indices]
        seeds = [derive_seed(self.seed, d) for d in draws]
        t0 = time.perf_counter()
        if self.env is not None:
            with watchdog.waiting("the rollout engine and the environment (multi-turn episodes)"):
                eps = run_episodes(self.engine, self.tok, self.env, ids, infos, self.sampling, max_turns=self.max_turns,
                                   max_response_tokens=self.max_response_tokens, seeds=seeds, prompt_texts=texts)
            groups = [Group(t, g[0].prompt_ids if g else p, info, g, q, d)
                      for t, p, info, g, q, d in zip(texts, ids, infos, eps, problems, draws)]
            for g in groups:
                for e in g.episodes:
                    e.terms = {"reward": e.reward}
            self.last["generate_s"] = self.last.get("generate_s", 0.0) + time.perf_counter() - t0
            return groups
        with watchdog.waiting(f"the rollout engine ({type(self.engine).__name__}.generate)"):
            outs = self.engine.generate(ids, self.sampling, seeds=seeds)
        groups = [Group(t, p, info, [episode_from_completion(p, c) for c in cs], q, d)
                  for t, p, info, cs, q, d in zip(texts, ids, infos, outs, problems, draws)]
        t1 = time.perf_counter()
        flat = [(g, e) for g in groups for e in g.episodes]
        with watchdog.waiting(f"the reward pool (task.reward_fn={getattr(self.pool, 'spec', '?')})"):
            results = self.pool.score([g.prompt_text for g, _ in flat], [e.text for _, e in flat],
                                      [g.extra_info for g, _ in flat], completion_ids=[e.response_ids for _, e in flat])
        for (_, e), r in zip(flat, results):
            e.reward, e.score, e.components, e.reward_error = r.reward, r.score, dict(r.components), r.error
            e.terms = self._terms(e)
            if r.error is not None and self._first_error is None:
                self._first_error = r.message or r.error
        if self.scorer is not None:
            self._add_learned_reward(flat)
        for _, e in flat:  # the outcome sits on the last token (multi-turn: each turn's reward on its turn's)
            if e.token_rewards:
                e.token_rewards[-1] = e.reward
        self.last["generate_s"] = self.last.get("generate_s", 0.0) + t1 - t0
        self.last["reward_s"] = self.last.get("reward_s", 0.0) + time.perf_counter() - t1
        return groups

    def _terms(self, e: Episode) -> dict[str, float]:
        """The reward's named terms: the task's components (weighted by ``term_weights``), or
        the components of a custom reward (weight 1 each), or the reward itself as one term."""
        if self.task_terms:
            return {k: e.components.get(k, 0.0) for k in self.task_terms}
        return dict(e.components) if e.components else {"reward": e.reward}

    def term_weight(self, name: str) -> float:
        return self.term_weights.get(name, self.default_weight)

    def _add_learned_reward(self, flat: list[tuple[Group, Episode]]) -> None:
        """Score every completion with the learned reward in batches and mix it with the rule
        reward; the rule's score (correctness) stays what is logged as accuracy."""
        problems, texts = [g.problem for g, _ in flat], [e.text for _, e in flat]
        # the score and its named parts (a reader's: linguistic calibration), logged as reward/<part>
        details = self.scorer.score_detailed(problems, texts, extra_infos=[g.extra_info for g, _ in flat],
                                             finished=[e.finish_reason != "length" for _, e in flat])
        model_scores = [d.pop("reward") for d in details]
        for (_, e), s, parts in zip(flat, model_scores, details):
            rule = e.reward
            e.reward = self.rule_weight * rule + self.scorer_weight * float(s)
            e.components = {**e.components, "rule": rule, "model": float(s), **parts}
            e.terms = {**e.terms, "model": float(s)}

    def collect(self, sampler: StepSampler, n_groups: int, dynamic: bool, max_rounds: int) -> list[Group]:
        """The step's ``n_groups`` groups, the same list on every rank, in draw order.

        With ``dynamic``, zero-variance groups are dropped and more prompts drawn, for at
        most ``max_rounds`` generation batches; then whatever was kept (possibly fewer groups,
        or none: the caller skips the step).
        """
        # every rank samples a strided share with its own full engine, whatever the mesh: a replica's tp
        # ranks must hold the very same groups (rewards with timeouts could differ if each scored its own)
        rank, world = distributed.rank(), distributed.world_size()
        self.last = {}
        self._first_error = None
        kept: list[Group] = []
        rounds = 0
        failures: dict[str, int] = {"samples": 0, "exception": 0, "timeout": 0}
        while len(kept) < n_groups and rounds < (max_rounds if dynamic else 1):
            indices = sampler.next()  # the same on every rank
            first = sampler.drawn - len(indices)
            mine = list(range(rank, len(indices), world))  # strided share of this rank
            local = self.rollout([indices[j] for j in mine], [first + j for j in mine])
            groups = [g for part in distributed.all_gather_object(local) for g in part]
            groups.sort(key=lambda g: g.draw)
            rounds += 1
            # counted before dynamic sampling drops groups: failed rewards are all 0, so all-failed
            # groups have no variance and would vanish from the step unseen
            for e in (e for g in groups for e in g.episodes):
                failures["samples"] += 1
                if e.reward_error in failures:
                    failures[e.reward_error] += 1
            if dynamic:
                r = torch.tensor([e.reward for g in groups for e in g.episodes])
                drop = zero_variance_groups(r, len(groups[0].episodes)).tolist()
                self._filtered += sum(drop)
                groups = [g for g, d in zip(groups, drop) if not d]
            kept.extend(groups)
        self.last["rounds"] = float(rounds)
        if self.env is None and self.pool is not None:
            self._check_failures(failures["samples"], failures["exception"], failures["timeout"])
        self._collected += 1
        return kept[:n_groups]

    def _check_failures(self, samples: int, raised: int, timed_out: int) -> None:
        """Warn when most of a step's rewards failed; stop when all of the first step's did.

        The counts are the whole step's (every rank holds them after the gather), so every rank
        decides the same; the message is this rank's first failure."""
        failed = raised + timed_out
        if not samples or failed * 2 <= samples:
            return
        spec = getattr(self.pool, "spec", "?")
        first = " ".join(str(self._first_error or "(raised on another rank)").split())[:500]
        counts = f"{failed} of {samples} rewards failed ({raised} raised, {timed_out} timed out)"
        if failed == samples and self._collected == 0:
            raise ConfigError(f"task.reward_fn={spec}: every reward of the first step failed: {counts}; "
                              f"first error: {first}")
        if distributed.is_main():
            text = f"reward function {spec}: {counts} this step, scored 0; first error: {first}"
            log.warning(text)
            if not log.isEnabledFor(logging.WARNING) or not _reaches_a_handler(log):
                print(f"WARNING: {text}", file=sys.stderr, flush=True)

    def step_metrics(self, groups: list[Group]) -> dict[str, float]:
        """Per-step reward components, reward failures, multi-turn and sampling statistics."""
        eps = [e for g in groups for e in g.episodes]
        out: dict[str, float] = {}
        for k in sorted({k for e in eps for k in e.components}):
            out[f"reward/{k}"] = float(np.mean([e.components.get(k, 0.0) for e in eps]))
        if self.scorer is not None:  # a learned reward's own metrics (the reader's calibration)
            out.update(self.scorer.step_metrics([e.components for e in eps]))
        out["reward/errors"] = float(sum(e.reward_error == "exception" for e in eps))
        out["reward/timeouts"] = float(sum(e.reward_error == "timeout" for e in eps))
        if self.env is not None:
            out["env/turns_mean"] = float(np.mean([e.turns for e in eps])) if eps else 0.0
            out["env/errors"] = float(sum(e.env_errors for e in eps))
        out["rollout/rounds"] = self.last.get("rounds", 1.0)
        if self._filtered:
            out["rollout/filtered_groups"] = float(self._filtered)
            self._filtered = 0
        out["data/prompts_skipped_long"] = float(self.skipped_long)
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _reaches_a_handler(logger: logging.Logger) -> bool:
    """Whether a record from ``logger`` reaches a handler that shows warnings (logging's
    last-resort handler counts: it writes to stderr when nothing is configured)."""
    current: logging.Logger | None = logger
    found = False
    while current is not None:
        for h in current.handlers:
            found = True
            if h.level <= logging.WARNING:
                return True
        if not current.propagate:
            break
        current = current.parent
    return not found and logging.lastResort is not None
