"""DPO and the Bradley-Terry reward model learn a clearly separable preference, and the DPO
recipe's numbers do not depend on how the batch is cut or how the reference is obtained."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relign.config import load_config
from relign.tracking import read_metrics

from ..conftest import write_jsonl

WORDS = "apple river stone cloud green seven table music light paper horse candle".split()
GOOD = ["yes", "good", "right", "true", "up", "in", "on", "big"]  # one token each, like BAD
BAD = ["no", "down", "out", "off", "small", "a", "b", "c"]


def separable_pairs(n: int, seed: int) -> list[dict]:
    """Chosen and rejected say the same words and end with a marker: one of GOOD for the chosen,
    one of BAD for the rejected, drawn independently (so an untrained model's preferences
    between the two markers are coin flips over the set)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = "Say: " + " ".join(rng.choices(WORDS, k=3))
        body = " ".join(rng.choices(WORDS, k=rng.randint(2, 5)))
        rows.append({"prompt": prompt, "chosen": f"{body} {rng.choice(GOOD)}", "rejected": f"{body} {rng.choice(BAD)}"})
    return rows


@pytest.fixture(scope="module")
def pref_data(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("pref")
    return write_jsonl(d / "train.jsonl", separable_pairs(64, 0)), write_jsonl(d / "eval.jsonl", separable_pairs(32, 1))


def _dpo(model_dir, data, run_dir, *extra):
    from relign.recipes import preference

    train, held_out = data
    cfg = load_config(preference.Config, None, [
        f"model.path={model_dir}", f"data.path={train}", f"data.eval_path={held_out}", f"run_dir={run_dir}",
        "data.max_length=64", "batch_size=16", "micro_batch_size=8", "optim.lr=2e-3", "optim.warmup_ratio=0",
        "optim.schedule=constant", "logging.progress=false", "logging.tensorboard=false", "checkpoint.save_final=false",
        *extra,
    ])
    return preference.train(cfg)


@pytest.mark.slow
def test_dpo_learns_a_separable_preference(tiny_model_dir, pref_data, tmp_path):
    res = _dpo(tiny_model_dir, pref_data, tmp_path, "max_steps=16", "eval_every=16", "beta=0.5")
    hist = read_metrics(tmp_path)
    first, last = hist[1], hist[-1]
    assert first["train/loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference: h = 0, L = log 2
    assert first["train/rewards/margins"] == pytest.approx(0.0, abs=1e-4)
    # before the first update the random model's own ranking is a coin flip (~50%)
    assert 0.2 <= first["train/logps/accuracy"] <= 0.8
    assert last["eval/rewards/accuracy"] > 0.9
    assert last["eval/logps/accuracy"] > 0.9
    assert last["eval/rewards/margins"] > 1.0  # the implicit reward margin grew from 0
    assert last["train/loss"] < 0.3
    assert res.metrics["eval/rewards/accuracy"] == last["eval/rewards/accuracy"]


@pytest.mark.slow
def test_reward_model_learns_a_separable_preference(tiny_model_dir, pref_data, tmp_path):
    from relign.models.reward import load_scorer, scorer_kind
    from relign.recipes import reward_model

    train, held_out = pref_data
    cfg = load_config(reward_model.Config, None, [
        f"model.path={tiny_model_dir}", f"data.path={train}", f"data.eval_path={held_out}", f"run_dir={tmp_path}",
        "data.max_length=64", "batch_size=16", "micro_batch_size=8", "optim.lr=2e-3", "optim.warmup_ratio=0",
        "max_steps=16", "eval_every=1", "logging.progress=false", "logging.tensorboard=false",
    ])
    res = reward_model.train(cfg)
    hist = read_metrics(tmp_path)
    assert hist[1]["train/loss"] == pytest.approx(0.6931, abs=1e-3)  # zero-initialized head: r = 0 for all
    assert hist[1]["eval/accuracy"] <= 0.75
    assert hist[-1]["eval/accuracy"] > 0.9
    assert hist[-1]["eval/rewards/margins"] > hist[1]["eval/rewards/margins"]

    # the checkpoint is a plain HF sequence-classification model, and scores like the trainer
    assert scorer_kind(str(res.checkpoint)) == "rm"
    scorer = load_scorer(str(res.checkpoint))
    rows = separable_pairs(8, 5)
    good = scorer.score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    bad = scorer.score([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    assert sum(g > b for g, b in zip(good, bad)) >= 7


@pytest.mark.parametrize("loss", ["dpo", "kto"])
def test_loss_is_invariant_to_micro_batching_and_prompt_sharing(tiny_model_dir, pref_data, tmp_path, loss):
    """One step with 1 micro-batch of 16 == 4 of 4 (prompt shared or not, or packed) == the
    reference computed online instead of cached: same loss, same updated weights.

    Adam's first step is lr * g / (|g| + eps): with the default eps a coordinate whose gradient
    is ~1e-8 moves by anything up to lr when float summation order changes it by 1e-9, so the
    weights are compared after a step with eps = 1, where the step is ~lr * g (linear in the
    gradient, like SGD) and the check measures the gradients, not Adam's amplification of noise."""
    runs = {
        "one": ("micro_batch_size=16",),
        "four": ("micro_batch_size=4",),
        "full_rows": ("micro_batch_size=4", "share_prompt=false"),
        "online": ("micro_batch_size=8", "reference=online"),
        # one padding-free row per micro-batch, attention row by row (relign.models.varlen)
        "packed": ("micro_batch_size=4", "packing=true"),
        "packed_online": ("micro_batch_size=8", "packing=true", "reference=online"),
        # passes of at most 300 packed tokens (pairs.micro_batches), micro_batch_size no longer counting
        "budget": ("micro_batch_size=16", "packing=true", "max_tokens_per_micro=300"),
    }
    losses, weights = {}, {}
    for name, extra in runs.items():
        res = _dpo(tiny_model_dir, pref_data, tmp_path / name, "max_steps=1", f"loss={loss}", "checkpoint.save_final=true",
                   "data.eval_path=''", "optim.eps=1.0", *extra)
        losses[name] = read_metrics(tmp_path / name)[1]["train/loss"]
        weights[name] = load_file(str(Path(res.checkpoint) / "model.safetensors"))
    start = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    moved = max((weights["one"][k] - v).abs().max().item() for k, v in start.items() if k in weights["one"])
    assert moved > 1e-5  # the step is far larger than the tolerance below, so the check has teeth
    for name in runs:
        assert losses[name] == pytest.approx(losses["one"], abs=1e-5), name
        for k, v in weights[name].items():
            torch.testing.assert_close(v, weights["one"][k], atol=1e-7, rtol=0)


def test_reference_logps_are_cached_and_reused_on_resume(tiny_model_dir, pref_data, tmp_path):
    run = tmp_path / "run"
    _dpo(tiny_model_dir, pref_data, run, "max_steps=2", "checkpoint.save_every=2")
    cache = run / "reference_logps.safetensors"
    assert cache.is_file()
    stamp = cache.stat().st_mtime_ns
    _dpo(tiny_model_dir, pref_data, run, "max_steps=4", "checkpoint.save_every=2", "resume=auto")
    assert cache.stat().st_mtime_ns == stamp  # reused, not recomputed from the (moved) policy
    straight = tmp_path / "straight"
    _dpo(tiny_model_dir, pref_data, straight, "max_steps=4")
    resumed = [r["train/loss"] for r in read_metrics(run)[1:]]
    uninterrupted = [r["train/loss"] for r in read_metrics(straight)[1:]]
    assert resumed == pytest.approx(uninterrupted, abs=1e-6)


def test_lora_reference_is_the_adapter_free_base(tiny_model_dir, pref_data, tmp_path):
    """With LoRA and reference=online there is no second model: the reference is the policy
    with its adapter disabled, so the first loss is exactly log 2."""
    _dpo(tiny_model_dir, pref_data, tmp_path, "max_steps=2", "reference=online", "model.lora.enabled=true",
         "model.lora.r=4", "optim.lr=1e-2", "data.eval_path=''")
    hist = read_metrics(tmp_path)
    assert hist[1]["train/loss"] == pytest.approx(0.6931, abs=1e-4)
    assert hist[2]["train/loss"] < hist[1]["train/loss"]
    assert not (tmp_path / "reference_logps.safetensors").exists()


def test_micro_batches_are_cut_by_the_positions_each_example_computes():
    """by_positions: pairs ordered by prompt + 2 x longer response (shared prompt) or 2 x longer
    row (full rows), examples by length; ties keep the index order."""
    from relign.data.preference import PairExample, UnpairedExample
    from relign.recipes.pairs import by_positions

    def pair(p, c, r):
        return PairExample(chosen_ids=[1] * (p + c), chosen_mask=[0] * p + [1] * c, rejected_ids=[1] * (p + r),
                           rejected_mask=[0] * p + [1] * r, prompt_len=p)

    pairs = [pair(10, 5, 1), pair(2, 3, 4), pair(20, 1, 1), pair(1, 12, 2)]
    # shared: 10+2*5=20, 2+2*4=10, 20+2*1=22, 1+2*12=25; full rows: 2*15=30, 2*6=12, 2*21=42, 2*13=26
    assert by_positions(pairs, range(4), share_prompt=True) == [1, 0, 2, 3]
    assert by_positions(pairs, range(4), share_prompt=False) == [1, 3, 0, 2]
    assert by_positions(pairs, [3, 2, 0], share_prompt=True) == [0, 2, 3]
    ex = [UnpairedExample([1] * n, [1] * n, 0, True) for n in (5, 3, 5, 1)]
    assert by_positions(ex, range(4), share_prompt=False) == [3, 1, 0, 2]


def test_a_token_budget_cuts_the_pairs_into_passes_that_fit_it():
    """pairs.micro_batches with max_tokens: every pair once, each pass's packed tokens (a pair's two
    rows, or its prompt once and the rejected response from the prompt's last token) within the
    budget unless a pair alone is longer; without a budget, micro_batch_size pairs a pass."""
    from relign.data.preference import PairExample
    from relign.recipes.pairs import micro_batches, packed_tokens

    def pair(p, c, r):
        return PairExample(chosen_ids=[1] * (p + c), chosen_mask=[0] * p + [1] * c, rejected_ids=[1] * (p + r),
                           rejected_mask=[0] * p + [1] * r, prompt_len=p)

    pairs = [pair(10, 5, 1), pair(2, 3, 4), pair(20, 1, 1), pair(1, 12, 2), pair(40, 30, 30)]
    # shared: 15 + 11 - 9 = 17, 5 + 6 - 1 = 10, 21 + 21 - 19 = 23, 13 + 3 - 0 = 16, 70 + 70 - 39 = 101;
    # full rows: 26, 11, 42, 16, 140
    assert [packed_tokens(e, share_prompt=True) for e in pairs] == [17, 10, 23, 16, 101]
    assert [packed_tokens(e, share_prompt=False) for e in pairs] == [26, 11, 42, 16, 140]
    for share, budget in ((True, 40), (False, 60), (True, 30)):
        parts = micro_batches(pairs, range(5), share_prompt=share, micro_batch_size=1, max_tokens=budget)
        assert sorted(i for part in parts for i in part) == [0, 1, 2, 3, 4]
        for part in parts:
            used = sum(packed_tokens(pairs[i], share_prompt=share) for i in part)
            assert used <= budget or part == [4], (share, budget, part)
        # the 66 (shared) or 95 (full rows) tokens of the four short pairs need at least ceil(66 / 40) = 2 passes
        shorts = sum(packed_tokens(pairs[i], share_prompt=share) for i in range(4))
        assert len(parts) >= 1 + -(-shorts // budget)
    assert micro_batches(pairs, range(5), share_prompt=True, micro_batch_size=2) == [[1, 0], [2, 3], [4]]
