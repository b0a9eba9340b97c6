"""Stateful property test of BlockManager against a plain model of the pool.

The model tracks, independently of the manager, every live table's tokens and blocks, each block's
physical contents (as the runner would write them: appended tokens, copy-on-write copies), the
reference count every block should have and every token prefix ever published in the prefix cache.
Hypothesis drives random appends, registrations, prefix matches, forks and frees on a small pool and
checks after every step that the manager agrees with the model.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule

from engine.sched.block_manager import BlockManager, BlockTable, NoFreeBlocksError

pytestmark = pytest.mark.engine

BLOCK_SIZE = 2
NUM_BLOCKS = 10
MAX_TABLES = 6
# a tiny alphabet: different tables often share prefixes, so the prefix cache gets hits
token_lists = st.lists(st.integers(0, 1), min_size=1, max_size=7)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ModelTable:
    """The model's view of one live table: its tokens and the blocks it should hold."""

    def __init__(self, table: BlockTable, tokens: list[int], blocks: list[int]):
        self.table = table
        self.tokens = tokens
        self.blocks = blocks


class BlockManagerMachine(RuleBasedStateMachine):
    tables = Bundle("tables")

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
        self.live: dict[int, ModelTable] = {}  # id(BlockTable) -> model
        self.content: dict[int, list[int | None]] = {}  # block -> tokens the runner wrote into it
        self.published: set[tuple[int, ...]] = set()  # token prefixes ever registered (whole blocks)
        self.next_name = 0

    # ------------------------------------------------------------------ model helpers
    def refs(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for m in self.live.values():
            for b in m.blocks:
                counts[b] = counts.get(b, 0) + 1
        return counts

    def model_free(self) -> int:
        return NUM_BLOCKS - len(self.refs())

    def new(self, table: BlockTable, tokens: list[int], blocks: list[int]) -> BlockTable:
        self.live[id(table)] = ModelTable(table, tokens, blocks)
        return table

    def append(self, m: ModelTable, new_tokens: list[int]) -> None:
        """Model of one chunk: prepare_append, the runner's block copies, then the KV writes."""
        start, n = len(m.tokens), len(new_tokens)
        refs = self.refs()
        last = min((start + n - 1) // BLOCK_SIZE, len(m.blocks) - 1)
        shared = [i for i in range(start // BLOCK_SIZE, last + 1) if refs[m.blocks[i]] > 1]
        need = max(0, ceil_div(start + n, BLOCK_SIZE) - len(m.blocks)) + len(shared)
        expect_ok = need <= self.model_free()
        assert self.bm.can_append(m.table, start, n) == expect_ok, (start, n, need, self.model_free())
        if not expect_ok:
            event("pool exhausted")
            before = list(m.table.blocks)
            with pytest.raises(NoFreeBlocksError):
                self.bm.prepare_append(m.table, start, n)
            assert m.table.blocks == before, "a failed prepare_append changed the table"
            return
        free_before = set(range(NUM_BLOCKS)) - set(refs)
        cached_before = set(self.bm.free_cached)
        copies = self.bm.prepare_append(m.table, start, n)
        # exactly the shared blocks in the written range are copied, each into a block that was free
        assert [src for src, _ in copies] == [m.blocks[i] for i in shared]
        dsts = [dst for _, dst in copies]
        fresh = m.table.blocks[len(m.blocks) :]
        assert len(fresh) == ceil_div(start + n, BLOCK_SIZE) - len(m.blocks)
        assert len(set(dsts + fresh)) == len(dsts + fresh) and set(dsts + fresh) <= free_before
        if copies:
            event("copy-on-write")
        if cached_before & set(dsts + fresh):
            event("evicted a cached block")
        for i, (src, dst) in zip(shared, copies):
            m.blocks[i] = dst
            self.content[dst] = list(self.content[src])  # the runner performs the copy
        for b in fresh:
            m.blocks.append(b)
            self.content[b] = [None] * BLOCK_SIZE  # whatever was there is garbage now
        for pos, tok in enumerate(new_tokens, start):
            self.content[m.blocks[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] = tok
        m.tokens += new_tokens

    # ------------------------------------------------------------------ rules
    def admit(self, table: BlockTable):
        """Bundle result for a new live table; past MAX_TABLES it is freed at once instead."""
        if len(self.live) > MAX_TABLES:
            self.free_table_now(table)
            return multiple()
        return table

    @initialize(target=tables, tokens=token_lists)
    def first_table(self, tokens):
        return self.new_table(tokens)

    @rule(target=tables, tokens=token_lists)
    def new_table(self, tokens):
        t = self.new(BlockTable(), [], [])
        self.append(self.live[id(t)], tokens)
        return self.admit(t)

    @rule(table=tables, tokens=token_lists)
    def append_tokens(self, table, tokens):
        self.append(self.live[id(table)], tokens)

    @rule(table=tables, data=st.data())
    def register(self, table, data):
        m = self.live[id(table)]
        num_computed = data.draw(st.integers(0, len(m.tokens)), label="num_computed")
        self.bm.register_full_blocks(table, m.tokens, num_computed)
        for k in range(1, min(num_computed // BLOCK_SIZE, len(m.blocks)) + 1):
            self.published.add(tuple(m.tokens[: k * BLOCK_SIZE]))

    @rule(target=tables, table=tables, suffix=token_lists, keep=st.integers(0, 8))
    def match_prefix(self, table, suffix, keep):
        """A new table for (a prefix of an existing table's tokens) + suffix, matched in the cache."""
        query = self.live[id(table)].tokens[:keep] + suffix
        t = BlockTable()
        cached = self.bm.match_prefix(t, query)
        assert cached % BLOCK_SIZE == 0 and cached <= (len(query) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert cached == 0 or tuple(query[:cached]) in self.published, "matched tokens never published"
        assert len(t.blocks) == cached // BLOCK_SIZE
        event(f"prefix match of {cached // BLOCK_SIZE} blocks")
        for i, b in enumerate(t.blocks):  # the matched blocks really hold the query's tokens
            assert self.content[b] == query[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], (i, b)
        self.new(t, query[:cached], list(t.blocks))
        return self.admit(t)

    @rule(target=tables, tokens=token_lists)
    def publish_then_match(self, tokens):
        """A fresh table written and registered whole is found whole: right after registration (no
        allocation in between, so nothing can be evicted) every full block's hash is in the cache."""
        t = self.new(BlockTable(), [], [])
        m = self.live[id(t)]
        self.append(m, tokens)
        if len(m.tokens) == len(tokens):  # the pool had room
            self.bm.register_full_blocks(t, m.tokens, len(m.tokens))
            for k in range(1, len(m.tokens) // BLOCK_SIZE + 1):
                self.published.add(tuple(m.tokens[: k * BLOCK_SIZE]))
            probe = BlockTable()
            assert self.bm.match_prefix(probe, m.tokens + [1]) == len(m.tokens) // BLOCK_SIZE * BLOCK_SIZE
            self.bm.free(probe)
        return self.admit(t)

    def fork_now(self, table: BlockTable) -> BlockTable:
        m = self.live[id(table)]
        child = self.bm.fork(table)
        assert child.blocks == m.blocks and child is not table
        self.new(child, list(m.tokens), list(m.blocks))
        return child

    @rule(target=tables, table=tables)
    def fork(self, table):
        return self.admit(self.fork_now(table))

    @rule(target=tables, table=tables, tokens=token_lists)
    def fork_and_diverge(self, table, tokens):
        """n > 1 sampling: fork, then both write their own tokens (copy-on-write separates them)."""
        child = self.fork_now(table)
        self.append(self.live[id(child)], tokens)
        self.append(self.live[id(table)], [tokens[0] ^ 1])
        return self.admit(child)

    @rule(table=consumes(tables))
    def free(self, table):
        self.free_table_now(table)

    def free_table_now(self, table: BlockTable) -> BlockTable:
        self.bm.free(table)
        del self.live[id(table)]
        assert table.blocks == [] and table.hashes == []
        return table

    # ------------------------------------------------------------------ invariants
    @invariant()
    def audit_is_clean(self):
        assert self.bm.audit([m.table for m in self.live.values()]) == []

    @invariant()
    def tables_hold_the_model_blocks(self):
        for m in self.live.values():
            assert m.table.blocks == m.blocks
            assert len(m.blocks) == ceil_div(len(m.tokens), BLOCK_SIZE)

    @invariant()
    def refcounts_match_the_model(self):
        refs = self.refs()
        assert [self.bm.ref_count[b] for b in range(NUM_BLOCKS)] == [
            refs.get(b, 0) for b in range(NUM_BLOCKS)
        ]
        assert self.bm.num_free == NUM_BLOCKS - len(refs)
        assert len(self.bm.free_uncached) + len(self.bm.free_cached) + len(refs) == NUM_BLOCKS

    @invariant()
    def every_table_reads_its_own_tokens(self):
        """No table ever wrote into a block another table reads (copy-on-write holds)."""
        for m in self.live.values():
            for pos, tok in enumerate(m.tokens):
                assert self.content[m.blocks[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] == tok, (pos, m.tokens)

    def teardown(self):
        for m in list(self.live.values()):
            self.free_table_now(m.table)
        assert self.bm.num_free == NUM_BLOCKS and self.bm.ref_count == [0] * NUM_BLOCKS
        assert self.bm.audit([]) == []


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerStateful = BlockManagerMachine.TestCase
