"""relign's ``math`` grader against public answer-equivalence suites, side by side with math-verify.

    python bench/math_grader.py                      # the tables of docs/tasks.md (~12 s on 2 shared cores)
    python bench/math_grader.py --record             # ... and record math-verify's figures in the data file
    python bench/math_grader.py --show-misses        # every case a grader gets wrong
    python bench/math_grader.py extract --math-verify-tests DIR --hendrycks-test FILE   # rebuild the data

The cases (tests/envs/data/math_equivalence_suites.json, sources in the README next to it) are
the (gold, prediction, expected label) triples of math-verify 0.9.0's own test files and of
Hendrycks MATH's ``is_equiv`` tests. How a case reaches the graders (``present``): both graders
get the same two texts.

* A text that is a bare answer (no ``\\boxed``, no math delimiter except possibly one span
  around the whole text, at most ``MAX_BARE_WORDS`` words outside ``\\text{}``: ``10\\text{ units}``,
  ``$\\frac13 $``, ``$$(-793, 10)$$``, ``28 percent``) is presented as ``\\boxed{<answer>}``, the
  form the math task's prompt asks for; a text holding a box, or prose (``Answer $ 9 $``, ``the
  number is not 10 which is 1,000.99``, a worked solution) is presented as it is. The same
  rule for gold and prediction.
* relign: ``relign.envs.math.reward("", prediction, {"answer": gold}, answer_format=...)`` (the
  reward a run computes; a gold holding a box is read as a worked solution), for each
  ``answer_format``: ``boxed`` (the default), ``boxed_or_final``, ``any``.
* math-verify: ``math_verify.verify(math_verify.parse(gold), math_verify.parse(prediction))``
  with every setting at its default (math-verify's tests use their own extraction settings per
  test; the label is what they assert).

A case counts as agreeing when the grader's 0/1 equals the expected label.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DATA = REPO / "tests" / "envs" / "data" / "math_equivalence_suites.json"

# --------------------------------------------------------------------------- extraction

# Test options that change what "equivalent" means (math-verify's defaults: strict=True,
# allow_set_relation_comp=False, float_rounding=6). A case asserted only under another value
# is left out: its label is not the default notion of equivalence (f(x) = f(y) with
# strict=False; x in [-2,7] = -2 <= x <= 7 only with set relations; 2.6667 = 8/3 at 2 digits).
DEFAULT_OPTIONS = {"strict": True, "allow_set_relation_comp": False}
MIN_PRECISION = 5  # precision=5 cases hold at 6 digits too (sqrt(17) to 15 digits, 4 vs 4 sqrt 2, \text{13} vs 13)


def _call_options(fn: ast.FunctionDef) -> dict:
    """The keyword options of the test body's compare_strings(...) call (constants only)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "compare_strings":
            out = {}
            for kw in node.keywords:
                try:
                    out[kw.arg] = ast.literal_eval(kw.value)
                except ValueError:
                    out[kw.arg] = ast.unparse(kw.value)  # a parameter name (precision=precision)
            return out
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "verify":
            return {"match_types": "default"}
    return {}


def extract_math_verify(path: Path) -> tuple[list[dict], list[dict]]:
    """(kept, left out) cases of one math-verify test file: every parametrized test with gold,
    pred and an expected label."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kept, left = [], []
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and ast.unparse(dec.func) == "pytest.mark.parametrize"):
                continue
            names = [s.strip() for s in ast.literal_eval(dec.args[0]).split(",")]
            if not {"gold", "pred"} <= set(names):
                continue
            label = "expected" if "expected" in names else "result"
            rows = eval(compile(ast.Expression(dec.args[1]), str(path), "eval"), {"math": math})  # f-strings
            call = _call_options(fn)
            for i, row in enumerate(rows):
                r = dict(zip(names, row))
                opts = {k: v for k, v in call.items() if k != "match_types"}
                for k in ("precision", "strict", "allow_set_relation_comp"):
                    if k in r:
                        opts[k] = r[k]
                case = {"suite": f"math-verify/{path.name}", "test": f"{fn.name}[{i}]", "gold": r["gold"],
                        "pred": r["pred"], "expected": int(r[label]), "match_types": call.get("match_types", "default"),
                        "options": opts}
                nondefault = [k for k, v in DEFAULT_OPTIONS.items() if k in opts and opts[k] != v]
                if opts.get("precision", 6) < MIN_PRECISION:
                    nondefault.append("precision")
                (left if nondefault else kept).append({**case, "left_out": nondefault} if nondefault else case)
    return kept, left


def extract_hendrycks(path: Path) -> list[dict]:
    """The cases of hendrycks/math modeling/math_equivalence_test.py: test_in (the reference) and
    test_out (the prediction), assertTrue / assertFalse(is_equiv(test_in, test_out))."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cases = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        values, expected = {}, None
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                values[node.targets[0].id] = ast.literal_eval(node.value)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("assertTrue", "assertFalse"):
                expected = int(node.func.attr == "assertTrue")
        if expected is not None:
            cases.append({"suite": "hendrycks/math", "test": fn.name, "gold": values["test_in"], "pred": values["test_out"],
                          "expected": expected, "match_types": "is_equiv", "options": {}})
    return cases


