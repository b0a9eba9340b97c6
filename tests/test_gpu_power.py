"""The power sampler's parsing and windowing (benchmarks/gpu_power.py: the harness records the clock and the
power of every decode figure), on rows written by hand, and the decode note that reports them.

Reference: the expected medians, minimum, capped share and energy are worked out by hand from the inputs
below; the row format is nvidia-smi's `--format=csv,noheader,nounits` for the sampler's query.
"""

from __future__ import annotations

from datetime import datetime

from benchmarks import gpu_power
from benchmarks.report import _decode_note


def _row(second: float, sm: int, watts: float, reasons: str) -> str:
    stamp = datetime(2026, 11, 23, 12, 0, 0).timestamp() + second
    text = datetime.fromtimestamp(stamp).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]  # nvidia-smi keeps ms
    return f"{text}, {sm}, 1980, {watts}, 700.00, {reasons}"


ROWS = [
    _row(0.0, 1980, 120.5, "0x0000000000000000"),  # before the window: idle
    _row(1.0, 1560, 688.0, "0x0000000000000004"),  # SW power cap
    _row(1.1, 1500, 699.0, "0x0000000000000004"),
    _row(1.2, 1815, 650.0, "0x0000000000000000"),
    "[N/A], [N/A], 1980, [N/A], 700.00, [N/A]",  # a row the driver could not fill is skipped
    _row(3.0, 1980, 130.0, "0x0000000000000001"),  # after the window: idle (GPU idle bit)
]


def test_summary_keeps_only_samples_inside_the_windows():
    samples = gpu_power.parse(ROWS)
    assert len(samples) == 5  # the [N/A] row is dropped
    t0 = samples[1].t
    got = gpu_power.summarize(samples, [(t0 - 0.05, t0 + 0.25)])
    assert got == {
        "samples": 3,
        "sm_mhz_p50": 1560.0,
        "sm_mhz_min": 1500.0,
        "max_sm_mhz": 1980.0,
        "watts_p50": 688.0,
        "watts_max": 699.0,
        "limit_watts": 700.0,
        "power_capped_pct": 100 * 2 / 3,
    }
    assert gpu_power.summarize(samples, [(t0 + 10, t0 + 11)]) is None


def test_the_decode_note_reports_clock_and_power_when_sampled():
    base = {"step_ms_p50": 6.6, "step_ms_p90": 6.7, "weight_GBps": 2400.0, "roofline": {"bound": "memory"}}
    assert "SM clock" not in _decode_note({**base, "power": None})
    power = gpu_power.summarize(gpu_power.parse(ROWS), [(0, 1e12)])
    note = _decode_note({**base, "power": power})
    # all five rows: SM clock median of 1500, 1560, 1815, 1980, 1980 is 1815; power median 650; 2 of 5
    # capped; energy 650 W x 6.6 ms = 4,290 mJ
    assert note.endswith(
        "; SM clock p50 1,815 of 1,980 MHz, board 650 W p50 of a 700 W limit, "
        "power-capped in 40% of samples, ~4,290 mJ per step"
    )


def test_sampler_records_nothing_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(gpu_power.shutil, "which", lambda name: None)
    with gpu_power.PowerSampler("0") as p:
        pass
    assert p.samples == []


def test_smi_device_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert gpu_power.smi_device(1) == "5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_power.smi_device(1) == "1"
