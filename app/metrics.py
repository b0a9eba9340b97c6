"""Serving metrics through ray.serve.metrics, exported at Ray's metrics port with a `ray_` prefix.

Histograms are observed per request (TTFT, queue time, end-to-end), measured from the moment the ingress
received the request (its time.time(), passed to the engine replica as `arrival_time` and kept by the
engine as RequestMetrics.arrival_time), so they include the HTTP front and the hop to the replica, as a
client sees them. TTFT ends where a client's does: when the ingress hands the response its first
generated text (streaming: the first SSE chunk that carries completion text), so it is observed in the
ingress (`IngressMetrics`), once per request. The engine's own TTFT, from the request's arrival in the
replica to the core sampling its first token (RequestMetrics.engine_token_time), is a histogram of the
engine replica. Inter-token latency is
aggregated per streamed item (chunk): one observation per item, the mean gap between the engine steps
that brought its tokens, so the Ray calls scale with items (at most stream_items_per_s), not tokens.
Each Ray call takes this replica's GIL, and one call per token took a large share of the replica's time
under load (docs/performance.md, ideas tried). The event loop only counts values into local buckets
(`ItlBuckets.add`); a background thread replays them into the Ray histogram every 0.1 s, each bucket's count
at the mean of its values, so bucket counts and the sum stay exact. Counters and gauges come from the engine
core's stats, polled by the engine deployment: counters advance by the difference between two polls of the
engine's running totals, so a poll that is missed or late loses nothing. Ray adds the application,
deployment and replica tags; we add `model`.
Prometheus names (Ray appends `_total` to counters):
ray_minserve_{time_to_first_token,engine_time_to_first_token,inter_token_latency,e2e_request_latency,
queue_time}_seconds,
ray_minserve_{prompt_tokens,generation_tokens,preemptions,aborts,errors}_total,
ray_minserve_{num_running,num_waiting,kv_blocks_used,kv_blocks_total,prefix_cache_hit_rate,
ongoing_requests}; on a GPU ray_minserve_gpu_busy_estimate (docs/operations.md); with speculative
decoding also ray_minserve_spec_{draft_tokens,accepted_tokens,verified_chunks,forced_cuts}_total and
ray_minserve_spec_{acceptance_rate,mean_accepted_length}; with a host KV tier (kv_offloading_size)
ray_minserve_kv_host_{hit_blocks,hit_requests}_total, ray_minserve_kv_{offload,reload}_{blocks,bytes}_total,
ray_minserve_kv_host_{blocks_used,blocks_total,hit_rate} and ray_minserve_kv_{offload,reload}_gbps.
"""

from __future__ import annotations

import bisect
import threading
import time

from ray.serve.metrics import Counter, Gauge, Histogram

from engine.outputs import RequestOutput

# Fine between 10 and 250 ms, where TTFT and queue time mostly fall: a p50 interpolated inside a bucket
# (Prometheus' histogram_quantile) is then within a few ms of the exact one.
_LATENCY_BUCKETS = [
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.045, 0.05, 0.055, 0.06, 0.07, 0.08, 0.09, 0.1,
    0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
]  # fmt: skip
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5]
_E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0]

# stats() key -> counter name; the engine reports running totals since start.
_COUNTERS = {
    "prompt_tokens_total": ("minserve_prompt_tokens", "Prompt tokens processed."),
    "generation_tokens_total": ("minserve_generation_tokens", "Tokens generated."),
    "num_preemptions": ("minserve_preemptions", "Sequences preempted for lack of KV blocks."),
    "num_aborts": ("minserve_aborts", "Requests aborted (client disconnects included)."),
    "num_errors": ("minserve_errors", "Requests that finished with an engine error."),
    "spec_draft_tokens": ("minserve_spec_draft_tokens", "Speculative proposals verified."),
    "spec_accepted_tokens": ("minserve_spec_accepted_tokens", "Speculative proposals accepted."),
    "spec_verify_rows": ("minserve_spec_verified_chunks", "Sequence-steps that verified proposals."),
    "spec_forced_cuts": (
        "minserve_spec_forced_cuts",
        "Verified chunks cut after a forced token (budget forcing, a tool).",
    ),
    "kv_host_hit_blocks": ("minserve_kv_host_hit_blocks", "Prompt blocks found in the host KV tier."),
    "kv_host_hit_requests": ("minserve_kv_host_hit_requests", "Prompts with a block from the host KV tier."),
    "kv_offload_blocks": ("minserve_kv_offload_blocks", "KV blocks copied to the host tier."),
    "kv_offload_bytes": ("minserve_kv_offload_bytes", "Bytes copied to the host KV tier."),
    "kv_reload_blocks": ("minserve_kv_reload_blocks", "KV blocks copied back from the host tier."),
    "kv_reload_bytes": ("minserve_kv_reload_bytes", "Bytes copied back from the host KV tier."),
}
# stats() key -> gauge name
_GAUGES = {
    "num_running": ("minserve_num_running", "Requests being generated."),
    "num_waiting": ("minserve_num_waiting", "Requests queued in the scheduler."),
    "kv_blocks_used": ("minserve_kv_blocks_used", "KV cache blocks in use."),
    "kv_blocks_total": ("minserve_kv_blocks_total", "KV cache blocks in the pool."),
    "spec_acceptance_rate": ("minserve_spec_acceptance_rate", "Accepted / proposed since start."),
    "spec_mean_accepted_length": (
        "minserve_spec_mean_accepted_length",
        "Tokens emitted per verified sequence-step (accepted proposals + 1) since start.",
    ),
    "prefix_cache_hit_rate": (
        "minserve_prefix_cache_hit_rate",
        "Prompt tokens served from the prefix cache.",
    ),
    "kv_host_blocks_used": ("minserve_kv_host_blocks_used", "Host KV tier slots holding a block."),
    "kv_host_blocks_total": ("minserve_kv_host_blocks_total", "Host KV tier slots."),
    "kv_host_hit_rate": (
        "minserve_kv_host_hit_rate",
        "Prompt blocks missed on the GPU and found in the host tier, over those looked up there.",
    ),
    "kv_offload_gbps": ("minserve_kv_offload_gbps", "GB/s of the copies to the host tier since start."),
    "kv_reload_gbps": ("minserve_kv_reload_gbps", "GB/s of the copies back from the host tier since start."),
    "gpu_busy_estimate": (  # None (not exported) without CUDA
        "minserve_gpu_busy_estimate",
        "Share of the last 5 s of wall time the GPU spent inside engine steps (an upper bound of the "
        "kernel-busy share: it counts launch gaps inside eager steps).",
    ),
}


