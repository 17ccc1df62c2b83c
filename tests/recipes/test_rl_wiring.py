"""The RL recipe's wiring, checked against numbers worked out by hand.

The pure functions of relign/algorithms are tested on their own; these tests check that the
recipe feeds them the right inputs: GDPO's reward terms and weights, the overlong penalty's
budget in multi-turn episodes, the REINFORCE++ baseline through the estimator table, the
learning-rate schedule's count of updates, the logged loss, and the config checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from relign import distributed
from relign.checkpoint import latest_checkpoint, load_checkpoint
from relign.config import ConfigError, load_config
from relign.recipes import rl
from relign.recipes import rl_advantages as ra
from relign.rollout.batch import build_batch
from relign.rollout.collect import Group, RolloutCollector
from relign.rollout.engine import SamplingParams
from relign.rollout.multiturn import Episode

from ..rl_toy import toy_overrides

S = 1 / math.sqrt(2)  # a group of two different values normalizes to +-1/sqrt(2) (unbiased std)


def _episode(prompt_len: int, mask: list[int], reward: float, terms: dict[str, float]) -> Episode:
    n = len(mask)
    return Episode(prompt_ids=list(range(1, prompt_len + 1)), response_ids=list(range(10, 10 + n)), response_mask=mask,
                   sampling_logps=[0.0] * n, token_rewards=[0.0] * (n - 1) + [reward], reward=reward, terms=terms)


def _groups(episodes: list[Episode], G: int) -> list[Group]:
    return [Group("p", e[0].prompt_ids, {}, e) for e in (episodes[i : i + G] for i in range(0, len(episodes), G))]


def test_builtin_task_terms_carry_the_format_weight():
    """The collector's term weights are the task's reward weights (correct 1, format format_weight)."""
    from relign.recipes.build import task_for

    task = task_for(rl.TaskConfig(name="gsm8k", format_weight=0.5))
    c = RolloutCollector(None, None, [], sampling=SamplingParams(), term_weights=task.term_weights)
    e = Episode(prompt_ids=[1], components={"correct": 0.0, "format": 1.0}, reward=0.5)
    assert c._terms(e) == {"correct": 0.0, "format": 1.0}
    assert (c.term_weight("correct"), c.term_weight("format")) == (1.0, 0.5)
    # a learned reward scales the rule's terms by reward.rule_weight and adds the model's score
    c = RolloutCollector(None, None, [], sampling=SamplingParams(), term_weights=task.term_weights, scorer=object(),
                         scorer_weight=2.0, rule_weight=0.5)
    assert (c.term_weight("correct"), c.term_weight("format"), c.term_weight("model")) == (0.5, 0.25, 2.0)


def test_gdpo_normalizes_every_reward_term_with_its_weight():
    """GDPO sees the task's terms with their weights (format 0.5), DAPO's overlong penalty and the
    KL in the reward, each normalized within its group, then the batch (arXiv 2601.05242).

    Terms (G = 2):       correct  format(w .5)  overlong(w 1)  kl(w -beta = -.5)
        e0 (L = 10)         1        0             -1            0.2
        e1 (L = 5)          0        1              0            0
        e2 (L = 5)          1        1              0            0
        e3 (L = 5)          1        0              0            0
    overlong: L_max 10, cache 4 -> 10 is at the end of the ramp: (6 - 10) / 4 = -1.
    Group-normalized (two different values -> +-s, s = 1/sqrt 2; equal -> 0):
        correct [s, -s, 0, 0]; format [-s, s, s, -s]; overlong [-s, s, 0, 0]; kl [s, -s, 0, 0]
    A = correct + .5 format + overlong - .5 kl = [-s, s, s/2, -s/2]
    batch: mean 0, unbiased var (s^2 + s^2 + s^2/4 + s^2/4) / 3 = 5/12 -> A / sqrt(5/12).
    (Before the fix GDPO saw the raw components with weight 1 and neither shaping term.)
    """
    eps = [
        _episode(3, [1] * 10, 1.0, {"correct": 1.0, "format": 0.0}),
        _episode(3, [1] * 5, 0.5, {"correct": 0.0, "format": 1.0}),
        _episode(2, [1] * 5, 1.5, {"correct": 1.0, "format": 1.0}),
        _episode(2, [1] * 5, 1.0, {"correct": 1.0, "format": 0.0}),
    ]
    groups = _groups(eps, 2)
    batch = build_batch(eps, 0, "cpu", 2)
    kl_tok = torch.zeros(batch.input_ids.shape)
    kl_tok[0, 3:13] = 0.02  # sum over e0's response: 0.2
    weights = {"correct": 1.0, "format": 0.5}.get
    ra.check_terms(groups, weights)
    r = ra.shaped_rewards(groups, batch, term_weight=weights, overlong="penalty", max_len=10, overlong_cache=4,
                          kl_tok=kl_tok, kl_coef=0.5)
    adv, returns = ra.ESTIMATORS["gdpo"].fn(r, batch.response_mask, None, ra.AdvantageOptions(group_size=2))
    want = torch.tensor([-S, S, S / 2, -S / 2]) / math.sqrt(5 / 12)
    torch.testing.assert_close(adv[:, 3], want, atol=1e-5, rtol=0)  # every response token carries its row's A
    assert returns is None
    # the sequence reward the other estimators see: task reward + overlong - beta * sum KL
    torch.testing.assert_close(r.seq, torch.tensor([1.0 - 1.0 - 0.1, 0.5, 1.5, 1.0]))
    torch.testing.assert_close(r.outcome, torch.tensor([0.0, 0.5, 1.5, 1.0]))


def test_gdpo_refuses_terms_that_do_not_add_up_to_the_reward():
    eps = [_episode(2, [1, 1], 0.25, {"spaces": 1.0, "lead": 0.0}), _episode(2, [1, 1], 0.5, {"spaces": 2.0, "lead": 1.0})]
    with pytest.raises(ConfigError, match="gdpo_weights"):
        ra.check_terms(_groups(eps, 2), lambda k: 1.0)
    ra.check_terms(_groups(eps, 2), {"spaces": 0.25, "lead": 0.0}.get)  # algorithm.gdpo_weights makes them add up


def test_multi_turn_overlong_penalty_uses_the_episode_budget():
    """A 3-turn episode: model 4, environment 3, model 4 tokens = 11 response tokens against the
    episode's budget of 12 (max_new_tokens 4 x ... capped by max_response_tokens 12), cache 4:
    the ramp starts at 8, so the penalty is (8 - 11) / 4 = -0.75 on the last model token.
    (Before: the 8 model tokens against the per-turn max_new_tokens 4 gave -1.)"""
    e = _episode(3, [1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1], 1.0, {"reward": 1.0})
    e.token_rewards = [0.0] * 3 + [0.5] + [0.0] * 6 + [0.5]  # turn rewards on each turn's last model token
    batch = build_batch([e], 0, "cpu", 1)
    r = ra.shaped_rewards([Group("p", e.prompt_ids, {}, [e])], batch, term_weight=lambda k: 1.0, overlong="penalty",
                          max_len=12, overlong_cache=4)
    assert r.seq.tolist() == [pytest.approx(0.25)]
    assert r.token[0, 3 + 3].item() == 0.5 and r.token[0, 3 + 10].item() == pytest.approx(0.5 - 0.75)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_baseline_estimator_gives_zero_to_an_equal_group(gamma):
    eps = [_episode(2, [1, 1, 1], 1.0, {"reward": 1.0}) for _ in range(2)]
    eps += [_episode(2, [1, 1, 1], v, {"reward": v}) for v in (0.0, 1.0)]
    batch = build_batch(eps, 0, "cpu", 2)
    r = ra.shaped_rewards(_groups(eps, 2), batch, term_weight=lambda k: 1.0)
    adv, _ = ra.ESTIMATORS["reinforce_pp_baseline"].fn(r, batch.response_mask, None,
                                                       ra.AdvantageOptions(group_size=2, gamma=gamma))
    assert torch.equal(adv[:2], torch.zeros_like(adv[:2]))  # the all-equal group: nothing to learn
    assert adv[2:].abs().sum() > 0


# --------------------------------------------------------------------------- the recipe, in process


def _train(tiny_model_dir, tmp_path, *extra):
    cfg = load_config(rl.Config, None, [*toy_overrides(tiny_model_dir, tmp_path, fn="graded"), f"run_dir={tmp_path / 'run'}",
                                        "traces_per_step=0", *extra])
    return rl.train(cfg)


def test_schedule_ends_at_its_end_value_with_uneven_mini_batches_and_skipped_steps(tiny_model_dir, tmp_path):
    """3 steps x 3 mini-batches of 4 groups (2 + 1 + 1) = 9 planned updates: the cosine schedule
    is stepped 9 times and ends at min_lr. (Before: ceil(4 / 3) = 2 groups per mini-batch made
    2 updates a step, 6 in all, and the run stopped a third of the way down the cosine.)"""
    common = ("max_steps=3", "prompts_per_step=4", "rollout.n=2", "algorithm.mini_batches=3", "optim.lr=1e-3",
              "optim.schedule=cosine", "optim.min_lr_ratio=0.1")
    result = _train(tiny_model_dir, tmp_path / "a", *common)
    lrs = [r["actor/lr"] for r in result.history if "actor/lr" in r]
    tensors, _ = load_checkpoint(latest_checkpoint(result.run_dir), restore_rng=False)
    assert tensors["scheduler"]["last_epoch"] == 9
    # the lr of the next update would be the end value; the last one used is one step before it
    assert tensors["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-4)
    # actor/lr is the mean lr of the step's three updates: factor(s) = 0.1 + 0.9 (1 + cos(pi s / 9)) / 2
    factor = [0.1 + 0.9 * (1 + math.cos(math.pi * s / 9)) / 2 for s in range(9)]
    assert lrs == pytest.approx([1e-3 * sum(factor[3 * k : 3 * k + 3]) / 3 for k in range(3)])


def test_dynamic_sampling_that_keeps_nothing_skips_the_step_and_the_schedule_still_ends(tiny_model_dir, tmp_path):
    const = tmp_path / "const.py"
    const.write_text("def reward(prompt, response, extra_info):\n    return 1.0\n")
    result = _train(tiny_model_dir, tmp_path, f"task.reward_fn={const}:reward", "max_steps=2", "prompts_per_step=2",
                    "rollout.n=2", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=2",
                    "optim.schedule=cosine", "optim.min_lr_ratio=0.1", "optim.lr=1e-3")
    rows = [r for r in result.history if r.get("step", 0) >= 1]
    assert [r["rollout/skipped_steps"] for r in rows] == [1.0, 2.0]
    assert all(r["rollout/rounds"] == 2.0 for r in rows)  # it drew a second batch before giving up
    tensors, _ = load_checkpoint(latest_checkpoint(result.run_dir), restore_rng=False)
    assert tensors["scheduler"]["last_epoch"] == 2
    assert tensors["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-4)


def test_logged_loss_is_the_batch_loss_whatever_the_micro_batches(tiny_model_dir, tmp_path):
    """actor/loss is the loss of the whole mini-batch, not a mean of micro-batch losses: one row
    per micro-batch gives the same value as one micro-batch for everything."""
    common = ("max_steps=2", "prompts_per_step=4", "rollout.n=2", "algorithm.mini_batches=2", "optim.lr=1e-3",
              "algorithm.loss_agg=token-mean", "share_prompt=false", "checkpoint.save_final=false")
    one = _train(tiny_model_dir, tmp_path / "one", *common, "max_tokens_per_micro=0")
    many = _train(tiny_model_dir, tmp_path / "many", *common, "micro_batch_size=1")
    a = [(r["actor/loss"], r["actor/grad_norm"]) for r in one.history if "actor/loss" in r]
    b = [(r["actor/loss"], r["actor/grad_norm"]) for r in many.history if "actor/loss" in r]
    assert len(a) == 2 and abs(a[0][0]) > 1e-4
    for x, y in zip(a, b):
        assert x == pytest.approx(y, abs=1e-6)


# --------------------------------------------------------------------------- config checks


def _cfg(*overrides):
    return load_config(rl.Config, None, ["model.path=unused", *overrides])


@pytest.mark.parametrize("overrides, match", [
    (["rollout.temperature=0"], "temperature"),
    (["algorithm.policy_loss=gspo"], "seq-mean-token-mean"),
    (["algorithm.kl=loss"], "kl_coef > 0"),
    (["algorithm.kl_coef=0.04"], "algorithm.kl=loss"),
    (["algorithm.mini_batches=16", "prompts_per_step=8"], "whole groups"),
    (["algorithm.advantage=rloo", "rollout.n=1"], "rollout.n >= 2"),
    (["algorithm.overlong=penalty", "algorithm.overlong_cache=300"], "overlong_cache"),
])
def test_config_errors_name_the_keys(overrides, match):
    with pytest.raises(ConfigError, match=match):
        rl._check(_cfg(*overrides))


def test_prompts_that_do_not_divide_across_ranks(monkeypatch):
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    with pytest.raises(ConfigError, match=r"prompts_per_step=3 does not divide across 2 ranks"):
        rl._check(_cfg("prompts_per_step=3"))
    rl._check(_cfg("prompts_per_step=4"))


class _FiveTurns:
    max_turns = 5

    async def step(self, state, action, extra_info):
        return {"next_state": state + action, "reward": 0.0, "score": 0.0, "done": True, "extra_info": extra_info}


def test_max_turns_0_reads_the_env_classes_own_limit():
    """rollout.max_turns=0 with a task.env class: its max_turns attribute, else one line naming the key."""
    from relign.config import ConfigError
    from relign.envs.tasks import get_task
    from relign.recipes.build import env_turn_limit

    task = get_task("calculator")
    assert env_turn_limit(task, f"{__name__}:_FiveTurns") == 5
    with pytest.raises(ConfigError, match=r"rollout\.max_turns=0 .*calculator.*CalculatorEnv\) has no fixed one"):
        env_turn_limit(task, task.env)
    with pytest.raises(ConfigError, match=r"rollout\.max_turns=0 .* task 'gsm8k' has no multi-turn environment"):
        env_turn_limit(get_task("gsm8k"), "")
