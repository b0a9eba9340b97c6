"""Token-bitmask application for grammar-constrained decoding (twin: kernels.torch_ops.apply_token_bitmask).

Grid (constrained row, vocabulary chunk). A program reads BLOCK // 32 mask words of its row, expands
them to a [BLOCK // 32, 32] grid of bits (token 32 * word + bit) and rewrites its BLOCK logits with
-inf where the bit is 0: one read and one write of the row's logits in 16-byte vectors (a masked
scatter of only the refused tokens would store element by element). Row i of the mask applies to
logits row rows[i] (or row i when HAS_ROWS is off). Knows nothing of requests or grammars.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # logits per program: 32 programs for one row of a 128k vocabulary


@triton.jit
def _bitmask_kernel(
    logits_ptr, mask_ptr, rows_ptr, V, W, stride_l,
    BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64) if HAS_ROWS else i
    words_at = chunk * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    # tokens beyond the mask's 32 * W bits are refused (their word reads as 0)
    words = tl.load(mask_ptr + i * W + words_at, mask=words_at < W, other=0)
    bit = tl.arange(0, 32)
    allowed = ((words[:, None] >> bit[None, :]) & 1) != 0  # [BLOCK // 32, 32]: token 32 * word + bit
    offs = words_at[:, None] * 32 + bit[None, :]
    inside = offs < V
    ptrs = logits_ptr + row * stride_l + offs
    x = tl.load(ptrs, mask=inside)
    tl.store(ptrs, tl.where(allowed, x, float("-inf")).to(x.dtype), mask=inside)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """In place on logits [N, V] (stride(-1) == 1); bitmask [R, W] int32, contiguous; rows [R] or None."""
    r, w = bitmask.shape
    if r == 0:
        return
    bitmask = bitmask.contiguous()
    grid = (r, triton.cdiv(logits.shape[1], BLOCK))
    _bitmask_kernel[grid](
        logits, bitmask, rows if rows is not None else bitmask, logits.shape[1], w, logits.stride(0),
        BLOCK=BLOCK, HAS_ROWS=rows is not None,
    )  # fmt: skip
