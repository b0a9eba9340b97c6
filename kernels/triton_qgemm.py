"""Quantised linear for M > 1 rows (decode batches, prefill): y = x @ deq(W)^T (+ bias), W of 1 byte.

Weights follow kernels/triton_qgemv.py's contract ("channel": scale [N]; "block": scale [NB, cdiv(K, 128)]
with the scale row of output n at row_block[n]). act_quant picks the operands of the tensor-core dot:
  None            weight-only: x as is, each weight tile converted to x's dtype in registers (exact for
                  "channel", whose scale waits for the epilogue; "block" rounds q * scale once), one
                  bf16 / fp16 dot (fp32 x: an IEEE fp32 dot, no TF32);
  "int8_token"    int8 weights: x -> int8 with one scale per row (sx = amax|x| / 127, round half to even),
                  int8 dot into an exact int32 accumulator;
  "fp8_token"     fp8 weights: x -> e4m3 with one scale per row (sx = amax / 448), fp8 dot;
  "fp8_group128"  fp8 weights: one scale per row and 128-column group (DeepSeek-style, for "block").
sx = max(amax / QMAX, SCALE_MIN) as in the twin, so an all-zero row (CUDA-graph padding) quantises to 0.
Activations are quantised by one small kernel (_act_quant_kernel: one program per row, which loads a row
of up to MAX_ONE_PASS values once and keeps it in registers, or reads a longer one twice, for amax and
to quantise) that writes xq and sx; the GEMM kernel then computes, in fp32,
    y[m, n] = sum_kb dot(xq[m, kb], q[n, kb]) * (sx[m, kb] * sw[n, kb])   (+ bias[n])
where each kb is a 128-wide K tile, so a tile never straddles a scale block. Scales that do not vary with
kb (per-token sx, per-channel sw) move out of the sum into the epilogue; when neither varies the dot
accumulates across the whole K loop in place. fp8 dots promote their partial sums to fp32 every K tile
(max_num_imprecise_acc = 128, as Hopper's fp8 accumulator keeps fewer bits).
Rounding to e4m3 is done in fp32 arithmetic (round to nearest even, like the hardware and torch) before
the exact cast, so the Triton interpreter, whose fp8 cast rounds half-up without carry, runs the same
code; the interpreter also runs the fp8 and int8 dots (in fp32 / int arithmetic), so every path is tested
on the CPU, and the compiled fp8 / int8 tensor-core path on a GPU (tests marked `gpu`).
Tiles: BLOCK_K = 128; (BLOCK_M, MAX_BLOCK_N, warps, stages) per M bucket (qgemm_config), BLOCK_N halved
while the grid has fewer programs than SMs; grouped tile order, so weight tiles are reused from L2.
Split K: a decode GEMM (few row tiles) over a narrow N has too few programs to keep enough weight bytes
in flight, so K is split over SPLIT programs per tile, each writing its scaled fp32 partial sums to a
workspace that _split_sum_kernel adds up in a fixed order (deterministic, unlike atomics), plus bias.
Configs are fixed (no autotune), so a warm-up compiles every variant before CUDA-graph capture. Both
kernels wait for their inputs with PDL (kernels.pdl). Twin: kernels.torch_ops.quant_linear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import enabled as pdl_enabled
from kernels.pdl import wait_for_inputs
from kernels.triton_gemv import _sm_count
from kernels.triton_qgemv import SCALE_BLOCK, check_weights, dequant

SCALE_MIN = 1e-12  # kernels.torch_ops.ACT_SCALE_MIN
# act_quant -> (code, activation dtype, QMAX, weight dtype it pairs with)
ACT_QUANT = {
    None: (0, None, 1.0, None),
    "int8_token": (1, torch.int8, 127.0, torch.int8),
    "fp8_token": (1, torch.float8_e4m3fn, 448.0, torch.float8_e4m3fn),
    "fp8_group128": (2, torch.float8_e4m3fn, 448.0, torch.float8_e4m3fn),
}
# (largest M, BLOCK_M, MAX_BLOCK_N, num_warps, num_stages); BLOCK_K is always 128
CONFIGS = ((16, 16, 64, 4, 5), (64, 64, 128, 4, 4), (1 << 62, 128, 128, 8, 3))
MIN_BLOCK_N = 32
GROUP_M = 8
QUANT_BLOCK = 1024  # a longer row is read twice in chunks of this many: for amax, then to quantise
MAX_ONE_PASS = 16384  # a row this long or shorter is loaded once and kept in registers
ONE_PASS_ELEMS_PER_WARP = 1024  # 32 values a thread, up to 16 warps
SPLIT_PROGRAMS_PER_SM = 2  # split K until the grid has this many programs per SM, while each split keeps
MIN_SPLIT_K_TILES = 4  # at least this many 128-wide K tiles and the fp32 partials (split * M * N * 4
MAX_PARTIAL_SHARE = 8  # bytes) stay under 1/MAX_PARTIAL_SHARE of the weight bytes (N * K)
MAX_SPLIT = 16
SUM_BLOCK = 1024


@triton.jit
def _quantise(v, s, QMAX: tl.constexpr, INT8: tl.constexpr):
    """v / s clamped to +-QMAX and rounded (int8: to integers, fp8: to e4m3), both ties to even."""
    v = tl.clamp(tl.math.div_rn(v, s), -QMAX, QMAX)
    if INT8:  # adding 1.5 * 2^23 leaves no fraction bits: the fp32 add rounds to an integer
        q = ((v + 12582912.0) - 12582912.0).to(tl.int8)
    else:  # keep 3 mantissa bits (ties to even) for |v| >= 2^-6; below, multiples of 2^-9 (subnormals)
        bits = v.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        sub = (tl.abs(v) + 24576.0) - 24576.0  # the fp32 add rounds to a multiple of 2^-9
        sub = tl.where(v < 0, -sub, sub)  # (-0.0 stays negative, as in a hardware cast)
        q = tl.where(tl.abs(v) < 0.015625, sub, normal).to(tl.float8e4nv)
    return q


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s, QMAX: tl.constexpr,
                      SCALE_MIN: tl.constexpr, INT8: tl.constexpr, GROUPED: tl.constexpr, BLOCK: tl.constexpr,
                      ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """Row `program_id` of x -> q (int8 / e4m3) and its scale(s): per row, or per 128-column group."""
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row, s_row = x_ptr + row * stride_x, q_ptr + row * stride_q, s_ptr + row * stride_s
    cols = tl.arange(0, BLOCK)
    wait_for_inputs(USE_PDL)
    if GROUPED:  # BLOCK // 128 groups per chunk (one chunk when ONE_PASS), each with its own scale
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            x = tl.reshape(x, (BLOCK // 128, 128))
            s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), QMAX), SCALE_MIN)
            q = tl.reshape(_quantise(x, s[:, None], QMAX, INT8), (BLOCK,))
            tl.store(q_row + k0 + cols, q, mask=k0 + cols < K)
            groups = k0 // 128 + tl.arange(0, BLOCK // 128)
            tl.store(s_row + groups, s, mask=groups * 128 < K)
    elif ONE_PASS:  # BLOCK >= K: the whole row in registers, one load
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), QMAX), SCALE_MIN)
        tl.store(q_row + cols, _quantise(x, s, QMAX, INT8), mask=cols < K)
        tl.store(s_row, s)
    else:
        amax = tl.zeros((BLOCK,), tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), SCALE_MIN)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + cols, _quantise(x, s, QMAX, INT8), mask=k0 + cols < K)
        tl.store(s_row, s)


def quantise_activations(x: torch.Tensor, act_quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] int8 / e4m3, sx fp32 [M] or [M, cdiv(K, 128)] for "fp8_group128")."""
    code, dtype, qmax, _ = ACT_QUANT[act_quant]
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    s = torch.empty((m, triton.cdiv(k, SCALE_BLOCK)) if code == 2 else (m,), dtype=torch.float32,
                    device=x.device)  # fmt: skip
    if m == 0:
        return q, s
    pdl = pdl_enabled(x.device)
    row = max(SCALE_BLOCK, triton.next_power_of_2(k))
    one_pass = row <= MAX_ONE_PASS
    block = row if one_pass else QUANT_BLOCK
    warps = min(16, max(4, block // ONE_PASS_ELEMS_PER_WARP)) if one_pass else 4
    _act_quant_kernel[(m,)](
        x, q, s, k, x.stride(0), q.stride(0), s.stride(0) if code == 2 else 1, QMAX=qmax, SCALE_MIN=SCALE_MIN,
        INT8=dtype == torch.int8, GROUPED=code == 2, BLOCK=block, ONE_PASS=one_pass, USE_PDL=pdl,
        num_warps=warps, launch_pdl=pdl,
    )  # fmt: skip
    return q, s


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """(pid_m, pid_n): programs walk GROUP row tiles down a column of N tiles before moving right, so
    the weight tile they share stays in L2 (prefill); for one row tile this is plain column order."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP * tiles_n)) * GROUP
    group = tl.minimum(tiles_m - first_m, GROUP)
    return first_m + (pid % (GROUP * tiles_n)) % group, (pid % (GROUP * tiles_n)) // group


@triton.jit
def _k_tile(a_ptrs, w_ptrs, ks, k0, K, EVEN_K: tl.constexpr):
    """The [BLOCK_M, 128] activation tile and the [128, BLOCK_N] weight tile (W^T) at column k0."""
    if EVEN_K:
        return tl.load(a_ptrs + k0), tl.load(w_ptrs + k0)
    a = tl.load(a_ptrs + k0, mask=(k0 + ks < K)[None, :], other=0.0)
    return a, tl.load(w_ptrs + k0, mask=(k0 + ks < K)[:, None], other=0.0)


@triton.jit
def _weight_only(w, a, sw_ptrs, k0, INT8: tl.constexpr, W_BLOCKS: tl.constexpr):
    """The weight-only dot's operand: fp32 values (times their block scale), then a's dtype."""
    w = dequant(w, INT8)
    if W_BLOCKS:
        w *= tl.load(sw_ptrs + k0 // 128)[None, :]
    return w.to(a.dtype)


@triton.jit
def _epilogue(acc, sa_ptrs, sw_ptrs, bias_ptrs, out_ptr, rows, cols, M, N, ROW_SCALE: tl.constexpr,
              COL_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Scales that did not vary with the K tile (per-token sx, per-channel sw), bias, masked store."""
    y = acc.to(tl.float32)
    if ROW_SCALE:
        y *= tl.load(sa_ptrs)[:, None]
    if COL_SCALE:
        y *= tl.load(sw_ptrs)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptrs).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _qgemm_kernel(
    a_ptr, sa_ptr, w_ptr, sw_ptr, rb_ptr, bias_ptr, out_ptr, M, N, K,
    stride_am, stride_sa, stride_wn, stride_sw, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, ACT: tl.constexpr, W_BLOCKS: tl.constexpr, INT8: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP)
    k_lo = tl.program_id(1) * K_PER_SPLIT  # this program's K range (the whole of K unless split)
    out_ptr += tl.program_id(1).to(tl.int64) * M * N  # a split's own slice of the workspace
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows, w_rows = tl.minimum(rows, M - 1).to(tl.int64), tl.minimum(cols, N - 1).to(tl.int64)
    ks = tl.arange(0, 128)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    w_ptrs = w_ptr + w_rows[None, :] * stride_wn + ks[:, None]
    sw_ptrs = sw_ptr + w_rows  # "channel": scale[n]; "block": scale[row_block[n], kb]
    if W_BLOCKS:
        sw_ptrs = sw_ptr + tl.load(rb_ptr + w_rows).to(tl.int64) * stride_sw
    # a scale varying with the K tile multiplies that tile's partial dot (weight-only "block": the tile)
    PER_TILE: tl.constexpr = (W_BLOCKS and ACT != 0) or ACT == 2
    INT_ACC: tl.constexpr = INT8 and ACT == 1
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32 if INT_ACC and not PER_TILE else tl.float32)
    wait_for_inputs(USE_PDL)
    for k0 in range(k_lo, tl.minimum(K, k_lo + K_PER_SPLIT), 128):
        a, w = _k_tile(a_ptrs, w_ptrs, ks, k0, K, EVEN_K)
        if ACT == 0:
            w = _weight_only(w, a, sw_ptrs, k0, INT8, W_BLOCKS)
        if PER_TILE:
            part = tl.dot(a, w, out_dtype=tl.int32 if INT_ACC else tl.float32).to(tl.float32)
            if W_BLOCKS:
                part *= tl.load(sw_ptrs + k0 // 128)[None, :]
            if ACT == 2:
                part *= tl.load(sa_ptr + a_rows * stride_sa + k0 // 128)[:, None]
            acc += part
        elif INT_ACC:
            acc += tl.dot(a, w, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, w, acc, input_precision="ieee" if IEEE else None,
                         max_num_imprecise_acc=128 if ACT != 0 else None)  # fmt: skip
    _epilogue(acc, sa_ptr + a_rows, sw_ptrs, bias_ptr + w_rows, out_ptr, rows, cols, M, N,
              ACT == 1, not W_BLOCKS, HAS_BIAS)  # fmt: skip


@triton.jit
def _split_sum_kernel(ws_ptr, bias_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """out = sum of the SPLIT partial results (in split order) + bias, in out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    wait_for_inputs(USE_PDL)
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def qgemm_config(m: int, n: int, k: int, sm_count: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, split) for M rows: the bucket's tiles, BLOCK_N halved
    (down to MIN_BLOCK_N) while the grid has fewer programs than SMs, then K split (in powers of two)
    while the grid has fewer than SPLIT_PROGRAMS_PER_SM programs per SM, each split keeps at least
    MIN_SPLIT_K_TILES tiles of K and the partial sums stay small against the weights: a split pays on a
    narrow projection with long rows (down_proj) and loses where its fp32 partials approach an eighth
    of the weight bytes (gate_up_proj; benchmarks/reports/gpu/quant_sweep_8b_h200.md)."""
    _, block_m, block_n, warps, stages = next(c for c in CONFIGS if m <= c[0])
    while block_n > MIN_BLOCK_N and triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < sm_count:
        block_n //= 2
    tiles, k_tiles, split = triton.cdiv(m, block_m) * triton.cdiv(n, block_n), triton.cdiv(k, 128), 1
    while (
        split < MAX_SPLIT
        and tiles * split < SPLIT_PROGRAMS_PER_SM * sm_count
        and k_tiles >= 2 * split * MIN_SPLIT_K_TILES
        and 2 * split * m * 4 * MAX_PARTIAL_SHARE < k
    ):
        split *= 2
    return block_m, block_n, warps, stages, split


def _check_act(x: torch.Tensor, qweight: torch.Tensor, act_quant: str | None) -> None:
    if act_quant not in ACT_QUANT:
        raise ValueError(f"unknown act_quant {act_quant!r} ({', '.join(map(str, ACT_QUANT))})")
    pairs_with = ACT_QUANT[act_quant][3]
    if pairs_with is not None and qweight.dtype != pairs_with:
        raise ValueError(f"act_quant {act_quant!r} needs {pairs_with} weights, got {qweight.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"qgemm: x must be bf16, fp16 or fp32, got {x.dtype}")


def qgemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    row_block: torch.Tensor | None,
    bias: torch.Tensor | None,
    scheme: str,
    act_quant: str | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ deq(qweight) [N, K]^T (+ bias) -> [..., N] in x's dtype; fp32 (int32) sums."""
    check_weights(qweight, scale, row_block, scheme)
    _check_act(x, qweight, act_quant)
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"qgemm: x {tuple(x.shape)} does not end in K = {k}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"qgemm: bias must be a contiguous [{n}] vector, got {tuple(bias.shape)}")
    x2 = x.reshape(-1, k).contiguous()
    m, code = x2.shape[0], ACT_QUANT[act_quant][0]
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    elif not out.is_contiguous() or out.shape != (*x.shape[:-1], n):
        raise ValueError(f"qgemm: out must be a contiguous {(*x.shape[:-1], n)} tensor")
    if m == 0 or n == 0:
        return out
    a, sa = (x2, x2) if act_quant is None else quantise_activations(x2, act_quant)
    block_m, block_n, warps, stages, split = qgemm_config(m, n, k, _sm_count(x.device))
    pdl, blocks = pdl_enabled(x.device), scheme == "block"
    k_per_split = triton.cdiv(triton.cdiv(k, 128), split) * 128
    split = triton.cdiv(k, k_per_split)  # no split left empty
    dest = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    has_bias = bias is not None and split == 1  # a split GEMM adds bias once, in the sum
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), split)
    _qgemm_kernel[grid](
        a, sa, qweight, scale, row_block if blocks else scale, bias if has_bias else dest, dest,
        m, n, k, a.stride(0), sa.stride(0) if code == 2 else 1, qweight.stride(0), scale.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, GROUP=GROUP_M, ACT=code, W_BLOCKS=blocks,
        INT8=qweight.dtype == torch.int8, HAS_BIAS=has_bias, EVEN_K=k % 128 == 0,
        IEEE=x.dtype == torch.float32, USE_PDL=pdl, K_PER_SPLIT=k_per_split,
        num_warps=warps, num_stages=stages, launch_pdl=pdl,
    )  # fmt: skip
    if split > 1:
        _split_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
            dest, bias if bias is not None else dest, out, m * n, n, SPLIT=split, HAS_BIAS=bias is not None,
            BLOCK=SUM_BLOCK, USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
        )  # fmt: skip
    return out
