"""The running GPU-busy estimate (engine/runner/busy_estimate.py) with fake timing events whose device
times and completion the test controls, its place in the engine's stats on CPU, the Prometheus gauge
(app/metrics.py) and the Grafana panel that shows it."""

from __future__ import annotations

import json

import pytest

from engine.runner.busy_estimate import BusyEstimate
from tests.import_graph import ROOT


class FakeDevice:
    """A device clock: events are stamped with `now_ms` when recorded, complete once `done_ms` passes."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.done_ms = -1.0
        self.made = 0

    def event(self) -> FakeEvent:
        self.made += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice):
        self.device, self.at = device, None

    def record(self) -> None:
        self.at = self.device.now_ms

    def query(self) -> bool:
        return self.at is not None and self.at <= self.device.done_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an event that has not completed"
        return end.at - self.at


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _estimator(window_s: float = 5.0):
    device, clock = FakeDevice(), Clock()
    return BusyEstimate(device.event, window_s=window_s, clock=clock, sample_every=1), device, clock


def _step(busy: BusyEstimate, device: FakeDevice, span_ms: float, gap_ms: float = 0.0) -> None:
    """One step whose device span is span_ms, then gap_ms with nothing on the device."""
    busy.begin()
    device.now_ms += span_ms
    busy.end()
    device.now_ms += gap_ms


def reference(spans: list[tuple[float, float]], now: float, since: float, window_s: float) -> float:
    """Independent recompute: (seen_at, span_s) pairs seen within the window, over the window's wall."""
    wall = min(window_s, now - since)
    return min(1.0, sum(s for t, s in spans if t >= now - window_s) / wall)


def test_without_a_device_there_is_no_estimate_and_nothing_is_recorded():
    busy = BusyEstimate(None)
    busy.begin()
    busy.end()
    assert busy.estimate() is None
    assert BusyEstimate.for_device(type("Dev", (), {"type": "cpu"})()).estimate() is None


def test_completed_spans_over_the_wall_window():
    busy, device, clock = _estimator()
    assert busy.estimate() == 0.0  # no step yet
    seen = []
    since = clock.t
    for _ in range(40):  # 40 steps of 30 ms device time each, 100 ms of wall apart
        _step(busy, device, 30.0, gap_ms=70.0)
        device.done_ms = device.now_ms  # the device has finished everything so far
        clock.t += 0.1
        assert busy.estimate() == pytest.approx(reference(seen + [(clock.t, 0.03)], clock.t, since, 5.0))
        seen.append((clock.t, 0.03))
    assert busy.estimate() == pytest.approx(0.3)  # 40 x 30 ms over 4 s
    clock.t += 3.0  # idle: spans seen more than 5 s ago leave the window
    assert busy.estimate() == pytest.approx(reference(seen, clock.t, since, 5.0))
    assert busy.estimate() == pytest.approx(sum(s for t, s in seen if t >= clock.t - 5.0) / 5.0)
    clock.t += 5.0
    assert busy.estimate() == 0.0


def test_one_step_in_k_is_timed_and_stands_for_k():
    """sample_every=4: a quarter of the steps record events, and the estimate scales their spans by 4,
    so steps of equal span give the same figure as timing every step."""
    device, clock = FakeDevice(), Clock()
    busy = BusyEstimate(device.event, window_s=5.0, clock=clock, sample_every=4)
    for _ in range(40):  # as above: 30 ms of device time per 100 ms of wall
        _step(busy, device, 30.0, gap_ms=70.0)
        device.done_ms = device.now_ms
        clock.t += 0.1
    assert device.made <= 2 * 10  # ten timed steps, two events each at most (then reused)
    assert busy.estimate() == pytest.approx(0.3)


def test_pairs_not_yet_complete_are_ignored_until_they_are():
    busy, device, clock = _estimator()
    _step(busy, device, 20.0)
    _step(busy, device, 50.0)  # in flight: the device has finished only the first step
    device.done_ms = 20.0
    clock.t += 1.0
    assert busy.estimate() == pytest.approx(0.02 / 1.0)
    device.done_ms = 70.0
    assert busy.estimate() == pytest.approx(0.07 / 1.0)


def test_completion_is_read_in_stream_order():
    """A later pair is not counted before an earlier one, whatever query() would say about it."""
    busy, device, clock = _estimator()
    _step(busy, device, 10.0)
    _step(busy, device, 10.0)
    first = busy._pending[0][1]
    first.query = lambda: False  # the earlier step has not ended on the device
    device.done_ms = 1e9
    clock.t += 1.0
    assert busy.estimate() == 0.0
    del first.query
    assert busy.estimate() == pytest.approx(0.02)


def test_a_step_not_begun_or_begun_twice_counts_once():
    busy, device, clock = _estimator()
    busy.end()  # never begun: ignored
    busy.begin()  # a step whose launch failed: replaced by the next begin
    device.now_ms += 500.0
    _step(busy, device, 40.0)
    device.done_ms = device.now_ms
    clock.t += 2.0
    assert busy.estimate() == pytest.approx(0.04 / 2.0)


def test_the_estimate_is_clamped_and_events_are_reused():
    busy, device, clock = _estimator()
    for _ in range(10):
        _step(busy, device, 100.0)  # spans longer than the wall that passed (clock skew)
        device.done_ms = device.now_ms
        clock.t += 0.01
        assert 0.0 <= busy.estimate() <= 1.0
    assert busy.estimate() == 1.0
    assert device.made <= 4  # a completed pair's events are recorded again


def test_cpu_engine_stats_carry_no_estimate(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_model_dir), device="cpu"))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    stats = engine.get_stats()
    assert "gpu_busy_estimate" in stats and stats["gpu_busy_estimate"] is None


@pytest.mark.serving
def test_the_gauge_skips_a_missing_estimate_and_the_dashboard_shows_it():
    from app.metrics import _GAUGES, ServerMetrics

    name = _GAUGES["gpu_busy_estimate"][0]
    assert name == "minserve_gpu_busy_estimate"
    metrics = ServerMetrics("m")
    values = []
    metrics._gauges["gpu_busy_estimate"].set = values.append
    metrics.update({"num_running": 0, "gpu_busy_estimate": None}, 0)  # CPU
    metrics.update({"num_running": 0}, 0)  # the null core
    metrics.update({"num_running": 0, "gpu_busy_estimate": 0.75}, 0)
    assert values == [0.75]
    board = json.loads((ROOT / "dashboards" / "grafana_minserve.json").read_text())
    exprs = [t["expr"] for p in board["panels"] if p["title"].startswith("GPU busy") for t in p["targets"]]
    assert exprs == [f'ray_{name}{{application=~"$application"}}']
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
