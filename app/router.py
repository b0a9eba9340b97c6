"""Prefix-aware routing of engine calls, on Ray Serve's RequestRouter API (Serve still does the routing).

A request whose leading KV blocks a replica already holds skips their prefill there, so a shared system
prompt or a multi-turn chat should land where its blocks are. Serve's default power-of-two router
ignores that. This router scores each candidate replica by how many of the request's leading blocks it
holds, using the engine's own block hashes (engine/sched/block_manager.chain_hash over the prompt's token
ids after the chat template, computed by the ingress: app/prefix_keys.py).
  * When the best holder holds at most `min_gain` (a quarter) of the request's blocks more than the
    least loaded replica, the cache would save little of this prompt: the least loaded replica takes
    it, as under Serve's default (ties: less work ahead, then more held, then sent fewer blocks).
    Without this, a multi-turn load whose shared prompt every replica already holds crowded each
    conversation onto one replica for a few blocks of history (benchmarks/reports/gpu/prefix_routing*).
  * Otherwise a request's first token waits for the prefill queued ahead of it on its replica's
    accelerator and then for its own uncached blocks, so the router picks the replica with the least
    of work ahead (blocks routed to the replicas on its GPU, not started yet: app/routing_table.py)
    + the request's blocks that replica does not hold, ties to the one holding more, then the less
    loaded.
The decision is recorded as
  cache_hit  the replica chosen holds the most of the request's blocks (more than none);
  balanced   any other choice: nobody holds a block (the chosen one becomes the prefix's home), the
             gain is small, or the work queued at the holder outweighs the prefill its cache saves;
  fallback   the holder chosen by work ahead has a load above the least loaded one's by more than
             `imbalance_abs` requests and by more than `imbalance_rel` times: power of two choices.
             A guard against load the work estimate cannot see (long decodes, another ingress's
             requests); a GPU replica runs hundreds of streams, so the margin is wide.
Replicas that share an accelerator (fractional num_gpus, or CPU replicas of one host) add up their
work ahead: with one GPU split in two, the holder's prefill queue is the other replica's queue too.
A request for a LoRA adapter (Serve's multiplexed model id: its name) first goes to a replica that
holds the adapter, else to one of those holding the fewest adapters (app/adapter_affinity.py); the
prefix decides among those, and the others follow in order of load. Its prefix hashes start from the
adapter (app/prefix_keys.py), so prefixes of different adapters never match each other.
Calls without hashes or adapter (stats, info, tokenize) go by power of two choices. An
`abort(request_ids)` goes to the replica its first id was routed to: the ingress groups its aborts by
`routing_table.replica_of` (the router runs inside the ingress's process, in its handle;
app/routing_table.py says why the tables live there).

What a replica holds comes from two sources:
  * its `record_routing_stats` (engine/sched/block_manager.prefix_summary): a sample of its cached block
    hashes, those h with h % stride == 0 (about 4096 of them whatever the pool), refreshed every
    `request_routing_stats_period_s` (1 s) plus the controller's broadcast delay; a held prefix is
    found to within `stride` blocks;
  * the hashes this router sent there in the last `recent_s` seconds, which covers that delay.
Load is Serve's cached queue length for the replica when it has one, else the replica's published
running + waiting count. Chain hashes use Python's tuple hash of ints, which is the same in every
process of one Python version: every node of a cluster must run the same Python.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)
from ray.util.metrics import Counter as MetricCounter

from app import routing_table  # shared state: through the module, never copied (app/routing_table.py)
from app.adapter_affinity import AdapterLRU, choose_group

HASHES_KWARG = "prefix_hashes"  # generate(..., prefix_hashes=[...]): the request's leading chain hashes
# what a block held in a replica's host KV tier (kv_offloading_size) counts for, a GPU block counting 1:
# it saves the block's prefill but costs a copy over PCIe, and may be evicted before the request comes
HOST_WEIGHT = 0.5


def _adapter_of(pending_request: PendingRequest | None) -> str:
    """The LoRA adapter a call is for: Serve's multiplexed model id ("" for none)."""
    metadata = getattr(pending_request, "metadata", None)
    return getattr(metadata, "multiplexed_model_id", "") or ""


