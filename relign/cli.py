"""Command line: ``relign <recipe> [CONFIG.yaml] [key.sub=value ...]`` and helpers.

The CLI only parses, loads the config and calls the recipe's ``train``. Problems a user can
fix (bad config key or value, missing file, malformed data row) are printed as one line
without a traceback and exit with status 2.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from .config import ConfigError, format_help, load_config
from .recipes import RECIPES

USAGE = """usage: relign COMMAND [CONFIG.yaml] [key.sub=value ...]

Commands:
{recipes}
  report RUN_DIR  Write RUN_DIR/report.html: metric plots, rollout traces, eval samples.
  tiny-model OUT_DIR [--arch qwen2|llama] [--size micro|tiny|small|base] [--seed N]
                  Build a small random model with a locally trained tokenizer.

`relign COMMAND --help` lists every config field of a recipe with its one-line doc.
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
    lines = [f"  {name:<14}  {summary}" for name, (_, summary) in RECIPES.items()]
    return USAGE.format(recipes="\n".join(lines))


def _fail(command: str, message: str) -> int:
    print(f"relign {command}: error: {message}", file=sys.stderr)
    return 2


def _tiny_model(argv: list[str]) -> int:
    import argparse

    from .models.tiny import SIZES, build_tiny_model, num_parameters

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
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: relign report RUN_DIR\n\nWrite RUN_DIR/report.html (one self-contained file, no network needed).")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from .report import write_report

    try:
        path = write_report(argv[0])
    except FileNotFoundError as e:
        return _fail("report", f"not found: {e.filename or e}")
    print(f"report: {path}")
    return 0


def run_recipe(command: str, argv: list[str]) -> int:
    module_name, summary = RECIPES[command]
    module = importlib.import_module(module_name)
    if any(a in ("-h", "--help") for a in argv):
        print(format_help(module.Config, command, summary))
        return 0
    from .data.readers import DataError

    try:
        config_path, overrides = split_args(argv)
        cfg = load_config(module.Config, config_path, overrides)
        result = module.train(cfg)
    except (ConfigError, DataError) as e:
        return _fail(command, str(e))
    except FileNotFoundError as e:
        return _fail(command, f"file not found: {e.filename or e}")
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
    if command == "tiny-model":
        return _tiny_model(rest)
    if command == "report":
        return _report(rest)
    if command not in RECIPES:
        return _fail(command, f"unknown command; choose one of {', '.join([*RECIPES, 'report', 'tiny-model'])}")
    return run_recipe(command, rest)


if __name__ == "__main__":
    raise SystemExit(main())
