"""Paged KV-cache bookkeeping: which physical blocks each sequence owns. Pure Python, no torch.

Invariants
  * Block `b` holds positions [i * block_size, (i + 1) * block_size) of every sequence whose
    block_table[i] == b. ref_count[b] is the number of such sequences.
  * A block with ref_count 0 is free. Free blocks that still carry a content hash stay findable in the
    prefix cache until they are evicted (LRU: least recently freed first); free blocks without a hash
    are always handed out before any cached block is evicted.
  * Only *full* blocks whose tokens are all computed are hashed. The hash chains the previous block's
    hash with this block's token ids, so equal hashes mean equal whole prefixes. A LoRA adapter's
    chain starts from the adapter's seed (`adapter_seed`), so two adapters never share a block.
  * With a host tier (engine/sched/host_tier.py), a cached block evicted here is offered to it, and
    match_prefix continues a prefix there: a block found only in the tier is allocated here and
    copied back, the copy holding one reference until the runner reports it complete; its hash is
    published here only then. The table holding it is scheduled only once the copy is handed to the
    runner (`is_loading`), in a step whose compute waits for it (`copies_in_flight`).
  * A sequence never writes into a block it shares (ref_count > 1): `prepare_append` replaces such a
    block by a private copy first (copy-on-write) and reports the copy for the runner to perform.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.sched.host_tier import HostTier, TierTransfers
from engine.sched.ref_audit import refcount_problems


def chain_hash(parent: int | None, tokens: Seq[int]) -> int:
    """Content hash of one full block given the hash of the block before it (None for the first).

    Equal in every process of one Python version (request routers compute it in another process than
    the engine's): a tuple of ints hashes without per-process salt, but hash(None) is an address
    before Python 3.12, so the first block chains from -1, a value hash() never returns."""
    return hash((-1 if parent is None else parent, tuple(tokens)))


def adapter_seed(lora_request) -> int | None:
    """Where the hash chain of a request's blocks starts: None for the base model; for a LoRA adapter
    (an engine.LoRARequest), a value of its name, id and path, the same in every process (a router
    computes it in another), non-negative (so never the base chain's -1)."""
    if lora_request is None:
        return None
    r = lora_request
    key = f"{r.lora_name}\0{r.lora_int_id}\0{r.lora_path}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def prompt_block_hashes(
    token_ids: Seq[int], block_size: int, max_blocks: int, lora_request=None
) -> list[int]:
    """The chain hashes of the blocks `match_prefix` could find for this prompt: (len - 1) //
    block_size of them (the last token is always computed), at most `max_blocks`. Request routers use
    them as the prompt's key (app/router.py). lora_request: the request's adapter (None: base model)."""
    hashes: list[int] = []
    parent = adapter_seed(lora_request)
    for i in range(min((len(token_ids) - 1) // block_size, max_blocks)):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


@dataclass
class BlockTable:
    """One sequence's view of the pool: its physical blocks and the hashes of its full prefix blocks."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hashes[i] is the chain hash of blocks[i]
    # Bumped by every change other than an append (a copy-on-write, a trim, a free), so a copy of the
    # table made at one epoch stays a valid prefix of it while the epoch holds
    # (engine/runner/table_mirror.py).
    epoch: int = 0

    def copy(self) -> BlockTable:
        return BlockTable(list(self.blocks), list(self.hashes))


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, host_blocks: int = 0
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # content hash -> block id
        self.free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order: first = evicted first
        self.prefix_queries = 0  # blocks looked up in the prefix cache
        self.prefix_hits = 0
        # the host tier (kv_offloading_size): None when off; a tier serves only the prefix cache
        self.host = HostTier(host_blocks) if host_blocks and enable_prefix_caching else None

    # ------------------------------------------------------------------ capacity
    @property
    def num_free(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """New blocks a sequence needs to hold `num_tokens` positions (copy-on-write not counted)."""
        return max(0, -(-num_tokens // self.block_size) - len(table.blocks))

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, table: BlockTable, token_ids: Seq[int], seed: int | None = None) -> int:
        """Attach cached full blocks matching the start of `token_ids` to an empty table.

        At most (len - 1) // block_size blocks are matched, so the last token is always computed
        (its logits are needed) and no matched block is ever written to. Returns cached tokens.
        seed: the chain's start (adapter_seed of the request's adapter; None: the base model).
        """
        assert not table.blocks, "match_prefix needs an empty block table"
        if not self.enable_prefix_caching:
            return 0
        parent, reloads, blocks = seed, 0, -(-len(token_ids) // self.block_size)
        for i in range((len(token_ids) - 1) // self.block_size):
            self.prefix_queries += 1
            h = chain_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.cached.get(h)
            if block is not None:
                self.prefix_hits += 1
                self._take(block)
            elif (block := self._reload(h, blocks - len(table.blocks))) is None:
                break
            else:
                reloads += 1
            table.blocks.append(block)
            table.hashes.append(h)
            parent = h
        if reloads:
            self.host.hit_requests += 1
        return len(table.blocks) * self.block_size

    # ------------------------------------------------------------------ host tier
    def _reload(self, h: int, need: int) -> int | None:
        """A GPU block for hash `h`, to be copied back from the host tier (None: not there, or fewer
        than `need` free blocks here, the rest of the prompt's: a sequence that could not run once
        loaded would hold its blocks idle). Two references: the copy's (until complete_transfers) and
        the table's."""
        if self.host is None or self.num_free < need:
            return None
        slot = self.host.lookup(h)
        if slot is None:
            return None
        block = self._allocate()  # may evict (and offer) a cached block; `slot` is referenced
        self.ref_count[block] += 1
        self.host.reload(slot, block, h)
        return block

    def is_loading(self, table: BlockTable) -> bool:
        """Must the table wait: is a copy into one of its blocks not handed to the runner yet?"""
        return self.host is not None and self.host.unsent(table.blocks)

    def copies_in_flight(self, table: BlockTable) -> set[int]:
        """The batches of copies into the table's blocks not complete yet: a step that reads those
        blocks must wait for them."""
        return self.host.batches_of(table.blocks) if self.host is not None else set()

    def take_transfers(self) -> TierTransfers | None:
        """The copies between tiers decided since the last call, for the step being scheduled."""
        return self.host.take() if self.host is not None else None

    def complete_transfers(self, batch_ids: list[int]) -> None:
        """The runner finished these batches: reloaded blocks get their hash and lose the copy's
        reference (an aborted owner's block stays cached); offloaded slots become findable."""
        for batch_id in batch_ids:
            batch = self.host.complete(batch_id)
            for (_, block), h in zip(batch.reloads, batch.reload_hashes, strict=True):
                if h not in self.cached and self.block_hash[block] is None:
                    self.cached[h] = block
                    self.block_hash[block] = h
                self._release(block)

    def register_full_blocks(
        self, table: BlockTable, token_ids: Seq[int], num_computed: int, seed: int | None = None
    ) -> None:
        """Hash every block that is now full of computed tokens and publish it in the prefix cache
        (seed: as in match_prefix)."""
        if not self.enable_prefix_caching:
            return
        full = min(num_computed // self.block_size, len(table.blocks))
        for i in range(len(table.hashes), full):
            parent = table.hashes[i - 1] if i else seed
            h = chain_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            table.hashes.append(h)
            block = table.blocks[i]
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h

    def prefix_summary(self, max_hashes: int) -> tuple[int, list[int]]:
        """(stride, hashes): the cached blocks' chain hashes h with h % stride == 0, stride the smallest
        power of two that leaves at most `max_hashes` of them. For request routers (app/router.py): a
        request's leading chain hashes that fall on the stride are looked up in it, which finds the
        longest prefix held to within about `stride` blocks, at a size bounded whatever the pool."""
        stride, hashes = 1, list(self.cached)
        while len(hashes) > max_hashes:  # never truncated: that would drop the newest blocks
            stride *= 2
            hashes = [h for h in hashes if h % stride == 0]
        return stride, hashes

    # ------------------------------------------------------------------ allocation
    def _take(self, block: int) -> None:
        """Add one reference; a free cached block leaves the LRU list."""
        if self.ref_count[block] == 0:
            self.free_cached.pop(block, None)
        self.ref_count[block] += 1

    def _allocate(self) -> int:
        if self.free_uncached:
            block = self.free_uncached.pop()
        elif self.free_cached:
            block, _ = self.free_cached.popitem(last=False)  # evict the least recently freed
            h = self.block_hash[block]
            del self.cached[h]
            self.block_hash[block] = None
            if self.host is not None:  # copied out before any write of the step that reuses it
                self.host.offer(h, block)
        else:
            raise NoFreeBlocksError("KV pool exhausted")
        self.ref_count[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, f"block {block} released twice"
        if self.ref_count[block] == 0:
            if self.block_hash[block] is not None:
                self.free_cached[block] = None
            else:
                self.free_uncached.append(block)

    def can_append(self, table: BlockTable, start: int, num_new: int) -> bool:
        """Would prepare_append(table, start, num_new) succeed right now?"""
        if num_new == 1 and start // self.block_size < len(table.blocks):
            # the decode fast path: one token into an existing block, which must not be shared
            return self.ref_count[table.blocks[start // self.block_size]] == 1 or self.num_free > 0
        return self.append_cost(table, start, num_new) <= self.num_free

    def append_cost(self, table: BlockTable, start: int, num_new: int) -> int:
        """Free blocks prepare_append(table, start, num_new) takes: new ones and copies of shared ones."""
        i = start // self.block_size
        if num_new == 1 and i < len(table.blocks):  # the decode fast path: at most a copy of its block
            return 0 if self.ref_count[table.blocks[i]] == 1 else 1
        need = self.blocks_needed(table, start + num_new)
        return need + len(self._shared_in_range(table, start, start + num_new))

    def _shared_in_range(self, table: BlockTable, start: int, end: int) -> list[int]:
        """Indices of existing table entries that positions [start, end) would write and that are shared."""
        first, last = start // self.block_size, min((end - 1) // self.block_size, len(table.blocks) - 1)
        return [i for i in range(first, last + 1) if self.ref_count[table.blocks[i]] > 1]

    def prepare_append(self, table: BlockTable, start: int, num_new: int) -> list[tuple[int, int]]:
        """Make positions [start, start + num_new) writable: copy shared blocks, add missing blocks.

        Returns (src, dst) block copies the runner must perform before the forward pass.
        """
        if num_new == 1 and start // self.block_size < len(table.blocks):
            if self.ref_count[table.blocks[start // self.block_size]] == 1:
                return []  # the decode fast path: nothing to allocate or copy
        if not self.can_append(table, start, num_new):
            raise NoFreeBlocksError("KV pool exhausted")
        copies = []
        for i in self._shared_in_range(table, start, start + num_new):
            src = table.blocks[i]
            dst = self._allocate()
            self._release(src)
            table.blocks[i] = dst
            table.epoch += 1
            del table.hashes[i:]  # a written block is no longer the hashed one
            copies.append((src, dst))
        for _ in range(self.blocks_needed(table, start + num_new)):
            table.blocks.append(self._allocate())
        return copies

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` positions: after speculative verification
        they hold only rejected draft tokens (never hashed: a hashed block is full of verified tokens)."""
        keep = -(-num_tokens // self.block_size)
        if len(table.blocks) > keep:
            table.epoch += 1
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())
        del table.hashes[keep:]

    def fork(self, table: BlockTable) -> BlockTable:
        """A child sharing every block of `table` (n > 1 samples: prefill once, then replicate)."""
        for block in table.blocks:
            self._take(block)
        return table.copy()

    def free(self, table: BlockTable) -> None:
        """Drop the table's references, tail first so a prefix outlives its tail in the LRU order."""
        for block in reversed(table.blocks):
            self._release(block)
        table.blocks.clear()
        table.hashes.clear()
        table.epoch += 1

    # ------------------------------------------------------------------ checks
    def audit(self, live_tables: list[BlockTable]) -> list[str]:
        """Compare reference counts with the live tables and the copies in flight from the host tier;
        any difference is a leak or a double free. Covers the host tier's slots too."""
        expected = [0] * self.num_blocks
        for table in live_tables:
            for block in table.blocks:
                expected[block] += 1
        for block in self.host.loading if self.host is not None else ():
            expected[block] += 1  # the copy's reference
        problems = refcount_problems(
            "block", self.ref_count, expected, "live references", self.free_uncached, self.free_cached
        )
        return problems + (self.host.audit() if self.host is not None else [])
