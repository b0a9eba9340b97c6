"""Iteration-level scheduler: decides, each step, which tokens of which sequences get computed.

Pure Python bookkeeping (no torch). Each step has one token budget (max_num_batched_tokens):
  1. running sequences whose prompt is done (decodes, forced-token catch-up) take their share first;
  2. running sequences still prefilling get chunks from what is left;
  3. waiting sequences are admitted FCFS into the rest, unless this step had to preempt.
So a long prompt never holds running decodes back for more than one chunk. When KV blocks run out,
the newest running sequence not yet scheduled this step is preempted: its blocks are dropped and it
is recomputed later (its tokens are kept, so its output is unchanged).

Async scheduling (`schedule_ahead`): while a pure decode step is still on the device, the next decode
step of the same sequences is scheduled before their sampled tokens reach the host. Its input tokens
are the previous step's sampled ids, still on the device (`prev_rows`). A sequence that turns out to
have finished wasted one row; its blocks, including the one reserved ahead, go back with its table.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.sched.block_manager import BlockManager
from engine.sched.request import Request, SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed when scheduled)
    num_tokens: int
    samples: list[Sequence] = field(default_factory=list)  # sequences that sample from the last position
    # speculative decoding: the chunk's last num_draft tokens are proposals, not yet in seq.token_ids;
    # verification accepts num_accepted of them (set by the engine before update_computed)
    num_draft: int = 0
    num_accepted: int = 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    block_copies: list[tuple[int, int]]  # (src, dst) KV block copies to perform before the forward
    num_preempted: int = 0
    # a step scheduled ahead: row i's input token is the one sampled by row prev_rows[i] of the step
    # before, which the host has not seen yet (see schedule_ahead)
    prev_rows: list[int] | None = None
    # indexes into `chunks` of prompt chunks whose logits at every position are wanted (a request with
    # SamplingParams.prompt_logprobs whose prompt has not been scored yet); empty in almost every step
    prompt_logprob_chunks: list[int] = field(default_factory=list)
    # a step scheduled ahead with a row whose draw reads host state the previous step's tokens change
    # (a grammar matcher, penalties' token history): its draw waits for them (DeferredSample)
    draw_late: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue management
    def add(self, request: Request) -> None:
        self.waiting.append(request.seqs[0])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _reserved_slots(self) -> int:
        """Sequence slots promised to running requests that have not forked their n samples yet."""
        return sum(s.request.params.n - 1 for s in self.running if not s.request.forked)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(chunks=[], block_copies=[])
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        for prefill_pass in (False, True):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status is SeqStatus.RUNNING and seq.prompt_done != prefill_pass:
                    budget -= self._schedule_running(seq, budget, scheduled, out)
                    if prefill_pass and seq.request.params.prompt_logprobs is not None:
                        self._mark_prompt_logprobs(seq, out)
        if out.num_preempted == 0:
            self._admit_waiting(budget, out)
        return out

    def _schedule_running(self, seq: Sequence, budget: int, scheduled: set[int], out: SchedulerOutput) -> int:
        n = min(seq.num_pending, budget)
        d = self._draft_slots(seq, budget)
        n += d
        while not self.bm.can_append(seq.table, seq.num_computed, n):
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)
            self.preempt(victim)
            out.num_preempted += 1
            if victim is seq:
                return 0
        self._add_chunk(seq, n, out, d)
        scheduled.add(seq.seq_id)
        return n

    def _draft_slots(self, seq: Sequence, budget: int) -> int:
        """Positions for the sequence's proposals (seq.lookahead, set by the speculator) after its one
        pending token: all of them or none, and never at the price of a preemption or of the budget."""
        d = seq.lookahead
        if not d or seq.num_pending != 1 or not seq.prompt_done or budget < 1 + d:
            return 0
        return d if self.bm.can_append(seq.table, seq.num_computed, 1 + d) else 0

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            slots = 1 if seq.request.forked else seq.request.params.n
            if len(self.running) + self._reserved_slots() + slots > self.config.max_num_seqs:
                return
            # a request that wants its prompt's logprobs computes every position: it takes no cached
            # blocks (its own full blocks are still published for others)
            if not seq.table.blocks and seq.request.params.prompt_logprobs is None:
                seq.num_computed = self.bm.match_prefix(seq.table, seq.token_ids)
                if seq.request.metrics.first_scheduled_time is None:
                    seq.request.cached_tokens = seq.num_computed
            n = min(seq.num_pending, budget)
            if not self.bm.can_append(seq.table, seq.num_computed, n):
                self.bm.free(seq.table)  # a waiting sequence holds no blocks: others may need them
                seq.num_computed = 0
                return
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._add_chunk(seq, n, out)
            if seq.request.params.prompt_logprobs is not None:
                self._mark_prompt_logprobs(seq, out)
            budget -= n

    def _add_chunk(self, seq: Sequence, n: int, out: SchedulerOutput, num_draft: int = 0) -> None:
        out.block_copies += self.bm.prepare_append(seq.table, seq.num_computed, n)
        chunk = ScheduledChunk(seq, seq.num_computed, n, num_draft=num_draft)
        if seq.num_computed + n - num_draft == seq.num_tokens:
            chunk.samples = [seq] if seq.request.forked else [seq] + self._fork(seq)
        out.chunks.append(chunk)

    @staticmethod
    def _mark_prompt_logprobs(seq: Sequence, out: SchedulerOutput) -> None:
        """Ask for the logits of every position of the chunk just added for `seq`, unless the prompt
        was scored already: sample 0 computes the prompt, and once it has an output token its prompt
        logprobs are out, so a recompute after preemption does not produce them again."""
        if out.chunks and out.chunks[-1].seq is seq and seq.index == 0 and seq.num_output == 0:
            out.prompt_logprob_chunks.append(len(out.chunks) - 1)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """On the chunk that completes the prompt of an n > 1 request, create samples 1..n-1.

        They share every block of sample 0, including the blocks this very chunk writes, and sample
        from the same logits row. Copy-on-write separates them at their first own token."""
        request = seq.request
        if request.forked:
            return []
        request.forked = True
        children = []
        for i in range(1, request.params.n):
            child = Sequence(request, i, list(seq.token_ids), num_computed=seq.num_computed)
            child.table = self.bm.fork(seq.table)
            if seq.grammar is not None:  # a copy of the parent's matcher (no output consumed yet)
                child.grammar = seq.grammar.fork()
            child.status = SeqStatus.RUNNING
            children.append(child)
        request.seqs.extend(children)
        self.running.extend(children)
        return children

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The next decode step of `prev`'s sequences, scheduled before `prev`'s tokens are known.

        Called while `prev` is on the device and before its tokens are appended: each sequence holds
        tokens [0, start] and `prev` samples the token at start + 1, which this step feeds back. Only
        pure decode steps qualify; sequences that `prev` surely finishes (length limits) or whose next
        input depends on host work are left out. None when a normal schedule() should run instead:
        someone is waiting for admission, a live sequence needs host tokens (it would starve), or the
        pool cannot give every sequence its next slot.
        """
        if not self.config.async_scheduling or not (prev.prev_rows is not None or self._is_decode(prev)):
            return None
        if self.waiting and len(self.running) + self._reserved_slots() < self.config.max_num_seqs:
            return None  # admit them now rather than one step later
        out = SchedulerOutput(chunks=[], block_copies=[], prev_rows=[])
        need = 0
        for row, chunk in enumerate(prev.chunks):
            seq, pos = chunk.seq, chunk.start + 1  # the position the fed-back token will occupy
            params = seq.request.params
            if seq.status is not SeqStatus.RUNNING:
                continue
            if params.needs_host_tokens:
                # it cannot run ahead; left out, it would wait until every other sequence ends (each
                # step ahead is followed by another without it): a normal schedule takes everyone
                return None
            # after `prev` the sequence holds pos + 1 tokens, pos + 1 - num_prompt of them output
            if pos + 1 - seq.num_prompt >= params.max_tokens or pos + 1 >= self.max_model_len:
                continue  # `prev` ends it by length
            need += self.bm.blocks_needed(seq.table, pos + 1)
            if seq.grammar is not None or params.draws_from_history:
                out.draw_late = True
            out.chunks.append(ScheduledChunk(seq, pos, 1, [seq]))
            out.prev_rows.append(row)
        if not out.chunks or need > self.bm.num_free:
            return None
        for chunk in out.chunks:
            out.block_copies += self.bm.prepare_append(chunk.seq.table, chunk.start, 1)
        return out

    @staticmethod
    def _is_decode(out: SchedulerOutput) -> bool:
        """Every chunk is one token that samples only for itself (no fork in this step)."""
        return all(c.num_tokens == 1 and len(c.samples) == 1 and c.samples[0] is c.seq for c in out.chunks)

    # ------------------------------------------------------------------ after the forward pass
    def update_computed(self, out: SchedulerOutput) -> None:
        """The chunks are now in the KV cache: advance num_computed and publish full blocks. A chunk with
        proposals keeps only its verified positions (its accepted tokens are already appended) and gives
        back the blocks that hold nothing but rejected ones."""
        for chunk in out.chunks:
            done = chunk.start + chunk.num_tokens - chunk.num_draft + chunk.num_accepted
            for seq in [chunk.seq] + chunk.samples[1:]:
                if seq.status is not SeqStatus.RUNNING:
                    continue  # a fresh fork child preempted later in the same step: it recomputes
                seq.num_computed = done
                if chunk.num_draft:
                    self.bm.trim(seq.table, seq.num_tokens)
                self.bm.register_full_blocks(seq.table, seq.token_ids, done)

    def preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV and queue it first in line for recomputation."""
        self.running.remove(seq)
        self.bm.free(seq.table)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish one sample and return its blocks to the pool at once."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq.table)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def abort(self, request: Request, reason: str = "abort") -> None:
        request.aborted = True
        request.forked = True  # no more samples will be created
        for seq in request.seqs:
            if not seq.finished:
                self.finish(seq, reason)

    def live_tables(self):
        return [s.table for s in list(self.running) + list(self.waiting)]
