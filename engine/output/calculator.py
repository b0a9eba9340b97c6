"""nanochat's calculator tool, evaluated safely.

Never Python `eval`: the expression is parsed with `ast` and walked over a whitelist:
numbers, + - * / // % (no **), unary minus/plus, parentheses, and "literal".count("x").
Limits on input length, nesting depth, literal length, intermediate size and wall time make every
input finish fast. No signals are used, so it is safe in the engine's worker thread.
"""

from __future__ import annotations

import ast
import math
import operator
import time

MAX_EXPR_CHARS = 500
MAX_DEPTH = 32
MAX_LITERAL_CHARS = 1000
MAX_NUMBER_DIGITS = 30
MAX_ABS_RESULT = 10**30
TIME_LIMIT_S = 0.02

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class _Reject(Exception):
    pass


def evaluate(expression: str) -> int | float | None:
    """The value of a whitelisted expression, or None for anything else (never raises)."""
    try:
        expr = expression.replace(",", "").strip()
        if not expr or len(expr) > MAX_EXPR_CHARS or _paren_depth(expr) > MAX_DEPTH:
            return None
        tree = ast.parse(expr, mode="eval")
        return _Walker(time.monotonic() + TIME_LIMIT_S).eval(tree.body, 0)
    except (
        _Reject,
        SyntaxError,
        ValueError,
        TypeError,
        ZeroDivisionError,
        OverflowError,
        RecursionError,
        MemoryError,
    ):
        return None


def format_result(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _paren_depth(text: str) -> int:
    depth = best = 0
    for ch in text:
        depth += ch in "(["
        depth -= ch in ")]"
        best = max(best, depth)
    return best


class _Walker:
    def __init__(self, deadline: float):
        self.deadline = deadline

    def eval(self, node: ast.AST, depth: int):
        if depth > MAX_DEPTH or time.monotonic() > self.deadline:
            raise _Reject
        if isinstance(node, ast.Constant):
            return self._number(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self.eval(node.operand, depth + 1)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = self.eval(node.left, depth + 1), self.eval(node.right, depth + 1)
            return self._bounded(_BINOPS[type(node.op)](left, right))
        if isinstance(node, ast.Call):
            return self._count(node)
        raise _Reject

    @staticmethod
    def _number(value):
        # bool is an int subclass: reject it along with strings, bytes, complex, None, Ellipsis
        if type(value) not in (int, float):
            raise _Reject
        if type(value) is int and len(str(abs(value))) > MAX_NUMBER_DIGITS:
            raise _Reject
        return _Walker._bounded(value)

    @staticmethod
    def _bounded(value):
        if isinstance(value, float) and not math.isfinite(value):
            raise _Reject
        if abs(value) > MAX_ABS_RESULT:
            raise _Reject
        return value

    @staticmethod
    def _count(node: ast.Call) -> int:
        """Only "literal".count("x"): a method call on a string constant with one string argument."""
        func = node.func
        ok = (
            isinstance(func, ast.Attribute)
            and func.attr == "count"
            and isinstance(func.value, ast.Constant)
            and type(func.value.value) is str
            and len(node.args) == 1
            and not node.keywords
            and isinstance(node.args[0], ast.Constant)
            and type(node.args[0].value) is str
        )
        if not ok:
            raise _Reject
        text, needle = func.value.value, node.args[0].value
        if len(text) > MAX_LITERAL_CHARS or len(needle) > MAX_LITERAL_CHARS:
            raise _Reject
        return text.count(needle)
