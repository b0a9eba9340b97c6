"""Batch-1 decode GEMV over 1-byte quantised weights: y[n] = sum_k deq(W)[n, k] x[k] (+ bias[n]).

Weight contract (docs/quantization.md): qweight [N, K] float8_e4m3fn or int8, K-contiguous; fp32 scales,
scheme "channel": scale [N] and deq(W)[n, k] = q[n, k] * scale[n]; scheme "block": scale [NB, cdiv(K, 128)]
and deq(W)[n, k] = q[n, k] * scale[row_block[n], k // 128], row_block int32 [N] (merged q|k|v or
gate|up shards need not start on a 128 row, so the kernel never computes n // 128). Activations are not
quantised: at batch 1 the weight stream is the only cost, so x stays exact and only W is rounded.

The design is kernels/triton_gemv.py's, fed half the bytes per element:
  * grid (cdiv(N, BLOCK_N),): program t owns rows [t*BLOCK_N, (t+1)*BLOCK_N) and streams them over K
    in [BLOCK_N, BLOCK_K] tiles, 16 one-byte weights per 16-byte load, marked evict-first. A tile holds
    twice the bf16 kernel's elements for the same bytes (up to 16 KiB tiles); BLOCK_N shrinks until
    the grid has MIN_PROGRAMS_PER_SM programs per SM;
  * weights become fp32 in registers: fp8 by the hardware conversion (e4m3x2 -> f16x2 -> f32); int8 by
    the float magic-number trick (q + 128, i.e. the byte with its sign bit flipped, under the exponent
    of 2^23 reads as 2^23 + 128 + q; subtracting that gives q exactly), where I2F would run at a
    quarter of the FMA rate. Compiled, it is inline PTX on four packed bytes: one XOR, then one PRMT
    and one FADD per weight. Triton's own lowering of the same ops spends several integer
    instructions per weight, which left int8 further from the HBM peak (quant_sweep_b1_h200.md);
  * each tile's products are summed in registers right away, per 16 columns ("channel": the thread's
    own 16-byte vector, adds only) or per 128 ("block": one scale block, plus three shuffles, then times
    scale[row_block[n], kb]), into a small fp32 accumulator. Keeping one fp32 per product instead (the
    bf16 kernel's way) would spend 4 bytes of registers per byte in flight and cap the programs per SM;
    this way the sm_90 build needs 61-85 registers (test_kernels_quant.test_hopper_build);
  * "channel" multiplies the final row sum by scale[n] (one multiply per output);
  * the last row tile re-reads row N-1 instead of masking (unpredicated loads; the store masks);
  * programmatic dependent launch (kernels.pdl): the first one or two weight tiles, their scales and
    row_block are read before waiting for the kernel that writes x;
  * gate|up (qgemv_gated): a tile's rows pair gate row j with up row I + j, and the epilogue writes
    act(gate) * up from the fp32 sums. The activation kernel and its launch between gate|up and
    down_proj go away; the grid and tiles are those of the plain [2I, K] GEMV.
Configs are fixed per shape (kernels/triton_qgemv_tiles.py, no autotune), so a warm-up call compiles
every variant before CUDA-graph capture. Twin: kernels.torch_ops.quant_linear with act_quant None.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import enabled as pdl_enabled
from kernels.pdl import interpreting as pdl_interpreting
from kernels.pdl import wait_for_inputs
from kernels.triton_act import gated_pair_rows, store_gated
from kernels.triton_gemv import _sm_count
from kernels.triton_qgemv_tiles import SCALE_BLOCK, qgemv_config

MAX_PREFETCH_BYTES = 8192  # a W tile this small is fetched two deep before the PDL wait
PRMT_INT8 = True  # int8 weights converted four at a time by inline PTX (never under the interpreter)
WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.int8)
# gate|up's batch-1 GEMV applies the gated activation itself (qgemv_gated; ops.quant_gated_linear)
GATED_EPILOGUE = True
RELEASE_FIRST = True  # the next kernel launches before this one's wait (kernels.pdl.wait_for_inputs)
SCALE_FIRST = True  # per-row scales and bias load before the PDL wait, so no load trails the last tile


@triton.jit
def _w_tile(w_ptrs, cols, k0, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptrs + k0, eviction_policy="evict_first")
    return tl.load(w_ptrs + k0, mask=(k0 + cols < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _s_tile(s_ptrs, k0, KB, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SCALES: tl.constexpr,
            EVEN_K: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_K // 128] block scales of the tile at column k0 (0 past the last K block);
    ones for "channel" (that scale is applied to the row sums)."""
    if not BLOCK_SCALES:
        s = tl.full((BLOCK_N, BLOCK_K // 16), 1.0, tl.float32)
    else:
        kb = k0 // 128 + tl.arange(0, BLOCK_K // 128)
        if EVEN_K:
            s = tl.load(s_ptrs + kb[None, :])
        else:
            s = tl.load(s_ptrs + kb[None, :], mask=(kb < KB)[None, :], other=0.0)
    return s


@triton.jit
def dequant(w, INT8: tl.constexpr, PRMT: tl.constexpr = False):
    """1-byte weights as exact fp32 values (shared with kernels.triton_qgemm)."""
    if INT8 and PRMT:  # the same trick on 4 packed bytes: one XOR, then a PRMT and an FADD per weight
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, m;
            xor.b32 t, $4, 0x80808080;
            mov.b32 m, 0x4B000000;
            prmt.b32 $0, t, m, 0x7440;
            prmt.b32 $1, t, m, 0x7441;
            prmt.b32 $2, t, m, 0x7442;
            prmt.b32 $3, t, m, 0x7443;
            sub.f32 $0, $0, 0f4B000080;
            sub.f32 $1, $1, 0f4B000080;
            sub.f32 $2, $2, 0f4B000080;
            sub.f32 $3, $3, 0f4B000080;
            }""",
            constraints="=r,=r,=r,=r,r",
            args=[w],
            dtype=tl.float32,
            is_pure=True,
            pack=4,
        )
    if INT8:  # q + 128 (the sign bit flipped) under the exponent of 2^23, minus 2^23 + 128
        u = (w.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint32)
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    return w.to(tl.float32)


@triton.jit
def _tile_sums(w, s, x_ptr, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_SCALES: tl.constexpr, INT8: tl.constexpr, EVEN_K: tl.constexpr,
               PRMT: tl.constexpr = False):  # fmt: skip
    """The tile's products summed over groups of GROUP columns (16: one thread's 16-byte vector, adds
    within the thread; 128: a scale block, three shuffles more), times the groups' scales."""
    GROUP: tl.constexpr = 128 if BLOCK_SCALES else 16
    cols = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        x = tl.load(x_ptr + cols).to(tl.float32)
    else:
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    p = dequant(w, INT8, PRMT) * x[None, :]
    return tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // GROUP, GROUP)), axis=2) * s


