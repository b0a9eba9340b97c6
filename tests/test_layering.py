"""The project's layering rules: what each package may import, checked at run time and in the source.

Run time: each rule imports the modules in a fresh interpreter (`sys.executable -c ...`) and inspects
`sys.modules`, so nothing this pytest process has imported already (the conftest imports torch) can
hide a violation. Source: `ast` over every file, which also catches imports inside functions.

Rules: the scheduler and block manager are plain Python (no torch); engine/ runs without Ray or
FastAPI/Starlette and never imports app/; kernels/ never imports engine/; app/ uses only the engine's
public API (below) and never a private (leading underscore) engine module or name.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The engine's public API for app/: what engine/__init__.py exports (LLM, LLMEngine, CoreClient,
# SamplingParams, ToolConfig, BudgetForcing, Tokenizer, prompt_block_hashes), the modules that define
# the first six of those names (the last two are reached through `engine` only), and the value-type
# modules a server needs to speak to the engine (its config, its errors, its outputs). app/ imports
# exactly these today: engine.config (EngineConfig), engine.core_client (CoreClient), engine.errors
# (EngineError and subclasses), engine.outputs (RequestOutput), engine.sampling_params (SamplingParams,
# ToolConfig, BudgetForcing, StructuredOutput).
ENGINE_PUBLIC_MODULES = {
    "engine",
    "engine.config",
    "engine.core_client",
    "engine.errors",
    "engine.llm",
    "engine.llm_engine",
    "engine.outputs",
    "engine.sampling_params",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_files(*dirs: str) -> list[Path]:
    """Every .py file of the given folders (not recursive: engine/templates holds no Python)."""
    return sorted(p for d in dirs for p in (ROOT / d).glob("*.py"))


ENGINE_FILES = package_files("engine", "engine/models")
KERNEL_FILES = package_files("kernels")
APP_FILES = package_files("app")


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


# ---------------------------------------------------------------------------- run time
def test_scheduler_and_block_manager_do_not_import_torch():
    result = fresh_import(["engine.block_manager", "engine.scheduler"])
    assert not result["errors"], result["errors"]
    assert "torch" not in result["modules"], f"torch imported by {first_importer(result, 'torch')}"


def test_the_module_lists_are_complete():
    """Every Python file of engine/, engine/models/ and kernels/ is checked; none is skipped."""
    on_disk = {
        p.relative_to(ROOT).as_posix() for d in ("engine", "kernels") for p in (ROOT / d).rglob("*.py")
    }
    checked = {p.relative_to(ROOT).as_posix() for p in ENGINE_FILES + KERNEL_FILES}
    assert on_disk == checked
    assert {"engine/scheduler.py", "engine/models/llama.py", "kernels/ops.py"} <= checked
    assert "app/ingress.py" in {p.relative_to(ROOT).as_posix() for p in APP_FILES}


def test_importing_every_engine_module_imports_neither_ray_nor_fastapi():
    result = fresh_import([module_name(p) for p in ENGINE_FILES])
    assert not result["errors"], result["errors"]
    for banned in ("ray", "fastapi", "starlette", "app"):
        assert banned not in result["modules"], f"{banned} imported by {first_importer(result, banned)}"


def test_importing_every_kernels_module_imports_no_engine_module():
    result = fresh_import([module_name(p) for p in KERNEL_FILES])
    assert not result["errors"], result["errors"]
    engine = [m for m in result["modules"] if m == "engine" or m.startswith("engine.")]
    assert not engine, f"{engine} imported by {first_importer(result, 'engine')}"


# ---------------------------------------------------------------------------- source (ast)
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


def offending(files: list[Path], banned_top: set[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in files
        for line, module, _ in imports_of(path)
        if module.split(".")[0] in banned_top
    ]


def test_the_import_parser_sees_every_form():
    source = "import ray\nfrom ray import serve\nimport ray.serve as s\ndef f():\n    from fastapi import X\n"
    assert [(m, n) for _, m, n in parse_imports(source, "engine.x")] == [
        ("ray", []),
        ("ray", ["serve"]),
        ("ray.serve", []),
        ("fastapi", ["X"]),
    ]
    assert parse_imports("from . import block_manager", "engine.scheduler") == [
        (1, "engine", ["block_manager"])
    ]
    assert parse_imports("from .. import scheduler", "engine.models.llama") == [(1, "engine", ["scheduler"])]
    assert parse_imports("from .layers import A", "engine.models", True) == [
        (1, "engine.models.layers", ["A"])
    ]


def test_no_engine_file_imports_ray_fastapi_or_app():
    assert offending(ENGINE_FILES, {"ray", "fastapi", "starlette", "app"}) == []


def test_no_kernels_file_imports_engine():
    assert offending(KERNEL_FILES, {"engine"}) == []


def engine_exports() -> set[str]:
    tree = ast.parse((ROOT / "engine" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("engine/__init__.py defines no __all__")


def api_violations(where: str, source: str, module: str) -> list[str]:
    """Every way the app module `module` (text `source`) steps outside the engine's public API."""
    problems = []
    bound: set[str] = set()  # local names that refer to engine modules or their objects
    for line, target, names in parse_imports(source, module):
        if target.split(".")[0] != "engine":
            continue
        if target not in ENGINE_PUBLIC_MODULES:
            problems.append(f"{where}:{line}: imports {target}, not part of the public API")
        if any(part.startswith("_") for part in target.split(".")):
            problems.append(f"{where}:{line}: imports private module {target}")
        for name in names:
            if name.startswith("_"):
                problems.append(f"{where}:{line}: imports private name {target}.{name}")
            elif target == "engine" and name not in engine_exports():
                problems.append(f"{where}:{line}: engine.{name} is not in engine.__all__")
        bound |= set(names) if names else {"engine"}
    for node in ast.walk(ast.parse(source)):  # Engine._private or engine.module._private
        if not (
            isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        ):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in bound:
            problems.append(f"{where}:{node.lineno}: uses private {ast.unparse(node)}")
    return problems


