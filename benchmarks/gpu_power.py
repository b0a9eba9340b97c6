"""Board power and SM clock while a figure is timed, sampled from nvidia-smi (GPU hosts only).

Why: batch-64 decode of the 8B shape streams HBM at full speed and keeps the tensor cores busy at once.
On an H200 that meets the 700 W board limit, and the firmware lowers the SM clock (throttle reason "SW
power cap"), which slows every kernel of the step, memory-bound ones included. A figure that lands short
should say so, so the harness records the clock, the power and how often the cap was active.

`PowerSampler` runs `nvidia-smi --loop-ms=100` in the background; `summarize` keeps the samples that fall
inside the given time windows (the decode steps, not prefill or warm-up). Without nvidia-smi (a CPU host)
the sampler records nothing and the summary is None.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from datetime import datetime

QUERY = "timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,{reasons}"
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # the field's new and old name
SW_POWER_CAP = 0x4  # bit of clocks_event_reasons.active (nvmlClocksEventReasonSwPowerCap)
PERIOD_MS = 100


@dataclass
class Sample:
    t: float  # seconds since the epoch (host clock, as time.time())
    sm_mhz: float
    max_sm_mhz: float
    watts: float
    limit_watts: float
    reasons: int


def parse(lines: list[str]) -> list[Sample]:
    """Rows of `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`; rows that do not parse
    (a driver that lacks a field prints "[N/A]" or an error line) are skipped."""
    out = []
    for line in lines:
        f = [x.strip() for x in line.split(",")]
        if len(f) != 6:
            continue
        try:
            t = datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append(Sample(t, float(f[1]), float(f[2]), float(f[3]), float(f[4]), int(f[5], 16)))
        except ValueError:
            continue
    return out


def summarize(samples: list[Sample], windows: list[tuple[float, float]]) -> dict | None:
    """Medians over the samples inside any window [start, end]; None if no sample falls in one."""
    inside = [s for s in samples if any(a <= s.t <= b for a, b in windows)]
    if not inside:
        return None
    return {
        "samples": len(inside),
        "sm_mhz_p50": statistics.median(s.sm_mhz for s in inside),
        "sm_mhz_min": min(s.sm_mhz for s in inside),
        "max_sm_mhz": max(s.max_sm_mhz for s in inside),
        "watts_p50": statistics.median(s.watts for s in inside),
        "watts_max": max(s.watts for s in inside),
        "limit_watts": max(s.limit_watts for s in inside),
        "power_capped_pct": 100 * sum(bool(s.reasons & SW_POWER_CAP) for s in inside) / len(inside),
    }


def _query(exe: str) -> str | None:
    """QUERY with the throttle-reason field this driver knows, or None if it knows neither name."""
    for name in REASONS:
        probe = subprocess.run([exe, f"--query-gpu={name}", "--format=csv"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return QUERY.format(reasons=name)
    return None


def smi_device(torch_index: int) -> str:
    """nvidia-smi's name for torch's device `torch_index` (they differ under CUDA_VISIBLE_DEVICES)."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[torch_index].strip() if torch_index < len(visible) else str(torch_index)


def _current_device() -> str:
    import torch

    return smi_device(torch.cuda.current_device()) if torch.cuda.is_available() else "0"


class PowerSampler:
    """`with PowerSampler() as p: ...` (torch's current device unless `device` names one for nvidia-smi);
    afterwards p.samples holds what nvidia-smi reported."""

    def __init__(self, device: str | None = None):
        self.device = device
        self.samples: list[Sample] = []
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> PowerSampler:
        exe = shutil.which("nvidia-smi")
        query = _query(exe) if exe else None
        if query:
            device = self.device if self.device is not None else _current_device()
            cmd = [exe, f"--query-gpu={query}", "--format=csv,noheader,nounits", f"--loop-ms={PERIOD_MS}",
                   f"--id={device}"]  # fmt: skip
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.samples = parse(out.splitlines())
