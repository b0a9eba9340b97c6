"""Triton KV-cache write (twin: kernels.torch_ops.store_kv) and the cast into the cache's element type.

Caches are [num_blocks, block_size, Hk, D] and contiguous, so flat slot s = block * block_size + offset
starts at element s * Hk * D. One program copies the Hk * D keys and values of one token; a token whose
slot is -1 (CUDA-graph padding) stores nothing.

An fp8 (e4m3) cache stores each value clamped to +-448 and rounded to nearest even, with a unit scale
(torch_ops.to_cache_dtype); readers upcast it exactly as they load (triton_attn_common.dot_dtype_for).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import torch_ops

FP8_MAX = tl.constexpr(torch_ops.FP8_MAX)  # the same clamp as the twin's


@triton.jit
def to_cache(x, cache_ptr):
    """x converted for a store through cache_ptr: clamped first when the cache is fp8, since an
    out-of-range value must saturate, not become NaN. A plain cast for any other cache dtype."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -FP8_MAX, FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # int64: slot * ROW overflows int32 on big caches
    if slot < 0:
        return
    idx = tl.arange(0, BLOCK)
    mask = idx < ROW
    head = idx // HEAD_DIM
    col = idx % HEAD_DIM
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + col, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + col, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + idx, to_cache(k, k_cache_ptr), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + idx, to_cache(v, v_cache_ptr), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hk, D] (last dim contiguous) -> caches [num_blocks, block_size, Hk, D] at slot_mapping
    [T] (int64 flat slots; -1 = skip)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"store_kv: caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit k {tuple(k.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv: k_cache and v_cache must be contiguous")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("store_kv: the last dim of k and v must be contiguous")
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    block = triton.next_power_of_2(row)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HEAD_DIM=head_dim, ROW=row, BLOCK=block, num_warps=min(8, max(1, block // 256)),
    )  # fmt: skip
