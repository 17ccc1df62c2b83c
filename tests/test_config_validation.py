"""Every count, size and rate of every recipe is checked at config time, before any model or data
loads: one line naming the key and its value (issue 14: batch_size=0 "trained" on empty batches
and exited 0, micro_batch_size=0 raised ZeroDivisionError, max_steps=-1 ran no step)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import pytest

from relign import distributed
from relign.config import ConfigError, load_config
from relign.checks import check_divides, check_fraction, check_model_path, check_non_negative, check_positive
from relign.recipes import demo, preference, reward_model, rest_em, rl, sft, verifier
from relign.recipes import eval as eval_recipe

# --------------------------------------------------------------------------- the helpers


@dataclass
class _Inner:
    lr: float = 1e-5


@dataclass
class _Cfg:
    batch_size: int = 16
    micro_batch_size: int = 4
    budget: int | None = None
    inner: _Inner = field(default_factory=_Inner)


def test_helpers_name_the_key_the_value_and_the_rule():
    cases = [
        (lambda: check_positive(_Cfg(batch_size=0), "batch_size"), "bad value for 'batch_size': 0; it must be >= 1"),
        (lambda: check_positive(_Cfg(inner=_Inner(lr=-1e-5)), "inner.lr"), "bad value for 'inner.lr': -1e-05; it must be > 0"),
        (lambda: check_non_negative(_Cfg(micro_batch_size=-2), "micro_batch_size"),
         "bad value for 'micro_batch_size': -2; it must be >= 0"),
        (lambda: check_fraction(_Cfg(inner=_Inner(lr=1.0)), "inner.lr"), "bad value for 'inner.lr': 1.0; it must be in [0, 1)"),
        (lambda: check_divides(_Cfg(batch_size=6), "batch_size", "micro_batch_size"),
         "bad value for 'batch_size': 6; it must be a multiple of micro_batch_size=4 (set micro_batch_size to a divisor "
         "of batch_size)"),
        (lambda: check_divides(_Cfg(batch_size=12), "batch_size", "micro_batch_size", 2),
         "bad value for 'batch_size': 12; it must be a multiple of micro_batch_size x ranks = 4 x 2 (set micro_batch_size "
         "to a divisor of batch_size)"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError) as e:
            call()
        assert str(e.value) == message
    check_positive(_Cfg(), "budget", allow_none=True)  # null = unset
    check_fraction(_Cfg(inner=_Inner(lr=1.0)), "inner.lr", closed=True)
    check_divides(_Cfg(batch_size=16), "batch_size", "micro_batch_size")


def test_model_path_must_be_given_and_a_local_one_must_exist(tmp_path):
    with pytest.raises(ConfigError, match=r"^missing value for 'model.path'"):
        check_model_path("model.path", "")
    for missing in (str(tmp_path / "nope"), "./nope", "runs/sft/checkpoints/step_9"):
        with pytest.raises(ConfigError) as e:
            check_model_path("model.path", missing)
        assert str(e.value).startswith(f"bad value for 'model.path': '{missing}'; no such folder")
    for fine in ("tiny:micro", "Qwen/Qwen2.5-0.5B-Instruct", "gpt2", str(tmp_path)):  # hub ids are checked when loaded
        check_model_path("model.path", fine)
    check_model_path("ref_model", "", required=False)


# --------------------------------------------------------------------------- every recipe

SFT = ["data.path=x.jsonl", "model.path=tiny:micro"]
RL = ["model.path=tiny:micro"]
VERIFIER = ["data.path=graded.jsonl", "model.path=tiny:micro"]

CASES = [  # (recipe, base overrides, bad override(s), the exact message)
    # sft: the cases
    (sft, SFT, ["batch_size=0"], "bad value for 'batch_size': 0; it must be >= 1"),
    (sft, SFT, ["batch_size=-4"], "bad value for 'batch_size': -4; it must be >= 1"),
    (sft, SFT, ["micro_batch_size=-2"], "bad value for 'micro_batch_size': -2; it must be >= 1"),
    (sft, SFT, ["micro_batch_size=0"], "bad value for 'micro_batch_size': 0; it must be >= 1"),
    (sft, SFT, ["max_steps=-1"], "bad value for 'max_steps': -1; it must be >= 0"),  # 0 = epochs x steps per epoch
    (sft, SFT, ["epochs=0"], "bad value for 'epochs': 0.0; it must be > 0"),
    (sft, SFT, ["batch_size=6"], "bad value for 'batch_size': 6; it must be a multiple of micro_batch_size=4 "
                                 "(set micro_batch_size to a divisor of batch_size)"),
    (sft, SFT, ["eval_batch_size=0"], "bad value for 'eval_batch_size': 0; it must be >= 1"),
    (sft, SFT, ["eval_every=-5"], "bad value for 'eval_every': -5; it must be >= 0"),
    (sft, SFT, ["optim.lr=0"], "bad value for 'optim.lr': 0.0; it must be > 0"),
    (sft, SFT, ["optim.lr=-1e-5"], "bad value for 'optim.lr': -1e-05; it must be > 0"),
    (sft, SFT, ["optim.warmup_ratio=1.5"], "bad value for 'optim.warmup_ratio': 1.5; it must be in [0, 1]"),
    (sft, SFT, ["optim.beta2=1.0"], "bad value for 'optim.beta2': 1.0; it must be in [0, 1)"),
    (sft, SFT, ["optim.max_grad_norm=-1"], "bad value for 'optim.max_grad_norm': -1.0; it must be >= 0"),
    (sft, SFT, ["optim.schedule=linear"], "bad value for 'optim.schedule': 'linear'; choose one of cosine, constant"),
    (sft, SFT, ["data.max_length=0"], "bad value for 'data.max_length': 0; it must be >= 1"),
    (sft, SFT, ["data.eval_fraction=1.0"], "bad value for 'data.eval_fraction': 1.0; it must be in [0, 1)"),
    (sft, SFT, ["data.max_rows=-1"], "bad value for 'data.max_rows': -1; it must be >= 0"),
    (sft, SFT, ["checkpoint.save_every=-1"], "bad value for 'checkpoint.save_every': -1; it must be >= 0"),
    (sft, SFT, ["model.lora.enabled=true", "model.lora.r=0"], "bad value for 'model.lora.r': 0; it must be >= 1"),
    (sft, SFT, ["model.dtype=fp8"], "bad value for 'model.dtype': 'fp8'; choose one of fp32, float32, bf16, bfloat16, bf16-mixed, bf16-compute"),
    (sft, ["data.path=x.jsonl"], [], "missing value for 'model.path': give a local model folder, a hub id (org/name) "
                                     "or tiny:SIZE"),
    (sft, SFT, ["model.path=./no/such/model"], "bad value for 'model.path': './no/such/model'; no such folder (give a "
                                               "local model folder, a hub id org/name or tiny:SIZE)"),
    # dpo family and reward model
    (preference, SFT, ["batch_size=0"], "bad value for 'batch_size': 0; it must be >= 1"),
    (preference, SFT, ["max_steps=-1"], "bad value for 'max_steps': -1; it must be >= 0"),
    (preference, SFT, ["micro_batch_size=0"], "bad value for 'micro_batch_size': 0; it must be >= 1"),
    (preference, SFT, ["batch_size=8", "micro_batch_size=3"], "bad value for 'batch_size': 8; it must be a multiple of "
                                                              "micro_batch_size=3 (set micro_batch_size to a divisor of "
                                                              "batch_size)"),
    (preference, SFT, ["beta=0"], "bad value for 'beta': 0.0; it must be > 0"),
    (preference, SFT, ["loss=kto", "kto_undesirable_weight=0"], "bad value for 'kto_undesirable_weight': 0.0; it must be > 0"),
    (preference, SFT, ["simpo_gamma=-0.5"], "bad value for 'simpo_gamma': -0.5; it must be >= 0"),
    (preference, SFT, ["ref_model=/no/such/ref"], "bad value for 'ref_model': '/no/such/ref'; no such folder (give a local "
                                                  "model folder, a hub id org/name or tiny:SIZE)"),
    (reward_model, SFT, ["batch_size=0"], "bad value for 'batch_size': 0; it must be >= 1"),
    (reward_model, SFT, ["max_steps=-1"], "bad value for 'max_steps': -1; it must be >= 0"),
    (reward_model, SFT, ["center_coef=-0.01"], "bad value for 'center_coef': -0.01; it must be >= 0"),
    (reward_model, SFT, ["data.max_length=0"], "bad value for 'data.max_length': 0; it must be >= 1"),
    # rl
    (rl, RL, ["max_steps=0"], "bad value for 'max_steps': 0; it must be >= 1"),
    (rl, RL, ["prompts_per_step=0"], "bad value for 'prompts_per_step': 0; it must be >= 1"),
    (rl, RL, ["rollout.n=0"], "bad value for 'rollout.n': 0; it must be >= 1"),
    (rl, RL, ["rollout.max_new_tokens=0"], "bad value for 'rollout.max_new_tokens': 0; it must be >= 1"),
    (rl, RL, ["rollout.top_p=0"], "bad value for 'rollout.top_p': 0.0; it must be > 0"),
    (rl, RL, ["rollout.top_p=1.5"], "bad value for 'rollout.top_p': 1.5; it must be in [0, 1]"),
    (rl, RL, ["rollout.min_new_tokens=300"], "bad value for 'rollout.min_new_tokens': 300; it must be <= "
                                             "rollout.max_new_tokens=256"),
    (rl, RL, ["algorithm.ppo_epochs=0"], "bad value for 'algorithm.ppo_epochs': 0; it must be >= 1"),
    (rl, RL, ["algorithm.gamma=1.5"], "bad value for 'algorithm.gamma': 1.5; it must be in [0, 1]"),
    (rl, RL, ["algorithm.dual_clip=0.5"], "bad value for 'algorithm.dual_clip': 0.5; it must be > 1 (or 0 = off)"),
    (rl, RL, ["micro_batch_size=-1"], "bad value for 'micro_batch_size': -1; it must be >= 0"),
    (rl, RL, ["max_tokens_per_micro=-1"], "bad value for 'max_tokens_per_micro': -1; it must be >= 0"),
    (rl, RL, ["task.reward_timeout=0"], "bad value for 'task.reward_timeout': 0.0; it must be > 0"),
    (rl, RL, ["eval.every=-1"], "bad value for 'eval.every': -1; it must be >= 0"),
    (rl, RL, ["critic.lr=0"], "bad value for 'critic.lr': 0.0; it must be > 0"),
    (rl, RL, ["optim.lr=0"], "bad value for 'optim.lr': 0.0; it must be > 0"),
    (rl, RL, ["rollout.engine=sglang"], "bad value for 'rollout.engine': 'sglang'; choose one of hf, vllm"),
    (rl, [], [], "missing value for 'model.path': give a local model folder, a hub id (org/name) or tiny:SIZE"),
    # eval
    (eval_recipe, RL, ["n=0"], "bad value for 'n': 0; it must be >= 1"),
    (eval_recipe, RL, ["max_new_tokens=0"], "bad value for 'max_new_tokens': 0; it must be >= 1"),
    (eval_recipe, RL, ["top_p=0"], "bad value for 'top_p': 0.0; it must be > 0"),
    (eval_recipe, RL, ["k=-1"], "bad value for 'k': -1; it must be >= 0"),
    (eval_recipe, RL, ["task.reward_workers=-1"], "bad value for 'task.reward_workers': -1; it must be >= 0"),
    (eval_recipe, RL, ["sweep.budgets=[256,0]"], "bad value for 'sweep.budgets': [256, 0]; every budget must be >= 1 token"),
    (eval_recipe, RL, ["search.width=0"], "bad value for 'search.width': 0; it must be >= 1"),
    (eval_recipe, [], [], "missing value for 'model.path': give a local model folder, a hub id (org/name) or tiny:SIZE"),
    # rest, verifier, demo
    (rest_em, RL, ["max_length=0"], "bad value for 'max_length': 0; it must be >= 1"),
    (rest_em, RL, ["rollout.top_p=0"], "bad value for 'rollout.top_p': 0.0; it must be > 0"),
    (rest_em, RL, ["val.batch_prompts=0"], "bad value for 'val.batch_prompts': 0; it must be >= 1"),
    (rest_em, RL, ["optim.lr=0"], "bad value for 'optim.lr': 0.0; it must be > 0"),
    (verifier, VERIFIER, ["batch_size=0"], "bad value for 'batch_size': 0; it must be >= 1"),
    (verifier, VERIFIER, ["max_steps=-1"], "bad value for 'max_steps': -1; it must be >= 0"),
    (verifier, VERIFIER, ["micro_batch_size=3"], "bad value for 'batch_size': 16; it must be a multiple of "
                                                 "micro_batch_size=3 (set micro_batch_size to a divisor of batch_size)"),
    (verifier, VERIFIER, ["data.eval_fraction=1"], "bad value for 'data.eval_fraction': 1.0; it must be in [0, 1)"),
    (verifier, ["data.path=graded.jsonl"], [], "missing value for 'model.path': give a local model folder, a hub id "
                                               "(org/name) or tiny:SIZE"),
    (demo, [], ["demo.test_problems=-1"], "bad value for 'demo.test_problems': -1; it must be >= 0"),
    (demo, [], ["demo.lr=-1e-4"], "bad value for 'demo.lr': -0.0001; it must be >= 0"),
    (demo, [], ["demo.model=./no/model"], "bad value for 'demo.model': './no/model'; no such folder (give a local model "
                                          "folder, a hub id org/name or tiny:SIZE)"),
]


@pytest.mark.parametrize("recipe, base, bad, message", CASES,
                         ids=[f"{c[0].__name__.rsplit('.', 1)[-1]}:{' '.join(c[2]) or 'no model.path'}" for c in CASES])
def test_every_recipe_names_the_bad_key_and_value(recipe, base, bad, message):
    cfg = load_config(recipe.Config, None, [*base, *bad])
    with pytest.raises(ConfigError) as e:
        recipe._check(cfg)
    assert str(e.value) == message and "\n" not in message


def test_the_batch_must_divide_across_ranks(monkeypatch):
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    with pytest.raises(ConfigError, match=r"^bad value for 'batch_size': 12; it must be a multiple of micro_batch_size "
                                          r"x ranks = 4 x 2"):
        sft._check(load_config(sft.Config, None, [*SFT, "batch_size=12"]))
    sft._check(load_config(sft.Config, None, [*SFT, "batch_size=16"]))


@pytest.mark.parametrize("recipe, base", [(sft, SFT), (preference, SFT), (reward_model, SFT), (rl, RL), (eval_recipe, RL),
                                          (rest_em, RL), (verifier, VERIFIER), (demo, [])])
def test_wandb_missing_is_reported_at_config_time(recipe, base, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_config(recipe.Config, None, [*base, "logging.wandb=true"])
    with pytest.raises(ConfigError) as e:
        recipe._check(cfg)
    assert str(e.value) == ("logging.wandb=true needs Weights & Biases, which is not installed: pip install "
                            "'relign[wandb]' (or set logging.wandb=false)")


def test_a_bad_demo_stage_setting_stops_the_demo_before_any_stage_runs(tmp_path):
    cfg = load_config(demo.Config, None, [f"run_dir={tmp_path / 'demo'}", "demo.threads=0",
                                          "demo.sft_overrides=[micro_batch_size=0]"])
    with pytest.raises(ConfigError) as e:
        demo.train(cfg)
    assert str(e.value) == ("the demo's sft stage (demo.* settings and demo.sft_overrides): bad value for "
                            "'micro_batch_size': 0; it must be >= 1")
    assert not (tmp_path / "demo" / "sft").exists()  # nothing trained


_LC_MODELS = ["model.path=tiny:micro", "reward.model=tiny:micro", "reward.reader.extractor=tiny:micro"]
STAGED_PRESETS = {"calibration": ["model.path=tiny:micro"], "lc_ppo": [*_LC_MODELS, "critic.path=tiny:micro"],
                  "lc_grpo": _LC_MODELS}
PRESET_RECIPES = {"sft_tiny": sft, "calibration_warm": sft, "rm": reward_model, "rest_em": rest_em, "verifier": verifier, "eval_gsm8k": eval_recipe,
                  "eval_search": eval_recipe, "demo": demo, **dict.fromkeys(("dpo", "dpop", "ipo", "kto", "orpo", "sdpo",
                                                                              "simpo"), preference)}


def test_every_shipped_preset_passes_the_checks():
    from .conftest import REPO

    presets = sorted((REPO / "examples").glob("*.yaml"))
    assert len(presets) >= 20
    for path in presets:
        recipe = PRESET_RECIPES.get(path.stem, rl)
        # presets that start from an earlier stage's checkpoints (docs/calibration.md): those paths made to exist
        overrides = STAGED_PRESETS.get(path.stem, [])
        recipe._check(load_config(recipe.Config, path, overrides))  # raises on a preset the checks would refuse
