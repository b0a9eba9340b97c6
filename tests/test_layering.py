"""The project's layering rules: which room of engine/ may import which, and what each package may import.

Rooms: each subpackage of engine/ is a room; the modules directly in engine/ form two, `top` (the entry
points that wire the rooms together) and `base` (the value types and services every room may use).
ROOMS below says which room may import which; a few single modules are allowed across it, each with its
reason (ACROSS). Other rules: the scheduler's room is plain Python (no torch, directly or through what it
imports); engine/ runs without Ray or FastAPI/Starlette and never imports app/; kernels/ never imports
engine/; app/ uses only the engine's public API (its top-level modules below) and no private name.

Source checks use `ast` over every file (tests/import_graph.py: imports inside functions and under
TYPE_CHECKING count too). Run-time checks import modules in a fresh interpreter (`sys.executable -c`)
and inspect `sys.modules`, so nothing this pytest process has imported already (the conftest imports
torch) can hide a violation.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from tests.import_graph import (
    ROOT,
    first_importer,
    fresh_import,
    import_graph,
    imports_of,
    module_name,
    parse_imports,
    python_files,
)
from tests.import_graph import sources_of as read_sources

# Which room may import which (a room always may import itself); `-`: nothing of engine/.
ROOMS_TABLE = """
room        may import                                            # why
top         base core sched runner device models sampling spec structured output lora  # wires the rooms
core        base sched output           # the core process loop; replica-side live requests make text
output      base sched sampling         # sampled tokens to outputs: finishes sequences, reads results
runner      base sched device models sampling spec structured lora  # runs a scheduled step on the device
spec        base sched sampling         # drafts per sequence, verified by the sampler
structured  base device                 # grammars and their masks: no scheduler, no runner
sampling    base device                 # logits to tokens
models      base device                 # a model knows no requests: no scheduler, no runner
lora        base models device          # adapters: files, host cache, GPU slots, LoRA layers; no requests
sched       base                        # plain Python: no torch, no device, no runner
device      -                           # where tensors live
base        -                           # configs and value types: no room
"""
ROOMS = {
    row.split()[0]: set(row.split()[1:]) - {"-"}
    for row in (line.split("#")[0] for line in ROOMS_TABLE.strip().splitlines()[1:])
}
# The modules directly in engine/: `top` wires the rooms together (LLM, LLMEngine, CoreClient, the nanochat
# driver); `base` imports no room and may be imported by all.
TOP_MODULES = {"engine", "engine.llm", "engine.llm_engine", "engine.core_client", "engine.nanochat"}
BASE_MODULES = {
    "engine.config",
    "engine.spec_config",
    "engine.sampling_params",
    "engine.outputs",
    "engine.errors",
    "engine.tokenizer",
    "engine.chat_template",
}
# (importing room, imported module): single modules a room may import although ROOMS does not allow
# their room.
ACROSS = {
    ("core", "engine.llm_engine"): "the core process (core/process.py) runs an LLMEngine",
    ("output", "engine.core.messages"): "the sink and builder write the step's records (wire form)",
    ("output", "engine.core.faults"): "test-only fault injection fires in the output processor",
    ("sched", "engine.structured.compiler"): "admission checks a grammar spec at the door (lazy; llguidance)",
    ("spec", "engine.device.stream"): "the verifier's result records its copy's event as the sampler's",
    ("spec", "engine.lora.adapter"): "spec/mtp_head.py (gated_lora_mtp) checks its LoRA as adapters are",
    ("spec", "engine.lora.weights"): "... and reads it as adapters are read, for the runner's LoRA slots",
    ("spec", "engine.lora.request"): "... under a LoRARequest, as the host cache and the slots key adapters",
    ("spec", "engine.models.quant_loader"): "the fp8 MTP head rounds its weights as fp8 loading does",
}
# The engine's public API for app/: engine/__init__.py (LLM, LLMEngine, CoreClient, SamplingParams,
# ToolConfig, BudgetForcing, Tokenizer, prompt_block_hashes) and the top-level modules that define those
# names or the values a server exchanges with the engine: configs, errors, outputs, the tokenizer.
ENGINE_PUBLIC_MODULES = TOP_MODULES - {"engine.nanochat"} | BASE_MODULES - {"engine.chat_template"}
MAX_TOP_LEVEL_MODULES = 15  # engine/ keeps its public API on top; everything else lives in a room

ENGINE_FILES = python_files("engine")
KERNEL_FILES = python_files("kernels")
APP_FILES = python_files("app")
SCHED_MODULES = [module_name(p) for p in python_files("engine/sched")]


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ROOMS and parts[1] not in ("top", "base"):
        return parts[1]
    return "top" if module in TOP_MODULES else "base"


def room_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of `graph` (engine modules only) that ROOMS and ACROSS do not allow."""
    problems = []
    for module, edges in sorted(graph.items()):
        room = room_of(module)
        for target, line in sorted(edges.items()):
            other = room_of(target)
            if other == room or other in ROOMS[room] or (room, target) in ACROSS:
                continue
            problems.append(f"{module}:{line}: room {room} imports {target} (room {other})")
    return problems


