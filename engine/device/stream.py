"""The current CUDA stream, cheaply: for the events the hot path records every step.

`torch.cuda.current_stream()` builds a new Stream object on every call, several microseconds of host
time, and `Event.record()` without a stream calls it. The raw handle of the current stream costs a
fraction of that, so the Stream object is kept per (device, handle) and returned while that stream is
current. A stream made current later (a `torch.cuda.stream` block, a graph capture) has another handle
and gets its own object, so an event is always recorded on the stream that is current at the call.
"""

from __future__ import annotations

import torch

_KEPT_MAX = 64  # streams kept at most (the engine uses a handful; a bound, not a working size)
_kept: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_stream(device_index: int) -> torch.cuda.Stream:
    """torch.cuda.current_stream(device_index), without building a Stream object each call."""
    key = (device_index, torch._C._cuda_getCurrentRawStream(device_index))
    stream = _kept.get(key)
    if stream is None:
        if len(_kept) >= _KEPT_MAX:
            _kept.clear()
        stream = _kept[key] = torch.cuda.current_stream(device_index)
    return stream


def record(event: torch.cuda.Event, device: torch.device) -> None:
    """event.record() on `device`'s current stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    event.record(current_stream(index))
