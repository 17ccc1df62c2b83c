"""Turn a step's prompts into scored groups of episodes: prompts -> rollout -> rewards.

Single-turn: ``engine.generate`` samples G completions per prompt; the task's reward function
scores them in a ``RewardPool`` (worker processes, so a reward that raises or hangs gives 0
and is counted, and the run goes on). Multi-turn: the environment's ``step`` gives the
rewards (``multiturn.run_episodes``). With DAPO's dynamic sampling, groups whose rewards are
all equal carry no signal; they are dropped and more prompts are sampled to refill the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..algorithms.shaping import zero_variance_groups
from ..config import ConfigError
from ..data.collate import StepSampler
from .engine import SamplingParams
from .multiturn import Episode, episode_from_completion, run_episodes


@dataclass
class Group:
    prompt_text: str
    prompt_ids: list[int]
    extra_info: dict[str, Any]
    episodes: list[Episode]
    problem: str = ""
    """The problem as the user wrote it (the last user message, or the raw prompt), without any chat markup."""


def problem_text(rec: dict) -> str:
    """What a learned reward (or a verifier) reads as the problem of an RL record."""
    if "messages" in rec:
        users = [m["content"] for m in rec["messages"] if m.get("role") == "user"]
        return users[-1] if users else ""
    return rec.get("prompt", "")


def _load_records(task, path: str, split: str, max_rows: int, seed: int) -> list[dict]:
    if task is None:  # the calculator tool task generates its problems
        from ..envs.calculator import make_calculator_records

        return make_calculator_records(max_rows or 1024, seed=seed)
    return task.load(path or None, split or None, max_rows=max_rows)


class RolloutCollector:
    """Prompts of one task, the engine that samples them, and the rewards that score them."""

    def __init__(
        self,
        tokenizer,
        engine,
        *,
        task: str,
        path: str = "",
        split: str = "",
        max_rows: int = 0,
        chat: bool = True,
        system_prompt: str = "",
        max_prompt_length: int = 512,
        format_weight: float = 0.0,
        reward_fn: str = "",
        reward_timeout: float = 10.0,
        reward_workers: int = 2,
        env: str = "",
        sampling: SamplingParams,
        max_turns: int = 1,
        max_response_tokens: int = 0,
        seed: int = 0,
        scorer=None,
        scorer_weight: float = 1.0,
        rule_weight: float = 1.0,
    ):
        from ..envs.base import get_task, load_function
        from ..envs.rewards import RewardPool

        self.tok, self.engine, self.sampling = tokenizer, engine, sampling
        # learned reward (reward model / verifier): reward = rule_weight * rule + scorer_weight * model
        self.scorer, self.scorer_weight, self.rule_weight = scorer, scorer_weight, rule_weight
        self.max_turns = max_turns
        self.max_response_tokens = max_response_tokens or sampling.max_new_tokens * max_turns
        self.env = None
        if task == "calculator" and not env:
            env = "relign.envs.calculator:CalculatorEnv"
        if env:
            self.env = load_function(env)()
        opts: dict[str, Any] = {"chat": chat, "system_prompt": system_prompt or None}
        if reward_fn and ":" not in reward_fn:
            reward_fn += ":reward"  # 'my_reward.py' means its function named reward
        try:
            if task == "calculator":
                task_obj = None
            elif task == "custom":
                if not (path and reward_fn):
                    raise ConfigError("task.name=custom needs task.path (prompts) and task.reward_fn ('file.py:function')")
                task_obj = get_task("custom", data_path=path, reward_fn_spec=reward_fn, **opts)
            else:
                task_obj = get_task(task, format_weight=format_weight, **opts)
                if reward_fn:
                    load_function(reward_fn)  # fail now, not in a worker
        except (ValueError, TypeError, FileNotFoundError) as e:
            raise ConfigError(f"task: {e}") from None
        records = _load_records(task_obj, path, split, max_rows, seed)
        # Render and tokenize every prompt once; prompts too long to leave room are skipped.
        self.records: list[tuple[str, list[int], dict]] = []
        self.problems: list[str] = []
        self.skipped_long = 0
        for rec in records:
            text = self._render(rec)
            ids = tokenizer(text, add_special_tokens=not ("messages" in rec or chat))["input_ids"]
            if len(ids) > max_prompt_length:
                self.skipped_long += 1
                continue
            self.records.append((text, ids, rec.get("extra_info", {})))
            self.problems.append(problem_text(rec))
        if not self.records:
            raise ConfigError(f"task '{task}': no prompt fits task.max_prompt_length={max_prompt_length}")
        self.pool = None
        if self.env is None:
            spec = reward_fn or task_obj.reward_spec
            kwargs = {} if reward_fn else task_obj.reward_kwargs
            self.pool = RewardPool(spec, kwargs=kwargs, num_workers=reward_workers, timeout=reward_timeout)
        self._rounds: list[int] = []
        self._filtered = 0
        self._last_stats = dict(self.pool.stats) if self.pool else {}

    def __len__(self) -> int:
        return len(self.records)

    def _render(self, rec: dict) -> str:
        if "messages" in rec:
            return self.tok.apply_chat_template(rec["messages"], tokenize=False, add_generation_prompt=True)
        return rec["prompt"]

    # ------------------------------------------------------------------ rollout
    def rollout(self, indices: list[int]) -> list[Group]:
        texts = [self.records[i][0] for i in indices]
        ids = [self.records[i][1] for i in indices]
        infos = [self.records[i][2] for i in indices]
        problems = [self.problems[i] for i in indices]
        if self.env is not None:
            eps = run_episodes(self.engine, self.tok, self.env, ids, infos, self.sampling,
                               max_turns=self.max_turns, max_response_tokens=self.max_response_tokens)
            return [Group(t, p, info, g, q) for t, p, info, g, q in zip(texts, ids, infos, eps, problems)]
        outs = self.engine.generate(ids, self.sampling)
        groups = [Group(t, p, info, [episode_from_completion(p, c) for c in cs], q)
                  for t, p, info, cs, q in zip(texts, ids, infos, outs, problems)]
        flat = [(g, e) for g in groups for e in g.episodes]
        results = self.pool.score([g.prompt_text for g, _ in flat], [e.text for _, e in flat], [g.extra_info for g, _ in flat])
        for (_, e), r in zip(flat, results):
            e.reward, e.score, e.components, e.reward_error = r.reward, r.score, dict(r.components), r.error
        if self.scorer is not None:
            self._add_learned_reward(flat)
        return groups

    def _add_learned_reward(self, flat: list[tuple[Group, Episode]]) -> None:
        """Score every completion with the learned reward in batches and mix it with the rule
        reward; the rule's score (correctness) stays what is logged as accuracy."""
        model_scores = self.scorer.score([g.problem for g, _ in flat], [e.text for _, e in flat])
        for (_, e), s in zip(flat, model_scores):
            rule = e.reward
            e.reward = self.rule_weight * rule + self.scorer_weight * float(s)
            e.components = {**e.components, "rule": rule, "model": float(s)}

    def collect(self, sampler: StepSampler, n_groups: int, dynamic: bool, max_rounds: int) -> list[Group]:
        """``n_groups`` groups for one step. With ``dynamic``, zero-variance groups are dropped
        and more prompts sampled, for at most ``max_rounds`` rounds (then whatever was kept;
        if nothing was, the last round as it is, whose advantages are simply 0)."""
        kept: list[Group] = []
        rounds = 0
        groups: list[Group] = []
        while len(kept) < n_groups and rounds < (max_rounds if dynamic else 1):
            groups = self.rollout(sampler.next())
            rounds += 1
            if dynamic:
                r = torch.tensor([e.reward for g in groups for e in g.episodes])
                flat = zero_variance_groups(r, len(groups[0].episodes)).tolist()
                self._filtered += sum(flat)
                groups = [g for g, drop in zip(groups, flat) if not drop]
            kept.extend(groups)
        self._rounds.append(rounds)
        return kept[:n_groups] if kept else groups

    def step_metrics(self, groups: list[Group]) -> dict[str, float]:
        """Per-step reward components, reward failures, multi-turn and sampling statistics."""
        eps = [e for g in groups for e in g.episodes]
        out: dict[str, float] = {}
        for k in sorted({k for e in eps for k in e.components}):
            out[f"reward/{k}"] = float(np.mean([e.components.get(k, 0.0) for e in eps]))
        if self.pool is not None:
            now = dict(self.pool.stats)
            out["reward/errors"] = float(now.get("exceptions", 0) - self._last_stats.get("exceptions", 0))
            out["reward/timeouts"] = float(now.get("timeouts", 0) - self._last_stats.get("timeouts", 0))
            self._last_stats = now
        if self.env is not None:
            out["env/turns_mean"] = float(np.mean([e.turns for e in eps]))
            out["env/errors"] = float(sum(e.env_errors for e in eps))
        out["rollout/rounds"] = float(self._rounds[-1]) if self._rounds else 1.0
        if self._filtered:
            out["rollout/filtered_groups"] = float(self._filtered)
            self._filtered = 0
        out["data/prompts_skipped_long"] = float(self.skipped_long)
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
