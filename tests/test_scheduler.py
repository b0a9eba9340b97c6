"""Scheduler unit behaviour on fake requests: a real BlockManager, no torch, no model.

`Engine` replays what engine/llm_engine.py does around the scheduler (schedule, mark first-scheduled,
update_computed, append one sampled token per sampling sequence, finish on max_tokens). The expected
schedules come from the test's own bookkeeping (`PlainScheduler`, a from-scratch recompute of the
budget split over the test's own queues), never from the scheduler's state.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import Phase, event, given, settings
from hypothesis import strategies as st

from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.sched.block_manager import BlockManager
from engine.sched.output import SchedulerOutput
from engine.sched.request import Request, SeqStatus, Sequence
from engine.sched.scheduler import Scheduler

pytestmark = pytest.mark.engine

BIG_POOL = 4096
QUICK_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]  # no slow "explain" phase


def fake_token(seq: Sequence) -> int:
    """A deterministic stand-in for the model: the next token depends only on the sequence so far."""
    return (sum(seq.token_ids) * 31 + len(seq.token_ids) * 7 + seq.index) % 1000


class Engine:
    """The engine loop around the scheduler, minus the model (see LLMEngine._launch / _complete)."""

    def __init__(
        self,
        budget: int,
        max_num_seqs: int = 256,
        num_blocks: int = BIG_POOL,
        block_size: int = 4,
        prefix_caching: bool = False,
    ):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        config = SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, async_scheduling=False
        )
        self.sched = Scheduler(config, self.bm, max_model_len=1 << 20)
        self.requests: dict[str, Request] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4, n: int = 1) -> Request:
        request = Request(rid, list(prompt), SamplingParams(n=n, max_tokens=max_tokens))
        self.requests[rid] = request
        self.sched.add(request)
        return request

    def step(self, out: SchedulerOutput | None = None) -> SchedulerOutput:
        """One engine step; `out` is a schedule() result the caller has already inspected."""
        if out is None:
            out = self.sched.schedule()
        now = time.time()
        for chunk in out.chunks:
            metrics = chunk.seq.request.metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        self.sched.update_computed(out)
        for chunk in out.chunks:
            for seq in chunk.samples:
                seq.token_ids.append(fake_token(seq))
                seq.masks.append(1)
                if seq.num_output >= seq.request.params.max_tokens:
                    self.sched.finish(seq, "length")
        assert self.bm.audit(self.sched.live_tables()) == []
        return out

    def run(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        outs = []
        while self.sched.has_work():
            outs.append(self.step())
            assert len(outs) < max_steps, "the scheduler stopped making progress"
        return outs


def rows(out: SchedulerOutput) -> list[tuple[str, int, int, int]]:
    """(request id, sample index, start, num_tokens) per chunk, in batch order."""
    return [(c.seq.request.request_id, c.seq.index, c.start, c.num_tokens) for c in out.chunks]


# ---------------------------------------------------------------------------- the plain reference
class PlainSeq:
    def __init__(self, rid: str, index: int, num_prompt: int, max_tokens: int, n: int):
        self.rid, self.index, self.num_prompt, self.max_tokens, self.n = rid, index, num_prompt, max_tokens, n
        self.num_tokens, self.computed = num_prompt, 0


class PlainScheduler:
    """What one step should schedule, recomputed from scratch over the test's own FCFS queues.

    Pool big enough that nothing is preempted and prefix caching off, so the split is: decodes (prompt
    done) in admission order, then prompt chunks in admission order, then the waiting queue in arrival
    order while sequence slots (n per request not yet forked) and budget last."""

    def __init__(self, budget: int, max_num_seqs: int):
        self.budget, self.max_num_seqs = budget, max_num_seqs
        self.running: list[PlainSeq] = []
        self.waiting: list[PlainSeq] = []
        self.forked: set[str] = set()

    def add(self, rid: str, num_prompt: int, max_tokens: int, n: int) -> None:
        self.waiting.append(PlainSeq(rid, 0, num_prompt, max_tokens, n))
        if n == 1:
            self.forked.add(rid)

    def step(self) -> tuple[list[tuple[str, int, int, int]], list[tuple[str, int]]]:
        """Plan one step and apply it: tokens computed, one token sampled per sampler, finishes.
        Returns the chunks (as `rows` gives them) and the sampling sequences."""
        chunks: list[tuple[str, int, int, int]] = []
        samplers: list[PlainSeq] = []
        budget = self.budget

        def take_chunk(s: PlainSeq) -> int:
            take = min(s.num_tokens - s.computed, budget)
            chunks.append((s.rid, s.index, s.computed, take))
            s.computed += take
            if s.computed == s.num_tokens:  # the chunk reaches the end: its last position samples
                samplers.append(s)
                if s.rid not in self.forked:
                    samplers.extend(self._fork(s))
            return take

        decodes = [s for s in self.running if s.computed >= s.num_prompt]
        prefills = [s for s in self.running if s.computed < s.num_prompt]
        for s in decodes + prefills:
            if budget == 0:
                break
            budget -= take_chunk(s)
        while self.waiting and budget > 0:
            s = self.waiting[0]
            slots = 1 if s.rid in self.forked else s.n
            reserved = sum(r.n - 1 for r in self.running if r.rid not in self.forked)
            if len(self.running) + reserved + slots > self.max_num_seqs:
                break
            self.running.append(self.waiting.pop(0))
            budget -= take_chunk(s)
        for s in samplers:
            s.num_tokens += 1
            if s.num_tokens - s.num_prompt >= s.max_tokens:
                self.running.remove(s)
        return chunks, [(s.rid, s.index) for s in samplers]

    def _fork(self, s: PlainSeq) -> list[PlainSeq]:
        """Samples 1..n-1 share the computed prompt and run after everything running now."""
        self.forked.add(s.rid)
        children = []
        for i in range(1, s.n):
            child = PlainSeq(s.rid, i, s.num_prompt, s.max_tokens, s.n)
            child.num_tokens = child.computed = s.num_tokens
            children.append(child)
        self.running += children
        return children


def seq_key(seq: Sequence) -> tuple[str, int]:
    return seq.request.request_id, seq.index


def first_steps(outs: list[SchedulerOutput]) -> dict[str, int]:
    """Request id -> the step its first chunk ran in."""
    first: dict[str, int] = {}
    for step, out in enumerate(outs):
        for rid, *_ in rows(out):
            first.setdefault(rid, step)
    return first


# ---------------------------------------------------------------------------- budget split, FCFS, slots
workloads = st.lists(
    st.tuples(
        st.integers(1, 40),  # prompt length
        st.integers(1, 4),  # max_tokens
        st.integers(1, 3),  # n
        st.integers(0, 6),  # arrival step
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None, phases=QUICK_PHASES)
@given(workload=workloads, budget=st.integers(1, 24), max_num_seqs=st.integers(3, 6))
def test_every_step_matches_a_plain_recompute_of_the_budget_split(workload, budget, max_num_seqs):
    eng, ref = Engine(budget, max_num_seqs), PlainScheduler(budget, max_num_seqs)
    arrivals = sorted(enumerate(workload), key=lambda item: item[1][3])
    step = 0
    while arrivals or eng.sched.has_work():
        while arrivals and arrivals[0][1][3] <= step:
            i, (num_prompt, max_tokens, n, _) = arrivals.pop(0)
            eng.add(f"r{i}", [i + 1] * num_prompt, max_tokens, n)
            ref.add(f"r{i}", num_prompt, max_tokens, n)
        # the kind of each sequence before the step: 0 decode, 1 prompt chunk, 2 admitted now
        kind = {seq_key(s): 0 if s.prompt_done else 1 for s in eng.sched.running}
        out = eng.step()
        expected_rows, expected_samplers = ref.step()
        assert rows(out) == expected_rows, f"step {step}"
        assert [seq_key(s) for c in out.chunks for s in c.samples] == expected_samplers, f"step {step}"
        assert out.num_batched_tokens <= budget and out.num_preempted == 0
        kinds = [kind.get(seq_key(c.seq), 2) for c in out.chunks]
        assert kinds == sorted(kinds), f"step {step}: decodes, then prompt chunks, then admissions"
        assert len(eng.sched.running) <= max_num_seqs
        step += 1
        assert step < 500
    assert all(r.finished for r in eng.requests.values())
    for r in eng.requests.values():
        assert [s.num_output for s in r.seqs] == [r.params.max_tokens] * r.params.n


def test_long_prompt_is_chunked_and_a_running_decode_gets_every_step():
    budget, long_len = 16, 100
    eng = Engine(budget)
    eng.add("short", [1, 2, 3], max_tokens=30)
    eng.step()  # short's prompt: it decodes from now on
    eng.add("long", list(range(long_len)), max_tokens=1)
    long_chunks = []
    for _ in range(12):
        out = eng.step()
        r = rows(out)
        assert r[0][:2] == ("short", 0) and r[0][3] == 1, "the decode goes first, one token"
        long_chunks += [(start, n) for rid, _, start, n in r if rid == "long"]
        assert out.num_batched_tokens <= budget
    # independently: the long prompt gets what the decode leaves of each step, contiguously
    expected, start = [], 0
    while start < long_len:
        expected.append((start, min(budget - 1, long_len - start)))
        start += expected[-1][1]
    assert long_chunks == expected
    assert len(expected) == 7


def test_a_long_prompt_alone_is_cut_into_budget_sized_chunks():
    eng = Engine(budget=8)
    eng.add("a", list(range(30)), max_tokens=2)
    outs = eng.run()
    assert [rows(o) for o in outs] == [
        [("a", 0, 0, 8)],
        [("a", 0, 8, 8)],
        [("a", 0, 16, 8)],
        [("a", 0, 24, 6)],  # the prompt's end: samples the first token
        [("a", 0, 30, 1)],  # one decode samples the second
    ]


def test_waiting_requests_are_admitted_first_come_first_served():
    eng = Engine(budget=64, max_num_seqs=2)
    names = ["a", "b", "c", "d", "e"]
    for i, name in enumerate(names):  # later requests are shorter: no shortest-first reordering
        eng.add(name, [i + 1] * (20 - 3 * i), max_tokens=3 + i % 2)
    first = first_steps(eng.run())
    assert sorted(names, key=lambda n: first[n]) == names
    # each request runs max_tokens steps (prompt + first token, then one decode per token), and the
    # next in line takes the first slot to free up: a (3 steps) and b (4) from step 0, c after a,
    # d after b, e after c
    assert [first[n] for n in names] == [0, 0, 3, 4, 6]


def test_the_head_of_the_queue_is_not_skipped_when_it_does_not_fit():
    # 6 blocks of 4: "running" holds 4 (15 prompt + 1 output token); "big" needs 3 of the 2 left,
    # "small" would fit in 1 but must wait behind "big".
    eng = Engine(budget=64, num_blocks=6, block_size=4)
    eng.add("running", list(range(15)), max_tokens=2)
    eng.add("big", list(range(100, 112)), max_tokens=1)
    eng.add("small", [7, 7, 7], max_tokens=1)
    outs = eng.run()
    first = first_steps(outs)
    assert first == {"running": 0, "big": 2, "small": 2}
    assert [rid for rid, *_ in rows(outs[2])] == ["big", "small"]


def test_max_num_seqs_counts_all_n_samples_of_a_waiting_request():
    eng = Engine(budget=64, max_num_seqs=4)
    eng.add("b", [1] * 5, max_tokens=2)  # finishes after step 1
    eng.add("c", [2] * 5, max_tokens=6)
    eng.add("a", [3] * 6, max_tokens=2, n=3)  # needs 3 slots: only 2 are free while b runs
    eng.add("d", [4] * 2, max_tokens=1)  # would fit in a free slot, but comes after "a"
    outs = []
    while eng.sched.has_work():
        outs.append(eng.step())
        assert len(eng.sched.running) <= 4
    first = first_steps(outs)
    assert first["b"] == first["c"] == 0
    assert first["a"] == 2  # b finished in step 1: 1 running + 3 samples = 4
    assert first["d"] > first["a"]
    assert [s.index for s in eng.requests["a"].seqs] == [0, 1, 2]
    # while a's samples and c ran, d (1 slot) waited: c + 3 samples = 4 = max_num_seqs
    assert first["d"] == 4  # a's samples take steps 2 (prompt, fork) and 3: then their slots free


def test_admission_says_why_it_left_sequences_waiting():
    """Scheduler.admit_stop, read by the core's pace log: each limit in turn, set up so that only it
    binds (the expected reason follows from the setup, not from the scheduler)."""
    seats = Engine(budget=64, max_num_seqs=1)
    seats.add("a", [1] * 4, max_tokens=3)
    seats.add("b", [2] * 4, max_tokens=3)
    seats.step()
    assert seats.sched.admit_stop == "seats"  # 56 tokens of budget left, but one seat
    budget = Engine(budget=8)
    budget.add("a", [1] * 8)
    budget.add("b", [2] * 4)
    budget.step()
    assert budget.sched.admit_stop == "budget"  # a's prompt took all 8 tokens
    kv = Engine(budget=64, num_blocks=2, block_size=4)
    kv.add("a", [1] * 6, max_tokens=2)
    kv.add("b", [2] * 4)
    kv.step()
    assert kv.sched.admit_stop == "kv"  # a holds both blocks
    room = Engine(budget=64)
    room.add("a", [1] * 4)
    room.add("b", [2] * 4)
    room.step()
    assert room.sched.admit_stop is None  # everyone got in
    kv.run()
    seats.run()
    assert kv.sched.admit_stop is None and seats.sched.admit_stop is None


# ---------------------------------------------------------------------------- preemption
def test_out_of_blocks_preempts_the_newest_unscheduled_sequence_and_keeps_its_tokens():
    # 6 blocks of 4; a, b, c hold 2 each after their 8-token prompts. Their first decode (position 8)
    # needs a third block each: a's request evicts c, the newest; b then takes c's freed block.
    eng = Engine(budget=64, num_blocks=6, block_size=4)
    for i, name in enumerate("abc"):
        eng.add(name, [10 * i + j for j in range(8)], max_tokens=3)
    eng.add("d", [5, 6, 7, 8], max_tokens=1)  # waits: no block left
    out = eng.step()
    assert [rid for rid, *_ in rows(out)] == ["a", "b", "c"]
    c = eng.requests["c"].seqs[0]
    c_tokens = list(c.token_ids)
    assert len(c_tokens) == 9

    out = eng.step()
    assert out.num_preempted == 1
    assert rows(out) == [("a", 0, 8, 1), ("b", 0, 8, 1)]  # no admission in a step that preempted
    assert c.status is SeqStatus.WAITING and c.num_computed == 0 and c.table.blocks == []
    assert [s.request.request_id for s in eng.sched.waiting] == ["c", "d"]  # first in line
    assert c.token_ids == c_tokens  # kept: it is recomputed, not restarted
    assert eng.sched.num_preemptions == 1

    out = eng.step()  # a and b finish (3 tokens); c (3 blocks) does not fit before they free theirs
    assert rows(out) == [("a", 0, 9, 1), ("b", 0, 9, 1)]
    out = eng.step()
    assert rows(out) == [("c", 0, 0, 9), ("d", 0, 0, 4)]  # prompt + kept output token recomputed
    eng.run()
    # the same request alone in a big pool produces the same tokens
    alone = Engine(budget=64)
    alone.add("c", c_tokens[:8], max_tokens=3)
    alone.run()
    assert c.token_ids == alone.requests["c"].seqs[0].token_ids


@settings(max_examples=40, deadline=None, phases=QUICK_PHASES)
@given(
    workload=st.lists(
        st.tuples(st.integers(1, 14), st.integers(1, 6), st.integers(1, 2)), min_size=2, max_size=6
    ),
    budget=st.integers(4, 24),
    spare=st.integers(0, 3),
)
def test_preemption_victims_are_the_newest_unscheduled_and_outputs_are_unchanged(workload, budget, spare):
    block_size = 2
    need = max(n * -(-(p + m) // block_size) for p, m, n in workload)
    eng = Engine(budget, max_num_seqs=8, num_blocks=need + spare, block_size=block_size)
    big = Engine(budget, max_num_seqs=8)
    for i, (num_prompt, max_tokens, n) in enumerate(workload):
        for e in (eng, big):
            e.add(f"r{i}", [(i * 7 + j) % 5 for j in range(num_prompt)], max_tokens, n)
    big.run()
    step = 0
    while eng.sched.has_work():
        before = list(eng.sched.running)  # admission order, oldest first
        waiting_before = list(eng.sched.waiting)
        tokens_before = {seq_key(s): list(s.token_ids) for s in before}
        out = eng.sched.schedule()
        scheduled = {seq_key(c.seq) for c in out.chunks}
        waiting = list(eng.sched.waiting)
        victims = [s for s in waiting if not any(s is w for w in waiting_before)]
        assert len(victims) == out.num_preempted
        event(f"preempted {min(len(victims), 2)}+")
        for v in victims:
            assert seq_key(v) not in scheduled and v.num_computed == 0 and not v.table.blocks
            if v in before:  # (else a sample forked in this very step, the newest of all)
                newer = before[before.index(v) + 1 :]
                assert all(seq_key(s) in scheduled or s in victims for s in newer), "not the newest"
                assert v.token_ids == tokens_before[seq_key(v)]
        # the victims go first, ahead of everything that was waiting; the older first
        assert waiting[len(victims) :] == [s for s in waiting_before if s.status is SeqStatus.WAITING]
        old_victims = [s for s in waiting[: len(victims)] if s in before]
        assert old_victims == [s for s in before if s in victims]
        assert out.num_batched_tokens <= budget
        eng.step(out)
        step += 1
        assert step < 1000
    for rid, request in eng.requests.items():
        assert [s.token_ids for s in request.seqs] == [s.token_ids for s in big.requests[rid].seqs]
    assert eng.bm.num_free == eng.bm.num_blocks


# ---------------------------------------------------------------------------- prefix cache hits
def expected_hit(published: list[int], prompt: list[int], block_size: int) -> int:
    """Tokens a new prompt should find cached: whole blocks of the common prefix with a published
    (computed, full-block) token list, never the prompt's last token."""
    common = 0
    while common < min(len(published), len(prompt)) and published[common] == prompt[common]:
        common += 1
    return min(common // block_size, (len(prompt) - 1) // block_size) * block_size


@pytest.mark.parametrize(
    "prompt",
    [
        list(range(100, 110)) + [1],  # same 10-token prefix, longer
        list(range(100, 110)),  # the same prompt: its last token is never taken from the cache
        list(range(100, 108)),  # exactly two blocks: only the first can be cached
        list(range(100, 109)) + [999, 998],  # diverges inside the third block
        [5] + list(range(101, 110)),  # diverges in the first token
    ],
)
def test_a_second_request_with_the_same_prefix_starts_from_the_cache(prompt):
    block_size = 4
    first = list(range(100, 110))
    eng = Engine(budget=64, block_size=block_size, prefix_caching=True)
    eng.add("first", first, max_tokens=5)
    eng.step()  # first's prompt computed: blocks 0 and 1 (8 tokens) are full and registered
    hit = expected_hit(first[: len(first) // block_size * block_size], prompt, block_size)
    second = eng.add("second", prompt, max_tokens=2)
    out = eng.step()
    assert rows(out) == [("first", 0, 10, 1), ("second", 0, hit, len(prompt) - hit)]
    assert second.cached_tokens == hit
    eng.run()
    assert eng.bm.num_free == eng.bm.num_blocks


def test_cached_tokens_are_only_the_blocks_computed_before_the_step():
    block_size, prompt = 4, list(range(20))
    eng = Engine(budget=12, block_size=block_size, prefix_caching=True)
    eng.add("a", prompt, max_tokens=2)
    assert rows(eng.step()) == [("a", 0, 0, 12)]
    b = eng.add("b", prompt, max_tokens=2)
    out = eng.step()
    # a's chunk 12..20 is in flight in this step: b matches only the 3 blocks computed before it
    assert rows(out) == [("a", 0, 12, 8), ("b", 0, 12, 4)]
    assert b.cached_tokens == 12
    assert eng.bm.prefix_hits == 3
    eng.run()
    assert eng.requests["a"].seqs[0].token_ids == eng.requests["b"].seqs[0].token_ids
