"""The recipes: one module per method (RL's loop keeps its config, update and advantages in three
files beside it: rl_config.py, rl_update.py, rl_advantages.py). Each recipe module exposes
``Config`` (a dataclass) and ``train(cfg) -> RunResult``, and runs in the frame of ``frame.py``
with the components ``build.py`` makes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# name -> (module, one-line summary); the CLI imports the module only when it is used.
RECIPES: dict[str, tuple[str, str]] = {
    "sft": ("relign.recipes.sft", "Supervised fine-tuning on prompt/response, chat or plain-text records."),
    "rm": ("relign.recipes.reward_model", "Bradley-Terry reward model on chosen/rejected pairs."),
    "dpo": ("relign.recipes.preference", "Preference optimization: DPO, IPO, DPOP, SimPO, ORPO, KTO, step-wise DPO."),
    "verifier": ("relign.recipes.verifier", "Generative verifier (GenRM): SFT on graded solutions, score = P(Yes)."),
    "rl": ("relign.recipes.rl", "RL with verifiable rewards: PPO, GRPO, Dr. GRPO, DAPO, GSPO, RLOO, REINFORCE++."),
    "rest": ("relign.recipes.rest_em", "ReST-EM: sample, keep the correct, fine-tune from the base, pick a checkpoint, repeat."),
    "eval": ("relign.recipes.eval", "Evaluate a model on a task: accuracy, pass@k, maj@k, lengths."),
    "demo": ("relign.recipes.demo", "The whole pipeline on a laptop CPU: tiny model, SFT warm start, GRPO, before/after eval."),
}


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint: Path | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
