"""Block manager unit behaviour: refcounts, prefix hashing, LRU eviction, copy-on-write, audit."""

from __future__ import annotations

import pytest

from engine.sched.block_manager import BlockManager, BlockTable, NoFreeBlocksError

pytestmark = pytest.mark.engine


def test_prefix_blocks_are_shared_and_evicted_lru():
    bm = BlockManager(num_blocks=6, block_size=4)
    tokens = list(range(12))
    a = BlockTable()
    bm.prepare_append(a, 0, 12)
    bm.register_full_blocks(a, tokens, 12)
    b = BlockTable()
    assert bm.match_prefix(b, tokens + [99]) == 12  # three full blocks reused
    assert b.blocks == a.blocks and all(bm.ref_count[x] == 2 for x in a.blocks)
    a_blocks = list(a.blocks)
    bm.free(a)
    bm.free(b)
    assert bm.num_used == 0 and bm.audit([]) == []
    c = BlockTable()
    bm.prepare_append(c, 0, 16)  # 3 uncached free blocks first, then evicts the LRU cached block
    assert set(c.blocks) & set(a_blocks) == {a_blocks[2]}
    d = BlockTable()
    # the tail block (freed first) was evicted; the first two prefix blocks survive
    assert bm.match_prefix(d, tokens + [1]) == 8


def test_copy_on_write_for_forked_tables():
    bm = BlockManager(num_blocks=4, block_size=4)
    parent = BlockTable()
    bm.prepare_append(parent, 0, 6)  # blocks for positions 0..5, block 1 is partial
    child = bm.fork(parent)
    copies = bm.prepare_append(child, 6, 1)  # child writes position 6 into the shared partial block
    assert copies == [(parent.blocks[1], child.blocks[1])] and child.blocks[0] == parent.blocks[0]
    assert bm.prepare_append(parent, 6, 1) == []  # now private to the parent: written in place
    assert bm.audit([parent, child]) == []
    bm.free(parent)
    bm.free(child)
    assert bm.num_used == 0


def test_exhaustion_raises_and_audit_detects_leaks():
    bm = BlockManager(num_blocks=2, block_size=4)
    t = BlockTable()
    bm.prepare_append(t, 0, 8)
    assert not bm.can_append(t, 8, 1)
    with pytest.raises(NoFreeBlocksError):
        bm.prepare_append(t, 8, 1)
    assert bm.audit([]) != []  # the table's blocks are held by no live table: a leak
    assert bm.audit([t]) == []
