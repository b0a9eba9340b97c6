"""The host-memory tier of the KV cache: which host slots hold which evicted blocks. Pure Python.

A slot holds one block of every layer, found by the same chain hash as in the GPU prefix cache. The
block manager (engine/sched/block_manager.py) decides; the runner's KVOffload (engine/runner/
kv_offload.py) copies. Invariants:
  * A slot's ref_count counts the copies in flight that touch it: 1 while a block is being copied
    into it (offload) and one per copy out of it (reload). A slot with ref_count 0 and a hash is in
    the LRU (`free_cached`, first = evicted first); without a hash it is in `free_uncached`.
  * A hash is findable (`cached`) only once its copy into the slot is complete, so a reload never
    reads a slot that is still being written; a slot being read is never handed out (ref_count > 0).
  * Every copy of a step belongs to one `TierTransfers` batch, in flight until the runner reports it
    complete (`complete`): then the offloaded hashes are published and the slots released. A GPU
    block being copied into is in `loading`, with its batch once the batch is handed to the runner
    (`take`): from then on a step may use the block if its compute waits for that batch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.sched.ref_audit import refcount_problems

UNSENT = -1  # HostTier.loading's batch for a copy not handed to the runner yet


@dataclass
class TierTransfers:
    """One step's copies between the tiers, in the order the runner must perform them (offloads
    first: a GPU block copied out may be the target of a reload of the same batch)."""

    batch: int
    offloads: list[tuple[int, int]] = field(default_factory=list)  # (GPU block, host slot)
    reloads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, GPU block)
    offload_hashes: list[int] = field(default_factory=list)  # the hash of each offload
    reload_hashes: list[int] = field(default_factory=list)  # the hash of each reload

    def __bool__(self) -> bool:
        return bool(self.offloads or self.reloads)


class HostTier:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("kv_offloading_size: the host tier holds no block; raise it or set 0 (off)")
        self.num_slots = num_slots
        self.ref_count = [0] * num_slots
        self.slot_hash: list[int | None] = [None] * num_slots
        self.cached: dict[int, int] = {}  # hash -> slot whose copy is complete
        self.writing: dict[int, int] = {}  # hash -> slot still being written
        self.free_uncached: list[int] = list(range(num_slots - 1, -1, -1))
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self._next = TierTransfers(0)
        self.in_flight: dict[int, TierTransfers] = {}
        self.loading: dict[int, int] = {}  # GPU block -> the batch copying into it (UNSENT: not taken)
        # running totals (engine stats)
        self.queries = 0  # blocks looked up here after a GPU miss
        self.hit_blocks = 0
        self.hit_requests = 0
        self.offloaded_blocks = 0  # copies completed, each way
        self.reloaded_blocks = 0
        self.dropped_blocks = 0  # evicted from the GPU with no slot free to take them

    @property
    def num_used(self) -> int:
        """Slots holding a block or receiving one."""
        return self.num_slots - len(self.free_uncached)

    @property
    def num_referenced(self) -> int:
        """Slots with a copy in flight (0 once every copy is complete)."""
        return sum(1 for r in self.ref_count if r)

    def _take(self, slot: int) -> None:
        if self.ref_count[slot] == 0:
            self.free_cached.pop(slot, None)
        self.ref_count[slot] += 1

    def _release(self, slot: int) -> None:
        self.ref_count[slot] -= 1
        assert self.ref_count[slot] >= 0, f"host slot {slot} released twice"
        if self.ref_count[slot] == 0:
            if self.slot_hash[slot] is not None:
                self.free_cached[slot] = None  # most recently used: evicted last
            else:
                self.free_uncached.append(slot)

    def _allocate(self) -> int | None:
        if self.free_uncached:
            slot = self.free_uncached.pop()
        elif self.free_cached:
            slot, _ = self.free_cached.popitem(last=False)
            del self.cached[self.slot_hash[slot]]
            self.slot_hash[slot] = None
        else:
            return None  # every slot has a copy in flight
        self.ref_count[slot] = 1
        return slot

    # ------------------------------------------------------------------ decisions
    def offer(self, h: int, block: int) -> None:
        """GPU block `block`, holding hash `h`, is being evicted: copy it here unless it already is."""
        slot = self.cached.get(h)
        if slot is not None:
            if self.ref_count[slot] == 0:
                self.free_cached.move_to_end(slot)
            return
        if h in self.writing:
            return
        slot = self._allocate()
        if slot is None:
            self.dropped_blocks += 1
            return
        self.writing[h] = slot
        self.slot_hash[slot] = h
        self._next.offloads.append((block, slot))
        self._next.offload_hashes.append(h)

    def lookup(self, h: int) -> int | None:
        """The slot holding `h`, referenced for a reload (released when the copy completes)."""
        self.queries += 1
        slot = self.cached.get(h)
        if slot is not None:
            self.hit_blocks += 1
            self._take(slot)
        return slot

    def reload(self, slot: int, block: int, h: int) -> None:
        """Copy slot `slot` (referenced by `lookup`) into the freshly allocated GPU block `block`."""
        self._next.reloads.append((slot, block))
        self._next.reload_hashes.append(h)
        self.loading[block] = UNSENT

    def unsent(self, blocks: list[int]) -> bool:
        """Is a copy into one of these GPU blocks not handed to the runner yet?"""
        return bool(self.loading) and any(self.loading.get(b) == UNSENT for b in blocks)

    def batches_of(self, blocks: list[int]) -> set[int]:
        """The batches in flight that copy into these GPU blocks."""
        if not self.loading:
            return set()
        return {self.loading[b] for b in blocks if self.loading.get(b, UNSENT) != UNSENT}

    def take(self) -> TierTransfers | None:
        """This step's copies, now in flight (None: nothing to copy)."""
        batch = self._next
        if not batch:
            return None
        self.in_flight[batch.batch] = batch
        for _, block in batch.reloads:
            self.loading[block] = batch.batch
        self._next = TierTransfers(batch.batch + 1)
        return batch

    def complete(self, batch_id: int) -> TierTransfers:
        """The runner finished a batch's copies: publish the offloaded slots, release the read ones.
        Returns the batch (the block manager publishes and releases its reloaded GPU blocks)."""
        batch = self.in_flight.pop(batch_id)
        for (_, slot), h in zip(batch.offloads, batch.offload_hashes, strict=True):
            del self.writing[h]
            self.cached[h] = slot
            self._release(slot)
        for slot, block in batch.reloads:
            self._release(slot)
            del self.loading[block]
        self.offloaded_blocks += len(batch.offloads)
        self.reloaded_blocks += len(batch.reloads)
        return batch

    def summary_beside(self, stride: int, hashes: list[int], max_hashes: int) -> tuple[int, list, list]:
        """For request routers: the GPU cache's sample (BlockManager.prefix_summary's stride and
        hashes) and this tier's held hashes at the same stride, doubled until both together are at
        most `max_hashes`."""
        host = [h for h in self.cached if h % stride == 0]
        while len(hashes) + len(host) > max_hashes:
            stride *= 2
            hashes, host = [h for h in hashes if h % stride == 0], [h for h in host if h % stride == 0]
        return stride, hashes, host

    # ------------------------------------------------------------------ checks
    def audit(self) -> list[str]:
        """Slot references against the copies in flight, the free lists and the hash maps."""
        expected = [0] * self.num_slots
        for batch in [*self.in_flight.values(), self._next]:
            for _, slot in batch.offloads:
                expected[slot] += 1
            for slot, _ in batch.reloads:
                expected[slot] += 1
        problems = refcount_problems(
            "host slot", self.ref_count, expected, "copies in flight", self.free_uncached, self.free_cached
        )
        for table in (self.cached, self.writing):
            problems += [f"host hash {h} maps to slot {s} holding another" for h, s in table.items()
                         if self.slot_hash[s] != h]  # fmt: skip
        problems += [f"host slot {s} has no hash but is cached" for s in self.free_cached
                     if self.slot_hash[s] is None]  # fmt: skip
        return problems