@triton.jit
def _qgemv_kernel(
    x_ptr, w_ptr, s_ptr, rb_ptr, bias_ptr, out_ptr, N, K, KB, stride_wn, stride_s,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SCALES: tl.constexpr, INT8: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
    PRMT: tl.constexpr, GATED: tl.constexpr = False, GELU_TANH: tl.constexpr = False,
    RELEASE_FIRST: tl.constexpr = False, SCALE_FIRST: tl.constexpr = False, SILU: tl.constexpr = False,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_K)
    if GATED:  # gate and up rows in pairs
        rows, w_rows = gated_pair_rows(N, BLOCK_N)
    else:
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = tl.minimum(rows, N - 1).to(tl.int64)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + cols[None, :]
    s_ptrs = s_ptr
    if BLOCK_SCALES:  # scale rows come from row_block, never from n // 128
        s_ptrs = s_ptr + tl.load(rb_ptr + w_rows).to(tl.int64)[:, None] * stride_s
    # Weights, scales and row_block are never written during a step: the first tiles load before the
    # PDL wait, while the kernel that writes x drains (PREFETCH = 2 only when K holds two whole tiles).
    w = _w_tile(w_ptrs, cols, 0, K, EVEN_K)
    s = _s_tile(s_ptrs, 0, KB, BLOCK_N, BLOCK_K, BLOCK_SCALES, EVEN_K)
    if PREFETCH == 2:
        w1 = _w_tile(w_ptrs, cols, BLOCK_K, K, EVEN_K)
        s1 = _s_tile(s_ptrs, BLOCK_K, KB, BLOCK_N, BLOCK_K, BLOCK_SCALES, EVEN_K)
    if SCALE_FIRST:  # the per-row scale and bias are weights too: read now, not after the last tile
        row_scale = tl.load(s_ptr + w_rows) if not BLOCK_SCALES else 1.0
        row_bias = tl.load(bias_ptr + w_rows).to(tl.float32) if HAS_BIAS else 0.0
    wait_for_inputs(USE_PDL, RELEASE_FIRST)
    acc = _tile_sums(w, s, x_ptr, 0, K, BLOCK_N, BLOCK_K, BLOCK_SCALES, INT8, EVEN_K, PRMT)
    if PREFETCH == 2:
        acc += _tile_sums(w1, s1, x_ptr, BLOCK_K, K, BLOCK_N, BLOCK_K, BLOCK_SCALES, INT8, EVEN_K, PRMT)
    for k0 in range(PREFETCH * BLOCK_K, K, BLOCK_K):
        w = _w_tile(w_ptrs, cols, k0, K, EVEN_K)
        s = _s_tile(s_ptrs, k0, KB, BLOCK_N, BLOCK_K, BLOCK_SCALES, EVEN_K)
        acc += _tile_sums(w, s, x_ptr, k0, K, BLOCK_N, BLOCK_K, BLOCK_SCALES, INT8, EVEN_K, PRMT)
    y = tl.sum(acc, axis=1)
    if SCALE_FIRST:
        y = y * row_scale + row_bias
    else:
        if not BLOCK_SCALES:
            y *= tl.load(s_ptr + w_rows)
        if HAS_BIAS:
            y += tl.load(bias_ptr + w_rows).to(tl.float32)
    if GATED:
        store_gated(out_ptr, y, N, BLOCK_N, GELU_TANH)
    else:
        if SILU:  # silu of the stored product, as a separate silu of the output would compute it
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
            y = y / (1.0 + tl.exp(-y))
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


