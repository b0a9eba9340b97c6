"""Iteration-level scheduler: decides, each step, which tokens of which sequences get computed.

Pure Python bookkeeping (no torch). Each step has one token budget (max_num_batched_tokens):
  1. running sequences whose prompt is done (decodes, forced-token catch-up) take their share first;
  2. running sequences still prefilling get chunks from what is left;
  3. waiting sequences are admitted FCFS into the rest, unless this step had to preempt.
So a long prompt never holds running decodes back for more than one chunk. When KV blocks run out,
the newest running sequence not yet scheduled this step is preempted: its blocks are dropped and it
is recomputed later (its tokens are kept, so its output is unchanged). With a host KV tier its full
blocks go to the prefix cache as any freed block, so they come back by hash (docs/kv_offload.md).

A waiting sequence whose prefix is found in the host tier gets GPU blocks at once and waits in
`loading` until their copies are handed to the runner with a step (BlockManager.is_loading), then
runs in a later step whose compute waits for those copies (`kv_waits`); admission goes on meanwhile.

Async scheduling (`schedule_ahead`): while a step is still on the device, the next one is scheduled
before its sampled tokens reach the host. Each sequence it samples for decodes next, its input token
the sampled id still on the device (`prev_rows`); prompt chunks continue where it stops, and waiting
requests are admitted as usual. A sequence that turns out to have finished wasted one row; its blocks,
including the one reserved ahead, go back with its table.
"""

from __future__ import annotations

from collections import deque

