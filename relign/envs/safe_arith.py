"""A small, safe arithmetic evaluator shared by the Countdown task and the calculator env.

Model output is untrusted text, so it is never handed to ``eval``/``exec``. The expression is
parsed with ``ast.parse(expr, mode="eval")`` (parsing executes nothing) and the tree is walked
here, allowing only:

* numeric literals: non-negative integers; decimal literals such as ``2.5`` only with
  ``allow_float=True`` (they become exact fractions, ``Fraction("2.5")``; exponent forms like
  ``1e9`` are refused, so a short literal cannot stand for a huge number);
* binary ``+ - * /``; ``/`` is exact (``fractions.Fraction``), division by zero is an error;
* unary ``-`` (and ``+``) only with ``allow_unary=True``. Countdown refuses it: the rules only
  combine the given numbers with binary operations, so ``-3`` would invent a number;
* parentheses (they leave no node in the tree).

Everything else — names, calls, attributes, subscripts, ``**``, ``//``, ``%``, bit operators,
comparisons, lambdas, strings, booleans, complex numbers — is an ``ArithError``. Length is
capped (``max_len``), which with only ``+ - * /`` also bounds the size of every intermediate
number: a 200-character expression cannot build a number much past 10**200, which
``Fraction`` handles in microseconds. Nothing here can loop or allocate without bound.

Written by hand because it is 80 lines and no maintained library offers exactly this
restricted grammar with exact rational results.
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction

MAX_LEN = 200

_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: None,  # handled below: exact, and division by zero is an error
}
# A decimal literal as written in the source: digits with at most one point, no exponent.
_DECIMAL = re.compile(r"\d+\.\d*|\.\d+|\d+")


class ArithError(ValueError):
    """The expression is not allowed or cannot be evaluated (syntax, forbidden node, x/0)."""


def parse_arith(expr: str, *, allow_float: bool = False, allow_unary: bool = False, max_len: int = MAX_LEN) -> ast.Expression:
    """Parse and validate ``expr``; return the checked tree or raise ``ArithError``."""
    if not isinstance(expr, str):
        raise ArithError(f"expected a string, got {type(expr).__name__}")
    expr = expr.strip()
    if not expr:
        raise ArithError("empty expression")
    if len(expr) > max_len:
        raise ArithError(f"expression longer than {max_len} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ArithError(f"not an arithmetic expression: {type(e).__name__}") from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expression, ast.operator, ast.unaryop)):
            continue  # operator kinds are checked on their BinOp/UnaryOp
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _BINOPS:
                raise ArithError(f"operator {type(node.op).__name__} is not allowed (only + - * /)")
        elif isinstance(node, ast.UnaryOp):
            if not allow_unary or not isinstance(node.op, (ast.USub, ast.UAdd)):
                raise ArithError(f"unary {type(node.op).__name__} is not allowed")
        elif isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ArithError(f"constant {v!r} is not a number")
            if isinstance(v, float):
                if not allow_float:
                    raise ArithError(f"non-integer number {v!r} is not allowed")
                src = ast.get_source_segment(expr, node) or ""
                if not _DECIMAL.fullmatch(src):
                    raise ArithError(f"number {src!r} must be written as plain decimal digits")
            elif not _DECIMAL.fullmatch(ast.get_source_segment(expr, node) or ""):
                # e.g. 0x10, 0b1, 1_000: legal Python, not plain arithmetic
                raise ArithError(f"number {ast.get_source_segment(expr, node)!r} must be written as plain digits")
        else:
            raise ArithError(f"{type(node).__name__} is not allowed")
    tree.source = expr  # type: ignore[attr-defined]  # for _value's literal lookup
    return tree


def _value(node: ast.AST, src: str) -> Fraction:
    if isinstance(node, ast.Constant):
        # Exact value from the written digits ("0.1" -> 1/10, not the float 0.1000000000000000055...).
        return Fraction(ast.get_source_segment(src, node))
    if isinstance(node, ast.UnaryOp):
        v = _value(node.operand, src)
        return -v if isinstance(node.op, ast.USub) else v
    assert isinstance(node, ast.BinOp)
    a, b = _value(node.left, src), _value(node.right, src)
    if isinstance(node.op, ast.Div):
        if b == 0:
            raise ArithError("division by zero")
        return a / b
    return _BINOPS[type(node.op)](a, b)


def evaluate(expr: str, *, allow_float: bool = False, allow_unary: bool = False, max_len: int = MAX_LEN) -> Fraction:
    """The exact value of ``expr`` as a ``Fraction``; ``ArithError`` if it is not allowed."""
    return analyze(expr, allow_float=allow_float, allow_unary=allow_unary, max_len=max_len)[0]


def analyze(
    expr: str, *, allow_float: bool = False, allow_unary: bool = False, max_len: int = MAX_LEN
) -> tuple[Fraction, list[Fraction]]:
    """``(value, literals)``: the exact value and the numeric literals in reading order.

    Countdown needs both (which numbers were used, and what they make); one parse serves both.
    """
    tree = parse_arith(expr, allow_float=allow_float, allow_unary=allow_unary, max_len=max_len)
    src = tree.source  # type: ignore[attr-defined]
    try:
        value = _value(tree.body, src)
    except RecursionError:
        raise ArithError("expression nested too deeply") from None
    lits = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Constant)), key=lambda n: (n.lineno, n.col_offset))
    return value, [Fraction(ast.get_source_segment(src, n)) for n in lits]


def format_number(value: Fraction, max_decimals: int = 6) -> str:
    """``12`` for integers, else a decimal rounded to ``max_decimals`` places (``7/2`` -> ``3.5``)."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(abs(value) * 10**max_decimals)  # an int (round half to even)
    whole, frac = divmod(scaled, 10**max_decimals)
    text = f"{whole}.{frac:0{max_decimals}d}".rstrip("0").rstrip(".")
    return text if text == "0" or value > 0 else "-" + text
