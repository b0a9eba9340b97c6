"""Per-sequence grammar state and the per-step token bitmask of every constrained row.

GrammarState wraps one llguidance matcher. A sampled token is `push`ed (a list append on the loop's
thread); the matcher consumes it at the start of the sequence's next mask fill, so the consume runs in
llguidance without the GIL, beside the loop. Invariant: the matcher's consumed tokens followed by
`pending` are exactly the sequence's sampled output tokens, so after preemption (recompute keeps the
tokens) or a prefix-cache hit nothing needs replaying. A completed grammar is not looked for on the
host: its mask then admits only the EOS ids, and the sampled EOS ends the sample with "stop" (as in
vLLM; max_tokens reached first ends it with "length"). `fork` copies the state for an n > 1 sibling,
`rollback(n)` undoes the last n tokens (for speculative decoding).

BitmaskFiller fills one int32 row per constrained sampling row (bit t of the row allows token t) into
pinned host memory, after its matchers have consumed their pending tokens, both as llguidance calls
that run on its thread pool without the GIL; the device reads those pinned rows in place (no copy).
It runs after the step's forward pass was enqueued, so on a GPU the host work overlaps the forward.
`start` runs the consume and fill of several rows on a worker thread: the caller's Python work
(emitting records, scheduling the next step) goes on meanwhile, and `join` hands the rows over.
Nothing else touches the matchers of a pending fill before its join: the engine's appends read only
a state's `error`, and a fork happens only at a prompt's last chunk, of a sequence that has sampled
nothing yet.

These run in the engine's process when `EngineConfig.grammar_process` is off; by default the same
contract is met by RemoteGrammar and ProcessBitmaskFiller (engine/structured/remote.py), whose
matchers live in a process of their own.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.device.uploader import device_view

# The loop's thread runs Python almost without pause, so it holds the GIL; a thread waiting for the GIL
# gets it when the holder blocks or after the switch interval (5 ms by default), longer than a whole
# step: the worker would start the fill only at the join and overlap nothing. While a fill is pending the
# interval is this short, so the worker takes the GIL within tens of microseconds to enter llguidance
# (which then drops it) and again to hand back its result.
HANDOFF_SWITCH_INTERVAL_S = 5e-5
# llguidance's pool threads for a consume and fill. The deep copies of one compiled matcher share its
# lexer behind one lock, so more threads mostly contend for it: 2 gain a little over a serial fill and
# llguidance's default (one per core) loses (benchmarks/reports/gpu/structured_handoff_h100.md).
FILL_THREADS = 2


class GrammarError(RuntimeError):
    """The matcher refused a token (a bug, since the mask allows only tokens it accepts)."""


class SampledTokens:
    """What every grammar state keeps of its sequence's sampled tokens: those its matcher has taken
    (`num_consumed`) and those waiting for the next fill (`pending`), plus the first refusal."""

    __slots__ = ("num_consumed", "pending", "error")

    def __init__(self, num_consumed: int = 0, pending: list[int] | None = None):
        self.num_consumed = num_consumed  # tokens the matcher has consumed (or was sent to)
        self.pending = pending if pending is not None else []  # sampled, not consumed yet
        self.error: str | None = None  # the matcher refused a pushed token (set by the filler)

    @property
    def num_tokens(self) -> int:
        """Sampled tokens this state has taken: consumed and pending."""
        return self.num_consumed + len(self.pending)

    def push(self, token: int) -> None:
        """Take one sampled token; the matcher consumes it before its next mask. A refusal is found
        then and kept in `error` (the engine fails the request; its mask meanwhile allows only EOS)."""
        self.pending.append(token)

    def check(self) -> None:
        """Raise GrammarError if the matcher refused a consumed token."""
        if self.error is not None:
            raise GrammarError(self.error)

    def _drop_pending(self, n: int) -> int:
        """The pending part of rollback(n): drop up to n pending tokens; the consumed ones left."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"cannot roll back {n} of {self.num_tokens} tokens")
        dropped = min(n, len(self.pending))
        del self.pending[len(self.pending) - dropped :]
        return n - dropped


