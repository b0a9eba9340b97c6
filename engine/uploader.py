"""Host-to-device copies for the hot path, through reusable pinned buffers.

A copy from pinned memory is asynchronous, so the GPU stream does not stall. Pinning a fresh buffer
every step costs tens of microseconds, so each named slot keeps one and reuses it; an event recorded
after each copy makes sure the previous copy out of a buffer has finished before it is refilled.
"""

from __future__ import annotations

import torch


class Uploader:
    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, tuple[torch.Tensor, torch.cuda.Event | None]] = {}

    def __call__(self, slot: str, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`host` on the device (into `out` when given). On CPU the host tensor itself is returned."""
        if self.device.type != "cuda":
            return host if out is None else out.copy_(host)
        buf, event = self._buffers.get(slot, (None, None))
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
        self._buffers[slot] = (buf, event)
        return out

    def values(self, slot: str, values: list, dtype: torch.dtype) -> torch.Tensor:
        return self(slot, torch.tensor(values, dtype=dtype))
