"""Batch-1 decode GEMV for int8 weights with int8 activations (W8A8, act_quant "int8_token"): integer dots.

y[n] = (sum_k q[n, k] * xq[k]) * sx * scale[n] (+ bias[n]), where xq, sx quantise the one row x exactly as
kernels.torch_ops.quant_linear does for "int8_token" (sx = max(amax|x| / 127, 1e-12), xq = x / sx
rounded half to even, clamped to +-127), except that x / sx is computed as x * (1 / sx): an IEEE
division per element nearly doubled the kernel's instructions (counted in its sm_90 SASS), and the two
round to different codes only where x / sx lies within an ulp of a half-integer. The integer sum is
exact, so otherwise the result differs from the twin only in the fp32 epilogue.

Why a kernel of its own: the float GEMV (kernels/triton_qgemv.py) must turn every int8 weight into an
fp32 value (a PRMT and an FADD each) before its FMA, about three instructions per weight byte. Here four
weights meet four activation codes in one DP4A (dp4a.s32.s32, a 4-way int8 dot into int32), a quarter
instruction per byte; the activation codes cost about eight instructions per element, paid once per
K tile for all BLOCK_N rows.

Layout: grid (cdiv(N, BLOCK_N),); program t owns rows [t*BLOCK_N, (t+1)*BLOCK_N). It reads each weight
row as int32 words (4 weights each, K a multiple of 16), [BLOCK_N, BLOCK_K // 4] words per tile in
16-byte evict-first loads. The first tile loads before the PDL wait; then one pass over x (from L2)
finds amax while it arrives, or amax is the maximum of partial maxima of |x| that x's producer wrote
(kernels/triton_act.gated_and_mul_amax, for down_proj, whose pass over 14,336 values adds 28 KB of
reads to every program and sits between the wait and the first dot). The main loop quantises each x
tile, packs it four codes to a word and accumulates per-word DP4A sums in an int32
[BLOCK_N, BLOCK_K // 4] tile, reduced once at the end. Tile configs: w8a8_config. Under the Triton
interpreter, DP4A is spelled out in shifts and multiplies (inline PTX runs only compiled).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import enabled as pdl_enabled
from kernels.pdl import interpreting, wait_for_inputs
from kernels.triton_gemv import LONG_K, _sm_count
from kernels.triton_qgemv_tiles import qgemv_config

QMAX = tl.constexpr(127.0)
SCALE_MIN = tl.constexpr(1e-12)  # kernels.torch_ops.ACT_SCALE_MIN
WIDE = (16, 2048, 2, 8)  # (BLOCK_N, BLOCK_K, num_stages, num_warps) of short rows, see w8a8_config
MAX_WIDE_PROGRAMS_PER_SM = 3
RELEASE_FIRST = True  # the next kernel launches before this one's wait (kernels.pdl.wait_for_inputs)
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: an fp32 add of it rounds to an integer, half to even


def supported(qweight: torch.Tensor, scheme: str) -> bool:
    """Whether this kernel takes the weights: int8, one scale per row, rows of whole 16-byte vectors."""
    return qweight.dtype == torch.int8 and scheme == "channel" and qweight.shape[1] % 16 == 0


@triton.jit
def _dp4a(w, x, acc, NATIVE: tl.constexpr):
    """acc + the dot of the four signed bytes of w with those of x, per int32 element."""
    if NATIVE:
        return tl.inline_asm_elementwise(
            asm="dp4a.s32.s32 $0, $1, $2, $3;",
            constraints="=r,r,r,r",
            args=[w, x, acc],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    for j in tl.static_range(4):  # byte j, sign-extended: shift it to the top, shift back arithmetically
        acc += ((w << (24 - 8 * j)) >> 24) * ((x << (24 - 8 * j)) >> 24)
    return acc


@triton.jit
def _x_tile(x_ptr, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    cols = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        return tl.load(x_ptr + cols).to(tl.float32)
    return tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _packed_codes(x_ptr, k0, K, inv_sx, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The x tile at k0 quantised (times 1 / sx), four codes per int32 (code j in byte j), as the
    [BLOCK_N, BLOCK_K // 4] operand of every row."""
    v = tl.clamp(_x_tile(x_ptr, k0, K, BLOCK_K, EVEN_K) * inv_sx, -QMAX, QMAX)
    q = (v + ROUND).to(tl.int32, bitcast=True) - 0x4B400000  # the rounded integer, from its fp32 bits
    q = tl.reshape(q & 0xFF, (BLOCK_K // 4, 4))
    packed = tl.sum(q << (tl.arange(0, 4) * 8)[None, :], axis=1)  # disjoint bytes: the sum is an OR
    return tl.broadcast_to(packed[None, :], (BLOCK_N, BLOCK_K // 4))


@triton.jit
def _w_words(w_ptrs, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptrs + k0 // 4, eviction_policy="evict_first")
    words = k0 // 4 + tl.arange(0, BLOCK_K // 4)
    return tl.load(w_ptrs + k0 // 4, mask=(words < K // 4)[None, :], other=0, eviction_policy="evict_first")


@triton.jit
def _w8a8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, amax_ptr, N, K, stride_wn, n_partials,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    PARTIALS: tl.constexpr, USE_PDL: tl.constexpr, NATIVE: tl.constexpr, RELEASE_FIRST: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(rows, N - 1).to(tl.int64)  # the last tile re-reads row N - 1; the store masks
    words = tl.arange(0, BLOCK_K // 4)
    w_ptrs = w_ptr.to(tl.pointer_type(tl.int32)) + w_rows[:, None] * (stride_wn // 4) + words[None, :]
    w = _w_words(w_ptrs, 0, K, BLOCK_K, EVEN_K)  # weights are never written in a step
    row_scale = tl.load(s_ptr + w_rows)  # nor are scales and bias: read now, not after the last tile
    row_bias = tl.load(bias_ptr + w_rows).to(tl.float32) if HAS_BIAS else 0.0
    wait_for_inputs(USE_PDL, RELEASE_FIRST)
    if PARTIALS > 0:  # the producer's partial maxima of |x| (PARTIALS: their count, a power of two)
        p = tl.arange(0, PARTIALS)
        amax = tl.load(amax_ptr + p, mask=p < n_partials, other=0.0)
    else:
        amax = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            amax = tl.maximum(amax, tl.abs(_x_tile(x_ptr, k0, K, BLOCK_K, EVEN_K)))
    sx = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), SCALE_MIN)
    inv_sx = tl.math.div_rn(1.0, sx)
    xq = _packed_codes(x_ptr, 0, K, inv_sx, BLOCK_N, BLOCK_K, EVEN_K)
    acc = _dp4a(w, xq, tl.zeros((BLOCK_N, BLOCK_K // 4), tl.int32), NATIVE)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = _w_words(w_ptrs, k0, K, BLOCK_K, EVEN_K)
        acc = _dp4a(w, _packed_codes(x_ptr, k0, K, inv_sx, BLOCK_N, BLOCK_K, EVEN_K), acc, NATIVE)
    y = tl.sum(acc, axis=1).to(tl.float32) * sx * row_scale + row_bias
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


def w8a8_config(n: int, k: int, sm_count: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_stages, num_warps): short rows (K < LONG_K) take 16 rows over 8 warps while
    that grid stays within MAX_WIDE_PROGRAMS_PER_SM programs per SM, else the float GEMV's config.
    The wide tiles pay on the short projections (q|k|v, o) and not past that grid size, where gate_up
    already has programs to spare (benchmarks/reports/gpu/quant_sweep_b1_w8a8_h200.md)."""
    block_k = min(WIDE[1], max(128, triton.next_power_of_2(k)))
    if k < LONG_K and triton.cdiv(n, WIDE[0]) <= MAX_WIDE_PROGRAMS_PER_SM * sm_count:
        return WIDE[0], block_k, WIDE[2], WIDE[3]
    return qgemv_config(n, k, sm_count)


def w8a8_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    act_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1, K] (one contiguous row) @ (qweight [N, K] int8 * scale [N])^T (+ bias) -> out [.., N], x
    quantised per token; the caller (kernels.triton_qgemv.qgemv) has checked the shapes. act_amax:
    float32 partial maxima of |x| (their maximum is x's amax) from x's producer, or None."""
    n, k = qweight.shape
    block_n, block_k, stages, warps = w8a8_config(n, k, _sm_count(x.device))
    pdl = pdl_enabled(x.device)
    partials = 0 if act_amax is None else act_amax.numel()
    if act_amax is not None and (act_amax.dtype != torch.float32 or not act_amax.is_contiguous()):
        raise ValueError("w8a8_gemv: act_amax must be a contiguous float32 tensor of partial maxima")
    _w8a8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scale, bias if bias is not None else out, out, act_amax if partials else scale,
        n, k, qweight.stride(0), partials,
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        PARTIALS=triton.next_power_of_2(partials) if partials else 0, USE_PDL=pdl, NATIVE=not interpreting(),
        RELEASE_FIRST=RELEASE_FIRST, num_warps=warps, num_stages=stages, launch_pdl=pdl,
    )  # fmt: skip
    return out