class GrammarState(SampledTokens):
    __slots__ = ("matcher",)

    def __init__(self, matcher, num_consumed: int = 0, pending: list[int] | None = None):
        super().__init__(num_consumed, pending)
        self.matcher = matcher  # an llguidance.LLMatcher owned by this sequence alone

    @classmethod
    def start(cls, prototype) -> GrammarState:
        """A fresh state from a compiled prototype (engine/structured/compiler.GrammarCompiler.prototype)."""
        return cls(prototype.deep_copy())

    def catch_up(self, keep: int = 0) -> None:
        """Consume all pending tokens but the last `keep` on the caller's thread (a refusal is
        recorded in `error`, raised by `check` or `sync`)."""
        for token in self.pending[: len(self.pending) - keep]:
            self.consumed(token, self.matcher.consume_token(token))
        del self.pending[: len(self.pending) - keep]

    def sync(self) -> bool:
        """Consume the pending tokens now; True when the grammar is complete (only EOS could follow)."""
        self.catch_up()
        self.check()
        return self.matcher.is_stopped()

    def consumed(self, token: int, ok: bool) -> None:
        """Record the matcher's verdict on one consumed token."""
        self.num_consumed += 1
        if not ok:
            self.refused(token)

    def refused(self, token: int) -> None:
        if self.error is None:  # the first refusal is the one to report
            self.error = f"the grammar refused token {token}: {self.matcher.get_error()}"

    def advance(self, token: int) -> bool:
        """push, then sync: consume one token now; True when the grammar is complete."""
        self.push(token)
        return self.sync()

    @property
    def finished(self) -> bool:
        """The grammar is complete (pending tokens are consumed first)."""
        return self.sync()

    def rollback(self, n: int) -> None:
        """Undo the last n sampled tokens (n <= num_tokens), pending ones first."""
        n = self._drop_pending(n)
        if n and not self.matcher.rollback(n):
            raise GrammarError(f"rollback of {n} tokens failed: {self.matcher.get_error()}")
        self.num_consumed -= n

    def fork(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy(), self.num_consumed, list(self.pending))

    def release(self) -> None:
        """Nothing to free early: the matcher goes with this object (see RemoteGrammar.release)."""


@dataclass(slots=True)
class _Plan:
    """One fill: the rows to fill, the tokens to consume first, and llguidance's verdicts on them."""

    rows: list[tuple[object, int]]  # (matcher, bitmask row) of every state
    consuming: list[GrammarState] = field(default_factory=list)  # the states handed a token
    tokens: list[tuple[object, int]] = field(default_factory=list)  # (matcher, token) of each of those
    verdicts: list[bool] | None = None  # per token: consumed (False: refused), set by the fill

    def settle(self) -> None:
        """Record refusals in their states (after the fill, on the caller's thread)."""
        if self.verdicts is not None and not all(self.verdicts):
            for state, (_, token), ok in zip(self.consuming, self.tokens, self.verdicts, strict=True):
                if not ok:
                    state.refused(token)


