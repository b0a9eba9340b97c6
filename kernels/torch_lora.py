"""Torch twins of the batched multi-LoRA ops (kernels.ops.lora_mapping / lora_shrink / lora_expand).

Adapters live in fixed slots, stacked per layer and zero-padded to the max rank r; the LoRA scaling is
folded into B when an adapter is loaded, so no op takes a scale. A fused base layer (QKV, gate|up) has
n_slices slices:
  lora_a [S, n_slices * r, K]  slice i's A is rows i*r:(i+1)*r
  lora_b [S, N_total, r]       slice i's B is rows off[i]:off[i+1] (slice_offsets, n_slices + 1 ints)
These twins are the CPU path and the reference for kernels.triton_lora. They loop over the S slots (a
host int) with masked dense products, so they are plain, fixed-shape and CUDA-graph capturable, at
S times the work of the Triton kernels. The shape checks here are shared with the Triton path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.lora_mapping import LoraMapping, build_lora_mapping


def lora_mapping(token_slots: torch.Tensor, num_slots: int) -> LoraMapping:
    """Rows grouped by adapter slot (kernels.lora_mapping.build_lora_mapping; device-side, capturable)."""
    return build_lora_mapping(token_slots, num_slots)


def check_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoraMapping) -> None:
    """Shapes only (no device read): x [T, K], lora_a [S, R, K], T rows in the mapping."""
    if x.dim() != 2 or lora_a.dim() != 3 or x.shape[1] != lora_a.shape[2]:
        raise ValueError(
            f"lora_shrink: x {tuple(x.shape)} must be [T, K] and lora_a {tuple(lora_a.shape)} [S, R, K] "
            "with the same K (the base layer's input size)"
        )
    _check_rows("lora_shrink", x, lora_a, mapping)


def check_expand(
    y: torch.Tensor,
    s: torch.Tensor,
    lora_b: torch.Tensor,
    mapping: LoraMapping,
    slice_offsets: Sequence[int],
) -> int:
    """Shapes only: y [T, N_total], s [T, n_slices * r] fp32 (lora_shrink's output) or in lora_b's dtype
    (a folded layer's GEMM columns), lora_b [S, N_total, r], offsets running 0 <= off[0] <= ... <=
    off[n_slices] = N_total with off[0] = 0. Returns n_slices."""
    n_slices = len(slice_offsets) - 1
    off = list(slice_offsets)
    if n_slices < 1 or off[0] != 0 or off[-1] != lora_b.shape[1] or sorted(off) != off:
        raise ValueError(
            f"lora_expand: slice_offsets {off} must run from 0 up to N_total={lora_b.shape[1]} "
            "(lora_b's rows), nondecreasing, one more entry than slices"
        )
    if y.dim() != 2 or lora_b.dim() != 3 or y.shape[1] != lora_b.shape[1]:
        raise ValueError(
            f"lora_expand: y {tuple(y.shape)} must be [T, N_total] and lora_b {tuple(lora_b.shape)} "
            "[S, N_total, r] with the same N_total"
        )
    shape_ok = s.dim() == 2 and s.shape == (y.shape[0], n_slices * lora_b.shape[2])
    if not shape_ok or s.dtype not in (torch.float32, lora_b.dtype):
        raise ValueError(
            f"lora_expand: s {tuple(s.shape)} {s.dtype} must be [T, n_slices * r] = "
            f"[{y.shape[0]}, {n_slices * lora_b.shape[2]}] float32 (lora_shrink's output) or {lora_b.dtype}"
        )
    _check_rows("lora_expand", y, lora_b, mapping)
    return n_slices


def _check_rows(name: str, rows: torch.Tensor, stack: torch.Tensor, mapping: LoraMapping) -> None:
    if rows.shape[0] != mapping.num_tokens or stack.shape[0] != mapping.num_slots:
        raise ValueError(
            f"{name}: {rows.shape[0]} rows and {stack.shape[0]} slots in the weight stack, but the "
            f"mapping has {mapping.num_tokens} rows and {mapping.num_slots} slots; build the mapping "
            "from this batch's token_slots with num_slots = max_loras"
        )


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoraMapping) -> torch.Tensor:
    """out [T, R] fp32: out[t] = lora_a[slot[t]] @ x[t] in fp32; rows without an adapter are 0."""
    check_shrink(x, lora_a, mapping)
    slots = mapping.token_slots
    xf = x.float()
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in range(lora_a.shape[0]):
        rows = (slots == slot)[:, None]
        out = torch.where(rows, xf @ lora_a[slot].float().t(), out)
    return out


def lora_expand(
    y: torch.Tensor,
    s: torch.Tensor,
    lora_b: torch.Tensor,
    mapping: LoraMapping,
    slice_offsets: Sequence[int],
) -> None:
    """In place: y[t, off[i]:off[i+1]] += lora_b[slot[t], off[i]:off[i+1], :] @ s[t, i*r:(i+1)*r].

    s is rounded to lora_b's dtype before the product (as the Triton kernel feeds its tensor cores),
    the sum and the add to y are fp32, y keeps its dtype; rows without an adapter are left untouched."""
    n_slices = check_expand(y, s, lora_b, mapping, slice_offsets)
    r = lora_b.shape[2]
    slots = mapping.token_slots
    sf = s.to(lora_b.dtype).float()
    for i in range(n_slices):
        lo, hi = slice_offsets[i], slice_offsets[i + 1]
        if lo == hi:
            continue
        cols = y[:, lo:hi]
        new = cols
        for slot in range(lora_b.shape[0]):
            delta = sf[:, i * r : (i + 1) * r] @ lora_b[slot, lo:hi].float().t()
            rows = (slots == slot)[:, None]
            new = torch.where(rows, (cols.float() + delta).to(y.dtype), new)
        cols.copy_(new)
