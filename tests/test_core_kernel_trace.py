"""The engine core's kernel-trace window (engine/core/kernel_trace.py: SIGUSR1 starts it, SIGUSR2 stops
it, a JSON file reports the GPU's busy share) and the prefix-cache summary, which the core builds only
for prefix-aware routing.

The union of kernel intervals is checked against a boolean timeline; the window against a real core
process (a CPU engine, which reports why it has no figure) that keeps serving after it; on a GPU, the
busy time of a window against CUDA events around the same work.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from multiprocessing import Pipe

import pytest
import torch

from engine.config import EngineConfig
from engine.core import kernel_trace, process
from engine.core.kernel_trace import KernelTrace, busy_time
from engine.core.messages import Add, Idle, Shutdown, Step
from engine.core.null_engine import NullEngine
from engine.core.process import EngineCore
from engine.core_client import CoreClient
from engine.sampling_params import SamplingParams
from tests.test_engine_core import Collector, wait_for

pytestmark = pytest.mark.engine
FIELDS = {"pid", "window_s", "busy_s", "busy_fraction", "kernels", "device"}
GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------- the union of intervals
def covered(intervals: list[tuple[int, int]]) -> int:
    """Independent reference: the integer points t with start <= t < end for some interval."""
    timeline = [False] * (max((e for _, e in intervals), default=0) + 1)
    for start, end in intervals:
        for t in range(start, end):
            timeline[t] = True
    return sum(timeline)


def test_busy_time_is_the_union_of_the_intervals():
    rng = random.Random(46)
    for _ in range(500):
        intervals = []
        for _ in range(rng.randint(0, 12)):
            start = rng.randint(0, 60)
            intervals.append((start, start + rng.randint(0, 15)))  # empty, nested, touching, overlapping
        assert busy_time(intervals) == covered(intervals), intervals
    assert busy_time([(0.5, 1.0), (0.75, 2.0), (3.0, 3.25)]) == 1.75


def test_decode_profile_uses_the_same_union():
    from benchmarks import decode_profile

    assert decode_profile.busy_time is busy_time


# ---------------------------------------------------------------- the window, in this process
def _read(path) -> dict:
    return json.loads(path.read_text())


def test_a_window_without_cuda_still_writes_its_file(tmp_path):
    trace = KernelTrace(tmp_path)
    trace.requests.extend([True, True, False])  # a second start while open changes nothing
    time.sleep(0.01)  # still queued: only `act` opens and closes windows
    trace.act()
    first = _read(tmp_path / f"kernel_busy_{os.getpid()}_0.json")
    assert set(first) == FIELDS | {"reason"} and first["pid"] == os.getpid()
    assert first["busy_fraction"] is None and first["busy_s"] is None and first["window_s"] >= 0.0
    assert "CPU" in first["reason"] or "null core" in first["reason"]
    trace.requests.append(False)  # a stop with no window open answers too
    trace.act()
    second = _read(tmp_path / f"kernel_busy_{os.getpid()}_1.json")
    assert second["busy_fraction"] is None and "no window" in second["reason"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"kernel_busy_{os.getpid()}_{n}.json" for n in (0, 1)
    ]


def test_a_failing_trace_is_reported_not_raised(tmp_path, monkeypatch):
    """A profiler that cannot start (here: the device fails to drain) costs the loop nothing: the
    window's file says why."""

    def fail() -> None:
        raise RuntimeError("boom")

    fake = type("FakeTorch", (), {"cuda": type("Cuda", (), {"synchronize": staticmethod(fail)})})
    monkeypatch.setattr(kernel_trace, "_cuda_torch", lambda: (fake, None))
    trace = KernelTrace(tmp_path)
    trace.requests.extend([True, False])
    trace.act()
    result = _read(tmp_path / f"kernel_busy_{os.getpid()}_0.json")
    assert result["busy_fraction"] is None and "boom" in result["reason"] and result["window_s"] >= 0.0


