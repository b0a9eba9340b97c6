"""Triton neox-style (rotate-half) rotary embedding (twins: kernels.torch_ops.apply_rotary / rope_store_kv).

One program rotates every q and k head of one token: the token's cos/sin row is loaded once and
shared. cos_sin is [max_pos, D] with cos in columns [0, D/2) and sin in [D/2, D). For each head,
x = [x1 | x2] (halves of D) becomes [x1*cos - x2*sin | x2*cos + x1*sin], computed in fp32.
q and k may be strided views (e.g. slices of a fused qkv projection); the outputs are new contiguous
tensors unless destinations are passed.

rope_store_kv fuses the attention prologue into the same one-program-per-token launch: optional per-head
RMSNorm of q and k (QK-norm, Qwen3 / Gemma 3; rounded to the input dtype before RoPE, like the unfused
twins), RoPE, and the paged KV-cache write of the rotated k and the untouched v (slot -1 stores nothing;
an fp8 cache gets them clamped and rounded, kernels.triton_kv.to_cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import enabled as pdl_enabled
from kernels.pdl import wait_for_inputs
from kernels.triton_kv import to_cache


@triton.jit
def _cos_sin_row(pos_ptr, cos_sin_ptr, stride_cs, t, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token t's cos and sin halves, [1, BLOCK_HALF] fp32 each."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    row = cos_sin_ptr + pos * stride_cs + cols
    cos = tl.load(row, mask=cols < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF, mask=cols < HALF, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, stride_t, stride_h, dst_stride_t, dst_stride_h, t, num_heads, cos, sin,
    w_ptr, eps, w_offset,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    src = src_ptr + t * stride_t + heads * stride_h + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # RMSNorm of each head over D = 2 * HALF, rounded to the input dtype as the twin stores it
        inv_rms = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        x1 = (x1 * inv_rms * (w_offset + w1)).to(src_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv_rms * (w_offset + w2)).to(src_ptr.dtype.element_ty).to(tl.float32)
    # Both halves are loaded before anything is stored, so dst may alias src (in-place rotation).
    # Results round to the input dtype first, like the twin's rotated tensor, and then into dst's type
    # (a no-op unless dst is an fp8 KV cache).
    dst = dst_ptr + t * dst_stride_t + heads * dst_stride_h + cols
    in_ty = src_ptr.dtype.element_ty
    tl.store(dst, to_cache((x1 * cos - x2 * sin).to(in_ty), dst_ptr), mask=mask)
    tl.store(dst + HALF, to_cache((x2 * cos + x1 * sin).to(in_ty), dst_ptr), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, stride_qot, stride_qoh, stride_kot, stride_koh,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin_row(pos_ptr, cos_sin_ptr, stride_cs, t, HALF, BLOCK_HALF)
    _rotate_heads(
        q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, num_q_heads, cos, sin,
        q_ptr, 0.0, 0.0, False, HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, num_kv_heads, cos, sin,
        k_ptr, 0.0, 0.0, False, HALF, BLOCK_HK, BLOCK_HALF,
    )  # fmt: skip


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    q_w_ptr, k_w_ptr, eps, w_offset,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, num_q_heads, num_kv_heads,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin_row(pos_ptr, cos_sin_ptr, stride_cs, t, HALF, BLOCK_HALF)
    _rotate_heads(
        q_ptr, q_out_ptr, stride_qt, stride_qh, num_q_heads * 2 * HALF, 2 * HALF, t, num_q_heads, cos, sin,
        q_w_ptr, eps, w_offset, HAS_NORM, HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    slot = tl.load(slot_ptr + t).to(tl.int64)  # int64: slot * Hk * D overflows int32 on big caches
    if slot >= 0:  # -1: CUDA-graph padding row, q only
        # Caches are contiguous [num_blocks, page, Hk, D]: flat slot s = block * page + offset starts at
        # element s * Hk * D, and head h of that slot at s * Hk * D + h * D.
        row = slot * num_kv_heads * (2 * HALF)
        _rotate_heads(
            k_ptr, k_cache_ptr + row, stride_kt, stride_kh, 0, 2 * HALF, t, num_kv_heads, cos, sin,
            k_w_ptr, eps, w_offset, HAS_NORM, HALF, BLOCK_HK, BLOCK_HALF,
        )  # fmt: skip
        heads = tl.arange(0, BLOCK_HK)[:, None]
        cols = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (heads < num_kv_heads) & (cols < HALF)
        src = v_ptr + t * stride_vt + heads * stride_vh + cols
        dst = v_cache_ptr + row + heads * (2 * HALF) + cols
        tl.store(dst, to_cache(tl.load(src, mask=mask), v_cache_ptr), mask=mask)
        tl.store(dst + HALF, to_cache(tl.load(src + HALF, mask=mask), v_cache_ptr), mask=mask)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], positions: [T] (int), cos_sin: [max_pos, D] -> rotated (q, k).

    q_out / k_out: optional destinations of the same shapes (strided; q_out=q rotates in place)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or k.shape[2] != head_dim or cos_sin.shape[-1] != head_dim:
        raise ValueError(
            f"apply_rotary: head_dim of q {tuple(q.shape)}, k {tuple(k.shape)} and cos_sin "
            f"{tuple(cos_sin.shape)} must agree and be even"
        )
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_sin.stride(1) != 1:
        raise ValueError("apply_rotary: the last dim of q, k and cos_sin must be contiguous")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    if q_out.shape != q.shape or k_out.shape != k.shape or q_out.stride(2) != 1 or k_out.stride(2) != 1:
        raise ValueError("apply_rotary: q_out / k_out must match q / k with a contiguous last dim")
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_hq = triton.next_power_of_2(num_q_heads)
    # One warp covers 32 lanes x 8 bf16 = 256 elements; size the CTA to the larger (q) tile.
    num_warps = min(8, max(1, block_hq * block_half // 256))
    _rope_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        num_q_heads, num_kv_heads,
        HALF=half, BLOCK_HQ=block_hq, BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half, num_warps=num_warps,
    )  # fmt: skip
    return q_out, k_out


def _check_rope_store_kv(q, k, v, cos_sin, k_cache, v_cache, slot_mapping, positions, q_w, k_w) -> None:
    num_tokens, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"rope_store_kv: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be "
            "[T, H, D] with the same T and an even D, and v must match k"
        )
    per_token = (num_tokens,)
    if cos_sin.shape[-1] != head_dim or positions.shape != per_token or slot_mapping.shape != per_token:
        raise ValueError(
            f"rope_store_kv: cos_sin {tuple(cos_sin.shape)} must be [max_pos, {head_dim}] and positions "
            f"{tuple(positions.shape)} / slot_mapping {tuple(slot_mapping.shape)} must be [{num_tokens}]"
        )
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or cos_sin.stride(1) != 1:
        raise ValueError("rope_store_kv: the last dim of q, k, v and cos_sin must be contiguous")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"rope_store_kv: caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} must be "
            f"[num_blocks, page, {num_kv_heads}, {head_dim}] to fit k {tuple(k.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_store_kv: k_cache and v_cache must be contiguous")
    if (q_w is None) != (k_w is None):
        raise ValueError("rope_store_kv: pass both q_norm_weight and k_norm_weight, or neither")
    for name, w in (("q_norm_weight", q_w), ("k_norm_weight", k_w)):
        if w is not None and (w.shape != (head_dim,) or not w.is_contiguous()):
            raise ValueError(f"rope_store_kv: {name} must be contiguous of shape ({head_dim},)")


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    norm_offset: float = 0.0,
) -> torch.Tensor:
    """q: [T, Hq, D], k, v: [T, Hk, D] (strided, last dim contiguous) -> new contiguous rotated q [T, Hq, D].

    With q_norm_weight / k_norm_weight ([D]) q and k are RMS-normalised per head first. The rotated k and
    v are written to the caches [num_blocks, page, Hk, D] at slot_mapping [T] (int64; -1 = skip)."""
    _check_rope_store_kv(q, k, v, cos_sin, k_cache, v_cache, slot_mapping, positions, q_norm_weight,
                         k_norm_weight)  # fmt: skip
    num_tokens, num_q_heads, head_dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    has_norm = q_norm_weight is not None
    q_w, k_w = (q_norm_weight, k_norm_weight) if has_norm else (q, k)  # unread stand-ins without the norm
    half, block_hq = head_dim // 2, triton.next_power_of_2(num_q_heads)
    block_half = triton.next_power_of_2(half)
    pdl = pdl_enabled(q.device)
    _rope_store_kv_kernel[(num_tokens,)](
        q, k, v, q_out, positions, cos_sin, k_cache, v_cache, slot_mapping,
        q_w, k_w, float(norm_eps), float(norm_offset),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
        num_q_heads, k.shape[1],
        HAS_NORM=has_norm, HALF=half, BLOCK_HQ=block_hq, BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=block_half, USE_PDL=pdl, launch_pdl=pdl,
        num_warps=min(8, max(1, block_hq * block_half // 256)),  # as apply_rotary
    )  # fmt: skip
    return q_out
