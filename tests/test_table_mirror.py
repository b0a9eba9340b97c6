"""TableMirror against the block lists it mirrors: through every way the block manager changes a table
(appends, copy-on-write of a forked table, trims, frees and reuse), with rows running out (sweeps),
the array growing, and tables longer than its width; and `pack` from the mirror against `pack` from
the lists."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.runner.step_inputs import StepBatch, pack
from engine.runner.table_mirror import TableMirror
from engine.sched.block_manager import BlockManager, BlockTable

pytestmark = pytest.mark.engine
BS = 4


class _Walk:
    """Live tables with their token counts, changed at random through a BlockManager."""

    def __init__(self, rng: random.Random):
        self.rng, self.bm = rng, BlockManager(4000, BS, enable_prefix_caching=False)
        self.live: dict[int, tuple[BlockTable, int]] = {}

    def change(self) -> None:
        rng, bm, key = self.rng, self.bm, self.rng.randrange(12)
        if key not in self.live:
            table = BlockTable()
            n = rng.randint(1, 40)
            bm.prepare_append(table, 0, n)
            self.live[key] = (table, n)
            return
        table, n = self.live[key]
        op = rng.random()
        if op < 0.55:  # decode or a chunk: appends, sometimes a new block
            k = rng.choice([1, 1, 1, 3, 9])
            bm.prepare_append(table, n, k)
            self.live[key] = (table, n + k)
        elif op < 0.7:  # n > 1: a child shares every block; its next write copies the shared one
            child = bm.fork(table)
            self.live[rng.randrange(12, 20)] = (child, n)
            bm.prepare_append(child, n - 1, 1)  # rewrites the last position: copy-on-write
        elif op < 0.85:  # speculation's trim
            keep = rng.randint(1, n)
            bm.trim(table, keep)
            self.live[key] = (table, keep)
        else:  # preempted: freed, and later the same table fills again
            bm.free(table)
            m = rng.randint(1, 30)
            bm.prepare_append(table, 0, m)
            self.live[key] = (table, m)


@pytest.mark.parametrize("seed", range(6))
def test_rows_equal_the_block_lists_through_every_change(seed: int):
    rng = random.Random(seed)
    walk, mirror = _Walk(rng), TableMirror(width=4, capacity=3)  # small: sweeps, growth, widening
    for _ in range(400):
        for _ in range(rng.randint(1, 3)):
            walk.change()
        tables = [t for t, _ in walk.live.values()]
        step = rng.sample(tables, rng.randint(1, len(tables)))
        idx = mirror.index(step)
        width = max(len(t.blocks) for t in step)
        out = np.full((len(step), width), -7, dtype=np.int32)
        mirror.gather(idx, out)
        for row, table in zip(out, step, strict=True):
            assert row[: len(table.blocks)].tolist() == table.blocks
        assert len(set(idx.tolist())) == len(step)  # one row per table in a step


def test_pack_from_the_mirror_equals_pack_from_the_lists():
    """Every segment equal; the table rows equal up to each table's length (past it, the list fill
    writes 0 and the mirror whatever the row held: never read)."""
    rng = random.Random(7)
    walk, mirror = _Walk(rng), TableMirror(width=16, capacity=8)
    for _ in range(60):
        walk.change()
        tables = [t for t, _ in walk.live.values()]
        b = StepBatch()
        for table, n in walk.live.values():
            b.input_ids.append(rng.randrange(100))
            b.positions.append(n - 1)
            b.slot_mapping.append(table.blocks[(n - 1) // BS] * BS + (n - 1) % BS)
            b.query_lens.append(1)
            b.seq_lens.append(n)
            b.block_tables.append(table.blocks)
        seqs, width = len(tables) + 3, max(16, -(-max(map(len, b.block_tables)) // 16) * 16)
        want64, want32 = pack(b, seqs, width)
        b.table_rows = (mirror, mirror.index(tables))
        got64, got32 = pack(b, seqs, width)
        assert got64.tolist() == want64.tolist()
        head = want32.numel() - seqs * width
        assert got32[:head].tolist() == want32[:head].tolist()
        got_t, want_t = got32[head:].view(seqs, width), want32[head:].view(seqs, width)
        for i, blocks in enumerate(b.block_tables):
            assert got_t[i, : len(blocks)].tolist() == blocks
        assert (got_t[len(tables) :] == 0).all() and (want_t[len(tables) :] == 0).all()  # padding rows
