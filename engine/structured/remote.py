"""The engine's side of structured output's matcher process (engine/structured/process.py).

RemoteGrammar is a sequence's grammar state whose matcher lives in the child: the same contract as
engine/structured/state.GrammarState (push, check, fork, rollback; the consumed tokens followed by
`pending` are the sequence's sampled tokens), with its matcher named by a slot number. Creating,
forking, rolling back and dropping a state queue an operation that the next job carries.

ProcessBitmaskFiller fills the constrained rows' bitmask in the child: `start` hands the states'
pending tokens and their rows over in one message, `join` waits for the reply. The host rows are the
shared file the child writes, registered as pinned memory on a GPU, where the draw reads them in
place (engine/device/uploader.device_view). Nothing in the loop's process waits for a GIL hand-off.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable

import torch

from engine.device.uploader import device_view
from engine.structured.process import PIN_CORES, THREADS, GrammarProcess
from engine.structured.state import BitmaskFiller, GrammarError, SampledTokens, _Buffers


class RemoteGrammar(SampledTokens):
    __slots__ = ("service", "slot", "__weakref__")

    def __init__(self, service: GrammarProcess, slot: int, num_consumed: int = 0, pending=None):
        super().__init__(num_consumed, pending)  # num_consumed: tokens sent to the child
        self.service = service
        self.slot = slot  # the child's name for this state's matcher

    def refused(self, message: str) -> None:
        if self.error is None:
            self.error = message

    def fork(self) -> RemoteGrammar:
        """A copy for an n > 1 sibling: the child copies the matcher as it stands after every operation
        and job sent so far, which is what `num_consumed` counts."""
        slot = _new_slot()
        self.service.ops.append(("fork", slot, self.slot))
        return RemoteGrammar(self.service, slot, self.num_consumed, list(self.pending))

    def rollback(self, n: int) -> None:
        """Undo the last n sampled tokens, pending ones first. A failed rollback in the child (it
        keeps fewer tokens than asked) surfaces as `error` at the next join."""
        n = self._drop_pending(n)
        if n:
            self.service.ops.append(("rollback", self.slot, n))
            self.num_consumed -= n

    def release(self) -> None:
        """Free the child's matcher (once): when the request retires, since a request and its
        sequences form a reference cycle that only the cyclic collector would otherwise break."""
        if self.slot is not None:
            self.service.ops.append(("free", self.slot))
            self.slot = None

    def __del__(self) -> None:
        try:
            self.release()
        except AttributeError:  # interpreter shutdown, or __init__ never ran
            pass


_slots = itertools.count()


def _new_slot() -> int:
    return next(_slots)


class ProcessBitmaskFiller(BitmaskFiller):
    """BitmaskFiller whose consumes and fills run in the matcher process."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        max_rows: int,
        threads: int = THREADS,
        pin_cores: bool = PIN_CORES,
    ):
        super().__init__(vocab_size, device)
        self.max_rows, self.threads, self.pin_cores = max_rows, threads, pin_cores
        self.service: GrammarProcess | None = None  # started with the first constrained request

    def new_state(self, so, compiler) -> RemoteGrammar:
        if self.service is None:
            self._start_service(compiler.tokenizer_spec)
        slot = _new_slot()
        self.service.ops.append(("new", slot, so.kind, compiler.key(so)[1]))
        return RemoteGrammar(self.service, slot)

    def _start_service(self, tokenizer_spec: tuple) -> None:
        service = GrammarProcess(
            tokenizer_spec, self.max_rows, self.words, self.BUFFERS, self.threads, self.pin_cores
        )
        host = torch.frombuffer(service.buffer, dtype=torch.int32)
        host = host.view(self.BUFFERS, self.max_rows, self.words)
        if self._pin:  # the child's rows become pinned memory the device reads in place
            status = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * 4, 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister of the grammar buffer failed ({status})")
        for turn in range(self.BUFFERS):
            view = device_view(host[turn], self.device) if self._pin else None
            self._buffers[turn] = _Buffers(host[turn], view)
        self.service = service
        weakref.finalize(self, _close, service, host if self._pin else None)

    def _buffer(self, rows: int) -> torch.Tensor:
        if rows > self.max_rows:
            raise GrammarError(f"{rows} constrained rows in one step, above max_num_seqs {self.max_rows}")
        return super()._buffer(rows)

    def start(self, states: list[RemoteGrammar], background: bool = True) -> Callable[[], torch.Tensor]:
        """Send the job now; the returned join waits for the child's reply and gives the rows."""
        host, turn = self._buffer(len(states)), self._turn
        fill, slots, tokens = [], [], []
        for state in states:
            slot, pending = state.slot, state.pending
            if slot is None:
                fill.append(-1)
                continue
            fill.append(slot)
            if pending:
                if len(pending) > 1:  # earlier tokens, consumed one by one before the job's
                    self.service.ops.append(("consume", slot, pending[:-1]))
                slots.append(slot)
                tokens.append(pending[-1])
                state.num_consumed += len(pending)
                pending.clear()
        self.service.submit(turn, fill, slots, tokens)

        def join() -> torch.Tensor:
            refusals = self.service.wait()
            if refusals:
                owners = {s.slot: s for s in states}
                for slot, message in refusals:
                    if slot in owners:
                        owners[slot].refused(message)
            return self._device_rows(host, turn)

        return join


def _close(service: GrammarProcess, pinned: torch.Tensor | None) -> None:
    if pinned is not None:
        with contextlib.suppress(RuntimeError):  # CUDA may be torn down already at exit
            torch.cuda.synchronize()  # no draw enqueued earlier may still read the rows
        torch.cuda.cudart().cudaHostUnregister(pinned.data_ptr())
    service.close()
