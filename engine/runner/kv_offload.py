"""KVOffload: the copies between the GPU KV pool and the host tier (kv_offloading_size).

The block manager decides (engine/sched/host_tier.py): each step's `TierTransfers` lists blocks to copy
out (evicted from the prefix cache) and to copy back (a prompt's prefix found in the tier). This does
the copies and reports when each batch is complete (`poll`).

Layout: host slot s holds one block of all 2L caches (K and V of every layer), [slots, 2L, piece]
bytes. The caches are evenly spaced views of one allocation (allocate_kv_cache), so one strided view
[blocks, 2L, piece] reaches a block in all of them: a batch moves as one gather into a staging buffer
on the device (one kernel, not one per cache) and one copy per run of consecutive slots, and back as
one copy per run and one scatter. Pinned on a GPU host; plain memory on CPU, where the same code runs
synchronously.

Ordering on a GPU (two side streams of high priority, one per direction, so that their small gather
and scatter kernels are not queued behind a step's; the steps run on the current stream):
  * copies out read blocks the step is about to reuse: they start at once (a block in the prefix cache
    is full and never written), and the step's compute waits for them (its writes come after);
  * copies in write freshly allocated blocks, which a step still on the device may have used before
    they were freed: they wait for everything already enqueued on the compute stream, and for the
    batch's copies out (a block copied in may be one just evicted). The step does not wait for them:
    their sequences run in a later step, whose compute waits for them (`wait`), by which time they
    have usually long finished beside the step between. On a stream of their own, a large batch in
    does not hold up the next step's copies out, which that step waits for.
A failed copy raises: the device is gone, and the engine with it.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from engine.runner.kv_cache import KVCacheSpec
from engine.sched.block_manager import BlockManager
from engine.sched.host_tier import TierTransfers

STAGING_BYTES = 128 * 2**20  # the most one gather or scatter stages on the device at once (a gather: twice)


@dataclass
class _InFlight:
    batch: int
    events: list = field(default_factory=list)  # (direction, start, end, bytes) on a GPU


@dataclass
class Direction:
    """Running totals of one direction of copies."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, blocks: int, nbytes: int, seconds: float) -> None:
        self.blocks, self.bytes, self.seconds = (
            self.blocks + blocks,
            self.bytes + nbytes,
            self.seconds + seconds,
        )

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of consecutive slots in `slots`."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, s, 1))
    return runs


def stacked_view(caches: list[torch.Tensor]) -> torch.Tensor | None:
    """[blocks, len(caches), piece] over the caches (each [blocks, piece] bytes) when they are evenly
    spaced in one storage, else None."""
    first = caches[0]
    step = caches[1].data_ptr() - first.data_ptr() if len(caches) > 1 else 0
    same = all(
        c.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and c.data_ptr() == first.data_ptr() + j * step
        and c.stride() == first.stride()
        for j, c in enumerate(caches)
    )
    if not same or step <= 0 or step % first.element_size():
        return None
    blocks, piece = first.shape
    return first.as_strided((blocks, len(caches), piece), (first.stride(0), step, 1))


