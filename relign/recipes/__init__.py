"""One file per training method. Each exposes ``Config`` (a dataclass) and ``train(cfg) -> RunResult``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# name -> (module, one-line summary); the CLI imports the module only when it is used.
RECIPES: dict[str, tuple[str, str]] = {
    "sft": ("relign.recipes.sft", "Supervised fine-tuning on prompt/response, chat or plain-text records."),
    "rl": ("relign.recipes.rl", "RL with verifiable rewards: PPO, GRPO, Dr. GRPO, DAPO, GSPO, RLOO, REINFORCE++."),
}


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint: Path | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
