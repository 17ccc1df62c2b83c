"""relign's import graph keeps its floors (docs/architecture.md, "Floors"): no cycle at run time,
no import from a lower floor to a higher one, and the few imports inside functions say why.

The graph is read with ``ast`` by ``tools/code_shape.py`` (the script that counts the shape of
the code for the issue and the docs), so these tests and the published counts are one code."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import load_script

code_shape = load_script("tools/code_shape.py", "code_shape")

MAX_IN_FUNCTION = 30  # imports of relign's own modules inside functions (the bound)


@pytest.fixture(scope="module")
def shape():
    return code_shape.scan()


def test_no_import_cycle_at_run_time(shape):
    assert code_shape.cycles(shape) == [], "modules that import each other (move the shared piece down a floor)"


def test_no_import_runs_back_up_the_floors(shape):
    up = [f"{i.source} (floor {code_shape.floor_of(i.source)}) imports {i.target} (floor {code_shape.floor_of(i.target)}) "
          f"at line {i.line}" for i in code_shape.upward(shape)]
    assert up == []


def test_every_module_has_a_floor(shape):
    assert [m for m in shape.modules if code_shape.floor_of(m) == 0] == []


def test_the_few_imports_inside_functions_say_why(shape):
    inside = {(i.source, i.line): i.text for i in code_shape.own_imports(shape) if i.in_function}
    assert len(inside) <= MAX_IN_FUNCTION
    assert [f"{m}:{line} {text}" for (m, line), text in sorted(inside.items()) if "#" not in text] == []


def _package(root: Path, modules: dict[str, str]) -> Path:
    for name, text in {"__init__": "", **modules}.items():
        path = root / "relign" / f"{name.replace('.', '/')}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checks_see_a_cycle_an_upward_import_and_what_type_checking_hides(tmp_path):
    """The graph the tests above read, on a package made for it: they are not vacuous."""
    root = _package(tmp_path, {
        "config": "from . import rundir\n",                                     # floor 2 -> floor 4: upward
        "rundir": "def f():\n    from .config import x\n",                        # and back: a cycle, inside a function
        "algorithms/__init__": "",
        "algorithms/kl": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..recipes import rl\n",
        "recipes/__init__": "", "recipes/rl": "from ..algorithms.kl import x\n",  # downward: fine
    })
    shape = code_shape.scan(root)
    assert code_shape.cycles(shape) == [["relign.config", "relign.rundir"]]
    assert [(i.source, i.target) for i in code_shape.upward(shape)] == [("relign.config", "relign.rundir")]
    assert [(i.source, i.in_function) for i in code_shape.own_imports(shape) if i.in_function] == [("relign.rundir", "f")]
    assert not any(i.source == "relign.algorithms.kl" for i in shape.imports)  # never runs


def test_a_package_whose_init_imports_a_module_that_imports_the_package_back_is_a_cycle(tmp_path):
    """``from relign.envs import gsm8k`` runs relign/envs/__init__.py first: when that imports the
    importing module, the two import each other (what envs/tasks.py once did)."""
    root = _package(tmp_path, {
        "envs/__init__": "from relign.envs.tasks import TASKS\n",
        "envs/gsm8k": "def task():\n    pass\n",
        "envs/tasks": "from relign.envs import gsm8k\nTASKS = {}\n",
    })
    assert code_shape.cycles(code_shape.scan(root)) == [["relign.envs", "relign.envs.tasks"]]
    (root / "relign" / "envs" / "tasks.py").write_text("from relign.envs.gsm8k import task\nTASKS = {}\n")
    assert code_shape.cycles(code_shape.scan(root)) == []


def test_no_choice_is_told_by_its_name_outside_its_table(shape):
    """What a task, an estimator, a strategy, a loss or a dtype does is in its table's row
    (``TASKS["custom"].from_file``, ``ESTIMATORS[a].values``): nothing outside compares its name."""
    assert {"TASKS", "ESTIMATORS", "STRATEGIES", "PAIR_LOSSES", "POLICY_LOSSES", "DTYPES", "PLANNERS"} <= set(shape.tables)
    assert [f"{m}:{line} {text} ({t})" for m, line, text, t in shape.name_tests] == []


def test_the_name_count_sees_a_name_test_by_field_lookup_and_check(tmp_path):
    """The count above, on a package made for it: a key compared through each of the ways a field is
    tied to its table, and what it leaves alone (a name list, a dict of scalars, another field's value)."""
    root = _package(tmp_path, {
        "tables": ('ROWS = {"alpha": Row(1), "beta": Row(2)}\n'      # a table of rows, looked up by `kind`
                   'SCALARS = {"alpha": 1.0}\n'                        # scalars: not a table of rows
                   'NAMES = ("alpha", "gamma")\n'                      # names only: not a table of rows
                   'def row(kind):\n    return ROWS[kind]\n'),
        "use": ('def f(cfg, kind, name, other):\n'
                '    a = cfg.kind == "alpha"\n'                         # by the lookup's field
                '    b = name in ("beta", "zeta")\n'                    # by check_choice's field
                '    c = cfg.row != "alpha"\n'                          # by the table's singular
                '    d = other == "alpha"\n'                            # another field: left alone
                '    e = cfg.kind == "gamma"\n'                         # not a key: left alone
                '    check_choice("x.name", name, tuple(ROWS))\n'),
    })
    shape = code_shape.scan(root)
    assert set(shape.tables) == {"ROWS"}
    assert [(m, line) for m, line, _, _ in shape.name_tests] == [("relign.use", 2), ("relign.use", 3), ("relign.use", 4)]


def test_the_architecture_page_quotes_the_tools_figures(shape):
    """docs/architecture.md's shape block is ``python tools/code_shape.py``'s output, as it is today."""
    from .conftest import REPO

    doc = (REPO / "docs" / "architecture.md").read_text()
    lead = "today (`tests/test_import_layers.py` keeps this block equal to its output):\n\n```text\n"
    block = doc.split(lead, 1)[1].split("```", 1)[0]
    printed = "".join(f"{k}: {v}\n" for k, v in code_shape.summary(shape).items())
    assert block == printed
