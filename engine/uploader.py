"""Host-to-device copies for the hot path, through reusable pinned buffers.

A copy from pinned memory is asynchronous, so the GPU stream does not stall. Pinning a fresh buffer
every step costs tens of microseconds, so each named slot keeps its buffers and reuses them; an event
recorded after each copy makes sure the previous copy out of a buffer has finished before it is
refilled. Each slot alternates between two buffers: with a step launched ahead, the copy that last
used a buffer belongs to the step before the one still on the device, so refilling it never waits
for the device (with one buffer the host would wait for the running step to reach its copy).
"""

from __future__ import annotations

import torch

BUFFERS_PER_SLOT = 2


class Uploader:
    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[tuple[str, int], tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._turn: dict[str, int] = {}

    def __call__(self, slot: str, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`host` on the device (into `out` when given). On CPU the host tensor itself is returned."""
        if self.device.type != "cuda":
            return host if out is None else out.copy_(host)
        turn = self._turn[slot] = (self._turn.get(slot, -1) + 1) % BUFFERS_PER_SLOT
        buf, event = self._buffers.get((slot, turn), (None, None))
        if buf is None or buf.numel() < host.numel() or buf.dtype != host.dtype:
            size = max(host.numel(), 2 * buf.numel() if buf is not None else 0)
            buf, event = torch.empty(size, dtype=host.dtype, pin_memory=True), None
        elif event is not None:
            event.synchronize()  # the last copy out of this buffer is done (normally long ago)
        staged = buf[: host.numel()].view(host.shape)
        staged.copy_(host)
        if out is None:
            out = staged.to(self.device, non_blocking=True)
        else:
            out.copy_(staged, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._buffers[(slot, turn)] = (buf, event)
        return out

    def values(self, slot: str, values: list, dtype: torch.dtype) -> torch.Tensor:
        return self(slot, torch.tensor(values, dtype=dtype))
