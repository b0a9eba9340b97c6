"""No import cycles in app/, engine/, kernels/ or benchmarks/, read from the source.

An edge is any import of one project module by another (tests/import_graph.py): inside a function too,
since a lazy import only hides a cycle that is still there in the design, and under TYPE_CHECKING.
"""

from __future__ import annotations

from tests.import_graph import find_cycles, import_graph, parse_imports, python_files, sources_of

PACKAGES = ("app", "engine", "kernels", "benchmarks")


def cycle_path(graph: dict[str, dict[str, int]], members: list[str]) -> str:
    """One loop through the cycle's first module, with the line of each import: `a:3 -> b:9 -> a`."""
    start, inside = members[0], set(members)
    paths = {start: [start]}
    todo = [start]
    while todo:  # breadth first, so the loop shown is a shortest one
        node = todo.pop(0)
        for target, line in sorted(graph[node].items()):
            if target not in inside:
                continue
            step = paths[node][:-1] + [f"{node}:{line}", target]
            if target == start:
                return " -> ".join(step)
            if target not in paths:
                paths[target] = step
                todo.append(target)
    raise AssertionError(f"{members} is no cycle")


def cycles_of(sources: dict[str, tuple[str, bool]]) -> list[str]:
    graph = import_graph(sources)
    return [cycle_path(graph, members) for members in find_cycles(graph)]


def test_no_import_cycles():
    sources = sources_of(python_files(*PACKAGES))
    assert {m.split(".")[0] for m in sources} == set(PACKAGES)
    assert {"engine.sched.scheduler", "benchmarks.bench", "kernels.triton_qgemv", "app.ingress"} <= set(
        sources
    )
    assert cycles_of(sources) == []


def test_the_cycle_check_sees_lazy_relative_and_type_only_cycles():
    """The checker itself, on synthetic packages: each cycle is found and shown as a loop; imports of
    a module's parent package, and modules that only import into a cycle, are no cycle."""
    sources = {
        "bench": ("", True),
        "bench.a": ("from . import b\n", False),  # `from pkg import mod`: the submodule
        "bench.b": ("import os\ndef main():\n    from bench.a import run\n", False),  # lazy
        "bench.c": ("import bench.a\nfrom bench import d\n", False),  # into the cycle, not part of it
        "bench.d": ("from bench import VERSION\n", False),  # the package itself: no way back to d
        "eng": ("def __getattr__(name):\n    from eng.x import X\n", True),
        "eng.x": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .y import Y\n", False),
        "eng.y": ("from .z import Z\n", False),
        "eng.z": ("from eng.x import X\n", False),  # eng.y -> eng.z runs eng/__init__ first: no edge
    }
    assert cycles_of(sources) == [
        "bench.a:1 -> bench.b:3 -> bench.a",
        "eng.x:3 -> eng.y:1 -> eng.z:1 -> eng.x",
    ]
    sources["eng.z"] = ("X = 1\n", False)
    assert cycles_of(sources) == ["bench.a:1 -> bench.b:3 -> bench.a"]


def test_the_import_parser_sees_every_form():
    source = "import ray\nfrom ray import serve\nimport ray.serve as s\ndef f():\n    from fastapi import X\n"
    assert [(m, n) for _, m, n in parse_imports(source, "engine.x")] == [
        ("ray", []),
        ("ray", ["serve"]),
        ("ray.serve", []),
        ("fastapi", ["X"]),
    ]
    assert parse_imports("from . import block_manager", "engine.sched.scheduler") == [
        (1, "engine.sched", ["block_manager"])
    ]
    assert parse_imports("from .. import config", "engine.sched.scheduler") == [(1, "engine", ["config"])]
    assert parse_imports("from .layers import A", "engine.models", True) == [
        (1, "engine.models.layers", ["A"])
    ]