def reads_act_amax(qweight: torch.Tensor, scheme: str, act_quant: str | None) -> bool:
    """Whether `qgemv` of these weights takes the integer-dot kernel, the one that reads act_amax."""
    if act_quant != "int8_token":
        return False
    from kernels import triton_qgemv_w8a8

    return triton_qgemv_w8a8.supported(qweight, scheme)


def check_weights(qweight: torch.Tensor, scale: torch.Tensor, row_block, scheme: str) -> None:
    """Raise ValueError unless (qweight, scale, row_block) follow the contract of `scheme`."""
    if qweight.dim() != 2 or qweight.dtype not in WEIGHT_DTYPES or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous [N, K] fp8 e4m3 / int8 tensor, got {qweight.dtype}")
    n, k = qweight.shape
    if scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError("scale must be a contiguous float32 tensor")
    if scheme == "channel":
        if scale.shape != (n,) or row_block is not None:
            raise ValueError(f"scheme 'channel' takes scale [{n}] and no row_block, got {tuple(scale.shape)}")
    elif scheme == "block":
        kb = triton.cdiv(k, SCALE_BLOCK)
        if scale.dim() != 2 or scale.shape[1] != kb:
            raise ValueError(f"scheme 'block' takes scale [NB, {kb}], got {tuple(scale.shape)}")
        if row_block is None or row_block.shape != (n,) or row_block.dtype != torch.int32:
            raise ValueError(f"scheme 'block' takes an int32 row_block [{n}]")
    else:
        raise ValueError(f"unknown scheme {scheme!r} (channel, block)")


def _check_inputs(name: str, x, qweight, scale, row_block, bias, scheme: str) -> int:
    """Raise ValueError unless x is one contiguous row and the weights follow the contract; returns N."""
    check_weights(qweight, scale, row_block, scheme)
    n, k = qweight.shape
    if x.shape[-1] != k or x.numel() != k or not x.is_contiguous():
        raise ValueError(f"{name}: x {tuple(x.shape)} must be one contiguous row of {k}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias must be a contiguous [{n}] vector, got {tuple(bias.shape)}")
    return n


def qgemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    row_block: torch.Tensor | None,
    bias: torch.Tensor | None,
    scheme: str,
    out: torch.Tensor | None = None,
    act_quant: str | None = None,
    act_amax: torch.Tensor | None = None,
    silu: bool = False,
) -> torch.Tensor:
    """x [1, K] (or [K]) @ deq(qweight) [N, K]^T (+ bias) -> [1, N] (or [N]) in x's dtype; fp32 sums.
    x stays exact, except that act_quant "int8_token" on int8 channel weights quantises it as the twin
    does and takes the integer-dot kernel (kernels/triton_qgemv_w8a8.py), which reads x's amax from
    act_amax (partial maxima from x's producer) when given. silu: silu of the product (rounded to x's
    dtype first, as F.silu of the output), in the store."""
    n = _check_inputs("qgemv", x, qweight, scale, row_block, bias, scheme)
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if reads_act_amax(qweight, scheme, act_quant):
        from kernels import triton_qgemv_w8a8

        out = triton_qgemv_w8a8.w8a8_gemv(x, qweight, scale, bias, out, act_amax)
        return torch.nn.functional.silu(out) if silu else out
    return _launch(x, qweight, scale, row_block, bias, scheme, out, silu=silu)


def fuses_gated(qweight: torch.Tensor, scheme: str, act_quant: str | None) -> bool:
    """Whether `qgemv_gated` takes this [gate | up] projection: not when its one row goes to the
    integer-dot kernel instead (GATED_EPILOGUE off: never)."""
    return GATED_EPILOGUE and qweight.shape[0] % 2 == 0 and not reads_act_amax(qweight, scheme, act_quant)


def qgemv_gated(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    row_block: torch.Tensor | None,
    bias: torch.Tensor | None,
    scheme: str,
    gelu_tanh: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(x @ deq(W_gate)^T) * (x @ deq(W_up)^T) -> [1, I] (or [I]) for qweight = [gate | up] [2I, K]:
    the batch-1 GEMV of gate|up with the gated activation (silu, or gelu_tanh) as its epilogue, so no
    activation kernel runs between it and down_proj. Each program reads matching gate and up rows."""
    n = _check_inputs("qgemv_gated", x, qweight, scale, row_block, bias, scheme)
    if n % 2:
        raise ValueError(f"qgemv_gated: qweight has {n} rows; [gate | up] needs an even number")
    if out is None:
        out = torch.empty((*x.shape[:-1], n // 2), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    return _launch(x, qweight, scale, row_block, bias, scheme, out, gelu_tanh)


def _launch(x, qweight, scale, row_block, bias, scheme: str, out, gelu_tanh: bool | None = None,
            silu: bool = False):  # fmt: skip
    """The float GEMV's launch; gelu_tanh not None: the gated epilogue (tile rows in gate/up pairs);
    silu: silu of the output."""
    n, k = qweight.shape
    block_n, block_k, stages, warps = qgemv_config(n, k, _sm_count(x.device))
    if gelu_tanh is not None:
        block_n = max(block_n, 2)
    pdl = pdl_enabled(x.device)
    prefetch = 2 if k >= 2 * block_k and block_n * block_k <= MAX_PREFETCH_BYTES else 1
    blocks = scheme == "block"
    _qgemv_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scale, row_block if blocks else scale, bias if bias is not None else out, out,
        n, k, triton.cdiv(k, SCALE_BLOCK), qweight.stride(0), scale.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_SCALES=blocks, INT8=qweight.dtype == torch.int8,
        HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, PREFETCH=prefetch, USE_PDL=pdl,
        PRMT=PRMT_INT8 and not pdl_interpreting(), GATED=gelu_tanh is not None, GELU_TANH=bool(gelu_tanh),
        RELEASE_FIRST=RELEASE_FIRST, SCALE_FIRST=SCALE_FIRST, SILU=silu, num_warps=warps, num_stages=stages,
        launch_pdl=pdl,
    )  # fmt: skip
    return out
