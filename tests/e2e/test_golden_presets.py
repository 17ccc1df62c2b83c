"""Every shipped preset, shrunk to two steps (tools/golden.py's PRESETS), through the real CLI:
its metrics match tests/golden/presets.json within the tolerance measured across CPUs.

The check that "nothing moves but code": a refactor that changes no behaviour leaves every
recorded metric where it was, to float rounding. tests/golden/presets.json was recorded by
``python tools/golden.py record`` at 58f161f with the tiny model this suite builds
(``tiny_model_dir``: byte for byte the ``relign tiny-model --size micro --seed 0`` model the
recording used; the same as tests/golden/presets_58f161f.json). Weights are not compared here:
their last bits differ between CPUs; ``tools/golden.py check --rtol 0`` compares them on one machine.

The tolerance (tools/golden.py CROSS_CPU): rtol 3e-3 and an absolute floor of 1e-6, larger for
the two kinds of metric that are 0 up to rounding (actor/loss of zero-mean advantages, the
engine-vs-trainer log-prob mismatch). Recorded against a run with the kernels held to AVX2 on
the AVX-512 machine, the largest relative difference of any other metric was 4.4e-4, and no
sampled token, eval answer or search path changed, so every preset is compared whole.

A difference means a behaviour change: if it is meant, re-record (tools/golden.py record
tests/golden/presets.json, from the repository root, with the model of ``relign tiny-model
/tmp/golden-model --size micro --seed 0``) and say why in the commit.
"""

from __future__ import annotations

import json

import pytest

from ..conftest import REPO, load_script, run_cli


golden = load_script("tools/golden.py", "relign_tools_golden")
RECORDED = json.loads((REPO / "tests" / "golden" / "presets.json").read_text())["presets"]

# Several presets per test: each run forks from the CLI fork server in about a second.
GROUPS = {
    "sft_rm_verifier": ["sft_tiny", "rm", "verifier"],
    "preference": ["dpo", "dpop", "ipo", "kto", "orpo", "simpo", "sdpo"],
    "rl_group": ["dr_grpo", "grpo", "dapo", "gspo", "rloo", "calculator_tool"],
    "rl_other": ["ppo", "reinforce_pp", "trpo", "vineppo", "grpo_async"],
    "rest_eval_demo": ["rest_em", "eval_gsm8k", "eval_search", "demo"],
}


def test_every_preset_is_in_one_group_and_recorded():
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(golden.PRESETS) == sorted(RECORDED)
    for name in golden.PRESETS:  # the recording was made with the table as it is
        assert RECORDED[name]["args"] == golden.preset_args(name, "{model}", "{run_dir}"), name
        assert RECORDED[name]["returncode"] == 0, name


@pytest.mark.parametrize("group", list(GROUPS))
def test_presets_match_the_recording(group, tiny_model_dir, tmp_path):
    cache = golden.model_cache(tiny_model_dir, tmp_path / "cache")  # tiny:micro (the demo's) = tiny_model_dir
    reward_fn = golden.write_reward(tmp_path)
    tol = golden.CROSS_CPU
    differences = []
    for name in GROUPS[group]:
        run = tmp_path / name
        run_cli(*golden.preset_args(name, str(tiny_model_dir), str(run), reward_fn), env={"RELIGN_CACHE": str(cache)})
        got = golden.collect(run, golden.PRESETS[name][0], weights=False)
        first, _ = golden.compare(RECORDED[name], got, rtol=tol["rtol"], atol=tol["atol"], weights=False,
                                  key_atol=tol["key_atol"])
        if first is not None:
            differences.append(f"{name}: {first}")
    assert not differences, "metrics moved from tests/golden/presets.json:\n" + "\n".join(differences)
