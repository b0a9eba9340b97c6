"""LoraMapping: which rows of a batch use which LoRA adapter slot, grouped on the device.

The batched LoRA kernels (kernels.triton_lora) walk the batch slot by slot: slot s owns the rows
token_order[slot_starts[s]:slot_starts[s + 1]]. The grouping is built from token_slots with a fixed
number of fixed-shape torch ops (no sort, no host sync, no data-dependent shape), so it can be built
inside a CUDA graph and is rebuilt on every replay from the token_slots buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraMapping:
    """token_slots: [T] int32, the adapter slot of each row (-1: no adapter; a value outside
    [0, num_slots) is treated as -1 by every op). token_order: [T] int32, row indices grouped by slot
    (stable within a slot; rows without an adapter last). slot_starts: [num_slots + 1] int32, slot s owns
    token_order[slot_starts[s]:slot_starts[s + 1]]; slot_starts[num_slots] is the number of adapter rows."""

    token_slots: torch.Tensor
    token_order: torch.Tensor
    slot_starts: torch.Tensor
    num_slots: int

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]


def build_lora_mapping(token_slots: torch.Tensor, num_slots: int) -> LoraMapping:
    """Group the rows of token_slots [T] (int32, -1 = no adapter) by slot, on token_slots' device.

    A counting sort: the group key of a row is its slot (num_slots for no adapter); its position is the
    start of its group (an exclusive cumsum of the group sizes) plus the number of earlier rows with the
    same key. O(T * num_slots) elementwise work, which is small next to any projection."""
    if token_slots.dim() != 1 or token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"lora_mapping: token_slots must be a 1-D int32 tensor (one slot per row, -1 for none), "
            f"got {tuple(token_slots.shape)} {token_slots.dtype}"
        )
    if num_slots < 1:
        raise ValueError(f"lora_mapping: num_slots must be >= 1 (max_loras), got {num_slots}")
    device = token_slots.device
    slots = token_slots.to(torch.int64)
    key = torch.where((slots < 0) | (slots >= num_slots), num_slots, slots)
    onehot = key[:, None] == torch.arange(num_slots + 1, device=device)[None, :]  # [T, S+1]
    counts = onehot.sum(0)
    starts = counts.cumsum(0) - counts  # exclusive: first position of each group
    rank = onehot.cumsum(0).gather(1, key[:, None]).squeeze(1) - 1  # earlier rows with this key
    pos = starts.gather(0, key) + rank
    rows = torch.arange(slots.shape[0], device=device, dtype=torch.int32)
    order = torch.empty_like(rows).scatter_(0, pos, rows)
    return LoraMapping(
        token_slots=token_slots.to(torch.int32),
        token_order=order,
        slot_starts=starts.to(torch.int32),
        num_slots=num_slots,
    )