def test_app_uses_only_the_public_engine_api():
    problems = []
    for path in APP_FILES:
        problems += api_violations(str(path.relative_to(ROOT)), path.read_text(), module_name(path))
    assert problems == []


def test_the_api_check_catches_private_and_internal_imports():
    """The rule above is not vacuous: each kind of violation is reported."""
    source = textwrap.dedent(
        """
        from engine.scheduler import Scheduler
        from engine.errors import _check
        from engine import LLM, SamplingParams, Sequence
        import engine.outputs
        from engine.core_client import CoreClient
        CoreClient._start(None)
        engine.outputs._helper
        CoreClient.submit
        """
    )
    problems = sorted(p.split(": ", 1)[1] for p in api_violations("app/probe.py", source, "app.probe"))
    assert problems == [
        "engine.Sequence is not in engine.__all__",
        "imports engine.scheduler, not part of the public API",
        "imports private name engine.errors._check",
        "uses private CoreClient._start",
        "uses private engine.outputs._helper",
    ]


def test_what_app_takes_from_the_engine_today():
    """A record of app/'s engine imports; change it together with the public API (and its docs)."""
    used = sorted(
        {
            (module, name)
            for path in APP_FILES
            for _, module, names in imports_of(path)
            if module.split(".")[0] == "engine"
            for name in names
        }
    )
    assert used == [
        ("engine", "Tokenizer"),
        ("engine", "prompt_block_hashes"),
        ("engine.config", "EngineConfig"),
        ("engine.core_client", "CoreClient"),
        ("engine.errors", "EngineDeadError"),
        ("engine.errors", "EngineError"),
        ("engine.errors", "InvalidRequestError"),
        ("engine.errors", "PromptTooLongError"),
        ("engine.errors", "QueueFullError"),
        ("engine.outputs", "RequestOutput"),
        ("engine.sampling_params", "BudgetForcing"),
        ("engine.sampling_params", "SamplingParams"),
        ("engine.sampling_params", "StructuredOutput"),
        ("engine.sampling_params", "ToolConfig"),
    ]


def test_the_matcher_process_imports_neither_torch_nor_transformers():
    """engine/grammar_worker.py starts a child per engine: it must stay light (llguidance only)."""
    result = fresh_import(["engine.grammar_worker"])
    assert not result["errors"], result["errors"]
    for heavy in ("torch", "transformers"):
        assert heavy not in result["modules"], f"{heavy} imported by {first_importer(result, heavy)}"