SOURCES = [
    {"suite": "math-verify/*", "repository": "https://github.com/huggingface/Math-Verify",
     "files": "tests/test_*.py", "release": "math-verify 0.9.0 (PyPI sdist math_verify-0.9.0.tar.gz, "
     "sha256 45ac6c61344ba056b9e99a660a4bc8d044ed408f730aed68c60435aa5eec4645)", "license": "Apache-2.0"},
    {"suite": "hendrycks/math", "repository": "https://github.com/hendrycks/math",
     "files": "modeling/math_equivalence_test.py", "commit": "5f3bf91d13367550bed100240554fd11c25abe48",
     "license": "MIT"},
]


def extract(mv_dir: Path, hendrycks: Path) -> dict:
    kept, left = [], []
    for path in sorted(mv_dir.glob("test_*.py")):
        k, l = extract_math_verify(path)
        kept += k
        left += l
    kept += extract_hendrycks(hendrycks)
    return {"sources": SOURCES, "cases": kept, "left_out": left}


# --------------------------------------------------------------------------- presentation

_SPAN = re.compile(r"\A\s*(?:\$\$(?P<a>.*)\$\$|\$(?P<b>.*)\$|\\\((?P<c>.*)\\\)|\\\[(?P<d>.*)\\\])\s*\Z", re.DOTALL)
_DELIMITER = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed|\\fbox")
_TEXT_GROUP = re.compile(r"\\(?:text\w*|mathrm|mbox)\{[^{}]*\}")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")  # a word of two letters or more, not a LaTeX command
MAX_BARE_WORDS = 3  # "28 percent", "19, 46, and 82"; "the number is not 10 which is 1,000.99" is a sentence


def present(text: str) -> str:
    """The text as both graders receive it: a bare answer boxed, anything else as it is."""
    if re.search(r"\\boxed|\\fbox", text):
        return text
    m = _SPAN.match(text)
    inner = next(g for g in m.groups() if g is not None) if m else text
    if _DELIMITER.search(inner) or len(_WORD.findall(_TEXT_GROUP.sub("", inner))) > MAX_BARE_WORDS:
        return text  # prose (with math in it, or sentences): a response
    return f"\\boxed{{{inner.strip()}}}"


# --------------------------------------------------------------------------- grading

def grade_relign(gold: str, pred: str, answer_format: str = "boxed") -> int:
    from relign.envs import math as math_task

    kw = {} if answer_format == "boxed" else {"answer_format": answer_format}
    return int(math_task.reward("", present(pred), {"answer": present(gold)}, **kw)["score"] == 1.0)


def grade_math_verify(gold: str, pred: str) -> int:
    from math_verify import parse, verify

    return int(bool(verify(parse(present(gold)), parse(present(pred)))))


GRADERS = {
    "relign": lambda g, p: grade_relign(g, p, "boxed"),
    "relign_final": lambda g, p: grade_relign(g, p, "boxed_or_final"),
    "relign_any": lambda g, p: grade_relign(g, p, "any"),
    "math_verify": grade_math_verify,
}


def run(cases: list[dict], graders: list[str]) -> dict[str, list[int]]:
    """Each grader's 0/1 on each case."""
    return {name: [GRADERS[name](c["gold"], c["pred"]) for c in cases] for name in graders}


def boxed(case: dict) -> bool:
    """Whether the prediction, as presented, holds a box (the format the math task asks for)."""
    return bool(re.search(r"\\boxed|\\fbox", present(case["pred"])))


