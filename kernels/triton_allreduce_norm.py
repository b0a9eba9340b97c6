"""One kernel for a tensor-parallel block boundary: all-reduce of the row-parallel partial sums, residual
add and RMSNorm (twin: the sum in rank order, then kernels.torch_ops.add_rms_norm).

Every rank holds a symmetric buffer (PyTorch symmetric memory: each rank maps every peer's buffer
into its own address space, so a kernel reads a peer's memory over NVLink with plain loads) and a
symmetric array of flags. Program p owns row p. It:
  1. writes its partial row into its own buffer, in the slot of this call's parity;
  2. tells every peer that row p of this call is there: a release store of the call's epoch into
     flags[p, rank] on that peer;
  3. waits until every peer's flags[p, peer] on this rank reach the epoch (acquire loads);
  4. reads row p of every peer's slot, sums the partials in rank order in fp32 (every rank sums the
     same values in the same order, so every rank gets the same bits), rounds the sum to the residual's
     dtype (the model's), adds the residual and normalises, exactly as kernels/triton_norm.py does.

The partials may be fp32 (a GEMM that kept its fp32 sums) or the model dtype; the slots hold the
partials' dtype (the caller passes its buffers viewed as that dtype). With fp32 partials the sum over
ranks is rounded once, as TP=1's single GEMM rounds its whole sum once.

One barrier per call, no second one: a rank writes slot e % 2 of row p only at epoch e, after its
wait of epoch e - 1, which needed every peer's row p of epoch e - 1, written after that peer's
previous kernels (those reading epoch e - 2's slot, the same slot) had completed. So a peer is at most
one epoch ahead and never overwrites what another still reads. Epochs count calls per program on each
rank (int64, never wraps); every rank runs the same calls with the same grids, so they agree.

All programs must be resident at once, or a rank could wait for a peer program that waits for an SM:
callers keep the grid at most MAX_ROWS, below any Hopper GPU's SM count. No NVLink multicast is used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import enabled as pdl_enabled
from kernels.pdl import wait_for_inputs

MAX_ROWS = 64  # rows (programs) per call; each program needs a resident SM slot (see above)
MAX_WORLD = 8


def _eight(per_rank: list[torch.Tensor]) -> list[torch.Tensor]:
    """The kernel's eight pointer arguments: one per rank, the unused ones repeating rank 0's."""
    return per_rank + [per_rank[0]] * (MAX_WORLD - len(per_rank))


@triton.jit
def _pick(i: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    """p<i> for a compile-time i: peers' buffers come as separate pointer arguments, so Triton knows
    their alignment and vectorises the loads (a pointer loaded from memory would be read in 2-byte
    pieces)."""
    if i == 0:
        return p0
    elif i == 1:
        return p1
    elif i == 2:
        return p2
    elif i == 3:
        return p3
    elif i == 4:
        return p4
    elif i == 5:
        return p5
    elif i == 6:
        return p6
    else:
        return p7


@triton.jit
def _allreduce_add_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, epoch_ptr,
    d0, d1, d2, d3, d4, d5, d6, d7, f0, f1, f2, f3, f4, f5, f6, f7,
    n_cols, slot_elems, eps, weight_offset,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: safe before the wait
    wait_for_inputs(USE_PDL, True)
    epoch = tl.load(epoch_ptr + row) + 1
    at = (epoch % 2) * slot_elems + row * n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    tl.store(_pick(RANK, d0, d1, d2, d3, d4, d5, d6, d7) + at + cols, x, mask=mask)
    tl.debug_barrier()  # every thread's part of the row is stored before the release below
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flags = _pick(peer, f0, f1, f2, f3, f4, f5, f6, f7)
            tl.atomic_xchg(flags + row * WORLD + RANK, epoch, sem="release", scope="sys")
    mine = _pick(RANK, f0, f1, f2, f3, f4, f5, f6, f7)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            seen = tl.atomic_add(mine + row * WORLD + peer, 0, sem="acquire", scope="sys")
            while seen < epoch:
                seen = tl.atomic_add(mine + row * WORLD + peer, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # no thread reads a peer's row before the acquire above
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        if peer == RANK:
            acc += x.to(tl.float32)
        else:
            theirs = _pick(peer, d0, d1, d2, d3, d4, d5, d6, d7) + at + cols
            acc += tl.load(theirs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(epoch_ptr + row, epoch)
    r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # the reduced value in the model dtype, then the sum rounded to the storage dtype: as an all-reduce
    # followed by kernels/triton_norm.py would compute it
    h = (acc.to(res_ptr.dtype.element_ty).to(tl.float32) + r).to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + row * n_cols + cols, h, mask=mask)
    hf = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * n_cols + cols, (hf * inv_rms * (weight_offset + w)).to(out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


def allreduce_add_rms_norm(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    data: list[torch.Tensor],
    flags: list[torch.Tensor],
    epochs: torch.Tensor,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum over ranks of partial + residual), that sum + residual) for partial, residual
    [R, N] contiguous with R <= MAX_ROWS; partial in residual's dtype or fp32, the outputs in residual's.
    data / flags: every rank's symmetric buffers as this process maps them, by rank: data in partial's
    dtype, of two slots, each at least R * N elements; flags
    int64 [MAX_ROWS, world], zeroed on every rank before the first call. epochs: int64 [MAX_ROWS],
    this rank's, zeroed."""
    world = len(data)
    slot_elems = data[0].numel() // 2
    rows, n = partial.shape
    if world > MAX_WORLD or len(flags) != world:
        raise ValueError(f"allreduce_add_rms_norm: {world} ranks; at most {MAX_WORLD}, one flag array each")
    if rows > MAX_ROWS or rows * n > slot_elems:
        raise ValueError(f"allreduce_add_rms_norm: {rows} rows of {n} exceed {MAX_ROWS} rows or the slot")
    if data[0].dtype != partial.dtype or partial.dtype not in (residual.dtype, torch.float32):
        raise ValueError(
            f"allreduce_add_rms_norm: partial {partial.dtype}, slots {data[0].dtype}, residual "
            f"{residual.dtype}; the slots take the partial's dtype, which is the residual's or float32"
        )
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual)
    if rows == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    pdl = pdl_enabled(partial.device)
    _allreduce_add_norm_kernel[(rows,)](
        partial, residual, weight, out, res_out, epochs, *_eight(data), *_eight(flags),
        n, slot_elems, eps, float(weight_offset),
        RANK=rank, WORLD=world, BLOCK=block, USE_PDL=pdl,
        num_warps=min(16, max(1, block // 256)), launch_pdl=pdl,
    )  # fmt: skip
    return out, res_out
