"""Device-side pieces shared by the decode and prefill attention kernels (inlined by Triton).

Scores are kept in base 2 (scaled by log2(e)) so the softmax uses exp2; masked scores are -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_act import tanh

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def load_paged_rows(base_ptr, bt_row, pos, valid, kh, stride_b, stride_s, stride_h, d, dmask,
                    PAGE: tl.constexpr):  # fmt: skip
    """Rows [len(pos), BLOCK_D] of one KV head at sequence positions `pos` of a paged cache:
    position p lives in physical block bt_row[p // PAGE] at offset p % PAGE. Invalid rows read 0."""
    blk = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)  # int64: blk * stride_b is big
    offs = blk[:, None] * stride_b + (pos % PAGE)[:, None] * stride_s + kh * stride_h + d[None, :]
    return tl.load(base_ptr + offs, mask=valid[:, None] & dmask[None, :], other=0.0)


@triton.jit
def dot_dtype_for(q, kv_ptr):
    """q in the type the attention dots run in over the cache behind kv_ptr: its own, except bf16 q over
    an fp8 cache, which runs in fp16. fp8 -> fp16 is one instruction per pair of values (fp8 -> bf16
    takes three more), both are exact, and fp16 holds bf16 q to more digits (within +-65504)."""
    if kv_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    return q


@triton.jit
def scores_log2(q, k, allowed, scale, softcap, HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr):
    """q [M, D] . k [N, D]^T * scale, optionally soft-capped (cap * tanh(s / cap)), in base 2; -inf where
    not `allowed`. fp32 accumulation."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale
    if HAS_SOFTCAP:
        s = softcap * tanh(s / softcap)
    return tl.where(allowed, s * LOG2E, float("-inf"))


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    """Fold one tile of base-2 scores s [M, N] and values v [N, D] into the running row max m_i, row sum
    l_i and unnormalised output acc [M, D]. A row with no allowed key so far keeps m_i = -inf; m_safe
    keeps exp2 away from (-inf) - (-inf)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc
