"""Where the kernel tests run: the Triton interpreter on CPU tensors, or compiled kernels on CUDA.

Import this before triton. Triton fixes its interpreter flag for its own library (tl.sum, ...) when it is
first imported, so the flag is chosen here (tests/conftest.py does the same for whole sessions); if
something imported triton earlier (torch._dynamo, transformers), the interpreter cannot run in this
process and interpreter_usable() says so.
"""

from __future__ import annotations

import importlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA_OK = torch.cuda.is_available() and not INTERPRET


def interpreter_usable() -> bool:
    """True when triton's own library was defined under the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return INTERPRET and isinstance(
        importlib.import_module("triton.language.standard").sum, InterpretedFunction
    )
