"""Skinny GEMM for decode: y = x @ W^T with few rows in x (M <= 16), W an nn.Linear weight [N, K].

At M <= 16 the layer is bound by reading W once from HBM, so the kernel is built to stream W:
  * grid (cdiv(N, BLOCK_N), num_splits): program (t, s) owns outputs [t*BLOCK_N, (t+1)*BLOCK_N) and
    k-blocks [s*blocks_per_split, (s+1)*blocks_per_split) of the reduction;
  * per k-block it loads a W tile [BLOCK_N, BLOCK_K] (rows are K-contiguous, so each thread moves
    16-byte vectors; the loop is software-pipelined num_stages deep through shared memory) and the x
    tile [BLOCK_M=16, BLOCK_K] (tiny, L2-resident), and accumulates acc[n, m] += W . x^T in fp32 with
    tl.dot: the tensor cores are otherwise idle, and the 16-row minimum of tl.dot costs no HBM bytes,
    since rows m >= M re-read row M-1 of x (clamped, so no load is predicated) and are never stored;
  * num_splits is chosen from the shapes and the SM count only, so the grid fills ~PROGRAMS_PER_SM
    programs per SM when N / BLOCK_N alone would not (o_proj, down_proj). With one split the program
    writes the output directly; with several, each writes an fp32 partial [num_splits, M, N] and a
    second kernel sums them in split order: deterministic, no atomics.
Configs are fixed (no autotune) and nothing reads device memory on the host, so a warm-up call
compiles every variant and the launcher can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tl.dot's minimum; also the largest M the launcher accepts
BLOCK_N = 64  # one wgmma M-tile of W rows per program (4 warps = one warpgroup)
BLOCK_K = 128  # 64 x 128 bf16 = 16 KiB of W per pipeline stage: 8 x 16-byte loads per thread
NUM_WARPS = 4
NUM_STAGES = 4  # 3 tiles (48 KiB) in flight per program, 2 programs per SM fit in shared memory
PROGRAMS_PER_SM = 4  # split K until the grid has about this many programs per SM
MIN_BLOCKS_PER_SPLIT = 2  # a split reads at least this many k-blocks (amortises its prologue)
REDUCE_BLOCK = 1024  # split-K reduce: 1024 fp32 / 128 threads = 8 per thread = 2 x 16-byte loads
INTERPRETER_SMS = 2  # stand-in SM count for CPU tensors (TRITON_INTERPRET): still yields splits


# M and the split geometry vary per call: not specialised, so M = 1 does not compile its own variant.
@triton.jit(do_not_specialize=["M", "blocks_per_split"])
def _skinny_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om, blocks_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Clamped row indices: the last N tile re-reads row N-1 and padding rows of x re-read row M-1, so
    # the loads need no row mask (unpredicated 16-byte copies); the store below masks those lanes.
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_rows = tl.minimum(offs_m, M - 1)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]

    # This split's k-blocks: [kb_lo, kb_hi); the last split may be shorter (or, never, empty).
    kb_lo = split * blocks_per_split
    kb_hi = tl.minimum(kb_lo + blocks_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k0 = kb * BLOCK_K
        if EVEN_K:  # K % BLOCK_K == 0: no column mask at all
            w = tl.load(w_ptrs + k0)
            x = tl.load(x_ptrs + k0)
        else:  # the mask is constant over 16 columns whenever K % 16 == 0, so loads stay 16-byte wide
            kmask = (k0 + offs_k) < K
            w = tl.load(w_ptrs + k0, mask=kmask[None, :], other=0.0)
            x = tl.load(x_ptrs + k0, mask=kmask[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PREC)  # acc[n, m] += sum_k w[n,k] x[m,k]

    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if SPLIT:
        # part is [num_splits, M, N] fp32, contiguous: element (s, m, n) lives at (s * M + m) * N + n.
        part_ptrs = part_ptr + (split * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(part_ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + w_rows).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_splits"])
def _splitk_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, stride_om, num_splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    """out[m, n] = sum_s part[s, m, n] (+ bias[n]) in split order (deterministic); grid (M, N / BLOCK)."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_split(n: int, k: int, sm_count: int) -> tuple[int, int]:
    """(num_splits, blocks_per_split) from shapes only: enough programs to fill the SMs, each split
    at least MIN_BLOCKS_PER_SPLIT k-blocks long, and no split left empty."""
    tiles_n = triton.cdiv(n, BLOCK_N)
    k_blocks = triton.cdiv(k, BLOCK_K)
    want = triton.cdiv(PROGRAMS_PER_SM * sm_count, tiles_n)
    most = max(1, k_blocks // MIN_BLOCKS_PER_SPLIT)
    blocks_per_split = triton.cdiv(k_blocks, max(1, min(want, most)))
    return triton.cdiv(k_blocks, blocks_per_split), blocks_per_split


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} must be [M, K] and w {tuple(w.shape)} [N, K]")
    if x.shape[0] > BLOCK_M:
        raise ValueError(f"skinny_linear: M = {x.shape[0]} rows; at most {BLOCK_M} (use F.linear above)")
    if x.dtype != w.dtype or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(
            "skinny_linear: x and w need one dtype and a contiguous last dim (call .contiguous())"
        )
    if bias is not None and (bias.shape != (w.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"skinny_linear: bias must be a contiguous [{w.shape[0]}] vector")
    want = (x.shape[0], w.shape[0])
    if out is not None and (tuple(out.shape) != want or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"skinny_linear: out must be {want} {x.dtype} with a contiguous last dim")


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, M <= 16; fp32 accumulation.
    num_splits overrides the shape-derived split-K count (tests, benchmarks)."""
    _check(x, w, bias, out)
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    if num_splits is None:
        num_splits, per_split = choose_split(n, k, _sm_count(x.device))
    else:
        per_split = triton.cdiv(triton.cdiv(k, BLOCK_K), num_splits)
        num_splits = triton.cdiv(triton.cdiv(k, BLOCK_K), per_split)  # drop splits that would be empty
    split = num_splits > 1
    part = torch.empty((num_splits, m, n), dtype=torch.float32, device=x.device) if split else out
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    _skinny_kernel[(triton.cdiv(n, BLOCK_N), num_splits)](
        x, w, bias_arg, out, part, m, n, k, x.stride(0), w.stride(0), out.stride(0), per_split,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT=split, HAS_BIAS=bias is not None,
        EVEN_K=k % BLOCK_K == 0, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    if split:
        _splitk_reduce_kernel[(m, triton.cdiv(n, REDUCE_BLOCK))](
            part, bias_arg, out, m, n, out.stride(0), num_splits,
            HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK, num_warps=4,
        )  # fmt: skip
    return out
