"""Host-to-device copies for the hot path, through reusable pinned buffers.

A copy from pinned memory is asynchronous, so the GPU stream does not stall. Pinning a fresh buffer
every step costs tens of microseconds, so each named slot keeps its buffers and reuses them; an event
per buffer, recorded again after each copy out of it, makes sure that copy has finished before the
buffer is refilled. Each slot alternates between two buffers: with a step launched ahead, the copy
that last used a buffer belongs to the step before the one still on the device, so refilling it never
waits for the device (with one buffer the host would wait for the running step to reach its copy).

`device_view` is the copy's alternative for rows a kernel reads sparsely (a grammar's token bitmask,
one word per 32 logits): the device reads pinned host memory in place.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.device.stream import record

BUFFERS_PER_SLOT = 2
# what `values` and `array` take, with the numpy type of each
NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


class Uploader:
    def __init__(self, device: torch.device):
        self.device = device
        # per (slot, turn): the pinned buffer, its numpy view, and the event of its last copy out
        self._buffers: dict[tuple[str, int], tuple[torch.Tensor, np.ndarray | None, torch.cuda.Event]] = {}
        self._turn: dict[str, int] = {}
        self._filled: dict[str, tuple] = {}  # slot -> (key, staged tensor) handed out by `array`

    def __call__(self, slot: str, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`host` on the device (into `out` when given). On CPU the host tensor itself is returned."""
        if self.device.type != "cuda":
            return host if out is None else out.copy_(host)
        key, staged, _ = self._stage(slot, host.numel(), host.dtype)
        staged = staged.view(host.shape)
        staged.copy_(host)
        return self._send(key, staged, out)

    def values(self, slot: str, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A list's values on the device. They go straight into the slot's pinned buffer through its
        numpy view: building a tensor from a Python list first costs several times more."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype)
        key, staged, view = self._stage(slot, len(values), dtype)
        view[:] = values
        return self._send(key, staged, None)

    def segments(self, slot: str, parts: list[list], dtype: torch.dtype) -> list[torch.Tensor]:
        """Several lists in one upload (`values`), each on the device from a 16-byte boundary: Triton
        specialises a kernel on each pointer's alignment, so a part right after an odd-sized one
        would compile another variant whenever the sizes' parity changes."""
        per, values, starts = 16 // dtype.itemsize, [], []
        for part in parts:
            starts.append(len(values))
            values += part
            values += [0] * (-len(values) % per)
        both = self.values(slot, values, dtype)
        return [both[start : start + len(part)] for start, part in zip(starts, parts, strict=True)]

    def array(self, slot: str, n: int, dtype: torch.dtype) -> np.ndarray:
        """The slot's next buffer as a numpy array of `n` elements for the caller to fill; `send(slot)`
        then copies it to the device. Filling pinned memory in place saves a host copy per step. On
        CPU a fresh array, which `send` hands out as a tensor."""
        if self.device.type != "cuda":
            array = np.empty(n, dtype=NUMPY_DTYPES[dtype])
            self._filled[slot] = (None, torch.from_numpy(array))
            return array
        key, staged, view = self._stage(slot, n, dtype)
        self._filled[slot] = (key, staged)
        return view

    def send(self, slot: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The array `array(slot, ...)` handed out, on the device (into `out` when given)."""
        key, staged = self._filled.pop(slot)
        if key is None:
            return staged if out is None else out.copy_(staged)
        return self._send(key, staged, out)

    def _stage(
        self, slot: str, n: int, dtype: torch.dtype
    ) -> tuple[tuple[str, int], torch.Tensor, np.ndarray | None]:
        """The slot's next pinned buffer, free to refill, cut to `n` elements (and its numpy view)."""
        turn = self._turn[slot] = (self._turn.get(slot, -1) + 1) % BUFFERS_PER_SLOT
        key = (slot, turn)
        entry = self._buffers.get(key)
        if entry is None or entry[0].numel() < n or entry[0].dtype != dtype:
            size = max(n, 2 * entry[0].numel() if entry is not None else 0, 1)
            buf = torch.empty(size, dtype=dtype, pin_memory=True)
            view = buf.numpy() if dtype in NUMPY_DTYPES else None  # `values` writes through it
            entry = self._buffers[key] = (buf, view, torch.cuda.Event())
        else:
            entry[2].synchronize()  # the last copy out of this buffer is done (normally long ago)
        return key, entry[0][:n], None if entry[1] is None else entry[1][:n]

    def _send(self, key: tuple[str, int], staged: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Enqueue the copy of `staged` to the device (into `out` when given), recording the buffer's
        event behind it."""
        if out is None:
            out = staged.to(self.device, non_blocking=True)
        else:
            out.copy_(staged, non_blocking=True)
        record(self._buffers[key][2], self.device)
        return out


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
