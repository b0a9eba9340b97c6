"""How busy the GPU is over a served measurement window, two ways, for benchmarks/serve_overhead.py.

    probe = BusyProbe(server_session_pid, trace_dir).start()    # at the window's start
    ...                                                         # the load window
    busy = probe.stop()     # {"trace": {...}, "dmon": {...}}   # at its end

trace: the served engine core's own kernel trace (engine/core/kernel_trace.py). SIGUSR1 to every engine
core of the server's session (command line with `engine.core.process`, as proc_cpu finds it) opens a
window, SIGUSR2 closes it; each core then writes TRACE_DIR/kernel_busy_<pid>_<n>.json, read here
(waited for up to `wait_s`). busy_fraction = the union of the device's kernel / copy intervals / wall.
Only a core whose tree handles the signals may get them (`tree_has_trace`): to an older core SIGUSR1 is
fatal, so there the trace is "not measured" with its reason.
dmon: `nvidia-smi dmon -s u -d 1 -o DT` over the same window (where nvidia-smi exists): the driver's
sampled SM utilisation (`sm`: the share of each ~1 s sample in which some kernel ran), mean and p50 of
the samples stamped inside the window, per GPU; the headline is the busiest GPU (the engine's).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

TRACE_MARKER = "SIGUSR1"  # in engine/core/process.py of a tree whose core handles the trace signals


def tree_has_trace(root: Path) -> bool:
    """True when the engine core of the tree at `root` handles SIGUSR1 / SIGUSR2 (else SIGUSR1 kills it)."""
    path = Path(root) / "engine" / "core" / "process.py"
    return path.exists() and TRACE_MARKER in path.read_text(errors="replace")


def core_pids(session: int) -> list[int]:
    """The engine core processes of session `session` (the `serve run` of one server)."""
    import psutil

    from benchmarks.proc_cpu import session_pids

    found = []
    for pid in session_pids(session):
        with contextlib.suppress(psutil.Error):
            if "engine.core.process" in " ".join(psutil.Process(pid).cmdline()):
                found.append(pid)
    return sorted(found)


# ---------------------------------------------------------------------------------------------- dmon
def parse_dmon(lines: list[tuple[float, str]]) -> list[dict]:
    """[(read time, line)] of `nvidia-smi dmon` -> [{"ts", "gpu", "sm"}]. Column names come from the
    first '#' line; later '#' lines (dmon repeats its header) and malformed lines are skipped. `ts` is the
    Date + Time columns (local time) when present, else the read time; `sm` is None where dmon prints '-'."""
    cols: list[str] | None = None
    samples = []
    for read_ts, line in lines:
        if line.lstrip().startswith("#"):
            cols = cols or line.lstrip().lstrip("#").split()
            continue
        cells = line.split()
        if cols is None or len(cells) != len(cols) or "sm" not in cols:
            continue
        row = dict(zip(cols, cells, strict=True))
        ts = read_ts
        if "Date" in row and "Time" in row:
            with contextlib.suppress(ValueError):
                ts = time.mktime(time.strptime(f"{row['Date']} {row['Time']}", "%Y%m%d %H:%M:%S"))
        sm = int(row["sm"]) if row["sm"].isdigit() else None
        samples.append({"ts": ts, "gpu": row.get("gpu", row.get("Idx", "0")), "sm": sm})
    return samples


def dmon_summary(samples: list[dict], t0: float, t1: float) -> dict:
    """Mean and p50 of `sm` per GPU over the samples with t0 < ts <= t1 (a sample covers the second
    before its stamp, and dmon stamps whole seconds: the start's own second is left out)."""
    per_gpu: dict[str, list[int]] = {}
    for s in samples:
        if int(t0) < s["ts"] <= t1 and s["sm"] is not None:
            per_gpu.setdefault(str(s["gpu"]), []).append(s["sm"])
    gpus = {g: {"samples": len(v), "sm_mean": statistics.fmean(v), "sm_p50": statistics.median(v)}
            for g, v in per_gpu.items()}  # fmt: skip
    if not gpus:
        return {"sm_mean": None, "sm_p50": None, "samples": 0, "gpus": {}, "reason": "no dmon sample"}
    busiest = max(gpus, key=lambda g: gpus[g]["sm_mean"])
    return {**gpus[busiest], "gpu": busiest, "gpus": gpus}


class Dmon:
    """`nvidia-smi dmon -s u -d 1 -o DT` in the background; every line kept with its read time."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc: subprocess.Popen | None = None
        self.reason = "" if shutil.which("nvidia-smi") else "no nvidia-smi on this host"

    def start(self) -> Dmon:
        if not self.reason:
            cmd = ["nvidia-smi", "dmon", "-s", "u", "-d", "1", "-o", "DT"]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, daemon=True, name="dmon").start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    def stop(self, t0: float, t1: float) -> dict:
        """The summary of the samples inside [t0, t1] (wall-clock seconds)."""
        if self.proc is None:
            return {"sm_mean": None, "sm_p50": None, "samples": 0, "reason": self.reason}
        time.sleep(1.2)  # the sample that covers the window's last second
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.poll() is None:
            self.proc.kill()
        return dmon_summary(parse_dmon(self.lines), t0, t1)


# --------------------------------------------------------------------------------------------- trace
def _signal(pids: list[int], sig: int) -> list[int]:
    """Send `sig` to each pid; the ones that got it."""
    sent = []
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
            sent.append(pid)
    return sent


def _windows(directory: Path, pid: int) -> set[str]:
    return {p.name for p in directory.glob(f"kernel_busy_{pid}_*.json")}


class KernelTraceWindow:
    """SIGUSR1 / SIGUSR2 to the cores of one session, and the files they write for the window."""

    def __init__(self, session: int, directory: Path, wait_s: float = 30.0):
        self.session, self.directory, self.wait_s = session, Path(directory), wait_s
        self.before: dict[int, set[str]] = {}

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        pids = core_pids(self.session)
        self.before = {pid: _windows(self.directory, pid) for pid in pids}
        self.before = {pid: self.before[pid] for pid in _signal(pids, signal.SIGUSR1)}

    def stop(self) -> dict:
        """The window's file of every core signalled at the start (waited for up to wait_s)."""
        if not self.before:
            return {"busy_fraction": None, "cores": [], "reason": "no engine core process found"}
        _signal(list(self.before), signal.SIGUSR2)
        found: dict[int, dict] = {}
        deadline = time.monotonic() + self.wait_s
        while len(found) < len(self.before) and time.monotonic() < deadline:
            for pid, seen in self.before.items():
                new = sorted(_windows(self.directory, pid) - seen)
                if pid not in found and new:
                    with contextlib.suppress(ValueError):  # a writer without rename: read it again
                        found[pid] = json.loads((self.directory / new[-1]).read_text())
            time.sleep(0.2)
        return trace_summary(found, missing=sorted(set(self.before) - set(found)), wait_s=self.wait_s)


def trace_summary(found: dict[int, dict], missing: list[int], wait_s: float) -> dict:
    """One figure from the cores' window files: the mean busy fraction of the cores that measured one."""
    cores = [found[pid] for pid in sorted(found)]
    fractions = [c["busy_fraction"] for c in cores if c.get("busy_fraction") is not None]
    out = {"busy_fraction": statistics.fmean(fractions) if fractions else None, "cores": cores}
    reasons = [f"core {c.get('pid')}: {c['reason']}" for c in cores if c.get("reason")]
    reasons += [f"core {pid}: no kernel_busy file within {wait_s:g} s" for pid in missing]
    return {**out, "reason": "; ".join(reasons)} if reasons else out


class BusyProbe:
    """Both measurements over one window. `trace_dir` None: the served tree's core has no trace handler
    (`why_not` says so) and is never signalled."""

    def __init__(self, session: int, trace_dir: Path | None, why_not: str = "", wait_s: float = 30.0):
        self.trace = KernelTraceWindow(session, trace_dir, wait_s) if trace_dir is not None else None
        self.why_not, self.dmon = why_not, Dmon()

    def start(self) -> BusyProbe:
        self.dmon.start()
        self.t0 = time.time()
        if self.trace is not None:
            self.trace.start()
        return self

    def stop(self) -> dict:
        t1 = time.time()
        trace = self.trace.stop() if self.trace is not None else None
        dmon = self.dmon.stop(self.t0, t1)
        trace = trace or {"busy_fraction": None, "reason": self.why_not or "kernel trace off"}
        return {"window_s": t1 - self.t0, "trace": trace, "dmon": dmon}
