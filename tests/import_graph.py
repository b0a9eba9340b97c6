"""The project's import graph, read from the source with `ast`, and imports at run time in a fresh
interpreter: shared by tests/test_layering.py (which room may import which, what each package may
import) and tests/test_import_cycles.py (no cycles).

Every import statement counts wherever it stands: at module level, inside a function (a lazy import
still makes one module depend on the other) and under `if TYPE_CHECKING:` (a type-only import still
ties a module to another's names). Relative imports are resolved against the importing module, and
`from pkg import mod` names the submodule `pkg.mod` when one exists. Importing `a.b.c` also runs the
packages `a` and `a.b` first; those implicit parent imports are not edges, since a package's
`__init__` is its front door (engine/__init__.py reaches its modules lazily, on attribute access).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(*dirs: str) -> list[Path]:
    """Every .py file under the given folders, subpackages included."""
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def parse_imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) for every import statement anywhere in `source`, the
    text of module `module` (relative imports are resolved against it)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([target] if target else []))
            found.append((node.lineno, target, [alias.name for alias in node.names]))
    return sorted(found)


def imports_of(path: Path) -> list[tuple[int, str, list[str]]]:
    return parse_imports(path.read_text(), module_name(path), path.name == "__init__.py")


def targets(module: str, names: list[str], known: set[str]) -> set[str]:
    """The modules of `known` that one import statement (`import module` when `names` is empty, else
    `from module import names`) loads: the submodules named in `names`, and `module` itself unless every
    name is a submodule. Modules outside `known` (the standard library, third parties) are no edge."""
    subs = {f"{module}.{n}" for n in names if f"{module}.{n}" in known}
    if names and len(subs) == len(names):
        return subs
    return subs | ({module} if module in known else set())


def sources_of(files: Iterable[Path]) -> dict[str, tuple[str, bool]]:
    """module name -> (source text, is a package) for the given files."""
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in files}


def import_graph(sources: Mapping[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """module -> {module of `sources` it imports: first line that does}. Self-imports are dropped."""
    known = set(sources)
    graph: dict[str, dict[str, int]] = {}
    for module, (text, is_package) in sources.items():
        edges: dict[str, int] = {}
        for line, target, names in parse_imports(text, module, is_package):
            for hit in targets(target, names, known) - {module}:
                edges.setdefault(hit, line)
        graph[module] = edges
    return graph


def find_cycles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as a sorted list: an
    import cycle runs through the modules of each."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


# ---------------------------------------------------------------------------- run time
def fresh_import(modules: list[str]) -> dict:
    """Import `modules` one by one in a fresh interpreter. Returns, per module, the top-level packages
    that import added to sys.modules, plus the import errors and the final sys.modules names."""
    script = textwrap.dedent(
        """
        import importlib, json, sys, traceback
        seen, added, errors = set(sys.modules), {}, {}
        for name in json.loads(sys.argv[1]):
            try:
                importlib.import_module(name)
            except BaseException:
                errors[name] = traceback.format_exc(limit=3)
            now = set(sys.modules)
            new = now - seen
            added[name] = sorted({m.split(".")[0] for m in new} | {m for m in new if m.startswith("engine")})
            seen = now
        print(json.dumps({"added": added, "errors": errors, "modules": sorted(sys.modules)}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(modules)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def first_importer(result: dict, top_level: str) -> list[str]:
    """The module whose import first brought `top_level` in (later ones find it loaded); the culprit is
    that module or one it imports."""
    return [name for name, added in result["added"].items() if top_level in added]