def reached_from(graph: dict[str, dict[str, int]], start: list[str]) -> set[str]:
    """The modules that `start` imports, directly or through others (lazy imports too), and `start`."""
    seen, todo = set(start), list(start)
    while todo:
        for target in graph.get(todo.pop(), {}):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def torch_importers(sources: dict[str, tuple[str, bool]], start: list[str]) -> list[str]:
    """module:line of each torch import in `start` or in a module it reaches."""
    found = []
    for module in sorted(reached_from(import_graph(sources), start)):
        text, is_package = sources[module]
        found += [
            f"{module}:{line}"
            for line, target, _ in parse_imports(text, module, is_package)
            if target == "torch" or target.startswith("torch.")
        ]
    return found


def engine_sources() -> dict[str, tuple[str, bool]]:
    return read_sources(ENGINE_FILES)


# ---------------------------------------------------------------------------- rooms (ast)
def test_every_engine_module_has_a_room_and_the_top_stays_small():
    modules = set(engine_sources())
    subpackages = {p.parent.name for p in ENGINE_FILES if p.parent != ROOT / "engine"}
    assert subpackages == set(ROOMS) - {"top", "base"}, "a subpackage of engine/ is missing from ROOMS"
    top_level = {m for m in modules if m.count(".") <= 1 and m.split(".")[-1] not in subpackages}
    assert top_level == TOP_MODULES | BASE_MODULES, (
        "put each module of engine/ in TOP_MODULES or BASE_MODULES"
    )
    assert not TOP_MODULES & BASE_MODULES
    assert len(top_level - {"engine"}) <= MAX_TOP_LEVEL_MODULES
    assert all(room in ROOMS for allowed in ROOMS.values() for room in allowed)


def test_each_room_imports_only_the_rooms_it_may():
    assert room_violations(import_graph(engine_sources())) == []


def test_each_allowance_across_the_rooms_is_still_used():
    """ACROSS stays a true record: an allowance no import needs any more is removed."""
    graph = import_graph(engine_sources())
    used = {(room_of(m), t) for m, edges in graph.items() for t in edges}
    assert set(ACROSS) - used == set()


def test_the_room_check_catches_a_violation_in_a_synthetic_engine():
    """room_violations is not vacuous: lazy and type-only imports across a wall are reported, imports the
    table or ACROSS allows are not."""
    type_only = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.output.text import TextStream\n"
    )
    sources = {
        "engine.sched.request": ("def f():\n    from engine.runner import model_runner\n", False),
        "engine.sched.scheduler": (type_only, False),
        "engine.runner": ("", True),
        "engine.runner.model_runner": ("from engine.sched.request import Sequence\nimport torch\n", False),
        "engine.device.placement": ("from engine import config\n", False),
        "engine.config": ("", False),
        "engine.output.text": ("from engine.core.messages import Record\nfrom engine import errors\n", False),
        "engine.core.messages": ("", False),
        "engine.errors": ("", False),
    }
    assert room_violations(import_graph(sources)) == [
        "engine.device.placement:1: room device imports engine.config (room base)",
        "engine.sched.request:2: room sched imports engine.runner.model_runner (room runner)",
        "engine.sched.scheduler:3: room sched imports engine.output.text (room output)",
    ]
    assert torch_importers(sources, ["engine.sched.scheduler"]) == []
    assert torch_importers(sources, ["engine.sched.request"]) == ["engine.runner.model_runner:2"]


