"""Shared fixtures: the tiny embedded model (made once per session), the shared default server (started
once for the modules that need no server configuration of their own), and the order of the tests."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

# Triton fixes its interpreter flag when first imported (torch._dynamo and transformers import it
# early), so choose it before anything else: on a machine without CUDA the kernels are interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _template_is_current(model_dir: Path) -> bool:
    from engine.chat_template import family_template

    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    return config.get("chat_template") == family_template("llama")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """models/tiny-llama (made by `make`), or a fresh one in a temp dir when it is missing or carries an
    older copy of the family's chat template (the served tool-call tests follow the current one)."""
    default = ROOT / "models" / "tiny-llama"
    if (default / "config.json").exists() and _template_is_current(default):
        return default
    from scripts.make_model import make_model

    return Path(make_model("tiny", tmp_path_factory.mktemp("models") / "tiny-llama"))


@pytest.fixture(scope="module")
def default_server(tiny_model_dir):
    """serve_config.yaml's application with TEST_OVERRIDES on the tiny model, shared by the modules that
    use it: started on first use, stopped after the last of their tests (see the hooks below)."""
    from tests.serving_fixtures import shared_server

    return shared_server(tiny_model_dir)


@pytest.fixture(scope="module")
def server(default_server):
    """A serving module's server: the shared one, unless the module defines its own `server`."""
    return default_server


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on the module's server."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _on_default_server(item: pytest.Item) -> bool:
    return "default_server" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the shared server run one after another, where the first of them is (files keep
    their order), so that it starts once. Each module's tests stay together and in order."""
    shared = [item for item in items if _on_default_server(item)]
    if shared:
        at = items.index(shared[0])
        rest = [item for item in items if not _on_default_server(item)]
        items[:] = rest[:at] + shared + rest[at:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the last test on the shared server (and its modules' fixtures), stop it: the tests that
    follow get the machine's CPUs. A core left behind by serve.shutdown() fails this teardown."""
    result = yield
    if _on_default_server(item) and (nextitem is None or not _on_default_server(nextitem)):
        _stop_shared_server()
    return result


def _stop_shared_server() -> None:
    fixtures = sys.modules.get("tests.serving_fixtures")
    if fixtures is not None:
        fixtures.stop_shared_server()


def _serving_stack_missing() -> bool:
    try:
        import fastapi  # noqa: F401
        import openai  # noqa: F401
        import ray  # noqa: F401
    except ImportError:
        return True
    return False


# The serving tests need Ray Serve and the openai client; a bare GPU host (for `pytest -m gpu`) has
# neither, so those modules are not collected there rather than failing at import.
_SERVING_MODULES = ["test_serving*.py", "test_hardening*.py", "test_api_surface.py", "test_clients.py"]
collect_ignore_glob = list(_SERVING_MODULES) if _serving_stack_missing() else []
# The property-based tests need hypothesis (the [dev] extra), which a bare GPU host may lack too.
if importlib.util.find_spec("hypothesis") is None:
    collect_ignore_glob += ["test_scheduler.py", "test_block_manager_stateful.py", "test_hardening*.py"]


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)
    try:  # still running when the run stopped early (-x, Ctrl-C)
        _stop_shared_server()
    except Exception as exc:  # reported, but the run's outcome is already decided
        print(f"\nstopping the shared server: {exc!r}", file=sys.stderr)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """After a Ray driver ran in this process, exit with pytest's status and skip finalization.

    ray.shutdown() leaves Ray's native threads running in the driver (after tests/test_serving.py:
    worker.io, gcs_client_io, gRPC pollers and timers, 12 in all). One that calls into Python while the
    interpreter finalizes kills the process with SIGSEGV after every test has passed and been
    reported (seen once in CI: "254 passed ... Segmentation fault"; Ray tracks the class of bug as
    ray-project/ray#31145). Nothing is left to run at this point: the summary is printed and the
    Ray session's processes were stopped by ray.shutdown(), so os._exit loses nothing."""
    fixtures = sys.modules.get("tests.serving_fixtures")
    status = config.stash.get(_EXIT_STATUS, None)
    if fixtures is None or not fixtures.ray_driver_started or status is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
