"""Host-to-device copies for the hot path, through reusable pinned buffers.

A copy from pinned memory is asynchronous, so the GPU stream does not stall. Pinning a fresh buffer
every step costs tens of microseconds, so each named slot keeps its buffers and reuses them; an event
recorded after each copy makes sure the previous copy out of a buffer has finished before it is
refilled. Each slot alternates between two buffers: with a step launched ahead, the copy that last
used a buffer belongs to the step before the one still on the device, so refilling it never waits
for the device (with one buffer the host would wait for the running step to reach its copy).

`device_view` is the copy's alternative for rows a kernel reads sparsely (a grammar's token bitmask,
one word per 32 logits): the device reads pinned host memory in place.
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


class _HostRows:
    """Pinned host rows under `__cuda_array_interface__`, as torch.as_tensor takes them. Pinned memory
    is mapped into every device's address space at its host address (unified addressing, any 64-bit
    CUDA platform), so the tensor made from it is a device tensor over the host memory itself."""

    def __init__(self, host: torch.Tensor):
        self.host = host  # the device tensor keeps this object, and so the memory, alive
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": "<i4",
            "data": (host.data_ptr(), False),
            "version": 3,
        }


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device tensor reading pinned (or cudaHostRegister'ed) int32 host rows in place: no copy, and
    every kernel that reads it reads across the bus. The caller keeps the host rows unchanged until
    those kernels are done."""
    if host.dtype != torch.int32 or not host.is_contiguous():
        raise ValueError(f"device_view: host rows must be contiguous int32, got {host.dtype}")
    with torch.cuda.device(device):
        return torch.as_tensor(_HostRows(host), device=device)
