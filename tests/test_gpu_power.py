"""The power sampler's parsing and windowing (benchmarks/gpu_power.py), on rows written by hand, and the
arithmetic of the energy probe (benchmarks/energy_probe.py).

Reference: the expected medians, minimum, capped share, sums and energies are worked out by hand from the
inputs below; the row format is nvidia-smi's `--format=csv,noheader,nounits` for the sampler's query.
"""

from __future__ import annotations

from datetime import datetime

from benchmarks import energy_probe, gpu_power
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


def _part(name: str, us: float, nbytes: int, watts: float) -> energy_probe.Part:
    power = {"watts_p50": watts, "sm_mhz_p50": 1875.0, "power_capped_pct": 100.0, "limit_watts": 700.0}
    return energy_probe.Part(name, us, nbytes, power)


def test_energy_probe_predicts_the_step_from_times_and_from_energy_at_the_limit():
    attn, gemms, lm = (
        _part("attn", 70.0, 279_000_000, 700.0),
        _part("gemms", 120.0, 1, 690.0),
        _part("lm", 280.0, 1, 690.0),
    )
    assert attn.row()["pJ/byte"] == 175.6  # 700 W x 70 us = 49 mJ over 279 MB
    got = energy_probe.predict([attn, gemms], [lm], layers=32, limit_watts=700.0)
    # times: 32 x (70 + 120) + 280 = 6,360 us
    # energy: 32 x (49 + 82.8) + 193.2 = 4,410.8 mJ, over 700 W = 6,301.1 us
    assert got["step_us_from_times"] == 6360.0
    assert abs(got["step_mJ"] - 4410.8) < 1e-9
    assert abs(got["step_us_at_limit"] - 4410.8 / 700 * 1e3) < 1e-9
    # a read of 1 GB in 250 us at 660 W (165 mJ): 25 GB take 6,250 us and 4,125 mJ, >= 5,893 us at 700 W
    reads = energy_probe.predict_read(25 * 10**9, _part("read", 250.0, 10**9, 660.0), limit_watts=700.0)
    assert [round(reads[k], 6) for k in ("step_us_from_times", "step_mJ")] == [6250.0, 4125.0]
    assert abs(reads["step_us_at_limit"] - 4125 / 700 * 1e3) < 1e-9
    report = {"env": {"hardware": {"gpu": "H200", "nvidia_smi": "700.00 W"}}, "command": "c", "commit": "x",
              "batch": 64, "ctx": 1064, "layers": 32, "limit_watts": 700.0, "step_bytes": 25 * 10**9,
              "parts": [attn.row()], "predictions": {"kernels": got, "reads": reads}}  # fmt: skip
    text = energy_probe.markdown(report)
    assert "| attn | 70.0 | 3986 | 1875 | 700 | 100 | 49.0 | 175.6 |" in text
    assert "lm_head): 6,360 us at the measured speed, 4,411 mJ, so >= 6,301 us at the 700 W limit." in text
    assert "Its 25.00 GB as a plain read: 6,250 us at the measured speed, 4,125 mJ, so >= 5,893 us" in text
