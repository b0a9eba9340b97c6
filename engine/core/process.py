"""The engine core process: the LLMEngine's step loop alone in a process of its own.

The server's engine replica starts it (`python -m engine.core.process FD PARENT_PID`, engine/core_client.py)
and talks to it over one Unix socket: multiprocessing.connection framing, pickled messages
(engine/core/messages.py). Each turn:
  1. read every command that has arrived: batches of Add, Abort, StopSample and Shutdown;
  2. run one engine step;
  3. send ONE message for the whole step, a Step with every request's new token ids.
Nothing else runs here: no event loop, no HTTP, no metrics, no text. The replica detokenizes, matches
stop strings (and sends the stop back), builds output objects and records metrics. The one feature
that needs text inside the loop, the calculator tool, decodes only its expression when a tool call
ends (engine/output/processor.py), and budget forcing encodes its replacement once per string.

Between steps the loop also opens and closes a kernel-trace window on SIGUSR1 / SIGUSR2, for
measuring how busy the GPU is (engine/core/kernel_trace.py).

Why a process: per-token Python in the replica (Serve's streaming, metrics) would otherwise share a
GIL with the thread that launches the forward passes, slowing every step (vLLM's EngineCore and
SGLang's scheduler process exist for the same reason).

Lifetime: the core never outlives its replica. It asks the kernel for SIGKILL when the thread that
started it goes away (PR_SET_PDEATHSIG; that thread lives as long as the replica), and a closed
socket (EOF, or EPIPE on send) ends the loop too. Its tensor-parallel workers, if any, never outlive
it (engine/runner/tp_group.py), and one that dies fails the core, idle or not: Dead, then exit 1.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection

from engine.core.kernel_trace import KernelTrace
from engine.core.messages import (
    Abort,
    Add,
    AddLoRA,
    Command,
    Dead,
    Failed,
    FinalMetrics,
    Idle,
    Ready,
    Record,
    Records,
    RemoveLoRA,
    Sample,
    Shutdown,
    Start,
    Step,
    StopSample,
)
from engine.core.pace_log import PaceLog
from engine.errors import EngineError, QueueFullError

log = logging.getLogger("engine.core.process")
IDLE_POLL_S = 1.0  # how often an idle core checks that its parent is still there
STATS_EVERY_S = 0.05  # a stats snapshot rides on a step message at most this often
SUMMARY_EVERY_S = 1.0  # and the prefix cache's summary (for routers) on one of them at most this often
SUMMARY_MAX_HASHES = 4096


def _final(rid: str, reason: str, error: str | None = None) -> Record:
    """The final record of a request the engine never held (aborted or refused on the way in)."""
    sample = Sample(0, [], [], finish_reason=reason, error=error)
    return Record(rid, [sample], finished=True, final_metrics=FinalMetrics(None, None))


class EngineCore:
    """The loop: apply commands, step, send. `engine` is an LLMEngine(detokenize=False) or a stand-in
    with the same surface (engine/core/null_engine.py). `prefix_summary`: the stats carry the prefix
    cache's summary, which only prefix-aware routing reads (building it walks the cache). `trace`: the
    kernel-trace window that SIGUSR1 / SIGUSR2 open and close (engine/core/kernel_trace.py)."""

    def __init__(
        self, engine, conn: Connection, prefix_summary: bool = False, trace: KernelTrace | None = None
    ):
        self.engine = engine
        self.conn = conn
        self.prefix_summary = prefix_summary
        self.trace = trace or KernelTrace()
        self.deferred: list[Add] = []  # adds waiting for room in the scheduler's queue, in order
        self.pending: list[Record] = []  # final records produced between steps (aborts, refusals)
        self.aborted_unadded = 0  # aborts of requests still in `deferred`: the engine never saw them
        self.lora_commands = 0  # AddLoRA / RemoveLoRA applied (the client's mirror: engine/lora/mirror.py)
        self.running = True
        self._last_stats = self._last_summary = 0.0
        self._busy_shown = False  # the last stats showed the GPU busy: an idle core keeps them fresh
        scheduler = getattr(engine, "scheduler", None)  # a stand-in engine (null_engine) has none
        self.pace = PaceLog.from_env() if scheduler is not None else None  # engine/core/pace_log.py

    def run(self) -> int:
        """The loop, until shutdown (0), the replica going away (0) or the loop failing (1: the replica
        is told why with a Dead message before this returns)."""
        try:
            self._loop()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return 0  # the replica is gone
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
            log.error("engine loop died: %s\n%s", message, traceback.format_exc())
            try:
                self.conn.send(Dead(message))
            except OSError:
                pass
            return 1
        return 0

    def _loop(self) -> None:
        idle_sent = False
        while self.running:
            if self.trace.requests:  # a kernel-trace window opens or closes between steps
                self.trace.act()
            self.apply_deferred()
            if self.engine.has_unfinished():
                idle_sent = False
                self.send_step(self.engine.step_records())
                if self.pace is not None:
                    self.pace.step(self.engine.scheduler)
                self.read(timeout=0.0)
                continue
            if self.pending or not idle_sent:  # at start too: the replica has stats before any request
                self.send_step(Records.of([]))
                self.conn.send(Idle(self.stats(summary=True), self.engine.audit()))
                idle_sent = True
            elif self._busy_shown:  # the running GPU-busy estimate decays to 0 while idle
                self.conn.send(Step(Records.of([]), self.stats()))
            # a tensor-parallel worker that died while nothing ran fails the core now (TPWorkerError),
            # so the replica turns unhealthy within IDLE_POLL_S instead of at its next request
            self.engine.check_workers()
            self.read(timeout=0.0 if self.deferred else IDLE_POLL_S)

    def send_step(self, records: Records) -> None:
        """The step's records, after the final records produced since the last step."""
        now = time.monotonic()
        if self.pending:
            records, self.pending = Records.of(self.pending).concat(records), []
        stats = None
        if now - self._last_stats >= STATS_EVERY_S:
            stats, self._last_stats = self.stats(), now
        if records.num_requests or stats is not None:
            self.conn.send(Step(records, stats))

    def stats(self, summary: bool = False) -> dict:
        """The engine's stats; with the prefix cache's summary (when the core publishes it) when
        `summary` or when it is due."""
        stats = self.engine.get_stats()
        stats["num_aborts"] += self.aborted_unadded
        self._busy_shown = bool(stats.get("gpu_busy_estimate"))
        if getattr(self.engine, "list_loras", None) is not None:
            stats["loras"] = (self.lora_commands, self.engine.list_loras())
        if not self.prefix_summary:
            return stats
        now = time.monotonic()
        if summary or now - self._last_summary >= SUMMARY_EVERY_S:
            stats["prefix_summary"] = self.engine.prefix_summary(SUMMARY_MAX_HASHES)
            self._last_summary = now
        return stats

    def read(self, timeout: float) -> None:
        """Apply every command that arrived; wait up to `timeout` for the first one."""
        if not self.conn.poll(timeout):
            return
        while self.running:
            for command in self.conn.recv():
                self.apply(command)
            if not self.conn.poll(0):
                return

    def apply(self, command: Command) -> None:
        if isinstance(command, Add):
            self.deferred.append(command)
        elif isinstance(command, Abort):
            self.abort(command.request_id)
        elif isinstance(command, StopSample):
            self.engine.stop_sample(command.request_id, command.index)
        elif isinstance(command, Shutdown):
            self.running = False
        elif isinstance(command, (AddLoRA, RemoveLoRA)):
            self.apply_lora(command)
        else:
            raise TypeError(f"unknown engine-core command {command!r}")

    def apply_lora(self, command: AddLoRA | RemoveLoRA) -> None:
        """An adapter into or out of the host cache. The client checked it; a file that changed since
        is logged, and its requests fail when they run."""
        self.lora_commands += 1
        if getattr(self.engine, "list_loras", None) is None:
            return  # a stand-in engine (null_engine) holds no adapters
        try:
            if isinstance(command, AddLoRA):
                self.engine.add_lora(command.lora_request)
            else:
                self.engine.remove_lora(command.lora_name)
        except EngineError as exc:
            log.warning("LoRA command %r failed: %s", command, exc)

    def abort(self, rid: str) -> None:
        if any(c.request_id == rid for c in self.deferred):  # aborted before the engine took it
            self.deferred = [c for c in self.deferred if c.request_id != rid]
            self.aborted_unadded += 1
            self.pending.append(_final(rid, "abort"))
            return
        record = self.engine.abort_record(rid)
        if record is not None:
            self.pending.append(record)

    def apply_deferred(self) -> None:
        """Hand queued adds to the engine in arrival order, until its queue is full.

        The replica admitted each request against the engine's capacity before answering 200, but the
        scheduler's queue can have grown since (preempted sequences): a request then waits here instead
        of failing after its caller was told it was accepted."""
        while self.deferred:
            add = self.deferred[0]
            try:
                lora = {"lora_request": add.lora_request} if add.lora_request is not None else {}
                self.engine.add_request(add.prompt_ids, add.params, add.request_id, add.arrival_time, **lora)
            except QueueFullError:
                return
            except EngineError as exc:
                self.pending.append(_final(add.request_id, "error", str(exc)))
            self.deferred.pop(0)


def _die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (Linux; elsewhere the socket's EOF)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _build(config, null_step_ms: float | None):
    if null_step_ms is not None:
        from engine.core.null_engine import NullEngine

        return NullEngine(config, null_step_ms)
    from engine.llm_engine import LLMEngine

    return LLMEngine(config, detokenize=False)


def main(fd: int, parent_pid: int) -> int:
    _die_with_parent()
    if os.getppid() != parent_pid:
        return 1  # the parent died before the death signal was armed
    logging.basicConfig(level=logging.INFO, format="engine-core %(levelname)s %(message)s")
    trace = KernelTrace()
    trace.install()  # before the model loads: a signal that comes early is queued, never fatal
    conn = Connection(fd)
    start: Start = conn.recv()
    try:
        engine = _build(start.config, start.null_step_ms)
    except BaseException as exc:
        conn.send(Failed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return 1
    conn.send(Ready(engine.limits, getattr(engine, "lora_shapes", None)))
    return EngineCore(engine, conn, start.prefix_summary, trace).run()


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