class ItlBuckets:
    """Gaps counted per histogram bucket (count and sum), between two flushes to Ray."""

    def __init__(self, boundaries: list[float]):
        self.boundaries = boundaries
        self._lock = threading.Lock()  # add() runs on the event loop, take() on the stats thread
        self._reset()

    def _reset(self) -> None:
        self._counts = [0] * (len(self.boundaries) + 1)
        self._sums = [0.0] * (len(self.boundaries) + 1)

    def add(self, value: float) -> None:
        i = bisect.bisect_left(self.boundaries, value)  # Prometheus buckets are "<= bound"
        with self._lock:
            self._counts[i] += 1
            self._sums[i] += value

    def take(self) -> list[tuple[float, int]]:
        """(mean gap, count) per non-empty bucket since the last call."""
        with self._lock:
            counts, sums = self._counts, self._sums
            self._reset()
        return [(sums[i] / c, c) for i, c in enumerate(counts) if c]


def _histogram(model_name: str, name: str, text: str, buckets: list[float]) -> Histogram:
    h = Histogram(name, description=text, boundaries=buckets, tag_keys=("model",))
    h.set_default_tags({"model": model_name})  # a fresh dict: Serve adds its own tags in place
    return h


class IngressMetrics:
    """What only the ingress sees: when a response got its first generated text."""

    def __init__(self, model_name: str):
        self.ttft = _histogram(
            model_name,
            "minserve_time_to_first_token_seconds",
            "Ingress arrival to the first generated text handed to the HTTP response.",
            _LATENCY_BUCKETS,
        )

    def first_text(self, arrival_time: float) -> None:
        self.ttft.observe(max(0.0, time.time() - arrival_time))


class ServerMetrics:
    """The engine replica's metrics: per-request histograms and the engine core's stats."""

    def __init__(self, model_name: str):
        def histogram(name: str, text: str, buckets: list[float]) -> Histogram:
            return _histogram(model_name, name, text, buckets)

        self.engine_ttft = histogram(
            "minserve_engine_time_to_first_token_seconds",
            "Engine replica arrival to first token sampled by the engine core.",
            _LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "minserve_inter_token_latency_seconds", "Time between a stream's tokens.", _ITL_BUCKETS
        )
        self._itl_buckets = ItlBuckets(_ITL_BUCKETS)
        self.e2e = histogram(
            "minserve_e2e_request_latency_seconds", "Ingress arrival to finish.", _E2E_BUCKETS
        )
        self.queue = histogram(
            "minserve_queue_time_seconds", "Ingress arrival to first scheduled.", _LATENCY_BUCKETS
        )
        self._counters = {
            key: Counter(name, description=text, tag_keys=("model",))
            for key, (name, text) in _COUNTERS.items()
        }
        self._gauges = {
            key: Gauge(name, description=text, tag_keys=("model",)) for key, (name, text) in _GAUGES.items()
        }
        self.ongoing = Gauge(
            "minserve_ongoing_requests", description="Streams open in this replica.", tag_keys=("model",)
        )
        for metric in [*self._counters.values(), *self._gauges.values(), self.ongoing]:
            metric.set_default_tags({"model": model_name})
        self._last_totals: dict[str, float] = {}

    def observe_finished(self, out: RequestOutput, replica_arrival: float | None = None) -> None:
        """Per-request latencies from the request's timestamps (time.time() in the ingress, the replica
        and the core; differences across hosts are as good as their clocks' agreement, hence the
        clamping at 0). replica_arrival: when the replica got the request, for the engine's own TTFT."""
        m = out.metrics
        if m is None:
            return
        if m.engine_token_time is not None and replica_arrival is not None:
            self.engine_ttft.observe(max(0.0, m.engine_token_time - replica_arrival))
        if m.first_scheduled_time is not None:
            self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))

    def observe_itl(self, seconds: float) -> None:
        """One streamed item's mean inter-token gap."""
        self._itl_buckets.add(seconds)

    def flush_itl(self) -> None:
        for mean, count in self._itl_buckets.take():
            for _ in range(count):
                self.itl.observe(mean)

    def update(self, stats: dict, ongoing: int) -> None:
        """Gauges from one stats() snapshot; counters by the growth of the engine's totals."""
        for key, gauge in self._gauges.items():
            if stats.get(key) is not None:  # absent or None: this engine has no such figure
                gauge.set(float(stats[key]))
        self.ongoing.set(float(ongoing))
        for key, counter in self._counters.items():
            total = float(stats.get(key, 0))
            delta = total - self._last_totals.get(key, 0.0)
            if delta > 0:
                counter.inc(delta)
            self._last_totals[key] = total
