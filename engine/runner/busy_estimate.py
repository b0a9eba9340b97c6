"""A cheap running estimate of how busy the GPU is: each step's device span, summed over a wall window.

Per step the engine records one timing event just before the step's work is enqueued (`begin`) and
one after its last kernel, the sampling, is enqueued (`end`). Steps run in order on one stream, so
their spans [begin, end] do not overlap, and a window's spans summed over its wall time is the share
of it the device spent inside steps. A span includes the launch gaps inside an eager step (and, for a
step whose draw waits on host work, the wait), so this is an upper bound of the kernel-trace figure
(engine/core/kernel_trace.py, the union of kernel intervals). When every step is one graph replay the
two come close: only the graph's own gaps between kernels remain, small next to a model's kernels.

Only one step in `sample_every` is timed, and its span stands for that many steps: timing every
step would add host work to every step, which costs throughput wherever the host is the bottleneck
(a small model's batch-1 decode). Host cost per timed step: two event records and a deque append,
and a query() of the oldest pending pair or two; nothing ever synchronizes. A pair counts once its
end event has completed, at the time this estimator sees it complete (the next timed step's `end`,
or a stats read). Without CUDA there is no
estimate (None).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

WINDOW_S = 5.0  # the wall time the estimate covers
SAMPLE_EVERY = 16  # steps per timed step: a window of a few seconds still holds many timed steps
MAX_PENDING = 64  # pairs not yet complete; a device this far behind is not timed pair by pair


class TimingEvent(Protocol):
    """What torch.cuda.Event(enable_timing=True) offers and this needs (tests pass fakes)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: TimingEvent) -> float: ...  # milliseconds


class BusyEstimate:
    """`new_event`: makes a timing event (None: no device to time, every call is a no-op)."""

    def __init__(
        self,
        new_event: Callable[[], TimingEvent] | None,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        sample_every: int = SAMPLE_EVERY,
    ):
        self._new_event, self.window_s, self._clock = new_event, window_s, clock
        self.sample_every, self._steps = sample_every, 0
        self._open: TimingEvent | None = None  # the begun step's start event
        self._pending: deque[tuple[TimingEvent, TimingEvent]] = deque()  # recorded, in stream order
        self._done: deque[tuple[float, float]] = deque()  # (seen complete at, span seconds)
        self._sum = 0.0  # of the spans in _done
        self._free: list[TimingEvent] = []  # events of counted pairs, recorded again later
        self._since: float | None = None  # the first step's begin: the window is never longer

    @classmethod
    def for_device(cls, device) -> BusyEstimate:
        """Timed with CUDA events on a CUDA device; a no-op elsewhere."""
        if getattr(device, "type", None) != "cuda":
            return cls(None)
        import torch

        return cls(lambda: torch.cuda.Event(enable_timing=True))

    def begin(self) -> None:
        """Just before a step's work is enqueued (only every sample_every-th step is timed)."""
        if self._new_event is None:
            return
        if self._since is None:
            self._since = self._clock()
        self._steps += 1
        if self._steps % self.sample_every:
            return
        self._open = self._event()
        self._open.record()

    def end(self) -> None:
        """Just after the step's last kernel is enqueued; a step that was not begun is ignored."""
        start, self._open = self._open, None
        if start is None:
            return
        stop = self._event()
        stop.record()
        self._pending.append((start, stop))
        if len(self._pending) > MAX_PENDING:
            self._pending.popleft()
        self._collect()

    def estimate(self) -> float | None:
        """Device time inside steps over the last window_s of wall time (clamped to [0, 1])."""
        if self._new_event is None:
            return None
        self._collect()
        if self._since is None:
            return 0.0
        wall = min(self.window_s, self._clock() - self._since)
        return min(1.0, max(0.0, self._sum * self.sample_every / wall)) if wall > 0 else 0.0

    def _collect(self) -> None:
        """Move completed pairs (the stream completes them in order) into the window; forget old ones."""
        now = self._clock()
        while self._pending and self._pending[0][1].query():
            start, stop = self._pending.popleft()
            span = start.elapsed_time(stop) / 1000.0
            self._done.append((now, span))
            self._sum += span
            self._free += (start, stop)
        while self._done and self._done[0][0] < now - self.window_s:
            self._sum -= self._done.popleft()[1]
        if not self._done:
            self._sum = 0.0  # no float residue once the window is empty

    def _event(self) -> TimingEvent:
        return self._free.pop() if self._free else self._new_event()
