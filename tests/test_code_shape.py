"""The code's shape: no function in app/ or engine/ runs over MAX_FUNCTION_LINES lines.

A function's length is from its `def` line to its last line (`ast`: end_lineno - lineno + 1; decorators
do not count), nested functions and methods included, each on its own.
"""

from __future__ import annotations

import ast

from tests.import_graph import ROOT, python_files

MAX_FUNCTION_LINES = 40
# Functions allowed over the limit, each with its reason (none today).
ALLOWED_LONG: set[str] = set()


def long_functions(source: str, where: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """`where::Qualified.name` -> length, for each function of `source` longer than `limit` lines."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                length = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and length > limit:
                    found[f"{where}::{name}"] = length
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_function_in_app_or_engine_is_over_the_limit():
    found: dict[str, int] = {}
    for path in python_files("app", "engine"):
        found |= long_functions(path.read_text(), path.relative_to(ROOT).as_posix())
    assert {name: n for name, n in found.items() if name not in ALLOWED_LONG} == {}


def test_the_length_check_counts_from_def_to_last_line():
    """The checker on synthetic source: a 41-line method, an async function and a nested function over
    the limit are reported by qualified name; 40 lines and decorators are not."""

    def body(lines: int, indent: str) -> str:  # a function of `lines` lines, `def` line included
        return "".join(f"{indent}x{i} = {i}\n" for i in range(lines - 1))

    source = (
        f"class A:\n    @staticmethod\n    def fits():\n{body(40, '        ')}"
        f"    def long():\n{body(41, '        ')}"
        f"async def outer():\n    async def inner():\n{body(41, '        ')}    return inner\n"
    )
    assert long_functions(source, "m.py") == {"m.py::A.long": 41, "m.py::outer": 43, "m.py::outer.inner": 41}
    assert long_functions(source, "m.py", limit=41) == {"m.py::outer": 43}
