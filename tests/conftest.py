"""Shared fixtures: the tiny embedded model (made once per session) and a naive reference generator."""

from __future__ import annotations

import importlib.util
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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """models/tiny-llama (made by `make`), or a fresh copy in a temp dir when it is missing."""
    default = ROOT / "models" / "tiny-llama"
    if (default / "config.json").exists():
        return default
    from scripts.make_model import make_model

    return Path(make_model("tiny", tmp_path_factory.mktemp("tiny-llama")))


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
