"""Triton neox-style (rotate-half) rotary embedding (twin: kernels.torch_ops.apply_rotary).

One program rotates every q and k head of one token: the token's cos/sin row is loaded once and
shared. cos_sin is [max_pos, D] with cos in columns [0, D/2) and sin in [D/2, D). For each head,
x = [x1 | x2] (halves of D) becomes [x1*cos - x2*sin | x2*cos + x1*sin], computed in fp32.
q and k may be strided views (e.g. slices of a fused qkv projection); the outputs are new contiguous
tensors unless destinations are passed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, stride_t, stride_h, dst_stride_t, dst_stride_h, t, num_heads, cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    src = src_ptr + t * stride_t + heads * stride_h + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # Both halves are loaded before anything is stored, so dst may alias src (in-place rotation).
    dst = dst_ptr + t * dst_stride_t + heads * dst_stride_h + cols
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, stride_qot, stride_qoh, stride_kot, stride_koh,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + cols, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, num_q_heads, cos, sin,
        HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, num_kv_heads, cos, sin,
        HALF, BLOCK_HK, BLOCK_HALF,
    )  # fmt: skip


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