class KVOffload:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], spec: KVCacheSpec, gib: float):
        first = kv_caches[0][0]
        self.device = first.device
        # every cache as rows of bytes, one row per block (fp8 and bf16 alike)
        self.caches = [c.view(torch.uint8).view(c.shape[0], -1) for pair in kv_caches for c in pair]
        self.piece = self.caches[0].shape[1]
        self.block_bytes = self.piece * len(self.caches)
        self.stacked = stacked_view(self.caches)
        if self.stacked is None:
            raise ValueError(
                "kv_offloading_size: the KV caches must be evenly spaced views of one allocation; "
                "allocate the pool with engine.runner.kv_cache.allocate_kv_cache"
            )
        self.num_slots = int(gib * 2**30) // self.block_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"kv_offloading_size: {gib} GiB holds no KV block ({self.block_bytes} bytes each); "
                "raise it, or set 0 to turn the host tier off"
            )
        cuda = self.device.type == "cuda"
        shape = (self.num_slots, len(self.caches), self.piece)
        self.host = self._host_pool(shape, cuda, gib)
        self.out_stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self.in_stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self.max_staged = max(1, STAGING_BYTES // self.block_bytes)
        self.in_flight: list[_InFlight] = []
        self.out, self.back = Direction(), Direction()  # device to host, host to device

    def _host_pool(self, shape: tuple[int, ...], cuda: bool, gib: float) -> torch.Tensor:
        """Plain memory, page-locked in place on a CUDA host: cudaHostRegister locks exactly its size
        (torch's pinned allocator may round up to a power of two: 24 GiB would lock 32), and copies
        from it are asynchronous. Unlocked when this object goes."""
        pool = torch.empty(shape, dtype=torch.uint8)
        if not cuda:
            return pool
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(pool.data_ptr(), pool.numel(), 0))
        if err:
            raise RuntimeError(
                f"kv_offloading_size: page-locking {gib} GiB of host memory failed (cudaError {err}); "
                "lower it or free host memory"
            )
        weakref.finalize(self, cudart.cudaHostUnregister, pool.data_ptr())
        return pool

    # ------------------------------------------------------------------ copies
    def _index(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.long)
        if self.out_stream is None:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)  # on the current (side) stream

    def copy_out(self, pairs: list[tuple[int, int]]) -> None:
        """GPU blocks into host slots: (block, slot) pairs, gathered per chunk of the staging size."""
        pairs = sorted(pairs, key=lambda p: p[1])
        for i in range(0, len(pairs), self.max_staged):
            part = pairs[i : i + self.max_staged]
            staged = self.stacked[self._index([b for b, _ in part])]
            for first, slot, n in slot_runs([s for _, s in part]):
                self.host[slot : slot + n].copy_(staged[first : first + n], non_blocking=True)

    def copy_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host slots into GPU blocks: (slot, block) pairs, staged per chunk, scattered in one kernel."""
        pairs = sorted(pairs)
        for i in range(0, len(pairs), self.max_staged):
            part = pairs[i : i + self.max_staged]
            staged = torch.empty(
                (len(part), len(self.caches), self.piece), dtype=torch.uint8, device=self.device
            )
            for first, slot, n in slot_runs([s for s, _ in part]):
                staged[first : first + n].copy_(self.host[slot : slot + n], non_blocking=True)
            self.stacked.index_copy_(0, self._index([b for _, b in part]), staged)

    # ------------------------------------------------------------------ batches
    def submit(self, transfers: TierTransfers) -> None:
        """Enqueue one step's copies (before the step's forward is enqueued)."""
        if self.out_stream is None:
            self._submit_sync(transfers)
            return
        compute = torch.cuda.current_stream(self.device)
        after_compute = compute.record_event()  # the steps enqueued so far
        flight = _InFlight(transfers.batch)
        if transfers.offloads:
            with torch.cuda.stream(self.out_stream):
                flight.events.append(self._timed("out", self.out_stream, transfers.offloads, self.copy_out))
            compute.wait_event(flight.events[-1][2])  # the step's writes after the copies out
        if transfers.reloads:
            with torch.cuda.stream(self.in_stream):
                self.in_stream.wait_event(after_compute)
                if transfers.offloads:
                    self.in_stream.wait_event(flight.events[-1][2])
                flight.events.append(self._timed("back", self.in_stream, transfers.reloads, self.copy_in))
        self.in_flight.append(flight)

    def wait(self, batches: set[int]) -> None:
        """The compute stream waits for these batches' copies in (a step reads their blocks)."""
        compute = torch.cuda.current_stream(self.device) if self.in_stream is not None else None
        for flight in self.in_flight:
            if compute is not None and flight.batch in batches:
                for direction, _, end, _ in flight.events:
                    if direction == "back":
                        compute.wait_event(end)

    def _timed(self, direction: str, stream, pairs, copy) -> tuple:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        copy(pairs)
        end.record(stream)
        return direction, start, end, len(pairs)

    def _submit_sync(self, transfers: TierTransfers) -> None:
        for direction, pairs, copy in (("out", transfers.offloads, self.copy_out),
                                       ("back", transfers.reloads, self.copy_in)):  # fmt: skip
            if pairs:
                began = time.perf_counter()
                copy(pairs)
                self._totals(direction).add(
                    len(pairs), len(pairs) * self.block_bytes, time.perf_counter() - began
                )
        self.in_flight.append(_InFlight(transfers.batch))

    def _totals(self, direction: str) -> Direction:
        return self.out if direction == "out" else self.back

    def poll(self) -> list[int]:
        """The batches whose copies are complete, in order (each side stream runs its copies in order)."""
        done = []
        while self.in_flight and all(end.query() for _, _, end, _ in self.in_flight[0].events):
            flight = self.in_flight.pop(0)
            for direction, start, end, n in flight.events:
                seconds = start.elapsed_time(end) / 1e3
                self._totals(direction).add(n, n * self.block_bytes, seconds)
            done.append(flight.batch)
        return done

    def synchronize(self) -> None:
        """Wait for every copy enqueued (tests, benchmarks)."""
        if self.out_stream is not None:
            self.out_stream.synchronize()
            self.in_stream.synchronize()

    def stats(self, bm: BlockManager) -> dict:
        """The tier's figures for engine stats (LLMEngine.get_stats), with the GPU prefix cache's block
        counts beside them (benchmarks take differences between two snapshots)."""
        host = bm.host
        return {
            "prefix_cache_query_blocks": bm.prefix_queries,
            "prefix_cache_hit_blocks": bm.prefix_hits,
            "kv_host_blocks_total": host.num_slots,
            "kv_host_blocks_used": host.num_used,
            "kv_host_hit_blocks": host.hit_blocks,
            "kv_host_hit_requests": host.hit_requests,
            "kv_host_hit_rate": host.hit_blocks / host.queries if host.queries else 0.0,
            "kv_host_dropped_blocks": host.dropped_blocks,
            "kv_offload_blocks": self.out.blocks,
            "kv_offload_bytes": self.out.bytes,
            "kv_offload_gbps": self.out.gbps,
            "kv_offload_seconds": self.out.seconds,
            "kv_reload_blocks": self.back.blocks,
            "kv_reload_bytes": self.back.bytes,
            "kv_reload_gbps": self.back.gbps,
            "kv_reload_seconds": self.back.seconds,
        }
