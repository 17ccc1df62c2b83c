"""``relign plan RECIPE CONFIG [key=value ...] [--device NAME|auto] [--world N]``: what a step of the run
needs, per rank and per stage, before anything loads (docs/plan.md).

It reads the config as the recipe would (preset, overrides, the recipe's checks) and the model's
config.json alone, prints the table of ``relign.plan.format_plan`` and exits 0 when the peak fits the
device, 1 when it does not (so a script can ask before it runs).
"""

from __future__ import annotations

import importlib

from .. import devices
from .. import plan_table
from ..cli import split_args
from ..config import load_config
from ..recipes import RECIPES, memory
from ._common import Parser
from .presets import resolve_config_arg


def main(argv: list[str]) -> int:
    p = Parser("plan", description="Memory per rank and stage, the largest micro-batch that fits, and an arithmetic "
                                   "step time, from the config alone (docs/plan.md).")
    p.add_argument("recipe", choices=list(memory.PLANNERS))
    p.add_argument("config", nargs="*", help="CONFIG.yaml or a preset name, then key.sub=value overrides")
    p.add_argument("--device", default="",
                   help="auto (this machine: CUDA free memory, else available RAM), cpu, cuda:N, or a named GPU: "
                        + ", ".join(g[0] for g in devices.GPUS) + " (default: the config's plan.device, else auto)")
    p.add_argument("--world", type=int, default=1, help="ranks of the launch (torchrun --nproc_per_node x nodes)")
    a = p.parse_intermixed_args(argv)  # flags anywhere among the key=value overrides
    if a.world < 1:
        p.error(f"--world {a.world}: give at least 1 rank")
    module = importlib.import_module(RECIPES[a.recipe][0])
    config_path, overrides = split_args(resolve_config_arg(a.recipe, a.config))
    cfg = load_config(module.Config, config_path, overrides)
    check = getattr(module, "_check", None)
    if check is not None:  # the recipe's own checks: a config the run would refuse is refused here too
        check(cfg)
    device = devices.local_device(a.device or cfg.plan.device or "auto")
    plan = memory.plan_for(cfg, a.recipe, device, world=a.world)
    if device.key == "cpu":
        plan.ranks = a.world  # every rank of a CPU launch shares this machine's RAM
    print(plan_table.format_plan(plan))
    return 0 if plan.fits_device else 1
