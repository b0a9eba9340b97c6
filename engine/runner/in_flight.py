"""InFlightStep: a step launched on the device whose tokens the host has not taken yet.

Its draw is what ModelRunner.execute returned, a `Draw`. Most are enqueued at once (EnqueuedDraw:
PendingSample, PendingSpec). A step launched ahead whose rows read host state (grammar matchers,
penalties' token history: SchedulerOutput.draw_late) has a deferred one (DeferredSample): once the
host has appended the previous step's tokens, `start` begins its mask fill on a worker thread, and
`finish` joins that and enqueues the sampling. Until `finish`, nothing of it samples on the device.
A draw that fails fails the step's requests (through `fail`) and leaves the step without a draw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.sampling.sampler import SampleResult
from engine.sched.output import SchedulerOutput

Fail = Callable[[SchedulerOutput, Exception], None]  # fails the requests of a step (TokenSink.fail_chunks)


class Draw(Protocol):
    deferred: bool  # its sampling waits for `finish`

    def start(self) -> None: ...

    def finish(self) -> Draw:
        """The draw enqueued: joins any host work, then enqueues the sampling."""
        ...

    def resolve(self) -> SampleResult: ...


@dataclass
class InFlightStep:
    out: SchedulerOutput
    draw: Draw | None  # None: nothing in it samples or scores, or its draw failed

    @property
    def deferred(self) -> bool:
        return self.draw is not None and self.draw.deferred

    def start(self, fail: Fail) -> None:
        """Begin the draw's host work (none unless deferred): after the previous step's tokens are in."""
        if self.draw is not None:
            try:
                self.draw.start()
            except Exception as exc:
                self._failed(fail, exc)

    def finish(self, fail: Fail) -> Draw | None:
        """The draw, enqueued on the device (None if it failed)."""
        if self.draw is not None:
            try:
                self.draw = self.draw.finish()
            except Exception as exc:
                self._failed(fail, exc)
        return self.draw

    def drop(self) -> None:
        """Forget the draw once its host work has ended (a mask fill's buffer is reused); the step's
        sequences have all finished, so a failure concerns nobody."""
        draw, self.draw = self.draw, None
        if draw is not None:
            with contextlib.suppress(Exception):
                draw.finish()

    def _failed(self, fail: Fail, exc: Exception) -> None:
        self.draw = None
        fail(self.out, exc)
