"""VinePPO refuses the KL in the reward at config time (issue 33, bug 2).

VinePPO's step rewards are [0, ..., 0, R] and its Monte-Carlo values hold no KL, so with
``algorithm.kl=reward`` the response's whole KL would land on its last step, wherever it was
spent; the reference code puts the KL in the loss only. The check is the estimator's own
(``ESTIMATORS["vine"].check``), which ``relign rl``'s config check runs before anything loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from relign.config import ConfigError, load_config
from relign.recipes import rl

from ..conftest import REPO, run_cli
from ..rl_toy import toy_overrides

VINE = ["model.path=tiny:micro", "algorithm.advantage=vine"]


def _refusal(text: str) -> bool:
    return "algorithm.advantage=vine" in text and "algorithm.kl=reward" in text and "use algorithm.kl=loss" in text


def test_vine_with_the_kl_in_the_reward_is_refused_with_one_line():
    cfg = load_config(rl.Config, None, [*VINE, "algorithm.kl=reward", "algorithm.kl_coef=0.05"])
    with pytest.raises(ConfigError) as e:
        rl._check(cfg)
    assert _refusal(str(e.value)) and "\n" not in str(e.value), str(e.value)
    for kl in (["algorithm.kl=loss", "algorithm.kl_coef=0.05"], ["algorithm.kl=none"]):  # the others pass
        rl._check(load_config(rl.Config, None, [*VINE, *kl]))
    # the KL in the reward stays allowed for the estimators that credit it per token or per sequence
    rl._check(load_config(rl.Config, None, ["model.path=tiny:micro", "algorithm.advantage=gae", "algorithm.kl=reward",
                                            "algorithm.kl_coef=0.05"]))


def test_no_shipped_preset_puts_vines_kl_in_the_reward():
    for path in sorted(Path(REPO / "relign" / "presets").glob("*.yaml")):
        text = path.read_text()
        if "advantage: vine" in text:
            cfg = load_config(rl.Config, path)
            assert cfg.algorithm.kl != "reward", path.name


def test_the_cli_exits_2_with_the_one_line(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("rl", *toy_overrides("tiny:micro", tmp_path), "algorithm.advantage=vine", "vine.delimiter=' '",
                   "algorithm.kl=reward", "algorithm.kl_coef=0.05", "max_steps=1", f"run_dir={run}", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and _refusal(lines[0]), proc.stderr[-2000:]
    assert not run.exists()  # refused before anything ran
