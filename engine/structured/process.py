"""Structured output's matchers in a process of their own, beside the engine's step loop.

A host-bound step loop (a small model at a large batch) runs Python without pause, and a matcher
thread in the same process costs it a GIL hand-off each time the thread needs the interpreter: to
start a job, between llguidance's calls, to hand back the result. Here the matchers live in a child
process with its own interpreter. Per step the loop sends one message (the rows to fill, the tokens to
consume first, the state operations queued since the last step) and later reads one reply (refusals).
The masks go through a shared-memory file that the device reads in place, so nothing is copied.

The child applies the messages in order: state operations, then the job's consumes, then its fill.
The engine's view of each state (engine/structured/remote.RemoteGrammar) is therefore exact whenever it
sends: every operation it queued is applied before any later job reads the matcher.

No torch here or in the child (engine/structured/worker.py), which imports only llguidance and
engine/structured (grammar texts, limits).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.device.cpus import last_cores, whole_cores

READY_TIMEOUT_S = 120.0  # generous: the child builds the tokenizer's token trie before it is ready
# llguidance's pool threads in the child, and at most as many independently compiled replicas per
# constraint. More threads shorten the child's consume and fill, which the loop does not wait for; half
# the cores leaves the rest to the loop and the replica (benchmarks/reports/gpu/structured_process_h100.md).
THREADS = int(os.environ.get("MINSERVE_GRAMMAR_THREADS", min(8, max(1, (os.cpu_count() or 2) // 2))))
PIN_CORES = os.environ.get("MINSERVE_GRAMMAR_PIN", "1") == "1"  # split_cpus below
ROOT = Path(__file__).resolve().parents[2]


class GrammarProcessError(RuntimeError):
    """The grammar process failed or stopped answering."""


class GrammarProcess:
    """The engine's handle on the child: its channel and the shared mask buffer.

    `buffer` is `turns` arrays of [rows, words] int32 words, back to back, that the child fills and
    the device reads. Operations queue in `ops` until the next `submit` sends them with its job."""

    def __init__(
        self,
        tokenizer_spec: tuple,
        rows: int,
        words: int,
        turns: int,
        threads: int = THREADS,
        pin_cores: bool = PIN_CORES,
    ):
        self.rows, self.words, self.turns = rows, words, turns
        self.ops: list[tuple] = []
        # the last job's times on the shared monotonic clock (time.perf_counter), for benchmarks:
        # sent by the engine, started and ended in the child
        self.sent_at = self.began_at = self.ended_at = 0.0
        self._ready = False
        size = turns * rows * words * 4
        fd, path = tempfile.mkstemp(prefix="minserve-grammar-", dir=buffer_dir(size))
        self._path = path
        try:
            os.ftruncate(fd, size)
            self.buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        ours, theirs = socket.socketpair()
        path_list = [str(ROOT), os.environ.get("PYTHONPATH")]  # the child imports engine/ from here
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path_list)))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "engine.structured.worker", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._channel = Channel(ours)
        child_cpus = split_cpus(threads) if pin_cores else None
        setup = (path, tokenizer_spec, rows, words, turns, threads, child_cpus)
        self._channel.send(SETUP, pickle.dumps(setup, protocol=pickle.HIGHEST_PROTOCOL))

    def submit(self, turn: int, fill: list[int], slots: list[int], tokens: list[int]) -> None:
        """Send the queued operations and one job: slots[i] consumes tokens[i], then row i of buffer
        `turn` gets slot fill[i]'s mask. `wait` must be called before the next submit. The job goes
        as packed int32s (far cheaper than pickling its tuples): turn, len(fill), fill,
        slots, tokens."""
        if not self._ready:
            self._channel.sock.settimeout(READY_TIMEOUT_S)
            self._expect(READY, READY_TIMEOUT_S)
            # blocking from now on: a timeout makes every recv a poll, a recv and two fcntl calls
            # (dear on a VM); a stuck job is bounded by llguidance's fuel, and a
            # dead child closes the socket
            self._channel.sock.settimeout(None)
            self._ready = True
        job = struct.pack(f"={2 + len(fill) + 2 * len(slots)}i", turn, len(fill), *fill, *slots, *tokens)
        try:
            if self.ops:
                ops, self.ops = self.ops, []
                self._channel.send(OPS, pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL))
            self._channel.send(JOB, job)
            self.sent_at = time.perf_counter()
        except OSError as exc:
            raise GrammarProcessError(f"the grammar process is gone ({exc})") from None

    def wait(self) -> list[tuple[int, str]]:
        """The job's refusals: (slot, llguidance's message) per token a matcher did not accept."""
        payload = self._expect(DONE, None)
        self.began_at, self.ended_at = TIMES.unpack_from(payload)
        return pickle.loads(payload[TIMES.size :]) if len(payload) > TIMES.size else []

    def _expect(self, kind: int, timeout: float | None) -> bytes:
        try:
            got, payload = self._channel.recv()
        except TimeoutError:
            raise GrammarProcessError(f"the grammar process did not answer within {timeout:g} s") from None
        except (EOFError, OSError) as exc:
            code = self._proc.poll()
            raise GrammarProcessError(f"the grammar process exited (code {code}): {exc!r}") from None
        if got != kind:
            raise GrammarProcessError(f"the grammar process failed: {payload.decode(errors='replace')}")
        return payload

    def close(self) -> None:
        """Stop the child (it also stops by itself when the engine's end of the socket closes)."""
        with contextlib.suppress(FileNotFoundError):  # the child unlinks it once mapped
            os.unlink(self._path)
        self._channel.sock.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def buffer_dir(size: int, shm: str = "/dev/shm") -> str | None:
    """Where the shared mask buffer goes: /dev/shm when it has room for twice `size` (a container's
    default 64 MiB may not: writing past a full tmpfs kills the writer with SIGBUS), else the
    system's temporary directory (None), whose page cache serves the same purpose."""
    try:
        stat = os.statvfs(shm)
    except OSError:
        return None
    return shm if stat.f_bavail * stat.f_frsize >= 2 * size else None


def split_cpus(threads: int) -> list[int] | None:
    """The child's CPUs: whole cores at the end of the process's set (engine/device/cpus.py says why),
    as many as its threads, at most half the cores. None (unpinned) under four cores."""
    return last_cores(max(1, min(threads, len(whole_cores()) // 2)))


# message kinds on the channel
SETUP, READY, OPS, JOB, DONE, FAILED = range(6)
HEADER = struct.Struct("=iI")  # kind, payload bytes
TIMES = struct.Struct("=dd")  # a job's start and end in the child; pickled refusals may follow


class Channel:
    """Length-prefixed messages over a stream socket: one send per message, and usually one recv
    (multiprocessing's Connection costs a selector and several reads, tens of microseconds)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray()
        self._chunk = bytearray(1 << 16)  # recv_into this: no 64 KiB bytes object per read

    def send(self, kind: int, payload: bytes = b"") -> None:
        self.sock.sendall(HEADER.pack(kind, len(payload)) + payload)

    def recv(self) -> tuple[int, bytes]:
        while True:
            if len(self._buf) >= HEADER.size:
                kind, size = HEADER.unpack_from(self._buf)
                end = HEADER.size + size
                if len(self._buf) >= end:
                    payload = bytes(self._buf[HEADER.size : end])
                    del self._buf[:end]
                    return kind, payload
            got = self.sock.recv_into(self._chunk)
            if not got:
                raise EOFError("the other end closed the channel")
            self._buf += memoryview(self._chunk)[:got]
