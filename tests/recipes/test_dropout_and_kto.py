"""Two correctness checks of the preference recipe.

* Dropout is off: with a dropout-0.5 model, step 1 of DPO (policy = reference) gives a loss of
  exactly log 2 through the real CLI (0.69498 while the policy still ran its dropout).
* KTO's mismatched pairs never give a prompt a completion of the same prompt (split pairs
  [A+, A-, B+, B-, ...] used to pair A+ with A-).
"""

from __future__ import annotations

import math
import shutil

import pytest

from relign.config import ConfigError
from relign.data.preference import UnpairedExample
from relign.recipes.preference import kl_examples
from relign.tracking import read_metrics

from ..conftest import REPO, run_cli

# ------------------------------------------------------------------- dropout: DPO step 1 = log 2

FAST_ONE_STEP = ["data.max_rows=16", "data.max_length=192", "data.eval_fraction=0.25", "batch_size=4", "micro_batch_size=2",
                 "optim.lr=1e-3", "optim.warmup_ratio=0", "optim.schedule=constant", "max_steps=1", "eval_every=0",
                 "checkpoint.save_every=0", "logging.tensorboard=false"]


def test_dpo_step1_loss_is_log2_with_a_dropout_model(tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    model = tmp_path / "qwen2-dropout"
    shutil.copytree(tiny_model_dir, model)
    cfg = AutoConfig.from_pretrained(model)
    cfg.attention_dropout = 0.5  # a float handed to the SDPA kernel in train mode
    cfg.save_pretrained(model)
    run = tmp_path / "run"
    run_cli("dpo", str(REPO / "examples" / "dpo.yaml"), f"model.path={model}", f"run_dir={run}", *FAST_ONE_STEP)
    step1 = next(r for r in read_metrics(run) if "train/loss" in r)
    # the reference is the starting policy, so every implicit reward is 0 and the loss log 2
    assert step1["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert step1["train/rewards/margins"] == pytest.approx(0.0, abs=1e-5)


# ------------------------------------------------------------------- KTO mismatched pairs

PROMPTS = {"A": [1, 2], "B": [3, 4, 5], "C": [6]}


def _ex(prompt: str, completion: list[int], label: bool) -> UnpairedExample:
    p = PROMPTS[prompt]
    return UnpairedExample(p + completion, [0] * len(p) + [1] * len(completion), len(p), label)


def _split_pairs() -> list[UnpairedExample]:
    """Pairs split into a desirable and an undesirable row, as load_examples gives them for KTO."""
    return [_ex("A", [10, 11], True), _ex("A", [12], False), _ex("B", [20], True), _ex("B", [21, 22, 23], False),
            _ex("C", [30], True), _ex("C", [31, 32], False)]


def _prompt(e: UnpairedExample) -> list[int]:
    return e.input_ids[: e.prompt_len]


def _completion(e: UnpairedExample) -> list[int]:
    return e.input_ids[e.prompt_len :]


def _check(examples: list[UnpairedExample], sources: list[int]) -> None:
    """Row i of kl_examples is prompt i + the completion (mask, label) of examples[sources[i]]."""
    out = kl_examples(examples, max_length=64)
    assert len(out) == len(examples)
    for i, (e, k) in enumerate(zip(examples, out)):
        o = examples[sources[i]]
        assert k.input_ids == _prompt(e) + _completion(o), i
        assert k.loss_mask == [0] * e.prompt_len + [1] * len(_completion(o))
        assert k.prompt_len == e.prompt_len and k.label == o.label
        assert _prompt(o) != _prompt(e), i  # really mismatched


def test_kto_split_pairs_shift_by_two():
    exs = _split_pairs()
    # [A+, A-, B+, B-, C+, C-] -> completions of [B+, B-, C+, C-, A+, A-]
    _check(exs, [2, 3, 4, 5, 0, 1])
    out = kl_examples(exs, max_length=64)
    assert out[0].input_ids == [1, 2, 20] and out[1].input_ids == [1, 2, 21, 22, 23]
    assert out[4].input_ids == [6, 10, 11] and out[5].input_ids == [6, 12]


def test_kto_unpaired_rows_take_the_smallest_cyclic_shift():
    exs = [_ex("A", [10], True), _ex("B", [20], False), _ex("A", [11], True), _ex("C", [30], False)]
    _check(exs, [1, 2, 3, 0])
    # the shift is cyclic: with A last, 1 would give the last A the first A's completion
    exs = [_ex("A", [10], True), _ex("B", [20], False), _ex("C", [30], True), _ex("A", [11], False)]
    _check(exs, [2, 3, 0, 1])


def test_kto_irregular_data_falls_back_to_the_next_other_prompt():
    # A A B C B: every shift matches a prompt with itself (s=1: A0-A1, 2: B2-B4, 3: B4-B2, 4: A1-A0)
    exs = [_ex("A", [10], True), _ex("A", [11], False), _ex("B", [20], True), _ex("C", [30], False), _ex("B", [21], True)]
    _check(exs, [2, 2, 3, 4, 0])
    # one prompt holds most rows (no shift can work): A A A B C
    exs = [_ex("A", [10], True), _ex("A", [11], False), _ex("A", [12], True), _ex("B", [20], True), _ex("C", [30], False)]
    _check(exs, [3, 3, 3, 4, 0])


def test_kto_truncates_to_max_length():
    out = kl_examples(_split_pairs(), max_length=3)
    assert [k.input_ids for k in out] == [[1, 2, 20], [1, 2, 21], [3, 4, 5], [3, 4, 5], [6, 10, 11], [6, 12]]
    assert all(len(k.loss_mask) == len(k.input_ids) for k in out)


def test_kto_one_prompt_only_raises():
    with pytest.raises(ValueError, match="at least two distinct prompts"):
        kl_examples([_ex("A", [10], True), _ex("A", [11], False)], max_length=64)
    with pytest.raises(ConfigError):  # a ValueError the CLI prints as a config error
        kl_examples([_ex("B", [20], True)], max_length=64)
    assert kl_examples([], max_length=64) == []


# ------------------------------------------------------------------- dropout: RL engine = trainer


def test_rl_trainer_logps_equal_the_engines_with_a_dropout_model(tiny_model_dir, tmp_path):
    """The engine samples in eval mode; the trainer's forwards must see the same distribution.
    With attention dropout 0.5 left on, the trainer's log-probs of the sampled tokens were off by
    0.076 nats on average on this toy; with dropout off they agree to float rounding
    (actor/logp_mismatch)."""
    from transformers import AutoConfig

    from relign.config import load_config
    from relign.recipes import rl

    from ..rl_toy import toy_overrides

    model = tmp_path / "qwen2-dropout"
    shutil.copytree(tiny_model_dir, model)
    cfg = AutoConfig.from_pretrained(model)
    cfg.attention_dropout = 0.5
    cfg.save_pretrained(model)
    rl_cfg = load_config(rl.Config, None, [*toy_overrides(model, tmp_path), f"run_dir={tmp_path / 'run'}", "max_steps=1",
                                           "prompts_per_step=2", "rollout.n=2", "checkpoint.save_final=false",
                                           "traces_per_step=0"])
    (row,) = [r for r in rl.train(rl_cfg).history if "actor/logp_mismatch" in r]
    assert row["actor/logp_mismatch"] < 1e-5
