"""``bench/ab/logprob.py`` (the GPU A/B section of issue 45 item 2) at its CPU smoke shape: every
variant runs, and each agrees with the old path (the same bf16 logits; gradients to bf16 rounding)."""

from __future__ import annotations


def test_logprob_section_smoke():
    from bench.ab import logprob

    out = logprob.run(True, "cpu", 60.0)
    assert out["tokens"] == 64 and out["vocab"] == 512
    assert set(out["sft"]) == {"old", "stage_a", "stage_b", "stage_b_chunk1024", "stage_b_weighted"}
    assert set(out["rl"]) == {"old", "stage_a", "stage_b"}
    for part in ("sft", "rl"):
        for name, res in out[part].items():
            if name == "old":
                continue
            d = res["max_abs_diff"]
            assert d["logp"] <= 1e-5 and d["loss"] <= 1e-5, (part, name, d)
            assert d["dh"] <= 2**-6 * d["dh_ref_max"] and d["dw"] <= 2**-6 * d["dw_ref_max"], (part, name, d)