# ---------------------------------------------------------------------------- the scheduler's room: no torch
def test_the_scheduler_room_reaches_no_torch_import_in_the_source():
    """Not in engine/sched/ nor in any engine module it imports, lazily or not."""
    assert torch_importers(engine_sources(), SCHED_MODULES) == []


def test_the_scheduler_room_does_not_import_torch_at_run_time():
    result = fresh_import(SCHED_MODULES)
    assert {"engine.sched.block_manager", "engine.sched.scheduler"} <= set(SCHED_MODULES)
    assert not result["errors"], result["errors"]
    assert "torch" not in result["modules"], f"torch imported by {first_importer(result, 'torch')}"


# ---------------------------------------------------------------------------- run time
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


def test_the_matcher_process_imports_neither_torch_nor_transformers():
    """engine/structured/worker.py starts a child per engine: it must stay light (llguidance only)."""
    result = fresh_import(["engine.structured.worker"])
    assert not result["errors"], result["errors"]
    for heavy in ("torch", "transformers"):
        assert heavy not in result["modules"], f"{heavy} imported by {first_importer(result, heavy)}"


# ---------------------------------------------------------------------------- packages (ast)
def offending(files: list[Path], banned_top: set[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in files
        for line, module, _ in imports_of(path)
        if module.split(".")[0] in banned_top
    ]


def test_the_file_lists_walk_the_subpackages():
    checked = {p.relative_to(ROOT).as_posix() for p in ENGINE_FILES + KERNEL_FILES + APP_FILES}
    assert {"engine/sched/scheduler.py", "engine/models/llama.py", "engine/output/sink.py"} <= checked
    assert {"kernels/ops.py", "app/ingress.py", "engine/__init__.py"} <= checked


def test_no_engine_file_imports_ray_fastapi_or_app():
    assert offending(ENGINE_FILES, {"ray", "fastapi", "starlette", "app"}) == []


def test_no_kernels_file_imports_engine():
    assert offending(KERNEL_FILES, {"engine"}) == []


# ---------------------------------------------------------------------------- app/ and the public API
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


def test_the_public_api_is_the_top_of_engine():
    """Public modules sit directly in engine/ (no room is public), and each exists."""
    assert ENGINE_PUBLIC_MODULES <= TOP_MODULES | BASE_MODULES
    assert ENGINE_PUBLIC_MODULES <= set(engine_sources())


def test_app_uses_only_the_public_engine_api():
    problems = []
    for path in APP_FILES:
        problems += api_violations(str(path.relative_to(ROOT)), path.read_text(), module_name(path))
    assert problems == []


def test_the_api_check_catches_private_and_internal_imports():
    """The rule above is not vacuous: each kind of violation is reported."""
    source = textwrap.dedent(
        """
        from engine.sched.scheduler import Scheduler
        from engine.errors import _check
        from engine import LLM, SamplingParams, Sequence
        import engine.outputs
        from engine.core_client import CoreClient
        CoreClient._start(None)
        engine.outputs._helper
        CoreClient.submit
        def later():
            from engine.output.text import TextStream
        """
    )
    problems = sorted(p.split(": ", 1)[1] for p in api_violations("app/probe.py", source, "app.probe"))
    assert problems == [
        "engine.Sequence is not in engine.__all__",
        "imports engine.output.text, not part of the public API",
        "imports engine.sched.scheduler, not part of the public API",
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
        ("engine", "LoRARequest"),
        ("engine", "Tokenizer"),
        ("engine", "prompt_block_hashes"),
        ("engine.config", "EngineConfig"),
        ("engine.core_client", "CoreClient"),
        ("engine.core_client", "StepNote"),
        ("engine.errors", "EngineDeadError"),
        ("engine.errors", "EngineError"),
        ("engine.errors", "InvalidRequestError"),
        ("engine.errors", "LoRAError"),
        ("engine.errors", "LoRANotFoundError"),
        ("engine.errors", "PromptTooLongError"),
        ("engine.errors", "QueueFullError"),
        ("engine.outputs", "CompletionDelta"),
        ("engine.outputs", "RequestOutput"),
        ("engine.sampling_params", "BudgetForcing"),
        ("engine.sampling_params", "SamplingParams"),
        ("engine.sampling_params", "StructuredOutput"),
        ("engine.sampling_params", "ToolConfig"),
    ]