# ---------------------------------------------------------------- the window, in a real core process
def test_signals_open_and_close_a_window_and_the_core_keeps_serving(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MINSERVE_TRACE_DIR", str(tmp_path))  # the core inherits this environment
    sink = Collector()
    client = CoreClient(EngineConfig.from_kwargs(str(tiny_model_dir)), sink, prefix_summary=True)
    try:
        pid = client.proc.pid
        for n in range(2):
            os.kill(pid, signal.SIGUSR1)
            rid = client.submit([5 + n] * 40, SamplingParams(max_tokens=8, **GREEDY))
            sink.wait(rid)
            os.kill(pid, signal.SIGUSR2)
            path = tmp_path / f"kernel_busy_{pid}_{n}.json"
            wait_for(path.exists, timeout=30, what=f"window {n}'s file")
            result = _read(path)
            assert set(result) == FIELDS | {"reason"} and result["pid"] == pid
            assert result["busy_fraction"] is None and result["window_s"] > 0.0  # a CPU engine
        rid = client.submit([9] * 20, SamplingParams(max_tokens=5, **GREEDY))
        sink.wait(rid)
        assert sink.finish[rid] == [(0, "length", None)] and len(sink.tokens[f"{rid}/0"]) == 5
        # prefix_summary=True: the core published its cache's hashes (40 tokens: 2 full blocks each)
        wait_for(lambda: len(client.prefix_summary()[1]) >= 4, what="the prefix summary")
        assert client.is_alive()
    finally:
        client.shutdown()


# ---------------------------------------------------------------- what the core's stats carry
def _stats_seen(model_dir, prefix_summary: bool, monkeypatch) -> list[dict]:
    """Every stats snapshot an in-process core (a null engine) sends while serving one request."""
    monkeypatch.setattr(process, "STATS_EVERY_S", 0.0)
    monkeypatch.setattr(process, "SUMMARY_EVERY_S", 0.0)  # the summary would be due on every snapshot
    conn, core_end = Pipe()
    engine = NullEngine(EngineConfig.from_kwargs(str(model_dir)), step_ms=1.0)
    core = EngineCore(engine, core_end, prefix_summary=prefix_summary)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    conn.send([Add("r", [5, 6, 7], SamplingParams(max_tokens=20), time.time())])
    seen, finished = [], False
    while not finished:
        assert conn.poll(30), "the core went quiet"
        message = conn.recv()
        if isinstance(message, Step):
            finished = finished or any(message.records.finished)
            seen += [message.stats] if message.stats is not None else []
        elif isinstance(message, Idle):
            seen.append(message.stats)
    conn.send([Shutdown()])
    thread.join(10)
    return seen


@pytest.mark.parametrize("routing", [False, True])
def test_the_core_builds_the_prefix_summary_only_for_prefix_aware_routing(
    tiny_model_dir, routing, monkeypatch
):
    seen = _stats_seen(tiny_model_dir, routing, monkeypatch)
    assert len(seen) >= 5
    with_summary = ["prefix_summary" in stats for stats in seen]
    assert all(with_summary) if routing else not any(with_summary)


def test_an_idle_core_sends_the_busy_estimate_until_it_has_decayed(tiny_model_dir, monkeypatch):
    """After its Idle message, a core whose stats showed the GPU busy refreshes them (the estimate
    falls as its window passes) and stops once they show 0; a core without an estimate sends none."""
    monkeypatch.setattr(process, "IDLE_POLL_S", 0.01)
    engine = NullEngine(EngineConfig.from_kwargs(str(tiny_model_dir)), step_ms=1.0)
    estimates = iter([0.6, 0.4, 0.2, 0.0])
    plain = engine.get_stats
    engine.get_stats = lambda: {**plain(), "gpu_busy_estimate": next(estimates, 0.0)}
    conn, core_end = Pipe()
    thread = threading.Thread(target=EngineCore(engine, core_end).run, daemon=True)
    thread.start()
    shown = []
    while conn.poll(1.0):  # quiet for a second: the core has stopped sending
        message = conn.recv()
        if isinstance(message, Step | Idle) and message.stats is not None:
            shown.append(message.stats["gpu_busy_estimate"])
    conn.send([Shutdown()])
    thread.join(10)
    assert shown == [0.6, 0.4, 0.2, 0.0]


def test_the_builder_asks_for_the_summary_exactly_when_it_routes_by_prefix(tiny_model_dir):
    pytest.importorskip("ray")
    from app.builder import AppArgs, build_app

    def asked(**args) -> bool:
        app = build_app(AppArgs(model=str(tiny_model_dir), num_gpus=0, **args))
        engine = app._bound_deployment.init_args[0]  # the ingress is bound to the engine application
        return engine._bound_deployment.init_kwargs["prefix_summary"]

    assert asked() is False  # one replica: Serve's own router
    assert asked(num_replicas=2) is True
    assert asked(num_replicas=2, prefix_aware_routing=False) is False
    assert asked(prefix_aware_routing=True) is True


# ---------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_window_measures_the_kernels_between_idle_stretches(tmp_path):
    """Idle, a chain of matmuls, idle: busy time is the chain's device time (CUDA events), the
    fraction that over the window."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()  # warm up the matmul
    trace = KernelTrace(tmp_path)
    trace.start()
    time.sleep(0.2)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(200):
        b = a @ a
    end.record()
    torch.cuda.synchronize()
    chain_s = begin.elapsed_time(end) / 1000.0
    time.sleep(0.2)
    result = trace.stop()
    assert result == _read(tmp_path / f"kernel_busy_{os.getpid()}_0.json") and b is not None
    assert result["kernels"] >= 200 and result["window_s"] >= 0.4 + chain_s
    assert result["busy_s"] == pytest.approx(chain_s, rel=0.05)
    assert result["busy_fraction"] == pytest.approx(result["busy_s"] / result["window_s"])
    assert "reason" not in result and result["device"] == torch.cuda.get_device_name()
