"""bench/arithmetic.py: the FLOP counts behind BENCHMARKS.md's bounds, checked against counts
worked out by hand on a toy shape, and the script run on the real bench shapes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from .conftest import load_script


@pytest.fixture(scope="module")
def arith():
    return load_script("bench/arithmetic.py", "bench_arithmetic")


def toy(arith):
    # hidden 4, 2 heads of 2, 1 K/V head, MLP 8, one layer, vocabulary 10
    return arith.Shape(SimpleNamespace(hidden_size=4, num_attention_heads=2, num_key_value_heads=1, head_dim=2,
                                       intermediate_size=8, num_hidden_layers=1, vocab_size=10))


def test_shape_counts_by_hand(arith):
    m = toy(arith)
    # q 4x4, k and v 4x2 each, o 4x4, gate/up/down 3 x 4x8: 144 weights, 2 FLOPs each
    assert (m.token, m.head, m.pair) == (288, 80, 16)
    assert m.causal(5) == 15 * 16 and m.full(2, 4) == 8 * 16


def test_dpo_counts_by_hand(arith):
    m = toy(arith)
    r = arith.dpo(m, [(3, 2, 1)], micro=1)  # prompt 3, chosen 2, rejected 1
    # relign, x3 for training: 7 positions (prompt, chosen, the prompt's last token again, rejected),
    # [prompt; chosen] causal (15 pairs), the rejected continuation 2 queries x 4 keys, logits at 3
    relign = 3 * (7 * 288 + 15 * 16 + 8 * 16 + 3 * 80)
    # TRL: two rows padded to 5, masked attention 25 pairs each, logits at every position
    trl = 3 * 2 * (5 * 288 + 25 * 16 + 5 * 80)
    assert (r["relign_gflop"] * 1e9, r["trl_gflop"] * 1e9) == pytest.approx((relign, trl))
    assert r["positions_ratio_trl_over_relign"] == pytest.approx(10 / 7)


def test_grpo_counts_by_hand(arith):
    m = toy(arith)
    r = arith.grpo(m, [2, 2, 2, 2], G=2, T=2)
    # relign, per prompt: prefill (2 tokens, 3 causal pairs, logits once); one decode step per row
    # against 3 keys; reference + update (x4) on [prompt, y_1] (4 tokens causal) and one continuation
    # of 3 tokens against 1 prefix key and its own, logits at G x T positions
    per_prompt = (2 * 288 + 3 * 16 + 80) + 2 * (288 + 3 * 16 + 80) + 4 * (4 * 288 + 10 * 16 + 3 * 288 + 12 * 16 + 4 * 80)
    # TRL, per prompt: each of the G rows prefilled (masked 2x2) and decoded once against 3 keys;
    # reference + update on G rows of 4 tokens, masked 4x4, logits at T + 1 positions
    trl = 2 * ((2 * 288 + 4 * 16 + 80) + (288 + 3 * 16 + 80)) + 4 * 2 * (4 * 288 + 16 * 16 + 3 * 80)
    assert (r["relign_gflop_per_step"] * 1e9, r["trl_gflop_per_step"] * 1e9) == pytest.approx((4 * per_prompt, 4 * trl))


def test_script_on_the_bench_shapes(arith, capsys):
    arith.main(["--max-new-tokens", "128"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["pairs"] == 52 and out["prompt_tokens_mean"] == pytest.approx(109.234375)  # the benches' own figures
    # the bounds BENCHMARKS.md quotes
    assert out["grpo_128"]["flop_ratio_trl_over_relign"] == pytest.approx(1.90, abs=0.005)
    assert out["dpo"]["flop_ratio_trl_over_relign"] == pytest.approx(1.45, abs=0.005)
    assert out["dpo"]["positions_ratio_trl_over_relign"] == pytest.approx(1.33, abs=0.005)
