"""The host KV tier (issue 50) in the serving layer: prefix-aware routing counts a replica's host-tier
blocks as cached, at HOST_WEIGHT of a GPU block (fake replicas publish what real ones do:
LLMEngine.prefix_summary's third part, as app/engine_deployment.record_routing_stats passes it on);
the tier's stats reach Prometheus and the Grafana dashboard."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import pytest

from app import routing_table
from app.router import HOST_WEIGHT, PrefixAwareRouter, ReplicaView
from engine import prompt_block_hashes as block_hashes
from tests.conftest import ROOT

pytestmark = pytest.mark.serving
BS = 16


class _Loads:
    def __init__(self, loads: dict):
        self.loads = loads

    def get(self, replica_id):
        return self.loads.get(replica_id)


def _replica(name: str, gpu: list[int], host: list[int]) -> SimpleNamespace:
    stats = {"prefix_stride": 1, "prefix_hashes": gpu, "prefix_host_hashes": host, "device": name}
    return SimpleNamespace(replica_id=name, routing_stats=stats)


def test_host_tier_blocks_count_at_a_lower_weight_than_gpu_blocks():
    rng = random.Random(4)
    ids = [rng.randrange(8, 30000) for _ in range(8 * BS + 5)]
    keys = block_hashes(ids, BS, 256)
    view = ReplicaView(max_recent=10)
    view.refresh(_replica("a", keys[:3], keys[2:8]).routing_stats)
    assert view.held(keys, now=0.0, recent_s=1.0) == 3 + HOST_WEIGHT * 5
    view.refresh(_replica("b", [], keys).routing_stats)
    assert view.held(keys, now=0.0, recent_s=1.0) == HOST_WEIGHT * 8 < 8

    router = object.__new__(PrefixAwareRouter)  # the decision logic only: no Serve handle behind it
    router.initialize_state()
    router._replica_queue_len_cache = _Loads({"gpu": 3, "host": 2, "none": 1})
    gpu, host, none = _replica("gpu", keys, []), _replica("host", [], keys), _replica("none", [], [])
    try:
        # the host tier beats recomputing everywhere; the GPU beats the host tier
        assert router.rank([host, none], keys) == ("cache_hit", [host, none])
        assert router.rank([gpu, host, none], keys) == ("cache_hit", [gpu, host, none])
    finally:
        routing_table.UNSTARTED.clear()
        routing_table.PENDING_BLOCKS.clear()


TIER_STATS = {  # as LLMEngine.get_stats reports them with the tier on (tests/test_kv_offload.py)
    "kv_host_blocks_total": 100, "kv_host_blocks_used": 40, "kv_host_hit_blocks": 30,
    "kv_host_hit_requests": 5, "kv_host_hit_rate": 0.6, "kv_host_dropped_blocks": 0,
    "kv_offload_blocks": 50, "kv_offload_bytes": 5000, "kv_offload_gbps": 20.5,
    "kv_reload_blocks": 30, "kv_reload_bytes": 3000, "kv_reload_gbps": 25.0,
}  # fmt: skip


def test_the_tier_stats_reach_prometheus_and_the_dashboard():
    from app.metrics import _COUNTERS, _GAUGES, ServerMetrics

    metrics = ServerMetrics("m")
    seen: dict[str, float] = {}
    for key, gauge in metrics._gauges.items():
        gauge.set = lambda value, key=key: seen.__setitem__(key, value)
    for key, counter in metrics._counters.items():
        counter.inc = lambda value, key=key: seen.__setitem__(key, seen.get(key, 0) + value)
    metrics.update({"num_running": 0, **TIER_STATS}, 0)
    exported = {k for k in TIER_STATS if k in seen}
    assert exported == set(TIER_STATS) - {"kv_host_dropped_blocks"}
    assert seen["kv_reload_bytes"] == 3000 and seen["kv_offload_gbps"] == 20.5
    names = {f"ray_{_GAUGES[k][0]}" for k in TIER_STATS if k in _GAUGES}
    names |= {f"ray_{_COUNTERS[k][0]}_total" for k in TIER_STATS if k in _COUNTERS}
    board = json.loads((ROOT / "dashboards" / "grafana_minserve.json").read_text())
    exprs = " ".join(
        t["expr"] for p in board["panels"] if p["title"].startswith("Host KV tier") for t in p["targets"]
    )
    shown = set(re.findall(r"ray_minserve_kv_\w+", exprs))
    assert shown and shown <= names | {"ray_minserve_prefix_cache_hit_rate"}
    assert {
        "ray_minserve_kv_reload_gbps",
        "ray_minserve_kv_offload_gbps",
        "ray_minserve_kv_host_hit_rate",
    } <= shown
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_the_benchmark_report_reads_the_window_from_two_stats_snapshots():
    from benchmarks.kv_offload_bench import acceptance, markdown, window_stats

    before = {"prefix_cache_query_blocks": 100, "prefix_cache_hit_blocks": 40, "kv_reload_bytes": 10**9,
              "kv_reload_seconds": 1.0, "kv_host_hit_blocks": 5}  # fmt: skip
    after = {**TIER_STATS, "prefix_cache_query_blocks": 300, "prefix_cache_hit_blocks": 140,
             "kv_reload_bytes": 3 * 10**9, "kv_reload_seconds": 1.1, "kv_host_hit_blocks": 85,
             "num_preemptions": 2}  # fmt: skip
    w = window_stats(before, after)
    assert w["gpu_hit_rate"] == 0.5 and w["host_hit_rate_of_gpu_misses"] == 0.8
    assert abs(w["reload_gbps"] - 20.0) < 1e-9 and w["num_preemptions"] == 2
    summary = lambda ttft, tok_s: {  # noqa: E731
        "ttft_ms": {"p50": ttft},
        "ttft_ms_later_turns": {"p50": ttft},
        "output_tok_s": tok_s,
        "requests": 9,
    }
    off = {"variant": "off", "summary": summary(300.0, 1000.0), "window": window_stats({}, {}),
           "live_kv_over_gpu_pool": 3.5}  # fmt: skip
    on = {"variant": "on", "summary": summary(100.0, 1500.0), "window": w, "live_kv_over_gpu_pool": 3.6}
    runs = [off, on]
    report = {"runs": runs, "plain_h2d": {"gbps": 25.0, "bytes": 2 * 10**9, "kind": "pinned"}}
    acc = acceptance(report)
    assert acc["ttft_speedup"] == 3.0 and acc["tok_s_speedup"] == 1.5 and acc["pass"]
    assert abs(acc["h2d_share"] - 0.8) < 1e-9
    report.update(acceptance=acc, model="m", device="cuda", command="c", gpu_pool_gib=4.0, num_blocks=8192,
                  tier_gib=24.0, settings={"users": 256, "duration": 90.0})  # fmt: skip
    text = markdown(report)
    assert "| on | 100.0 | 100.0 | 1500 |" in text and "PASS" in text


@pytest.mark.slow
def test_the_benchmark_smoke_serves_w4_with_the_tier_off_and_on(tmp_path):
    """benchmarks/kv_offload_bench.py --smoke end to end (two `serve run`s of the tiny model; make
    test-long): both variants measured, the tier used in the 'on' one only."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "benchmarks.kv_offload_bench",
        "--smoke",
        "--port",
        "8352",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "kv_offload.json").read_text())
    runs = {r["variant"]: r for r in report["runs"]}
    assert "error" not in runs["off"] and "error" not in runs["on"], report["runs"]
    assert runs["off"]["window"]["kv_reload_blocks"] == 0 and runs["on"]["window"]["kv_reload_blocks"] > 0
    assert runs["on"]["summary"]["max_turn"] >= 2 and report["plain_h2d"]["gbps"] > 0
    assert (tmp_path / "kv_offload.md").read_text().startswith("# Host KV tier")
