"""bench/gpu_ab.py, the A/B run of issue 45 on a GPU, in its --smoke shape on the CPU: every section
that exists runs (a Python bug would otherwise cost the one device run), the runner survives a
missing, a failing and a slow section, and the env section's yardsticks are right."""

from __future__ import annotations

import json
import sys
import time
import types

import pytest
import torch
import torch.nn.functional as F

from .conftest import load_script


@pytest.fixture(scope="module")
def ab():
    return load_script("bench/gpu_ab.py", "gpu_ab")


def test_smoke_runs_every_section(ab, tmp_path):
    out = tmp_path / "ab.json"
    ab.main(["--smoke", "--out", str(out)])
    res = json.loads(out.read_text())
    sections = res["sections"]
    assert list(sections) == list(ab.SECTIONS)  # in the fixed order
    assert {s["status"] for s in sections.values()} <= {"ok", "not present"}, {k: s.get("error") for k, s in sections.items()}
    assert all(sections[s]["status"] == "ok" for s in ("env", "profile", "compile"))
    env = sections["env"]["results"]
    assert env["versions"]["torch"] == torch.__version__ and env["compile"]["max_abs_diff"] < 1e-5
    assert env["varlen_attn"]["reference_gap_bottom_vs_top"] > 0.1  # the two alignments are told apart
    prof = sections["profile"]["results"]
    assert prof["busy_s"] > 0 and prof["by_kind_s"]["gemm"] > 0
    comp = {(r["mode"], r["layout"]): r for r in sections["compile"]["results"]["results"]}
    assert {("eager", "padded"), ("compiled", "padded"), ("eager", "packed")} <= set(comp)
    assert comp[("compiled", "padded")]["graph_breaks"] == 0 and comp[("compiled", "padded")]["graphs"] >= 1
    assert comp[("compiled", "padded")]["max_abs_diff_logp_vs_eager"] == 0.0  # dynamo alone on a CPU: the same ops


def test_runner_keeps_going(ab, monkeypatch):
    def fails(smoke, device, budget_s):
        raise RuntimeError("a bug in a section")

    def slow(smoke, device, budget_s):
        slow_mod.PARTIAL["done"] = 1
        time.sleep(5)

    slow_mod = types.SimpleNamespace(run=slow, PARTIAL={})
    monkeypatch.setitem(sys.modules, "bench.ab._fails", types.SimpleNamespace(run=fails))
    monkeypatch.setitem(sys.modules, "bench.ab._slow", slow_mod)
    assert ab.run_section("_absent", smoke=True, device="cpu", cap=5)["status"] == "not present"
    r = ab.run_section("_fails", smoke=True, device="cpu", cap=5)
    assert r["status"] == "error" and "a bug in a section" in r["error"]
    r = ab.run_section("_slow", smoke=True, device="cpu", cap=1)
    assert r["status"] == "timeout" and r["partial"] == {"done": 1} and r["wall_s"] < 3


def test_env_references_are_the_two_causal_alignments():
    """The yardsticks the device's varlen_attn is compared with: top-left is SDPA's is_causal,
    bottom-right is torch's causal_lower_right bias (a query sees the keys before it plus k - q)."""
    from torch.nn.attention.bias import causal_lower_right

    from bench.ab.env import reference

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(7, 2, 8, generator=g), torch.randn(7, 2, 8, generator=g)
    qh, kh, vh = q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1)
    lower_right = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(3, 7)).transpose(0, 1)
    upper_left = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1)
    assert torch.allclose(reference(q, k, v, [3], [7], bottom_right=True), lower_right, atol=1e-6)
    assert torch.allclose(reference(q, k, v, [3], [7], bottom_right=False), upper_left, atol=1e-6)
