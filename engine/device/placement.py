"""Where the model runs and in which dtype: "auto" and dtype names become torch objects here only.

"auto" means CUDA when it is available, else CPU; the auto dtype is bf16 on CUDA and fp32 elsewhere.
`configure_process` applies the process-wide torch settings every process that runs the model needs
(rank 0 and each tensor-parallel worker alike).
"""

from __future__ import annotations

import torch


def resolve_device_dtype(
    device: str | torch.device = "auto", dtype: torch.dtype | str | None = "auto"
) -> tuple[torch.device, torch.dtype]:
    """device: "auto", "cpu", "cuda", "cuda:N" or a torch.device; dtype: None / "auto", a torch
    dtype or the name of a floating one ("bfloat16"). Resolved values pass through unchanged."""
    resolved = _device(device)
    return resolved, _dtype(dtype, resolved)


def configure_process(device: torch.device, seed: int, blas_library: str) -> None:
    """The torch settings that hold per process: the seed and, on a GPU, the cuBLAS front end for
    GEMMs (LoadConfig.blas_library). Every rank applies the same ones: tensor-parallel ranks meet at
    each all-reduce, so a rank left on slower GEMM kernels holds up all of them."""
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library(blas_library)


def _device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype: {dtype!r} is not a floating torch dtype; use float32, float16 or bfloat16")
    return resolved
