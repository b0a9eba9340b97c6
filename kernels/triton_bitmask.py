"""Token-bitmask application for grammar-constrained decoding (twin: kernels.torch_ops.apply_token_bitmask).

Grid (constrained row, vocabulary chunk). A program reads BLOCK // 32 mask words of its row and writes
-inf into the logits whose bit is 0; allowed logits are neither read nor written, so a row costs one
read of its mask (V / 8 bytes) plus the stores of the refused tokens. Row i of the mask applies to
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
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    # tokens beyond the mask's 32 * W bits are refused (their word index reads as 0)
    words = tl.load(mask_ptr + i * W + offs // 32, mask=inside & (offs // 32 < W), other=0)
    bit = (words >> (offs % 32)) & 1
    neg_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_l + offs, neg_inf, mask=inside & (bit == 0))


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
