"""Batch-1 decode GEMV: y[n] = sum_k W[n, k] x[k] (+ bias[n]), W an nn.Linear weight [N, K].

At batch 1 a projection is a pure stream of W from HBM (W is read once, x and y are tiny), so the kernel
is built to keep as many W bytes in flight as the memory system wants and do nothing else:
  * grid (cdiv(N, BLOCK_N),): program t owns outputs [t*BLOCK_N, (t+1)*BLOCK_N) and reads those rows
    of W over the whole of K in [BLOCK_N, BLOCK_K] tiles (rows are K-contiguous: 16-byte vector loads),
    software-pipelined `num_stages` deep, marked evict-first (W is never reused within a step);
  * products are accumulated element-wise in an fp32 [BLOCK_N, BLOCK_K] register tile and reduced over
    K once at the end, so the loop body is loads and FMAs only (no tensor cores: at batch 1 they would
    multiply 15 rows of padding);
  * the tile shape comes from the weight shape only (gemv_config); BLOCK_N then shrinks until the grid
    has at least MIN_PROGRAMS_PER_SM programs per SM.
Configs are fixed per shape (no autotune), so a warm-up call compiles every variant before CUDA-graph
capture. It replaces cuBLAS at batch 1 because it beat it on every Llama-3.1-8B / 3.2-1B projection
(docs/performance.md). Twin: F.linear.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.pdl import enabled as pdl_enabled
from kernels.pdl import wait_for_inputs
from kernels.triton_act import gated_pair_rows, store_gated

# (BLOCK_K, num_stages, MAX_BLOCK_N): short rows take 2 KiB of 4 rows per tile; long rows (K >= LONG_K,
# e.g. down_proj of an 8B model) take 1 KiB of up to 16 rows, 4 tiles deep.
SHORT_ROWS = (1024, 2, 4)
LONG_ROWS = (512, 4, 16)
LONG_K = 12288
NUM_WARPS = 4
MIN_PROGRAMS_PER_SM = 2
INTERPRETER_SMS = 2
MAX_PREFETCH_ELEMS = 4096  # a W tile this small is fetched two deep before the PDL wait
GATED_EPILOGUE = True  # gate|up's batch-1 GEMV applies the gated activation itself (gemv_gated)
RELEASE_FIRST = True  # the next kernel launches before this one's wait (kernels.pdl.wait_for_inputs)


@triton.jit
def _w_tile(w_ptrs, cols, k0, K, EVEN_K: tl.constexpr):
    if EVEN_K:  # K % BLOCK_K == 0: no predicates at all
        return tl.load(w_ptrs + k0, eviction_policy="evict_first")
    return tl.load(w_ptrs + k0, mask=(k0 + cols < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _x_tile(x_ptr, cols, k0, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptr + k0 + cols).to(tl.float32)
    return tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    PREFETCH: tl.constexpr, USE_PDL: tl.constexpr, GATED: tl.constexpr = False,
    GELU_TANH: tl.constexpr = False, RELEASE_FIRST: tl.constexpr = False,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_K)
    # The last tile re-reads row N-1 instead of masking rows, so every W load is an unpredicated
    # 16-byte copy; the store masks those lanes.
    if GATED:  # gate and up rows in pairs
        rows, w_rows = gated_pair_rows(N, BLOCK_N)
    else:
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = tl.minimum(rows, N - 1).to(tl.int64)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + cols[None, :]
    # The first PREFETCH tiles are peeled: W is never written during a step, so their loads are issued
    # before waiting for the previous kernel (which produces x), and the weight stream starts while that
    # kernel drains (kernels.pdl). PREFETCH = 2 only when K holds two whole tiles.
    w = _w_tile(w_ptrs, cols, 0, K, EVEN_K)
    if PREFETCH == 2:
        w1 = _w_tile(w_ptrs, cols, BLOCK_K, K, EVEN_K)
    wait_for_inputs(USE_PDL, RELEASE_FIRST)
    acc = w.to(tl.float32) * _x_tile(x_ptr, cols, 0, K, EVEN_K)[None, :]
    if PREFETCH == 2:
        acc += w1.to(tl.float32) * _x_tile(x_ptr, cols, BLOCK_K, K, EVEN_K)[None, :]
    for k0 in range(PREFETCH * BLOCK_K, K, BLOCK_K):
        w = _w_tile(w_ptrs, cols, k0, K, EVEN_K)
        acc += w.to(tl.float32) * _x_tile(x_ptr, cols, k0, K, EVEN_K)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + w_rows).to(tl.float32)
    if GATED:
        store_gated(out_ptr, y, N, BLOCK_N, GELU_TANH)
    else:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_config(n: int, k: int, sm_count: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_stages) from the shape: BLOCK_N is the largest power of two <= the config's
    MAX_BLOCK_N that still gives MIN_PROGRAMS_PER_SM programs per SM (or 1)."""
    block_k, stages, block_n = LONG_ROWS if k >= LONG_K else SHORT_ROWS
    while block_n > 1 and triton.cdiv(n, block_n) < MIN_PROGRAMS_PER_SM * sm_count:
        block_n //= 2
    return block_n, block_k, stages


