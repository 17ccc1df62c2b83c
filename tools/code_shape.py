"""The shape of relign's code, counted: import cycles, imports that run back up the floors, imports
inside functions, the longest functions, and tests of a choice's name outside its table.

    python tools/code_shape.py            # the summary
    python tools/code_shape.py --verbose  # every cycle, upward import, in-function import and long function

How it counts (``docs/architecture.md``, "Floors"): every ``relign/**/*.py`` is parsed with ``ast``
(nothing is imported); each ``import relign.x`` / ``from .x import y`` becomes an edge to the module
it loads (``y`` itself when it is a submodule). Imports inside functions count, ``if TYPE_CHECKING:``
ones do not (they never run). A cycle is a strongly connected component of that graph with more than
one module. ``tests/test_import_layers.py`` runs this on every test run.

A *choice table* is a module-level ``UPPER_CASE`` dict whose keys are the names a setting takes and
whose values are its rows, all of one kind (``TASKS = {"gsm8k": TaskRow(...), ...}``): what a choice
does lives in its row. A *test of a choice's name* is a comparison (``==``, ``!=``, ``in``,
``not in``) of a table's key with an expression naming that choice's field: a field the table is
looked up by (``TASKS[name]``, ``name in TASKS``), checked against (``check_choice("x.advantage",
a.advantage, tuple(ESTIMATORS))``), or the table's singular (``task`` for ``TASKS``). Such a test,
anywhere but in the table itself, is a row's property decided by its name.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "relign"

# The floors of relign, from the ground up: a module may import its own floor and the floors below,
# never one above. The first matching prefix wins, so a module can sit on another floor than its
# package. Why each floor is where it is: docs/architecture.md.
FLOORS: list[tuple[str, ...]] = [
    ("relign", "relign.errors", "relign.algorithms", "relign.watchdog"),  # 1: the package's __init__ (env defaults), the error type, pure math, deadlines
    ("relign.config", "relign.checks", "relign.distributed", "relign.devices", "relign.dtypes", "relign.plan",
     "relign.plan_table"),  # 2
    ("relign.checkpoint", "relign.optim", "relign.tracking", "relign.data"),           # 3
    ("relign.envs", "relign.models", "relign.rundir", "relign.report"),                # 4
    ("relign.rollout", "relign.banner"),                                              # 5
    ("relign.strategies",),                                                           # 6
    ("relign.evaluate",),                                                             # 7
    ("relign.recipes",),                                                              # 8
    ("relign.commands", "relign.cli", "relign.__main__"),                             # 9: the command line
]


@dataclass
class Import:
    source: str  # the importing module
    target: str  # the module it loads
    line: int
    in_function: str = ""  # the enclosing function's name, "" at module level
    text: str = ""


@dataclass
class Shape:
    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)
    functions: list[tuple[int, str, str, int]] = field(default_factory=list)  # (lines, module, name, first line)
    in_function_imports: int = 0  # every import statement inside a function (relign's own or not)
    tables: dict[str, Table] = field(default_factory=dict)
    name_tests: list[tuple[str, int, str, str]] = field(default_factory=list)  # (module, line, text, tables)


@dataclass
class Table:
    module: str
    keys: set[str]
    fields: set[str]
    node: ast.AST


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan(root: Path = ROOT) -> Shape:
    shape = Shape()
    files = sorted((root / PACKAGE).rglob("*.py"))
    for f in files:
        shape.modules[module_name(f, root)] = f
    trees: dict[str, ast.Module] = {}
    for f in files:
        mod = module_name(f, root)
        is_package = f.name == "__init__.py"
        text = f.read_text()
        tree = trees[mod] = ast.parse(text, filename=str(f))
        lines = text.splitlines()

        def visit(node: ast.AST, func: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child.test):
                    for sub in child.orelse:
                        visit_stmt(sub, func)
                    continue
                visit_stmt(child, func)

        def visit_stmt(child: ast.AST, func: str) -> None:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                shape.functions.append((child.end_lineno - child.lineno + 1, mod, child.name, child.lineno))
                visit(child, child.name)
                return
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if func:
                    shape.in_function_imports += 1
                for target in _targets(child):
                    if target == PACKAGE or target.startswith(PACKAGE + "."):
                        shape.imports.append(Import(mod, _known(target, shape.modules), child.lineno, func,
                                                    lines[child.lineno - 1].strip()))
                return
            visit(child, func)

        def _targets(node: ast.Import | ast.ImportFrom) -> list[str]:
            if isinstance(node, ast.Import):
                return [a.name for a in node.names]
            base = _resolve(mod, is_package, node)
            # ``from pkg import sub`` runs pkg/__init__.py too: an edge to the package as well as to the submodule
            out = [base] if base != mod else []
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in shape.modules:
                    out.append(sub)
            return out or [base]

        visit(tree, "")
    shape.tables = choice_tables(trees)
    shape.name_tests = name_tests(trees, shape.tables)
    return shape


def _last_name(e: ast.AST) -> str:
    """``cfg.rollout.engine`` -> ``engine``; ``name`` -> ``name``; anything else -> ""."""
    return e.attr if isinstance(e, ast.Attribute) else e.id if isinstance(e, ast.Name) else ""


def _names(e: ast.AST) -> list[str]:
    """The string constants ``e`` is: one, or a tuple / list / set of them ([] otherwise)."""
    if isinstance(e, ast.Constant) and isinstance(e.value, str):
        return [e.value]
    if isinstance(e, (ast.Tuple, ast.List, ast.Set)) and all(
            isinstance(x, ast.Constant) and isinstance(x.value, str) for x in e.elts):
        return [x.value for x in e.elts]
    return []


def _singular(name: str) -> str:
    low = name.lower()
    if low.endswith("ies"):
        return low[:-3] + "y"  # STRATEGIES -> strategy
    if low.endswith("sses"):
        return low[:-2]  # PAIR_LOSSES -> pair_loss
    return low[:-1] if low.endswith("s") else low


def choice_tables(trees: dict[str, ast.Module]) -> dict[str, Table]:
    tables: dict[str, Table] = {}
    for mod, tree in trees.items():
        for node in tree.body:
            target, value = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target, value = node.targets[0].id, node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                target, value = node.target.id, node.value
            if not (target and target.isupper() and isinstance(value, ast.Dict) and value.keys):
                continue
            keys = [_names(k) if k is not None else [] for k in value.keys]
            kinds = {type(v) for v in value.values}
            if all(len(k) == 1 for k in keys) and len(kinds) == 1 and ast.Constant not in kinds:
                tables[target] = Table(mod, {k[0] for k in keys}, {_singular(target)}, node)
    for tree in trees.values():  # the fields each table is looked up by, or checked against
        for n in ast.walk(tree):
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in tables:
                tables[n.value.id].fields.add(_last_name(n.slice))
            elif (isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], (ast.In, ast.NotIn))
                  and isinstance(n.comparators[0], ast.Name) and n.comparators[0].id in tables):
                tables[n.comparators[0].id].fields.add(_last_name(n.left))
            elif isinstance(n, ast.Call) and _last_name(n.func) == "check_choice" and len(n.args) >= 3:
                for x in ast.walk(n.args[2]):
                    if isinstance(x, ast.Name) and x.id in tables:
                        tables[x.id].fields.add(_last_name(n.args[1]))
    for t in tables.values():
        t.fields.discard("")
    return tables


def name_tests(trees: dict[str, ast.Module], tables: dict[str, Table]) -> list[tuple[str, int, str, str]]:
    out = []
    for mod, tree in trees.items():
        inside = {id(x) for t in tables.values() if t.module == mod for x in ast.walk(t.node)}
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Compare) and id(n) not in inside and len(n.ops) == 1
                    and isinstance(n.ops[0], (ast.Eq, ast.NotEq, ast.In, ast.NotIn))):
                continue
            hit = sorted({tname for a, b in ((n.left, n.comparators[0]), (n.comparators[0], n.left))
                          for tname, t in tables.items()
                          if _last_name(a) in t.fields and set(_names(b)) & t.keys})
            if hit:
                out.append((mod, n.lineno, ast.unparse(n), ", ".join(hit)))
    return sorted(out)


def _known(target: str, modules: dict[str, Path]) -> str:
    """The longest prefix of ``target`` that is a module of the package."""
    parts = target.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or target


def own_imports(shape: Shape) -> list[Import]:
    """Imports of relign's own modules, a module importing itself (``from . import x`` in x's package) left out."""
    return [i for i in shape.imports if i.target != i.source]


def graph(shape: Shape) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in shape.modules}
    for i in own_imports(shape):
        edges[i.source].add(i.target)
        # importing relign.a.b runs relign/a/__init__.py first; a package's own modules are
        # imported through it, so that edge would make every package a cycle: left out
        parent = i.target.rsplit(".", 1)[0]
        if "." in i.target and parent != i.source and not i.source.startswith(parent + "."):
            edges[i.source].add(parent)
    return edges


def cycles(shape: Shape) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    edges = graph(shape)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in edges:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def floor_of(module: str) -> int:
    best, floor = -1, 0
    for n, prefixes in enumerate(FLOORS, start=1):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, floor = len(p), n
    return floor


def upward(shape: Shape) -> list[Import]:
    """Imports from a lower floor to a higher one (package ``__init__`` files re-exporting their
    own modules are on their package's floor)."""
    return [i for i in own_imports(shape) if floor_of(i.target) > floor_of(i.source)]


def summary(shape: Shape) -> dict[str, object]:
    own_in_function = [i for i in own_imports(shape) if i.in_function]
    statements = {(i.source, i.line) for i in own_in_function}
    longest = max(shape.functions)
    trains = sorted(((n, mod) for n, mod, name, _ in shape.functions if name == "train" and mod.startswith("relign.recipes.")),
                    reverse=True)
    targets: dict[str, set[str]] = {}
    for i in own_imports(shape):
        targets.setdefault(i.source, set()).add(i.target)
    widest = max(((len(v), k) for k, v in targets.items()), default=None)
    return {
        "modules": len(shape.modules),
        "cycles": len(cycles(shape)),
        "upward imports": len(upward(shape)),
        "imports inside functions (statements)": shape.in_function_imports,
        "imports inside functions to relign's own modules (statements)": len(statements),
        "longest function": f"{longest[0]} lines ({longest[1]}.{longest[2]})",
        "functions over 100 lines": sum(n > 100 for n, *_ in shape.functions),
        "functions over 60 lines": sum(n > 60 for n, *_ in shape.functions),
        "longest recipe train()": f"{trains[0][0]} lines ({trains[0][1]}.train)" if trains else "none",
        "relign modules imported by one file (most)": f"{widest[0]} ({widest[1]})" if widest else "none",
        "choice tables": len(shape.tables),
        "tests of a choice's name outside its table": len(shape.name_tests),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--top", type=int, default=10, help="longest functions to list")
    args = ap.parse_args(argv)
    shape = scan()
    for k, v in summary(shape).items():
        print(f"{k}: {v}")
    if args.verbose:
        for c in cycles(shape):
            print("cycle:", " <-> ".join(c))
        for i in upward(shape):
            print(f"upward: {i.source} (floor {floor_of(i.source)}) -> {i.target} (floor {floor_of(i.target)}) "
                  f"line {i.line}")
        seen = set()
        for i in own_imports(shape):
            if i.in_function and (i.source, i.line) not in seen:
                seen.add((i.source, i.line))
                print(f"in function: {i.source}:{i.line} {i.in_function}(): {i.text}")
        for name, t in sorted(shape.tables.items()):
            print(f"table: {t.module}.{name} (fields {', '.join(sorted(t.fields))})")
        for mod, line, text, table in shape.name_tests:
            print(f"name test: {mod}:{line} {text} (a key of {table})")
        for n, mod, name, line in sorted(shape.functions, reverse=True)[: args.top]:
            print(f"long: {n} {mod}.{name} (line {line})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
