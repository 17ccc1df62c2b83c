"""Command line: ``relign <recipe> [CONFIG.yaml] [key.sub=value ...]`` and helpers.

The CLI only parses, loads the config and calls the recipe's ``train``. Problems a user can
fix (bad config key or value, missing file, malformed data row) are printed as one line
without a traceback and exit with status 2. A run stopped by a check while it runs (an engine
that does not hold the trainer's weights after a sync) is one line too, with status 3; a wait
past ``rollout.wait_timeout`` exits with 124 (``watchdog``).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from .commands import COMMANDS
from .commands._common import CommandError
from .commands.presets import resolve_config_arg
from .config import ConfigError, format_help, load_config
from .data.readers import DataError
from .errors import SyncMismatch
from .recipes import RECIPES

USAGE = """usage: relign RECIPE [CONFIG.yaml | PRESET] [key.sub=value ...]
       relign COMMAND [ARGS ...]

Recipes:
{recipes}

Commands:
{commands}
  report RUN_DIR [RUN_DIR ...] [--out PATH]  Write RUN_DIR/report.html; with several runs, one page comparing them.
  tiny-model OUT_DIR [--arch qwen2|llama] [--size micro|tiny|small|base] [--seed N]
                  Build a small random model with a locally trained tokenizer.

`relign RECIPE --help` lists every config field of a recipe with its one-line doc;
`relign presets` lists the presets, which run by name: `relign rl grpo`.
"""


def _quiet_libraries() -> None:
    """Our own progress bars carry the run; silence transformers' per-file load/save bars."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def _usage() -> str:
    recipes = [f"  {name:<14}  {summary}" for name, (_, summary) in RECIPES.items()]
    commands = []
    for name, (_, args, summary) in COMMANDS.items():
        head = f"{name} {args}".strip()
        commands.append(f"  {head:<14}  {summary}" if len(head) <= 14 else f"  {head}\n  {'':<14}  {summary}")
    return USAGE.format(recipes="\n".join(recipes), commands="\n".join(commands))


def _fail(command: str, message: str, status: int = 2) -> int:
    print(f"relign {command}: error: {message}", file=sys.stderr)
    return status


def _tiny_model(argv: list[str]) -> int:
    import argparse

    from .models.tiny import SIZES, build_tiny_model, num_parameters  # torch and tokenizers: only when asked for

    p = argparse.ArgumentParser(prog="relign tiny-model", description="Build a small random model + local tokenizer.")
    p.add_argument("out_dir")
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    p.add_argument("--size", default="micro", choices=list(SIZES))
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    model, _ = build_tiny_model(a.out_dir, arch=a.arch, size=a.size, vocab_size=a.vocab_size, seed=a.seed)
    print(f"wrote {a.arch} model ({num_parameters(model) / 1e6:.2f}M parameters) and tokenizer to {a.out_dir}")
    return 0


def _command(command: str, argv: list[str]) -> int:
    """A command of ``relign.commands``: its user errors become one line and exit status 2."""
    module = importlib.import_module(COMMANDS[command][0])
    try:
        return module.main(argv)
    except (CommandError, ConfigError, DataError) as e:
        return _fail(command, str(e))
    except SystemExit as e:  # argparse's --help (0) and usage errors (2, already printed)
        return e.code if isinstance(e.code, int) else 2


def split_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """First argument that is not a key=value is the config file; the rest are overrides."""
    config_path = None
    overrides = []
    for arg in argv:
        if "=" in arg and not arg.endswith((".yaml", ".yml")):
            overrides.append(arg)
        elif config_path is None:
            config_path = arg
        else:
            raise ConfigError(f"unexpected argument '{arg}': give one CONFIG.yaml and key.sub=value overrides")
    return config_path, overrides


def _report(argv: list[str]) -> int:
    from .report.command import main as report_main  # the report reads checkpoints: torch, only when asked for

    return report_main(argv)


def run_recipe(command: str, argv: list[str]) -> int:
    module_name, summary = RECIPES[command]
    module = importlib.import_module(module_name)
    if any(a in ("-h", "--help") for a in argv):
        print(format_help(module.Config, command, summary))
        return 0
    from . import distributed, report, rundir  # torch: this module stays light for --help and the commands

    rundir.request_dry_run("--dry-run" in argv)
    argv = [a for a in argv if a != "--dry-run"]
    try:
        config_path, overrides = split_args(argv)
        cfg = load_config(module.Config, config_path, overrides)
        result = module.train(cfg)
        distributed.barrier()  # every rank is done with every collective before the group goes
    except rundir.DryRunDone:
        return 0
    except (ConfigError, DataError) as e:
        return _fail(command, str(e))
    except SyncMismatch as e:  # not a setting: the run found the engine's weights wrong
        return _fail(command, str(e), SyncMismatch.exit_status)
    except FileNotFoundError as e:
        return _fail(command, f"file not found: {e.filename or e}")
    finally:
        # Leaving with the process group alive lets interpreter shutdown destroy gloo's
        # threads while they are still joinable, which aborts a rank now and then (SIGABRT,
        # "terminate called without an active exception") after a run that succeeded.
        distributed.cleanup()
    report.refresh_after_run(result.run_dir)  # here, not in checkpoint/tracking: those sit below the report
    print(f"run directory: {result.run_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=os.environ.get("RELIGN_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command in ("--version", "-V"):
        command = "version"
    if command == "tiny-model":
        return _tiny_model(rest)
    if command == "report":
        return _report(rest)
    if command in COMMANDS:
        return _command(command, rest)
    if command not in RECIPES:
        return _fail(command, f"unknown command; choose one of {', '.join([*RECIPES, *COMMANDS, 'report', 'tiny-model'])}")
    if not any(a in ("-h", "--help") for a in rest):
        try:  # a preset name or a docs path (examples/NAME.yaml) runs from any folder
            rest = resolve_config_arg(command, rest)
        except ConfigError as e:
            return _fail(command, str(e))
    return run_recipe(command, rest)


if __name__ == "__main__":
    raise SystemExit(main())
