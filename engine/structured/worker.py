"""Structured output's matcher process: the child side of engine/structured/process.py.

It holds every constrained sequence's llguidance matcher by slot, applies the engine's state
operations in order, and answers each job (consume the step's tokens, then fill the rows' masks into
the shared buffer) with one reply. No torch: it starts in well under a second.

    python -m engine.structured.worker FD   # started by GrammarProcess, never by hand
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import sys
import time
from array import array
from collections import OrderedDict

from engine.structured.process import DONE, FAILED, OPS, READY, TIMES, Channel

PROTOTYPES = 256  # compiled grammars kept in the child (the engine's compiler keeps its own)
STATES_PER_REPLICA = 8  # live states per independently compiled replica of a constraint


class _Matchers:
    """The child's side: matchers by slot, compiled prototypes by (kind, spec), and llguidance's pool."""

    def __init__(self, tokenizer_spec: tuple, threads: int):
        import llguidance

        from engine.structured import compiler as structured

        text, n_vocab, eos = tokenizer_spec
        self.llg, self.structured = llguidance, structured
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
        self.limits = structured.limits()
        self.pool = llguidance.LLExecutor(threads)
        self.replicas = threads
        self.by_slot: dict[int, object] = {}
        self.key_of: dict[int, tuple[str, str]] = {}  # slot -> its constraint, for `live`
        self.live: dict[tuple[str, str], int] = {}  # states per constraint
        self.prototypes: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.refusals: list[tuple[int, str]] = []

    def prototype(self, key: tuple[str, str]):
        """One of the constraint's independently compiled replicas. Deep copies of one compiled
        matcher share its lexer behind a lock, so the pool's threads fill rows of different
        replicas in parallel but would wait on each other over copies of one. A replica is compiled
        per STATES_PER_REPLICA live states of the constraint (up to one per thread): a lone request
        reuses the warm first one, and a batch of one schema spreads over several."""
        found = self.prototypes.setdefault(key, [])
        self.prototypes.move_to_end(key)
        while len(self.prototypes) > PROTOTYPES:
            self.prototypes.popitem(last=False)
        live = self.live.get(key, 0)
        if len(found) < min(self.replicas, 1 + live // STATES_PER_REPLICA):
            grammar = self.structured.grammar_text(*key)
            found.append(self.llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits))
        return found[live % len(found)]

    def track(self, slot: int, key: tuple[str, str] | None) -> None:
        """Count `slot` as a live state of `key` (None: drop it)."""
        old = self.key_of.pop(slot, None)
        if old is not None:
            self.live[old] -= 1
        if key is not None:
            self.key_of[slot] = key
            self.live[key] = self.live.get(key, 0) + 1

    def apply(self, op: tuple) -> None:
        name, slot = op[0], op[1]
        if name == "new":  # ("new", slot, kind, spec): the engine compiled it already (admission)
            matcher = self.prototype((op[2], op[3])).deep_copy()
            if matcher.is_error():
                self.refusals.append((slot, matcher.get_error()))
            self.by_slot[slot] = matcher
            self.track(slot, (op[2], op[3]))
        elif name == "fork":  # ("fork", slot, source)
            self.by_slot[slot] = self.by_slot[op[2]].deep_copy()
            self.track(slot, self.key_of.get(op[2]))
        elif name == "free":
            self.by_slot.pop(slot, None)
            self.track(slot, None)
        elif name == "consume":  # ("consume", slot, tokens): earlier tokens than a job's one
            matcher = self.by_slot[slot]
            for token in op[2]:
                self.consume(slot, matcher, token, matcher.consume_token(token))
        elif name == "rollback":  # ("rollback", slot, n)
            matcher = self.by_slot[slot]
            if not matcher.rollback(op[2]):
                self.refusals.append((slot, f"rollback of {op[2]} tokens failed: {matcher.get_error()}"))
        else:
            raise ValueError(f"unknown grammar operation {name!r}")

    def consume(self, slot: int, matcher, token: int, ok: bool) -> None:
        if not ok:
            self.refusals.append((slot, f"the grammar refused token {token}: {matcher.get_error()}"))

    def job(self, base: int, row_bytes: int, fill, slots, tokens) -> list:
        if slots:
            pairs = [(self.by_slot[slot], token) for slot, token in zip(slots, tokens, strict=True)]
            if len(pairs) > 1:
                verdicts = self.pool.consume_token_par(pairs)
            else:
                verdicts = [pairs[0][0].consume_token(pairs[0][1])]
            if not all(verdicts):
                for slot, (matcher, token), ok in zip(slots, pairs, verdicts, strict=True):
                    self.consume(slot, matcher, token, ok)
        # slot -1: a state released (its request aborted) after its step was scheduled; the row's
        # draw is discarded, so its mask is left as it was
        rows = [(self.by_slot[slot], i) for i, slot in enumerate(fill) if slot >= 0]
        if len(rows) == 1:
            matcher, i = rows[0]
            matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        elif rows:
            self.pool.unsafe_compute_mask_ptr(rows, base, row_bytes, len(fill))
        refusals, self.refusals = self.refusals, []
        return refusals


def _set_up(channel: Channel) -> tuple[mmap.mmap, _Matchers, int, int]:
    """Take the engine's set-up message: pin the CPUs, map the shared mask buffer, build the matchers.
    Returns (the buffer, the matchers, one turn's bytes, one row's bytes)."""
    kind, payload = channel.recv()
    path, tokenizer_spec, rows, words, turns, threads, cpus = pickle.loads(payload)
    if cpus:  # before llguidance's pool starts: its threads inherit this
        os.sched_setaffinity(0, cpus)
    with open(path, "r+b") as f:
        buffer = mmap.mmap(f.fileno(), turns * rows * words * 4)
    os.unlink(path)  # both processes have it mapped: nothing is left behind if either dies
    return buffer, _Matchers(tokenizer_spec, threads), rows * words * 4, words * 4


def _run_job(matchers: _Matchers, payload: bytes, base: int, turn_bytes: int, row_bytes: int) -> bytes:
    """One job (turn, n, n rows to fill, then the slots and tokens to consume first), done into the
    buffer at `base`. Returns DONE's payload: start and end times, then the refusals if there were any."""
    began = time.perf_counter()
    job = array("i")
    job.frombytes(payload)
    turn, n = job[0], job[1]
    half = (len(job) - 2 - n) // 2
    fill, slots, tokens = job[2 : 2 + n], job[2 + n : 2 + n + half], job[2 + n + half :]
    refusals = matchers.job(base + turn * turn_bytes, row_bytes, fill, slots, tokens)
    extra = pickle.dumps(refusals) if refusals else b""
    return TIMES.pack(began, time.perf_counter()) + extra


def serve(channel: Channel) -> None:
    """The child's loop: set up, then one reply per job until the engine closes the socket."""
    import ctypes

    buffer, matchers, turn_bytes, row_bytes = _set_up(channel)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))  # `buffer` lives as long as this loop
    channel.send(READY)
    failed = None  # an operation's failure, answered in place of the next job's reply
    while True:
        try:
            kind, payload = channel.recv()
        except (EOFError, OSError):
            return
        if kind == OPS:  # applied now, answered with the next job
            try:
                for op in pickle.loads(payload):
                    matchers.apply(op)
            except Exception as exc:  # noqa: BLE001
                failed = failed or f"{type(exc).__name__}: {exc}"
            continue
        try:
            if failed is not None:
                raise RuntimeError(failed)
            channel.send(DONE, _run_job(matchers, payload, base, turn_bytes, row_bytes))
        except Exception as exc:  # noqa: BLE001 - handed to the engine, which fails the step
            failed = None
            channel.send(FAILED, f"{type(exc).__name__}: {exc}".encode())


if __name__ == "__main__":
    serve(Channel(socket.socket(fileno=int(sys.argv[1]))))
