"""Per-sequence grammar state and the per-step token bitmask of every constrained row.

GrammarState wraps one llguidance matcher. Invariant: the matcher has consumed exactly the sequence's
sampled output tokens, in order (`num_consumed` of them), so after preemption (recompute keeps the
tokens) or a prefix-cache hit nothing needs replaying. `fork` copies the state for an n > 1 sibling,
`rollback(n)` undoes the last n tokens (for speculative decoding).

BitmaskFiller fills one int32 row per constrained sampling row (bit t of the row allows token t) into
pinned host memory, all rows in one llguidance call that runs on its thread pool without the GIL, and
uploads it asynchronously. It runs after the step's forward pass was enqueued, so on a GPU the host
work overlaps the forward. `start` runs the fill of several rows on a worker thread: the caller's
Python work (emitting records, scheduling the next step) goes on meanwhile, and `join` uploads.
Matchers being filled must not be advanced before the join (the engine joins before it appends).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import torch

# The loop's thread runs Python almost without pause, so it holds the GIL; a thread waiting for the GIL
# gets it when the holder blocks or after the switch interval (5 ms by default), longer than a whole
# step: the worker would start the fill only at the join and overlap nothing. While a fill is pending the
# interval is this short, so the worker takes the GIL within tens of microseconds to enter llguidance
# (which then drops it) and again to hand back its result.
HANDOFF_SWITCH_INTERVAL_S = 5e-5
# llguidance's pool threads for a fill. The matchers of one cached grammar are copies that share its
# lexer behind one lock, so more threads mostly contend for it: 64 rows took 0.71-0.80 ms serially,
# 0.66-0.73 ms on 2 threads and 0.93-0.95 ms on 12 (llguidance's default on 16 cores) on the GPU host.
FILL_THREADS = 2


class GrammarError(RuntimeError):
    """The matcher refused a token (a bug, since the mask allows only tokens it accepts)."""


class GrammarState:
    __slots__ = ("matcher", "num_consumed")

    def __init__(self, matcher, num_consumed: int = 0):
        self.matcher = matcher  # an llguidance.LLMatcher owned by this sequence alone
        self.num_consumed = num_consumed

    @classmethod
    def start(cls, prototype) -> GrammarState:
        """A fresh state from a compiled prototype (engine/structured.GrammarCompiler.prototype)."""
        return cls(prototype.deep_copy())

    def advance(self, token: int) -> bool:
        """Consume one sampled token; True when the grammar is complete (only EOS could follow)."""
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self.num_consumed += 1
        return self.matcher.is_stopped()

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, n: int) -> None:
        """Undo the last n consumed tokens (n <= num_consumed)."""
        if not 0 <= n <= self.num_consumed:
            raise ValueError(f"cannot roll back {n} of {self.num_consumed} tokens")
        if n and not self.matcher.rollback(n):
            raise GrammarError(f"rollback of {n} tokens failed: {self.matcher.get_error()}")
        self.num_consumed -= n

    def fork(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy(), self.num_consumed)


class BitmaskFiller:
    """Fills and uploads the token bitmask of one step's constrained rows."""

    BUFFERS = 2  # a step launched ahead may still read the previous step's buffer: alternate

    def __init__(self, vocab_size: int, device: torch.device):
        self.words = (vocab_size + 31) // 32
        self.device = device
        self._pin = device.type == "cuda"
        self._buffers: list[tuple[torch.Tensor, torch.cuda.Event | None] | None] = [None] * self.BUFFERS
        # one event per buffer, recorded again at each upload; the engine enqueues on the device's
        # default stream, so it is looked up once (both cost tens of microseconds per step otherwise)
        self._events = [torch.cuda.Event() for _ in range(self.BUFFERS)] if self._pin else None
        self._stream = torch.cuda.current_stream(device) if self._pin else None
        self._turn = 0
        self._executor = None  # llguidance's own thread pool (fills rows in parallel)
        self._worker: _FillWorker | None = None  # runs a fill behind the caller's back

    def _buffer(self, rows: int) -> torch.Tensor:
        self._turn = (self._turn + 1) % self.BUFFERS
        entry = self._buffers[self._turn]
        if entry is None or entry[0].shape[0] < rows:
            size = max(rows, 2 * entry[0].shape[0] if entry else 8)
            buf = torch.empty(size, self.words, dtype=torch.int32, pin_memory=self._pin)
            self._buffers[self._turn] = (buf, None)
            return buf[:rows]
        buf, event = entry
        if event is not None:
            event.synchronize()  # its last upload has left (normally long ago)
        return buf[:rows]

    def fill(self, states: list[GrammarState]) -> torch.Tensor:
        """The bitmask [len(states), words] on the device (int32, bit t of word t // 32 allows t)."""
        return self.start(states, background=False)()

    def start(self, states: list[GrammarState], background: bool = True) -> Callable[[], torch.Tensor]:
        """Begin filling; the returned join waits for the fill, uploads, and gives the device bitmask.
        One row is filled at once (a thread hand-off would cost more than it hides)."""
        host, turn = self._buffer(len(states)), self._turn
        if not (background and len(states) > 1):
            self._fill_host(states, host)
            return lambda: self._upload(host, turn)
        if self._worker is None:
            self._worker = _FillWorker()
        rows = self._rows(states)  # built here: the worker runs as little Python as possible
        previous = sys.getswitchinterval()
        sys.setswitchinterval(min(previous, HANDOFF_SWITCH_INTERVAL_S))
        self._worker.submit(lambda: self._fill_rows(rows, host))

        def join() -> torch.Tensor:
            try:
                self._worker.join()
            finally:
                sys.setswitchinterval(previous)
            return self._upload(host, turn)

        return join

    def _fill_host(self, states: list[GrammarState], host: torch.Tensor) -> torch.Tensor:
        """llguidance writes each row's words at its pointer. Its own llguidance.torch wrappers are
        not used: importing that module runs torch.compile's set-up (about a second), which would
        stall the step loop on the first constrained request."""
        if len(states) == 1:
            states[0].matcher.unsafe_compute_mask_ptr(host.data_ptr(), host.shape[1] * host.element_size())
        else:
            self._fill_rows(self._rows(states), host)
        return host

    def _rows(self, states: list[GrammarState]) -> list[tuple[object, int]]:
        """The (matcher, row) pairs of one llguidance call; makes llguidance's pool on first use."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(FILL_THREADS)
        return [(s.matcher, i) for i, s in enumerate(states)]

    def _fill_rows(self, rows: list[tuple[object, int]], host: torch.Tensor) -> None:
        """All rows in one call on llguidance's pool, which drops the GIL while it works."""
        self._executor.unsafe_compute_mask_ptr(
            rows, host.data_ptr(), host.shape[1] * host.element_size(), len(rows)
        )

    def _upload(self, host: torch.Tensor, turn: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return host.clone()  # the buffer is refilled next step while a CPU caller may keep this
        out = host.to(self.device, non_blocking=True)
        event = self._events[turn]
        event.record(self._stream)
        self._buffers[turn] = (self._buffers[turn][0], event)
        return out


class _FillWorker:
    """One daemon thread running one job at a time. It waits on locks, which hold no GIL, and runs a
    few bytecodes of Python around each job, so the loop's thread loses the GIL only briefly
    (a ThreadPoolExecutor's futures and queue cost tens of microseconds of it per job)."""

    def __init__(self):
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job: Callable[[], None] | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="minserve-bitmask", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            try:
                self._job()
            except BaseException as exc:  # handed to the joining caller
                self._error = exc
            self._done.release()

    def submit(self, job: Callable[[], None]) -> None:
        """Start `job`; the previous one must have been joined."""
        self._job = job
        self._go.release()

    def join(self) -> None:
        """Wait for the job; re-raise its exception."""
        self._done.acquire()
        error, self._error, self._job = self._error, None, None
        if error is not None:
            raise error