from engine.config import SchedulerConfig
from engine.sched import ahead
from engine.sched.block_manager import BlockManager
from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.sched.request import Request, SeqStatus, Sequence


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        max_loras: int | None = None,
    ):
        self.config = config
        # multi-LoRA: at most this many distinct adapters among running sequences (GPU slots), else None
        self.max_loras = max_loras
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.loading: list[Sequence] = []  # waiting for their prefix blocks from the host tier
        self.num_preemptions = 0
        # why the last admission left sequences waiting: "seats" (max_num_seqs), "kv" (no blocks),
        # "budget" (the step's tokens), "lora" (max_loras); None when nobody was left waiting
        self.admit_stop: str | None = None

    # ------------------------------------------------------------------ queue management
    def add(self, request: Request) -> None:
        self.waiting.append(request.seqs[0])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

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
        else:
            out.active_loras = self.running_loras()
        out.kv_transfers = self.bm.take_transfers()
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
        return n * (1 + seq.mask_tokens) if d else n

    def _draft_slots(self, seq: Sequence, budget: int) -> int:
        """Positions for the sequence's proposals (seq.lookahead, set by the speculator) after its one
        pending token: all of them or none, and never at the price of a preemption or of the budget
        (which counts a gated-LoRA MTP chunk's mask tokens too)."""
        d = seq.lookahead
        if not d or seq.num_pending != 1 or not seq.prompt_done or budget < (1 + d) * (1 + seq.mask_tokens):
            return 0
        return d if self.bm.can_append(seq.table, seq.num_computed, 1 + d) else 0

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        """Admit waiting sequences in order. With LoRA, one whose adapter would make the running
        sequences hold more than max_loras distinct adapters is passed over and keeps its place
        (vLLM's max_loras per batch); `out.active_loras` tells the runner which slots to keep."""
        passed: list[Sequence] = []
        try:
            self._admit(budget, out, passed)
        finally:
            self.waiting.extendleft(reversed(passed))
        out.active_loras = self.running_loras()

    def running_loras(self) -> set | None:
        """The adapters (LoRARequest.key) of running and loading sequences; None without LoRA."""
        if self.max_loras is None:
            return None
        requests = (s.request.lora_request for s in [*self.running, *self.loading])
        return {lora.key for lora in requests if lora is not None}

    def _lora_fits(self, seq: Sequence, loras: set | None) -> bool:
        lora = seq.request.lora_request
        if loras is None or lora is None or lora.key in loras:
            return True
        if len(loras) < self.max_loras:
            loras.add(lora.key)
            return True
        return False

    def _admit(self, budget: int, out: SchedulerOutput, passed: list[Sequence]) -> None:
        if self.loading:
            self._requeue_loaded()
        loras = self.running_loras()
        self.admit_stop = None
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not self._lora_fits(seq, loras):
                passed.append(self.waiting.popleft())
                self.admit_stop = "lora"
                continue
            slots = 1 if seq.request.forked else seq.request.params.n
            taken = len(self.running) + len(self.loading) + self._reserved_slots()
            if taken + slots > self.config.max_num_seqs:
                self.admit_stop = "seats"
                return
            # a request that wants its prompt's logprobs computes every position: it takes no cached
            # blocks (its own full blocks are still published for others)
            if not seq.table.blocks and seq.request.params.prompt_logprobs is None:
                seq.num_computed = self.bm.match_prefix(seq.table, seq.token_ids, seq.request.cache_seed)
                if seq.request.metrics.first_scheduled_time is None:
                    seq.request.cached_tokens = seq.num_computed
                if self.bm.is_loading(seq.table):  # it waits for its copies, the others go on
                    self.loading.append(self.waiting.popleft())
                    continue
            n = min(seq.num_pending, budget)
            if not self.bm.can_append(seq.table, seq.num_computed, n):
                self._release_waiting()  # a waiting sequence holds no blocks: others may need them
                self.admit_stop = "kv"
                return
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._add_chunk(seq, n, out)
            if self.bm.host is not None and self.bm.host.loading:
                out.kv_waits |= self.bm.copies_in_flight(seq.table)
            if seq.request.params.prompt_logprobs is not None:
                self._mark_prompt_logprobs(seq, out)
            budget -= n
        self.admit_stop = "budget" if self.waiting else self.admit_stop  # the head did not fit this step

    def _release_waiting(self) -> None:
        """Admission stops here: every waiting sequence gives its blocks back (prefix hits, and blocks
        loaded from the host tier, published by now: it finds them again by hash), so none holds
        blocks the one at the head needs while nothing runs to free any."""
        for seq in self.waiting:
            if seq.table.blocks:
                self.bm.free(seq.table)
                seq.num_computed = 0

    def _requeue_loaded(self) -> None:
        """Sequences whose host-tier blocks are all in go back to the head of the queue, in order."""
        ready = [s for s in self.loading if not self.bm.is_loading(s.table)]
        if ready:
            self.loading = [s for s in self.loading if self.bm.is_loading(s.table)]
            self.waiting.extendleft(reversed(ready))

    def _add_chunk(
        self, seq: Sequence, n: int, out: SchedulerOutput, num_draft: int = 0, start: int | None = None
    ) -> None:
        """Schedule positions [start, start + n) of `seq` (start: num_computed unless a step in flight
        computes up to it); the chunk that reaches the end of its tokens samples (and forks)."""
        start = seq.num_computed if start is None else start
        out.block_copies += self.bm.prepare_append(seq.table, start, n)
        chunk = ScheduledChunk(seq, start, n, num_draft=num_draft)
        if start + n - num_draft == seq.num_tokens:
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

    def schedule_ahead(self, prev: SchedulerOutput, decodes_only: bool = False) -> SchedulerOutput | None:
        """The step after `prev`, scheduled while `prev` is on the device, before its tokens are known.

        Every sequence `prev` samples for decodes next, its input the token `prev` draws (a row of
        `prev_rows`, fed back on the device); these rows come first. Then, as schedule() orders them,
        decodes of tokens the host holds, prompt chunks (those in `prev` continue where it stops), and
        admissions. Sequences that `prev` surely finishes (length limits) are left out. None when a
        normal schedule() must run instead: `prev` forks or speculates, a sampling sequence needs host
        tokens next (forced tokens), or the pool cannot give every chunk its blocks without preempting.
        `decodes_only` (an engine that speculates): only a decode step's successor, all fed-back decodes,
        and None while anybody waits for a free slot.
        """
        if not self.config.async_scheduling:
            return None
        plan = ahead.plan(self.running, prev, self.max_model_len)
        if plan is None or (decodes_only and not self._decodes_alone(prev, plan)):
            return None
        plan = ahead.within_budget(plan, self.config.max_num_batched_tokens)
        if sum(self.bm.append_cost(seq.table, start, n) for seq, start, n, _ in plan) > self.bm.num_free:
            return None
        out = SchedulerOutput(chunks=[], block_copies=[], prev_rows=[])
        for seq, start, n, row in plan:
            if row is None:
                self._add_chunk(seq, n, out, start=start)
                if not seq.prompt_done and seq.request.params.prompt_logprobs is not None:
                    self._mark_prompt_logprobs(seq, out)
                continue
            out.block_copies += self.bm.prepare_append(seq.table, start, 1)
            out.chunks.append(ScheduledChunk(seq, start, 1, [seq]))
            out.prev_rows.append(row)
            params = seq.request.params
            out.draw_late |= seq.grammar is not None or params.draws_from_history
        self._admit_waiting(self.config.max_num_batched_tokens - out.num_batched_tokens, out)
        if not out.chunks:
            return None  # copies decided meanwhile go with the next schedule()
        out.kv_transfers = self.bm.take_transfers()
        return out

    def _decodes_alone(self, prev: SchedulerOutput, plan: list) -> bool:
        """`prev` only decodes, every planned chunk is fed back, and nobody waits for a free slot."""
        room = len(self.running) + self._reserved_slots() < self.config.max_num_seqs
        return ahead.only_fed_back_decodes(prev, plan) and not (self.waiting and room)

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
                self.bm.register_full_blocks(seq.table, seq.token_ids, done, seq.request.cache_seed)

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
        elif seq.status is SeqStatus.WAITING and seq in self.loading:
            self.loading.remove(seq)  # its blocks in flight keep the copy's reference until done
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
        return [s.table for s in [*self.running, *self.waiting, *self.loading]]