class ReplicaView:
    """What one replica holds, as far as this router knows."""

    def __init__(self, max_recent: int, max_adapters: int = 0):
        self.max_recent = max_recent
        self.adapters = AdapterLRU(max_adapters)
        self.recent: OrderedDict[int, float] = OrderedDict()  # hash -> when this router sent it there
        self._stats_seen: object = None
        self.stride, self.published = 1, frozenset()
        self.host_published: frozenset[int] = frozenset()  # sampled at the same stride
        self.device: str | None = None  # the accelerator it runs on, once it has published

    def refresh(self, stats: dict) -> None:
        if stats is not self._stats_seen and "prefix_hashes" in stats:  # a new publication
            self._stats_seen = stats
            self.stride, self.published = stats["prefix_stride"], frozenset(stats["prefix_hashes"])
            self.host_published = frozenset(stats.get("prefix_host_hashes", ()))
            self.device = stats.get("device")

    def sent(self, hashes: list[int], now: float) -> None:
        for h in hashes:
            self.recent[h] = now
            self.recent.move_to_end(h)
        while len(self.recent) > self.max_recent:
            self.recent.popitem(last=False)

    def held(self, hashes: list[int], now: float, recent_s: float) -> float:
        """Leading blocks of `hashes` this replica holds: the last position found, since a block is
        cached only with every block before it (chain hashes). Blocks past the last one found on the
        GPU (or sent recently) up to the last one found in the host tier count HOST_WEIGHT each."""
        gpu = host = 0
        for i, h in enumerate(hashes):
            sampled = h % self.stride == 0
            if (sampled and h in self.published) or self.recent.get(h, -math.inf) > now - recent_s:
                gpu = host = i + 1
            elif sampled and h in self.host_published:
                host = i + 1
        return gpu + HOST_WEIGHT * (host - gpu)


class PrefixAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Not FIFO (unlike Serve's default): a replica chosen for a request must go to that request, which
    is RequestRouter's own matching by request id; FIFOMixin would hand it to the oldest one waiting."""

    def initialize_state(
        self,
        imbalance_abs: int = 32,
        imbalance_rel: float = 1.5,
        min_gain: float = 0.25,
        recent_s: float = 5.0,
        max_recent: int = 65536,
        max_adapters: int = 0,
    ) -> None:
        """max_adapters: the adapters a replica holds at most (max_cpu_loras; 0: no LoRA)."""
        self.imbalance_abs, self.imbalance_rel, self.min_gain = imbalance_abs, imbalance_rel, min_gain
        self.recent_s, self.max_recent, self.max_adapters = recent_s, max_recent, max_adapters
        self.views: dict[ReplicaID, ReplicaView] = {}
        self._metric = MetricCounter(
            "minserve_routing_decisions",
            description="Engine calls routed, by decision: cache_hit, balanced or fallback (app/router.py).",
            tag_keys=("decision",),
        )

    def _view(self, replica: RunningReplica) -> ReplicaView:
        view = self.views.get(replica.replica_id)
        if view is None:
            view = self.views[replica.replica_id] = ReplicaView(self.max_recent, self.max_adapters)
        view.refresh(replica.routing_stats or {})
        return view

    def _load(self, replica: RunningReplica) -> int:
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        if queued is not None:
            return queued
        stats = replica.routing_stats or {}
        return stats.get("num_running", 0) + stats.get("num_waiting", 0)

    def _work_ahead(self, candidates: list[RunningReplica], views: list[ReplicaView]) -> list[int]:
        """Pending prefill blocks on each candidate's accelerator (summed over replicas sharing it)."""
        devices = [v.device or r.replica_id for v, r in zip(views, candidates, strict=True)]
        per_device: dict[object, int] = {}
        for d, r in zip(devices, candidates, strict=True):
            per_device[d] = per_device.get(d, 0) + routing_table.pending_blocks(r.replica_id)
        return [per_device[d] for d in devices]

    def rank(self, candidates: list[RunningReplica], hashes: list[int]) -> tuple[str, list[RunningReplica]]:
        """(decision, replicas best first); an empty list means: use power of two choices."""
        now = time.monotonic()
        views = [self._view(r) for r in candidates]
        held = [v.held(hashes, now, self.recent_s) for v in views]
        loads = [self._load(r) for r in candidates]
        ahead = self._work_ahead(candidates, views)
        order = range(len(candidates))
        tie = [(len(v.recent), random.random()) for v in views]
        least = min(order, key=lambda i: (loads[i], ahead[i], -held[i], tie[i]))
        most = max(held)
        if most - held[least] <= self.min_gain * len(hashes):
            best = least  # the cache would save little of this prompt: balance the load
        else:
            best = min(order, key=lambda i: (ahead[i] + len(hashes) - held[i], -held[i], loads[i], tie[i]))
            if held[best] == most and self._imbalanced(loads[best], loads[least]):
                return "fallback", []
        ranked = [candidates[best]] + [r for i, r in enumerate(candidates) if i != best]
        return ("cache_hit" if most > 0 and held[best] == most else "balanced"), ranked

    def _imbalanced(self, load: int, least: int) -> bool:
        """A replica this far above the least loaded one gives way to load balance."""
        return load - least > self.imbalance_abs and load > self.imbalance_rel * least

    def route(
        self, candidates: list[RunningReplica], hashes: list[int], adapter: str
    ) -> list[RunningReplica]:
        """Replicas best first for a request with prefix hashes and/or an adapter; [] for power of two."""
        group, rest = candidates, []
        if adapter:
            now = time.monotonic()
            holdings = [
                self._view(r).adapters.known(r.multiplexed_model_ids, now, self.recent_s) for r in candidates
            ]
            loads = [self._load(r) for r in candidates]
            decision, group = choose_group(candidates, holdings, loads, adapter, self._imbalanced)
            routing_table.ADAPTER_DECISIONS[decision] += 1
            rest = sorted((r for r in candidates if r not in group), key=self._load)
        ranked: list[RunningReplica] = []
        if hashes:
            decision, ranked = self.rank(group, hashes)
            routing_table.DECISIONS[decision] += 1
            self._metric.inc(tags={"decision": decision})
        if not ranked and adapter:  # no prefix, or its holder is overloaded: the least loaded of the group
            ranked = sorted(group, key=lambda r: (self._load(r), random.random()))
        return ranked + rest if ranked else []

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        hashes = kwargs.get(HASHES_KWARG)
        adapter = _adapter_of(pending_request)
        if (hashes or adapter) and candidate_replicas:
            ranked = self.route(candidate_replicas, hashes or [], adapter)
            if ranked:
                return [[r] for r in ranked]
        elif kwargs.get("request_ids"):  # an abort: where its first request went
            target = routing_table.replica_of(kwargs["request_ids"][0])
            ranked = [r for r in candidate_replicas if r.replica_id == target]
            if ranked:
                return [ranked, [r for r in candidate_replicas if r.replica_id != target]]
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        kwargs = pending_request.kwargs
        hashes = kwargs.get(HASHES_KWARG)
        now = time.monotonic()
        view = self.views.get(replica_id)
        adapter = _adapter_of(pending_request)
        if adapter and view is not None:
            view.adapters.sent(adapter, now)
        if not hashes:
            return
        # the blocks it must prefill there (+1: the prompt's tail, which no full-block hash covers)
        missing = len(hashes) + 1 - (view.held(hashes, now, self.recent_s) if view is not None else 0)
        if view is not None:
            view.sent(hashes, now)
        rid = kwargs.get("request_id")
        if rid is not None:
            routing_table.routed(rid, replica_id, missing)
