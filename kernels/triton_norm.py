"""Triton RMSNorm and fused residual-add + RMSNorm (twins: kernels.torch_ops.rms_norm / add_rms_norm).

One program normalises one row. The whole row is loaded as one block (hidden sizes of the models we
serve are <= 16384), the sum of squares is taken in fp32, and the result is cast back once.
`weight_offset` is 1.0 for Gemma, whose checkpoints store w - 1 and scale by (1 + w).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import enabled as pdl_enabled
from kernels.pdl import wait_for_inputs

MAX_HIDDEN = 65536
# Let the next kernel (a GEMV at batch 1) launch before the wait, so its first weight tiles load while
# the kernel before this one still runs (kernels.pdl.wait_for_inputs)
RELEASE_FIRST = True


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    n_cols,
    eps,
    weight_offset,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    RELEASE_FIRST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride may exceed 2**31 for long batches
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: safe before the wait
    wait_for_inputs(USE_PDL, RELEASE_FIRST)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the storage dtype first: the twin normalises the stored residual.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = xf * inv_rms * (weight_offset + w)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [R, N] with a unit stride along N (the kernel indexes rows by stride)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _out(out: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if out.shape != like.shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(f"rms_norm: {name} must be contiguous {tuple(like.shape)} {like.dtype}")
    return out


def _launch(x, residual, weight, eps, weight_offset, out=None, residual_out=None):
    n = x.shape[-1]
    if n > MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {n} > {MAX_HIDDEN}; split the row loop to support it")
    if weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight must be contiguous of shape ({n},), got {tuple(weight.shape)}")
    x2 = _rows(x)
    out = _out(out, x, "out")
    out2 = out.view(-1, n)
    res2 = _rows(residual) if residual is not None else x2
    res_out = _out(residual_out, x, "residual_out") if residual is not None else out
    res_out2 = res_out.view(-1, n)
    if x2.shape[0] == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    # ~16-byte vectors per thread: 8 bf16 lanes x 32 threads = 256 elements per warp.
    num_warps = min(16, max(1, block // 256))
    pdl = pdl_enabled(x.device)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, out2, res_out2,
        x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0),
        n, eps, weight_offset,
        HAS_RESIDUAL=residual is not None, BLOCK=block, USE_PDL=pdl, RELEASE_FIRST=RELEASE_FIRST,
        num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out, res_out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x / rms(x) * (weight_offset + weight); x: [..., N], weight: [N]; out: optional destination."""
    return _launch(x, None, weight, eps, float(weight_offset), out)[0]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the inputs are not modified unless passed as
    out / residual_out (each row is read before it is written, so residual_out=residual is safe)."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)}/{residual.dtype} must match x")
    return _launch(x, residual, weight, eps, float(weight_offset), out, residual_out)
