"""bench/gpu_checks.py, the GPU checks of issue 15, runs here in its --smoke shape, so that the
script a GPU session runs in one command has not rotted (it drives relign's public API only)."""

from __future__ import annotations

import json

from .conftest import load_script


def test_gpu_checks_smoke_on_cpu(tmp_path):
    mod = load_script("bench/gpu_checks.py", "gpu_checks")
    out = tmp_path / "gpu.json"
    # not torchrun here: the suite launches it in tests/e2e (12 s more of imports)
    mod.main(["--smoke", "--checks", "sft,decode,grpo,dpo,lora", "--out", str(out)])
    res = json.loads(out.read_text())
    by = {(r["check"], r.get("mode")): r for r in res["results"]}
    assert set(by) == {("sft", "padded"), ("sft", "packed"), ("dpo", None), ("grpo", None), ("decode", None), ("lora", None)}
    assert by[("sft", "padded")]["tokens_per_s"] > 0 and by[("sft", "packed")]["tokens_per_s"] > 0
    assert by[("dpo", None)]["pairs_per_s"] > 0 and by[("dpo", None)]["reference_precompute_s"] > 0
    assert {"rollout", "reference", "update", "step"} <= set(by[("grpo", None)]["seconds"])
    assert {"rollout", "reference", "update", "sync", "step"} <= set(by[("lora", None)]["seconds"])
    # relign plan's peak beside each check's own (issue 47; on a GPU with the measured one and their ratio)
    assert all(r["predicted_gib"] > 0 for r in res["results"])
    decode = by[("decode", None)]
    assert decode["tokens_per_s"] > 0 and decode["rows"] == 4
    if res["device"] == "cpu":  # no peak figures for a CPU: no MFU, no bound
        assert decode["bound_tokens_per_s"] is None and by[("sft", "padded")]["mfu"] is None
