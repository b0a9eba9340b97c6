"""A kernel-trace window of the engine core: the fraction of wall time during which the GPU runs work.

    kill -USR1 <core pid>     # start a window
    kill -USR2 <core pid>     # stop it: $MINSERVE_TRACE_DIR/kernel_busy_<pid>_<n>.json appears

The signal handlers only queue the request; the core's loop acts on it between steps (`act`), so a
step is never cut in two and the handlers touch no CUDA state. A window is a torch.profiler trace with
CUDA activity only. Busy time is the union of the device-side intervals the trace records (kernels,
memcpy and memset: every activity on the device counts, overlapping ones once); `kernels` counts those
intervals. Launch gaps between kernels are idle time here, unlike in the engine's running estimate
(engine/runner/busy_estimate.py), which times whole steps.

The JSON: {"pid", "window_s", "busy_s", "busy_fraction", "kernels", "device"}, written to a temporary
name and renamed, so a reader never sees half a file. A core that runs nothing on CUDA (a CPU engine,
the null core) still writes one, with busy_fraction null and a "reason", so its caller never waits
forever. The n-th window (from 0) is `kernel_busy_<pid>_<n>.json`; a stop without a start writes one
too, with its reason.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("engine.core.kernel_trace")
TRACE_DIR_ENV = "MINSERVE_TRACE_DIR"


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlapping kernels count once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def trace_dir() -> Path:
    return Path(os.environ.get(TRACE_DIR_ENV) or tempfile.gettempdir())


def _cuda_torch():
    """torch, when this process runs work on a CUDA device; else (None, why not)."""
    torch = sys.modules.get("torch")  # never imported here: a core without torch runs nothing on a GPU
    if torch is None:
        return None, "torch is not loaded in this core (null core): nothing runs on a GPU"
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None, "this core runs nothing on CUDA (CPU engine)"
    return torch, None


def device_intervals(prof) -> list[tuple[int, int]]:
    """(start_ns, end_ns) of every device-side activity of a stopped torch.profiler trace."""
    from torch.autograd import DeviceType

    intervals = []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() == DeviceType.CUDA and event.duration_ns() > 0:
            start = event.start_ns()
            intervals.append((start, start + event.duration_ns()))
    return intervals


class KernelTrace:
    """The window's state. `requests` is what the signal handlers queued (True: start, False: stop),
    in arrival order; the loop calls `act` whenever it is not empty."""

    def __init__(self, directory: Path | None = None):
        self.requests: deque[bool] = deque()
        self.directory = directory
        self.windows = 0  # files written so far: the next one's n
        self._prof = None
        self._torch = None
        self._started: float | None = None  # monotonic start of the open window
        self._reason: str | None = None  # why the open window has no trace

    def install(self) -> None:
        """SIGUSR1 starts a window, SIGUSR2 stops it (main thread only, as for any signal handler)."""
        signal.signal(signal.SIGUSR1, lambda *_: self.requests.append(True))
        signal.signal(signal.SIGUSR2, lambda *_: self.requests.append(False))

    def act(self) -> None:
        """Apply the queued requests: called by the loop between steps. A trace that fails is reported
        in its window's file and never fails the loop."""
        while self.requests:
            starting = self.requests.popleft()
            try:
                if starting:
                    self.start()
                else:
                    self.stop()
            except Exception as exc:
                log.exception("kernel trace failed")
                self._prof, self._reason = None, f"the trace failed: {type(exc).__name__}: {exc}"
                if not starting:  # the window still gets its file
                    self._started = None
                    self._write(self._result(0.0, None, reason=self._reason))

    def start(self) -> None:
        if self._started is not None:
            return  # a window is open already: it goes on
        self._started, self._reason = time.monotonic(), None
        torch, self._reason = _cuda_torch()
        if torch is not None:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()  # every kernel the window sees was launched inside it
            self._prof = profile(activities=[ProfilerActivity.CUDA])
            self._prof.start()
            self._started = time.monotonic()

    def stop(self) -> dict:
        """Close the window and write its file; returns what was written."""
        if self._started is None:
            return self._write(self._result(0.0, None, reason="a stop (SIGUSR2) with no window open"))
        prof, self._prof = self._prof, None
        torch = sys.modules.get("torch")
        if prof is not None:
            torch.cuda.synchronize()  # the window's last kernels have ended
        window_s = time.monotonic() - self._started
        self._started = None
        if prof is None:
            return self._write(self._result(window_s, None, reason=self._reason or "no trace was started"))
        prof.stop()
        return self._write(self._result(window_s, device_intervals(prof), torch.cuda.get_device_name()))

    def _result(self, window_s: float, intervals, device: str = "none", reason: str = "") -> dict:
        result = {"pid": os.getpid(), "window_s": window_s, "busy_s": None, "busy_fraction": None}
        result |= {"kernels": None, "device": device}
        if intervals is None:
            return {**result, "reason": reason}
        busy_s = busy_time(intervals) / 1e9
        fraction = busy_s / window_s if window_s > 0 else None
        return {**result, "busy_s": busy_s, "busy_fraction": fraction, "kernels": len(intervals)}

    def _write(self, result: dict) -> dict:
        directory = self.directory or trace_dir()
        directory.mkdir(parents=True, exist_ok=True)
        name = f"kernel_busy_{result['pid']}_{self.windows}.json"
        tmp = directory / f".{name}.tmp"  # not matched by kernel_busy_*.json
        tmp.write_text(json.dumps(result))
        os.replace(tmp, directory / name)
        self.windows += 1
        log.info("kernel trace window %s: %s", directory / name, result)
        return result
