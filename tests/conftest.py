"""Shared fixtures: the tiny embedded model (made once per session) and a naive reference generator."""

from __future__ import annotations

import os
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
