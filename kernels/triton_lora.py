"""Batched multi-LoRA shrink and expand (punica-style), grouped by adapter slot.

Rows are visited slot by slot through a LoraMapping (kernels.lora_mapping): slot s owns the rows
token_order[slot_starts[s]:slot_starts[s + 1]]. Both kernels launch a grid over (row tile, output tile)
x (split / slice) x slot that covers the worst case (every row on one slot); a program whose row tile
starts past its slot's rows, or whose output tile lies past its slice, returns at once. So the launch
shape depends only on T, S and the weight shapes, and nothing reads the device from the host: both run
inside CUDA graphs, mixed batches included, and a replay regroups rows from the token_slots buffer.

  shrink  out[t, :] = lora_a[slot, :, :] @ x[t]          x [T, K], lora_a [S, R, K] -> out [T, R] fp32
          a tensor-core dot of a gathered [BLOCK_M, BLOCK_K] x tile with a [BLOCK_K, BLOCK_N] A tile,
          fp32 accumulation; K is split over SPLIT_K programs when there are few row tiles (decode),
          which add their partial sums with fp32 atomics into a zeroed output (so the last bits of
          `out` may vary run to run when SPLIT_K > 1).
  expand  y[t, off[i]:off[i+1]] += lora_b[slot, off[i]:off[i+1], :] @ s[t, i*r:(i+1)*r]
          every slice of a fused layer (QKV, gate|up) in ONE launch (grid axis 1 = slice); the rank r
          is one K tile, s (fp32, or already in lora_b's dtype: a folded layer's GEMM columns, see
          engine/lora/layers.py) is rounded to lora_b's dtype for the dot (as the twin does), the add
          to y is fp32 and y keeps its dtype. Each y element is owned by one program: plain load/add/store.
fp32 operands use an IEEE fp32 dot (no TF32). Configs are fixed per (T, shape) (no autotune), so a
warm-up at each captured batch size compiles every variant before graph capture.
Twin: kernels.torch_lora.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.lora_mapping import LoraMapping
from kernels.pdl import enabled as pdl_enabled
from kernels.pdl import wait_for_inputs
from kernels.torch_lora import check_expand, check_shrink
from kernels.triton_gemv import _sm_count

MAX_SLICES = 4  # slice offsets travel as scalar kernel arguments (no host->device copy per call)
SMALL_T = 128  # up to this many rows: decode-sized tiles (BLOCK_M 16) and split K
SHRINK_K_PER_SPLIT = 256  # a shrink split covers at least this much of K
SHRINK_PROGRAMS_PER_SM = 2  # split K until the busy tiles make this many programs per SM
NUM_WARPS = 4
# The expand joins the step's PDL chain (kernels/pdl.py): it launches while the projection before it
# drains and lets the kernel after it (norm, RoPE, activation) launch at once.
EXPAND_PDL = True


@triton.jit
def _slot_rows(order_ptr, starts_ptr, slot, pid_m, BLOCK_M: tl.constexpr):
    """The row indices of this program's tile of its slot's rows, and which lanes hold a row."""
    start = tl.load(starts_ptr + slot)
    end = tl.load(starts_ptr + slot + 1)
    pos = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = pos < end
    rows = tl.load(order_ptr + pos, mask=ok, other=0).to(tl.int64)
    return rows, ok, start + pid_m * BLOCK_M < end


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, order_ptr, starts_ptr, R, K,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    num_n = tl.cdiv(R, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    pid_k = tl.program_id(1)
    slot = tl.program_id(2)
    rows, row_ok, busy = _slot_rows(order_ptr, starts_ptr, slot, pid_m, BLOCK_M)
    if not busy:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < R
    ks = tl.arange(0, BLOCK_K)
    k_first = pid_k * BLOCK_K  # split pid_k takes K tiles pid_k, pid_k + SPLIT_K, ...
    x_ptrs = x_ptr + rows[:, None] * stride_xt + (k_first + ks)[None, :] * stride_xk
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + cols[None, :] * stride_ar
    a_ptrs += (k_first + ks)[:, None] * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_first, K, BLOCK_K * SPLIT_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x.to(a.dtype), a, acc, input_precision="ieee" if IEEE else None)
        x_ptrs += BLOCK_K * SPLIT_K * stride_xk
        a_ptrs += BLOCK_K * SPLIT_K * stride_ak
    out_ptrs = out_ptr + rows[:, None] * stride_ot + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")


@triton.jit
def _slice_bounds(sl, off0, off1, off2, off3, off4):
    lo = tl.where(sl == 0, off0, tl.where(sl == 1, off1, tl.where(sl == 2, off2, off3)))
    hi = tl.where(sl == 0, off1, tl.where(sl == 1, off2, tl.where(sl == 2, off3, off4)))
    return lo, hi


@triton.jit
def _expand_kernel(
    s_ptr, b_ptr, y_ptr, order_ptr, starts_ptr, RANK, NUM_N, off0, off1, off2, off3, off4,
    stride_st, stride_sr, stride_bs, stride_bn, stride_br, stride_yt, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0) // NUM_N
    pid_n = tl.program_id(0) % NUM_N
    sl = tl.program_id(1)
    slot = tl.program_id(2)
    lo, hi = _slice_bounds(sl, off0, off1, off2, off3, off4)
    if lo + pid_n * BLOCK_N >= hi:
        return
    cols = lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hi
    rk = tl.arange(0, BLOCK_R)
    r_ok = rk < RANK
    # lora_b is a weight, never written during a step: its tile loads before the PDL wait, while the
    # GEMM that wrote y and s drains; the mapping, s and y are read after it.
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + cols[None, :] * stride_bn + rk[:, None] * stride_br
    b = tl.load(b_ptrs, mask=r_ok[:, None] & col_ok[None, :], other=0.0)
    wait_for_inputs(USE_PDL, True)
    rows, row_ok, busy = _slot_rows(order_ptr, starts_ptr, slot, pid_m, BLOCK_M)
    if not busy:
        return
    s_ptrs = s_ptr + rows[:, None] * stride_st + (sl * RANK + rk)[None, :] * stride_sr
    s = tl.load(s_ptrs, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    delta = tl.dot(s.to(b.dtype), b, input_precision="ieee" if IEEE else None)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yn
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def shrink_config(t: int, r_total: int, k: int, num_slots: int, sm_count: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) from T and the weight shape. SPLIT_K grows until the busy
    (slot, row tile, column tile) programs make SHRINK_PROGRAMS_PER_SM per SM; at most
    cdiv(T, BLOCK_M) + min(S, T) - 1 row tiles are busy (each slot's last tile may be partial)."""
    block_m = 16 if t <= SMALL_T else 64
    block_n = min(64, max(16, triton.next_power_of_2(r_total)))
    block_k = 128 if t <= SMALL_T else 64
    busy = (triton.cdiv(t, block_m) + min(num_slots, t) - 1) * triton.cdiv(r_total, block_n)
    want = triton.cdiv(SHRINK_PROGRAMS_PER_SM * sm_count, max(busy, 1))
    split_k = max(1, min(want, k // SHRINK_K_PER_SPLIT))
    return block_m, block_n, block_k, split_k


def expand_config(t: int, rank: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_R): the whole rank in one K tile (tensor-core dots need 16)."""
    block_m = 16 if t <= SMALL_T else 64
    return block_m, 128, max(16, triton.next_power_of_2(rank))


def _dot_ieee(*tensors: torch.Tensor) -> bool:
    return any(t.dtype == torch.float32 for t in tensors)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoraMapping) -> torch.Tensor:
    """out [T, R] fp32 = each row's slot of lora_a [S, R, K] @ x[t] [K]; 0 for rows without an adapter.
    x is cast to lora_a's dtype for the dot (both fp32 when either is fp32)."""
    check_shrink(x, lora_a, mapping)
    t, k = x.shape
    num_slots, r_total, _ = lora_a.shape
    out = torch.zeros(t, r_total, dtype=torch.float32, device=x.device)
    if t == 0 or r_total == 0:
        return out
    ieee = _dot_ieee(x, lora_a)
    if ieee:
        x, lora_a = x.float(), lora_a.float()
    bm, bn, bk, split_k = shrink_config(t, r_total, k, num_slots, _sm_count(x.device))
    grid = (triton.cdiv(t, bm) * triton.cdiv(r_total, bn), split_k, num_slots)
    _shrink_kernel[grid](
        x, lora_a, out, mapping.token_order, mapping.slot_starts, r_total, k,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split_k, IEEE=ieee, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def lora_expand(
    y: torch.Tensor,
    s: torch.Tensor,
    lora_b: torch.Tensor,
    mapping: LoraMapping,
    slice_offsets: Sequence[int],
) -> None:
    """In place: y[t, off[i]:off[i+1]] += lora_b[slot[t], off[i]:off[i+1]] @ s[t, i*r:(i+1)*r] for all
    n_slices slices in one launch; rows without an adapter are untouched."""
    n_slices = check_expand(y, s, lora_b, mapping, slice_offsets)
    if n_slices > MAX_SLICES:
        raise ValueError(f"lora_expand: {n_slices} slices; the kernel takes at most {MAX_SLICES}")
    t = y.shape[0]
    num_slots, _, rank = lora_b.shape
    widest = max(hi - lo for lo, hi in zip(slice_offsets[:-1], slice_offsets[1:]))
    if t == 0 or rank == 0 or widest == 0:
        return
    ieee = _dot_ieee(lora_b)
    bm, bn, br = expand_config(t, rank)
    num_n = triton.cdiv(widest, bn)
    pdl = EXPAND_PDL and pdl_enabled(y.device)
    offs = list(slice_offsets) + [slice_offsets[-1]] * (MAX_SLICES + 1 - len(slice_offsets))
    grid = (triton.cdiv(t, bm) * num_n, n_slices, num_slots)
    _expand_kernel[grid](
        s, lora_b, y, mapping.token_order, mapping.slot_starts, rank, num_n, *offs,
        s.stride(0), s.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br, IEEE=ieee, USE_PDL=pdl, num_warps=NUM_WARPS, launch_pdl=pdl,
    )  # fmt: skip