class BitmaskFiller:
    """Fills the token bitmask of one step's constrained rows and hands it to the device."""

    BUFFERS = 2  # a step launched ahead may still read the previous step's buffer: alternate

    def __init__(self, vocab_size: int, device: torch.device):
        self.words = (vocab_size + 31) // 32
        self.device = device
        self._pin = device.type == "cuda"
        # per turn: the pinned host rows and the device's view of them (the same memory, read across the
        # bus: no upload), and whether a kernel enqueued before the turn's event may still read them
        self._buffers: list[_Buffers | None] = [None] * self.BUFFERS
        # one event per buffer, recorded when the buffer is next passed over (every reader is enqueued by
        # then); the engine enqueues on the device's default stream, so it is looked up once
        self._events = [torch.cuda.Event() for _ in range(self.BUFFERS)] if self._pin else None
        self._stream = torch.cuda.current_stream(device) if self._pin else None
        self._turn = 0
        self._executor = None  # llguidance's own thread pool (fills rows in parallel)
        self._worker: _FillWorker | None = None  # runs a fill behind the caller's back

    def _buffer(self, rows: int) -> torch.Tensor:
        """The next turn's host rows, once no enqueued kernel can still read them. Readers of the turn
        being left are enqueued by now (its draw follows its join), so its event is recorded here."""
        left = self._buffers[self._turn]
        if left is not None and left.handed_out:
            self._events[self._turn].record(self._stream)
            left.handed_out, left.in_flight = False, True
        self._turn = (self._turn + 1) % self.BUFFERS
        entry = self._buffers[self._turn]
        if entry is not None and entry.in_flight:
            # the step that read it is done (normally long ago); also before a larger buffer replaces
            # it, since the allocator cannot see the device's reads of the one it would free
            self._events[self._turn].synchronize()
            entry.in_flight = False
        if entry is None or entry.host.shape[0] < rows:
            size = max(rows, 2 * entry.host.shape[0] if entry else 8)
            host = torch.empty(size, self.words, dtype=torch.int32, pin_memory=self._pin)
            self._buffers[self._turn] = _Buffers(host, device_view(host, self.device) if self._pin else None)
            return host[:rows]
        return entry.host[:rows]

    def new_state(self, so, compiler) -> GrammarState:
        """The grammar state of a new request's constraint `so` (engine/sampling_params.StructuredOutput)."""
        return GrammarState.start(compiler.prototype(so))

    def fill(self, states: list[GrammarState]) -> torch.Tensor:
        """The bitmask [len(states), words] on the device (int32, bit t of word t // 32 allows t)."""
        return self.start(states, background=False)()

    def start(self, states: list[GrammarState], background: bool = True) -> Callable[[], torch.Tensor]:
        """Begin consuming the states' pending tokens and filling; the returned join waits for both
        and gives the device bitmask. One row is done at once (a thread hand-off would cost
        more than it hides)."""
        host, turn = self._buffer(len(states)), self._turn
        plan = self._plan(states)  # built here: the worker runs as little Python as possible
        if not (background and len(states) > 1):
            self._run(plan, host)
            plan.settle()
            return lambda: self._device_rows(host, turn)
        if self._worker is None:
            self._worker = _FillWorker()
        self._worker.submit(lambda: self._run(plan, host))

        def join() -> torch.Tensor:
            self._worker.join()
            plan.settle()
            return self._device_rows(host, turn)

        return join

    def _plan(self, states: list[GrammarState]) -> _Plan:
        """The (matcher, row) pairs to fill, and the (matcher, token) pairs to consume first: each state's
        pending token, handed over here. In the engine a state has at most one pending token at a fill
        (each of its samples is followed by one); any earlier ones are consumed now."""
        plan = _Plan([(s.matcher, i) for i, s in enumerate(states)])
        for state in states:
            if state.pending:
                if len(state.pending) > 1:
                    state.catch_up(keep=1)
                plan.consuming.append(state)
                plan.tokens.append((state.matcher, state.pending.pop()))
                state.num_consumed += 1
        return plan

    def _pool(self):
        """llguidance's thread pool for consumes and fills, made on first use."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(FILL_THREADS)
        return self._executor

    def _run(self, plan: _Plan, host: torch.Tensor) -> None:
        """Consume, then fill: each one llguidance call that drops the GIL while it works. llguidance
        writes each row's words at its pointer (its llguidance.torch wrappers are not used: importing
        that module runs torch.compile's set-up, about a second, which would stall the step loop). CUDA
        calls (the buffer's event) stay on the caller's thread: from the worker, each would take the GIL
        back from the loop, a hand-off that costs both threads tens of microseconds."""
        if len(plan.tokens) == 1:
            plan.verdicts = [plan.tokens[0][0].consume_token(plan.tokens[0][1])]
        elif plan.tokens:
            plan.verdicts = self._pool().consume_token_par(plan.tokens)
        row_bytes = host.shape[1] * host.element_size()
        if len(plan.rows) == 1:
            plan.rows[0][0].unsafe_compute_mask_ptr(host.data_ptr(), row_bytes)
        else:
            self._pool().unsafe_compute_mask_ptr(plan.rows, host.data_ptr(), row_bytes, len(plan.rows))

    def _device_rows(self, host: torch.Tensor, turn: int) -> torch.Tensor:
        """The filled rows as the device reads them: on a GPU its view of the pinned host rows
        themselves. A draw reads one 32-bit word per 32 logits across the bus: that costs the device
        more than a copy would and spares the loop the copy's launch and event, the side of the trade
        a host-bound step needs (benchmarks/reports/gpu/structured_inplace_h100.md)."""
        if self.device.type != "cuda":
            return host.clone()  # the buffer is refilled next step while a CPU caller may keep this
        entry = self._buffers[turn]
        entry.handed_out = True
        rows = host.shape[0]
        if entry.view_rows != rows:  # slicing costs microseconds: kept while the batch holds
            entry.view, entry.view_rows = entry.device[:rows], rows
        return entry.view


@dataclass(slots=True)
class _Buffers:
    host: torch.Tensor  # [rows, words] int32, pinned on a GPU
    device: torch.Tensor | None  # the device's view of the same memory (None on a CPU)
    handed_out: bool = False  # the device view was returned since the turn's event was last recorded
    view: torch.Tensor | None = None  # device[:view_rows], the last rows handed out
    view_rows: int = -1
    in_flight: bool = False  # a kernel enqueued before the turn's event may still read `host`


class _FillWorker:
    """One daemon thread running one job at a time. It waits on locks, which hold no GIL, and runs a
    few bytecodes of Python around each job, so the loop's thread loses the GIL only briefly
    (a ThreadPoolExecutor's futures and queue cost tens of microseconds of it per job)."""

    def __init__(self):
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job: Callable[[], None] | None = None
        self._interval = sys.getswitchinterval()  # restored when the job ends
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="minserve-bitmask", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            try:
                self._job()
            except BaseException as exc:  # handed to the joining caller
                self._error = exc
            finally:  # the job's last need of the GIL is behind it (also when nobody joins it)
                sys.setswitchinterval(self._interval)
            self._done.release()

    def submit(self, job: Callable[[], None]) -> None:
        """Start `job` with a short switch interval until it ends; the previous one must have been
        joined."""
        self._job = job
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._interval, HANDOFF_SWITCH_INTERVAL_S))
        self._go.release()

    def join(self) -> None:
        """Wait for the job; re-raise its exception."""
        self._done.acquire()
        error, self._error, self._job = self._error, None, None
        if error is not None:
            raise error
