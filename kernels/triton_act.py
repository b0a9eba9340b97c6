"""Triton gated activations on [T, 2I] = [gate | up] (twins: torch_ops.silu_and_mul / gelu_tanh_and_mul).

Grid: (row, column block). Math in fp32, one rounding to the output dtype. `tanh` is also used by
the attention kernels for logit soft-capping, so it lives here.

`add_silu` (the gated-LoRA MTP sampler head's fc1 from two precomputed halves) is silu(a + b[idx])
per row, the sum rounded to the output dtype first, as the twin's bf16 add rounds it.

`gated_and_mul_amax` also writes, per row and column block, the largest |output| (as rounded): the
partial maxima from which a consumer that quantises the row per token (the W8A8 GEMV of down_proj)
takes amax without a pass of its own over the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import enabled as pdl_enabled
from kernels.pdl import wait_for_inputs

BLOCK = 1024  # 1024 elements / (4 warps x 32 lanes) = 8 bf16 per thread = one 16-byte load


@triton.jit
def tanh(x):
    """tanh(x) = 2 * sigmoid(2x) - 1: saturates cleanly to +-1 (exp overflow gives inf, not NaN)."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def gated(gate, up, GELU_TANH: tl.constexpr):
    """act(gate) * up in fp32: silu, or the tanh-approximated GELU (Gemma's GeGLU)."""
    gate = gate.to(tl.float32)
    if GELU_TANH:
        # gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
        act = 0.5 * gate * (1.0 + tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
    else:
        act = gate * tl.sigmoid(gate)
    return act * up.to(tl.float32)


@triton.jit
def gated_pair_rows(N, BLOCK_N: tl.constexpr):
    """(output rows, weight rows) of a tile of a batch-1 GEMV over [gate | up] [N, K] that applies the
    activation itself: tile row r pairs gate row j = t * BLOCK_N / 2 + r // 2 (even r) with up row
    N / 2 + j (odd r). Rows past N / 2 re-read row N / 2 - 1 (store_gated masks them)."""
    rows = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
    w_rows = (tl.minimum(rows, N // 2 - 1) + (tl.arange(0, BLOCK_N) % 2) * (N // 2)).to(tl.int64)
    return rows, w_rows


@triton.jit
def store_gated(out_ptr, y, N, BLOCK_N: tl.constexpr, GELU_TANH: tl.constexpr):
    """act(gate) * up of each (gate, up) pair of fp32 row sums y [BLOCK_N] (gated_pair_rows' order),
    into out[j] for j < N / 2: the projection is never rounded before the activation."""
    gate, up = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
    j = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(out_ptr + j, gated(gate, up, GELU_TANH).to(out_ptr.dtype.element_ty), mask=j < N // 2)


@triton.jit
def _gated_kernel(
    x_ptr, out_ptr, amax_ptr, stride_x, stride_out, inter,
    GELU_TANH: tl.constexpr, BLOCK: tl.constexpr, AMAX: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    out = gated(gate, up, GELU_TANH).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)
    if AMAX:  # masked columns hold act(0) * 0 = 0, which never raises the maximum
        tl.store(amax_ptr + row * tl.num_programs(1) + tl.program_id(1), tl.max(tl.abs(out.to(tl.float32))))


def _launch(
    x: torch.Tensor, gelu_tanh: bool, out: torch.Tensor | None, amax: torch.Tensor | None = None
) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"gated activation: last dim {x.shape[-1]} must be even ([gate | up])")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    shape = (*x.shape[:-1], inter)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif out.shape != shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"gated activation: out must be contiguous {shape} {x.dtype}")
    out2 = out.view(-1, inter)
    if x2.shape[0] == 0:
        return out
    grid = (x2.shape[0], triton.cdiv(inter, BLOCK))
    pdl = pdl_enabled(x.device)
    _gated_kernel[grid](
        x2, out2, amax if amax is not None else out2, x2.stride(0), out2.stride(0), inter,
        GELU_TANH=gelu_tanh, BLOCK=BLOCK, AMAX=amax is not None, USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out


def amax_blocks(inter: int) -> int:
    """How many partial maxima gated_and_mul_amax writes per row."""
    return triton.cdiv(inter, BLOCK)


def gated_and_mul_amax(x: torch.Tensor, gelu_tanh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated activation of x [T, 2I] and, per row, amax_blocks(I) partial maxima of |output|
    (float32 [T, amax_blocks(I)]): their maximum is the row's amax."""
    rows = x.numel() // x.shape[-1]
    amax = torch.empty(rows, amax_blocks(x.shape[-1] // 2), dtype=torch.float32, device=x.device)
    return _launch(x, gelu_tanh, None, amax), amax


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up: [..., I]."""
    return _launch(x, False, out)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., 2I] -> gelu_tanh(gate) * up: [..., I] (Gemma's GeGLU)."""
    return _launch(x, True, out)


@triton.jit
def _add_silu_kernel(
    a_ptr, b_ptr, idx_ptr, out_ptr, stride_a, stride_b, stride_out, cols_n,
    GATHER: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL, True)
    row = tl.program_id(0).to(tl.int64)
    b_row = tl.load(idx_ptr + row).to(tl.int64) if GATHER else row
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < cols_n
    a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0)
    b = tl.load(b_ptr + b_row * stride_b + cols, mask=mask, other=0.0)
    s = (a.to(tl.float32) + b.to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (s * tl.sigmoid(s)).to(out_ptr.dtype.element_ty), mask=mask)


def add_silu(a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
    """silu(a + b[idx]) [R, H] for a [R, H] and b [M, H] (rows may be strided; idx int64 [R], None: b's
    rows in order, M = R)."""
    rows, width = a.shape
    if b.shape[-1] != width or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"add_silu: a {tuple(a.shape)} and b {tuple(b.shape)}: same width, contiguous rows")
    if idx is None and b.shape[0] != rows:
        raise ValueError(f"add_silu: without idx b needs a's {rows} rows, got {b.shape[0]}")
    out = torch.empty((rows, width), dtype=a.dtype, device=a.device)
    if rows == 0:
        return out
    pdl = pdl_enabled(a.device)
    _add_silu_kernel[(rows, triton.cdiv(width, BLOCK))](
        a, b, idx if idx is not None else a, out, a.stride(0), b.stride(0), out.stride(0), width,
        GATHER=idx is not None, BLOCK=BLOCK, USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out