def agreement(cases: list[dict], verdicts: list[int], keep=lambda c: True) -> dict[str, tuple[int, int]]:
    """(agreeing, cases) per suite and "overall"."""
    out: dict[str, list[int]] = {}
    for c, v in zip(cases, verdicts):
        if keep(c):
            for key in (c["suite"], "overall"):
                row = out.setdefault(key, [0, 0])
                row[0] += int(v == c["expected"])
                row[1] += 1
    return {k: (a, n) for k, (a, n) in sorted(out.items(), key=lambda kv: (kv[0] == "overall", kv[0]))}


COLUMNS = [("relign", "relign `boxed` (default)"), ("relign_final", "relign `boxed_or_final`"),
           ("relign_any", "relign `any`"), ("math_verify", "math-verify")]


def table(cases: list[dict], results: dict[str, list[int]], keep=lambda c: True) -> str:
    cols = [(k, title) for k, title in COLUMNS if k in results]
    per = {k: agreement(cases, results[k], keep) for k, _ in cols}
    lines = ["| suite | cases | " + " | ".join(t for _, t in cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for suite, (_, n) in per[cols[0][0]].items():
        cells = [f"{per[k][suite][0]} ({100 * per[k][suite][0] / n:.1f}%)" for k, _ in cols]
        name = f"**{suite}**" if suite == "overall" else suite
        lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load() -> dict:
    return json.loads(DATA.read_text(encoding="utf-8"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command")
    ex = sub.add_parser("extract", help="rebuild the data file from the suites' test files")
    ex.add_argument("--math-verify-tests", type=Path, required=True, help="tests/ of the math-verify 0.9.0 sdist")
    ex.add_argument("--hendrycks-test", type=Path, required=True, help="hendrycks/math modeling/math_equivalence_test.py")
    ap.add_argument("--record", action="store_true", help="write math-verify's verdicts into the data file")
    ap.add_argument("--show-misses", action="store_true", help="list every case a grader gets wrong")
    args = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)  # math_verify logs parse failures of the malformed cases
    if args.command == "extract":
        data = extract(args.math_verify_tests, args.hendrycks_test)
        _dump(data)
        print(f"{DATA.relative_to(REPO)}: {len(data['cases'])} cases ({len(data['left_out'])} left out)")
        return
    import math_verify

    data = load()
    cases = data["cases"]
    results, seconds = {}, {}
    for name in GRADERS:
        t0 = time.perf_counter()
        results.update(run(cases, [name]))
        seconds[name] = time.perf_counter() - t0
    print(f"math-verify {math_verify.__version__ if hasattr(math_verify, '__version__') else _version()}, "
          f"{len(cases)} cases; seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()) + "\n")
    print("All cases:\n\n" + table(cases, results) + "\n")
    print("Predictions with a box (or a bare answer, presented boxed):\n\n" + table(cases, results, boxed) + "\n")
    print("Predictions without a box (prose):\n\n" + table(cases, results, lambda c: not boxed(c)) + "\n")
    if args.show_misses:
        for i, c in enumerate(cases):
            if any(results[k][i] != c["expected"] for k in results):
                print(f"{c['suite']} {c['test']} expected {c['expected']}: "
                      + ", ".join(f"{k} {results[k][i]}" for k in results))
                print(f"    gold {present(c['gold'])[-160:]!r}\n    pred {present(c['pred'])[-160:]!r}")
    if args.record:
        for c, v in zip(cases, results["math_verify"]):
            c["math_verify"] = v
        data["math_verify_version"] = _version()
        _dump(data)
        print(f"recorded math-verify's verdicts in {DATA.relative_to(REPO)}")


def _dump(data: dict) -> None:
    """The data file: its header fields indented, one case a line."""
    lines = ["{"]
    for key, value in data.items():
        if isinstance(value, list) and value and isinstance(value[0], dict) and "gold" in value[0]:
            rows = ",\n".join("  " + json.dumps(row, ensure_ascii=False) for row in value)
            lines.append(f" {json.dumps(key)}: [\n{rows}\n ],")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)},")
    lines[-1] = lines[-1].rstrip(",")
    DATA.write_text("\n".join(lines) + "\n}\n", encoding="utf-8")


def _version() -> str:
    from importlib.metadata import version

    return version("math-verify")


if __name__ == "__main__":
    main()
