"""The scheduler's pace, logged by the engine core: `MINSERVE_PACE_LOG_S=0.5` writes one INFO line per
half second. Off by default.

A closed loop of many users can fall into waves: a crowd of requests arrives, its prompts fill every
step's budget, its answers end at about the same time and its users return together. Prometheus
scrapes the running and waiting gauges too seldom to show a wave of a second or two; this line shows
them, with the mean, the least and the most running sequences of each interval, the waiting ones, the
step rate, and how often admission stopped with sequences still waiting, by reason
(engine/sched/scheduler.Scheduler.admit_stop: the step's token budget, free sequence seats, KV blocks,
LoRA slots).

Per step it costs two len() calls and a few additions; nothing when off.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter

log = logging.getLogger("engine.core.pace")
ENV = "MINSERVE_PACE_LOG_S"


class PaceLog:
    def __init__(self, interval_s: float, clock=time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._start = clock()
        self._reset()

    @classmethod
    def from_env(cls) -> PaceLog | None:
        value = os.environ.get(ENV, "")
        try:
            interval = float(value) if value else 0.0
        except ValueError:
            raise ValueError(
                f"{ENV}={value!r}: give seconds between log lines, e.g. 0.5 (0 or unset: off)"
            ) from None
        return cls(interval) if interval > 0 else None

    def _reset(self) -> None:
        self.steps = 0
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.stops: Counter[str] = Counter()

    def step(self, scheduler) -> str | None:
        """Count one engine step; at the end of an interval, log its line and return it."""
        self.steps += 1
        self.running.append(len(scheduler.running))
        self.waiting.append(len(scheduler.waiting))
        if scheduler.admit_stop is not None:
            self.stops[scheduler.admit_stop] += 1
        now = self._clock()
        if now - self._start < self.interval_s:
            return None
        line = self._line(now - self._start)
        self._start = now
        self._reset()
        log.info("%s", line)
        return line

    def _line(self, seconds: float) -> str:
        run, wait, n = self.running, self.waiting, self.steps
        stops = ", ".join(f"{k} {v}" for k, v in sorted(self.stops.items())) or "none"
        return (
            f"pace: {n / seconds:.0f} steps/s; running {sum(run) / n:.0f} (min {min(run)}, max {max(run)}); "
            f"waiting {sum(wait) / n:.1f} (max {max(wait)}); steps leaving some waiting: {stops}"
        )