def gemv(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [1, K] (or [K]) @ w [N, K]^T (+ bias) -> [1, N] (or [N]) in x's dtype; fp32 accumulation."""
    n = _check_inputs("gemv", x, w, bias)
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    return _launch(x, w, bias, out) if n else out


def gemv_gated(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    gelu_tanh: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(x @ w_gate^T) * (x @ w_up^T) -> [1, I] (or [I]) for w = [gate | up] [2I, K]: gate|up's GEMV
    with the gated activation (silu, or gelu_tanh) as its epilogue, from the fp32 sums. Each program
    reads matching gate and up rows, so no activation kernel runs between gate|up and down_proj."""
    n = _check_inputs("gemv_gated", x, w, bias)
    if n % 2:
        raise ValueError(f"gemv_gated: w has {n} rows; [gate | up] needs an even number")
    if out is None:
        out = torch.empty((*x.shape[:-1], n // 2), dtype=x.dtype, device=x.device)
    return _launch(x, w, bias, out, gelu_tanh) if n else out


def _check_inputs(name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> int:
    if x.shape[-1] != w.shape[1] or x.numel() != w.shape[1] or w.dim() != 2:
        raise ValueError(
            f"{name}: x {tuple(x.shape)} must hold one row of {w.shape[1]} for w {tuple(w.shape)}"
        )
    if not x.is_contiguous() or w.stride(1) != 1 or x.dtype != w.dtype:
        raise ValueError(f"{name}: x must be contiguous, w's rows contiguous, both of one dtype")
    n = w.shape[0]
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias must be a contiguous [{n}] vector, got {tuple(bias.shape)}")
    return n


def _launch(x, w, bias, out, gelu_tanh: bool | None = None) -> torch.Tensor:
    """gelu_tanh not None: the gated epilogue, tile rows in (gate, up) pairs (BLOCK_N at least 2)."""
    n, k = w.shape
    block_n, block_k, stages = gemv_config(n, k, _sm_count(x.device))
    if gelu_tanh is not None:
        block_n = max(block_n, 2)
    pdl = pdl_enabled(x.device)
    # Two tiles ahead while small (16 KiB per program in registers), one for the big long-row tiles.
    prefetch = 2 if k >= 2 * block_k and block_n * block_k <= MAX_PREFETCH_ELEMS else 1
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else out, out, n, k, w.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        PREFETCH=prefetch, USE_PDL=pdl, GATED=gelu_tanh is not None, GELU_TANH=bool(gelu_tanh),
        num_warps=NUM_WARPS, num_stages=stages, RELEASE_FIRST=RELEASE_FIRST, launch_pdl=pdl,
    )  # fmt: skip
    return out
