"""Presets shipped as package data (``relign/presets/*.yaml``), run by name after ``pip install``.

Each preset opens with one header line that says how to run it and what it does::

    # relign rl grpo: GRPO as in DeepSeekMath: group-normalized advantages, ...

``relign rl grpo`` finds ``grpo`` here when no file of that name is in the working
directory; ``relign presets`` lists the headers. A preset names the files it ships with
(``relign/envs/data/...``) relative to the source tree, which works from the repository root;
elsewhere those values are pointed at the installed package instead (``package_overrides``).
"""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError, load_config
from ..recipes import RECIPES
from ._common import fail

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the installed relign/ folder
PRESETS_DIR = PACKAGE_ROOT / "presets"
_HEADER = re.compile(r"^#\s*relign\s+(?P<recipe>[\w-]+)\s+(?P<name>[\w.-]+)\s*:\s*(?P<desc>.+?)\s*$")
_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class Preset:
    name: str
    recipe: str
    description: str
    path: Path


def read_header(path: Path) -> tuple[str, str] | None:
    """(recipe, description) from a YAML file's first line, None when it has no preset header."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError):
        return None
    m = _HEADER.match(first)
    return (m["recipe"], m["desc"]) if m else None


def list_presets() -> list[Preset]:
    out = []
    for path in sorted(PRESETS_DIR.glob("*.yaml")):
        recipe, desc = read_header(path) or ("?", "")
        out.append(Preset(path.stem, recipe, desc, path))
    return out


def find_preset(name: str) -> Preset | None:
    stem = name[: -len(suffix)] if (suffix := next((s for s in _SUFFIXES if name.endswith(s)), "")) else name
    return next((p for p in list_presets() if p.name == stem), None)


def _leaves(node, prefix: str = ""):
    """(dotted key, value) for every scalar under nested mappings (lists are left alone)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif prefix:
        yield prefix[:-1], node


def package_overrides(config_path: str | Path) -> list[str]:
    """``key=/abs/path`` for each value of the YAML that names a file shipped in the package
    (``relign/...``) that is not there relative to the working directory, so the preset runs
    after ``pip install`` from any folder. From the repository root nothing changes."""
    import yaml

    try:
        data = yaml.safe_load(Path(config_path).read_text(encoding="utf-8"))
    except Exception:  # load_config reports a broken file with its own message
        return []
    out = []
    for key, value in _leaves(data if isinstance(data, dict) else {}):
        if isinstance(value, str) and value.startswith(f"{PACKAGE_ROOT.name}/") and not Path(value).exists():
            shipped = PACKAGE_ROOT.parent / value
            if shipped.exists():
                out.append(f"{key}={shipped}")
    return out


def _is_override(arg: str) -> bool:
    return "=" in arg and not arg.endswith(_SUFFIXES)  # the rule of cli.split_args


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, [p.name for p in list_presets()], n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def resolve_config_arg(command: str, argv: list[str]) -> list[str]:
    """The recipe's arguments with the config argument made runnable from anywhere.

    ``NAME`` (no such file here) becomes the packaged preset ``NAME``; a missing
    ``examples/NAME.yaml`` (the form the docs use) falls back to the packaged one, with a note.
    The preset's shipped data paths come next as overrides, before the user's own, which win.
    A preset whose header names another recipe is refused in one line that names the right one.
    """
    idx = next((i for i, a in enumerate(argv) if not a.startswith("-") and not _is_override(a)), None)
    if idx is None:
        return argv
    arg = argv[idx]
    path = Path(arg).expanduser()
    if not path.is_file():
        preset = None
        if "/" not in arg:
            preset = find_preset(arg)
            if preset is None and not arg.endswith(_SUFFIXES):
                raise ConfigError(f"no config file or preset named '{arg}'{_suggest(arg)}; `relign presets` lists the presets")
        elif path.parent.name == "examples" and path.suffix in _SUFFIXES:
            preset = find_preset(path.name)
            if preset is not None:
                print(f"note: {arg} is not here; using the packaged preset '{preset.name}' ({preset.path})", file=sys.stderr)
        if preset is None:
            return argv  # load_config says "config file not found: ..."
        path = preset.path
    header = read_header(path)
    if header and header[0] != command:
        raise ConfigError(f"{arg} is a preset of `relign {header[0]}`, not `relign {command}`; run: relign {header[0]} {arg}")
    rest = argv[:idx] + argv[idx + 1 :]
    return [str(path), *package_overrides(path), *rest]


def load_preset(cls: type, name: str, overrides: list[str] | tuple = ()):
    """The config of the shipped preset ``name`` (``relign presets`` lists them) with ``overrides``
    on top, as ``relign RECIPE NAME k=v ...`` builds it from any folder: the preset's shipped data
    paths point at the installed package. ``rl.train(load_preset(rl.Config, "grpo", ["max_steps=2"]))``."""
    preset = find_preset(name)
    if preset is None:
        raise ConfigError(f"no preset named '{name}'{_suggest(name)}; `relign presets` lists the presets")
    return load_config(cls, preset.path, [*package_overrides(preset.path), *overrides])


def format_table(presets: list[Preset]) -> str:

    order = {name: i for i, name in enumerate(RECIPES)}
    rows = sorted(presets, key=lambda p: (order.get(p.recipe, len(order)), p.name))
    w = max(len(p.name) for p in rows)
    wr = max(len("recipe"), *(len(p.recipe) for p in rows))
    lines = [f"{'preset':<{w}}  {'recipe':<{wr}}  description"]
    lines += [f"{p.name:<{w}}  {p.recipe:<{wr}}  {p.description}" for p in rows]
    lines += ["", "Run one: relign RECIPE PRESET [key.sub=value ...]   e.g. relign rl grpo max_steps=20",
              "Copy one to edit: relign presets PRESET > my.yaml", f"Folder: {PRESETS_DIR}"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: relign presets [PRESET]\n\nList the shipped presets, or print one preset's YAML.")
        return 0
    if len(argv) > 1:
        return fail("presets", f"takes at most one preset name, got {' '.join(argv)}")
    if argv:
        preset = find_preset(argv[0])
        if preset is None:
            return fail("presets", f"no preset named '{argv[0]}'{_suggest(argv[0])}; `relign presets` lists them")
        sys.stdout.write(preset.path.read_text(encoding="utf-8"))
        return 0
    print(format_table(list_presets()))
    return 0
