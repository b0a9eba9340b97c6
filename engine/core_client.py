"""The server's side of the engine core process (engine/core/process.py): start it, feed it, read it.

    client = CoreClient(config, on_step)       # starts `python -m engine.core.process`, waits for the model
    rid = client.submit(prompt, params)         # any thread; validation errors are raised here
    client.abort(rid)                           # the request ends now: no further outputs
    ...on_step(outputs) is called once per engine step, on the client's reader thread

Requests and aborts go to the core in batches: they queue in an outbox, and `flush` sends all of it
as one message. With autoflush (the default) every call flushes; a server passes autoflush=False and
calls `flush` once per turn of its event loop, so what arrived in that turn travels together.

The core answers with one message per step holding every request's new token ids; the reader thread
turns them into text here (engine/output/text.TextStream: detokenization and stop strings, which go
back to the core as StopSample), builds the RequestOutputs and hands the whole step's list to
`on_step` in one call.

With deferred_text (a server whose streams send one item per several steps), the reader only stashes
each record and hands `on_step` a StepNote per request; the consumer calls `take(request_id)` when it
is about to send (engine/core/deferred_text.py).

Transport: multiprocessing.connection over a Unix socketpair with pickled messages
(engine/core/messages.py; stdlib, no extra dependency). A step message grows by a few dozen bytes per
record; what it costs the core to send: `python -m benchmarks.core_transport` (benchmarks/reports/).
Every request gets exactly one final output (finished=True), unless it was aborted by the caller:
also when it fails, or when the core dies (the error says why).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from engine.config import EngineConfig
from engine.core.deferred_text import StepNote, stash_step, take_output
from engine.core.faults import FaultInjector
from engine.core.live_request import LiveRequest, guarded
from engine.core.messages import (
    Abort,
    Add,
    AddLoRA,
    Command,
    Dead,
    Failed,
    Idle,
    Ready,
    Records,
    RemoveLoRA,
    Shutdown,
    Start,
    Step,
)
from engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from engine.lora.admission import LoRAAdmission
from engine.lora.mirror import LoRAMirror
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sched import admission
from engine.sched.admission import Prompt
from engine.structured import compiler as structured
from engine.tokenizer import Tokenizer

log = logging.getLogger("engine")
ROOT = Path(__file__).resolve().parents[1]
OnStep = Callable[[list], None]  # list[RequestOutput], or list[StepNote] with deferred_text
__all__ = ["CoreClient", "OnStep", "StepNote"]


class CoreClient:
    def __init__(
        self,
        config: EngineConfig,
        on_step: OnStep,
        null_step_ms: float | None = None,
        autoflush: bool = True,
        prefix_summary: bool = False,
        env: dict[str, str] | None = None,
        deferred_text: bool = False,
    ):
        """prefix_summary: the core publishes its prefix cache's summary (`prefix_summary()`), for
        prefix-aware routing; without it the core never builds one. env: variables set in the core's
        environment (and its tensor-parallel workers'), e.g. the GPUs of a server's placement group.
        deferred_text: on_step gets StepNotes, and outputs come from `take` (module docstring)."""
        self.model_name = config.load.model.rstrip("/").split("/")[-1]
        self._on_step = on_step
        self._deferred = deferred_text
        self._live: dict[str, LiveRequest] = {}
        self._lock = threading.Lock()
        self._outbox: list[Command] = []
        self._send_lock = threading.Lock()  # one sender at a time, batches in outbox order
        self._autoflush = autoflush
        self._closing = False
        self.death: str | None = None
        self._stats: dict = {}
        self._prefix_summary: tuple[int, list[int], list[int]] = (1, [], [])
        self._audit: list[str] = []
        self.proc, self._conn = self._start(Start(config, null_step_ms, prefix_summary), env or {})
        ready = self._tokenizer_then_ready(config.load.model)
        self._fault = FaultInjector(config.fault_injection, self.tokenizer.decode).checker()
        self.limits: admission.Limits = ready.limits
        self._loras = LoRAMirror(LoRAAdmission(ready.lora_shapes, config.max_lora_rank))
        self.max_model_len = self.limits.max_model_len
        structured.warm_up(self.tokenizer, self.limits.vocab_size)  # admission compiles constraints here too
        threading.Thread(target=self._read, name="core-reader", daemon=True).start()

    # ------------------------------------------------------------------ starting the core
    def _start(self, start: Start, extra_env: dict[str, str]):
        """Spawn the core from a keeper thread that then waits on it for the core's whole life: the
        core's death signal is tied to the thread that started it (engine/core/process.py). The reader thread,
        not the keeper, reports the core's end: it sees EOF only after the core's last message."""
        ours, theirs = socket.socketpair()
        started: list = []
        ready = threading.Event()

        def keeper() -> None:
            env = {
                **os.environ,
                **extra_env,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            }
            cmd = [sys.executable, "-m", "engine.core.process", str(theirs.fileno()), str(os.getpid())]
            try:
                started.append(subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env=env, cwd=ROOT))
            except BaseException as exc:
                started.append(exc)
            finally:
                ready.set()
            if isinstance(started[0], subprocess.Popen):
                started[0].wait()

        threading.Thread(target=keeper, name="core-keeper", daemon=True).start()
        ready.wait()
        theirs.close()
        if isinstance(started[0], BaseException):
            raise started[0]
        conn = _CoreConnection(ours.detach())
        conn.send(start)
        return started[0], conn

    def _tokenizer_then_ready(self, model_dir: str) -> Ready:
        """Load this side's tokenizer while the core starts (imports, weights), then wait for the core's
        Ready. If either fails, the core is ended before the error propagates: nothing is left behind."""
        try:
            self.tokenizer = Tokenizer.from_dir(model_dir)
            return self._conn.recv_ready()
        except BaseException:
            self._conn.close()
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            raise

    # ------------------------------------------------------------------ called from any thread
    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; raises EngineError subclasses synchronously (LoRAError for
        an adapter whose files do not fit: the core reads it when the request first runs)."""
        if not self.is_alive():
            raise EngineDeadError(f"the engine core is not running ({self.death or 'exited'})")
        ids = admission.tokenize(self.tokenizer, prompt, self.limits.vocab_size)
        admission.check(ids, params, self.limits, self.tokenizer)
        self._loras.check(lora_request)
        arrival = arrival_time or time.time()
        with self._lock:
            # checked again under the lock that `_fail_all` holds: a request added after the core's
            # death was declared would never get its final output
            if self.death is not None:
                raise EngineDeadError(f"the engine core is not running ({self.death})")
            if len(self._live) >= self.limits.max_num_seqs + self.limits.max_waiting:
                raise QueueFullError("the engine is at capacity: retry later")
            request_id = request_id or f"req-{uuid.uuid4().hex}"
            if request_id in self._live:
                raise InvalidRequestError(f"request_id: {request_id!r} is in use", field="request_id")
            self._live[request_id] = LiveRequest(request_id, ids, params, arrival, self.tokenizer)
            self._outbox.append(Add(request_id, ids, params, arrival, lora_request))
        if self._autoflush:
            self.flush()
        return request_id

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._live.pop(request_id, None) is None:
                return
            self._outbox.append(Abort(request_id))
        if self._autoflush:
            self.flush()

    # ------------------------------------------------------------------ LoRA adapters (vLLM's names)
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Check the adapter here (LoRAError) and have the core read it into its host cache."""
        self._loras.check(lora_request)
        self._send_lora(AddLoRA(lora_request), lambda: self._loras.added(lora_request))

    def remove_lora(self, lora_name: str) -> bool:
        """Drop the adapter from the core's caches (requests running with it finish first); False
        when the core's host cache did not hold it (as last mirrored)."""
        return self._send_lora(RemoveLoRA(lora_name), lambda: self._loras.removed(lora_name))

    def list_loras(self) -> list[str]:
        """The adapters in the core's host cache, least recently used first."""
        return self._loras.names()

    def _send_lora(self, command: Command, note: Callable[[], object]) -> object:
        with self._lock:  # the mirror counts commands in the order they are queued
            result = note()
            self._outbox.append(command)
        if self._autoflush:
            self.flush()
        return result

    def is_alive(self) -> bool:
        return self.death is None and self.proc.poll() is None

    def stats(self) -> dict:
        return {**self._stats, "core_pid": self.proc.pid}

    def prefix_summary(self) -> tuple[int, list[int], list[int]]:
        """(stride, hashes, host-tier hashes) of the core's prefix cache, at most about a second old
        (LLMEngine.prefix_summary); (1, [], []) unless the client was made with prefix_summary=True."""
        return self._prefix_summary

    def audit(self) -> list[str]:
        """KV leak problems the core saw at its last idle point (blocks held with no live request)."""
        return list(self._audit)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        with self._lock:
            self._outbox.append(Shutdown())
        self.flush()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def flush(self) -> None:
        """Send every queued command as one message. A send blocks only while the core's socket buffer
        is full, i.e. for at most about one engine step (the core reads between steps)."""
        with self._send_lock:
            with self._lock:
                batch, self._outbox = self._outbox, []
            if not batch or self.death is not None:
                return
            try:
                self._conn.send(batch)
            except OSError:
                pass  # the core is gone; the reader reports it

    # ------------------------------------------------------------------ the reader thread
    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._core_exited()
                return
            if isinstance(message, Step):
                if message.stats is not None:
                    self._take_stats(message.stats)
                self._deliver(self._outputs(message.records))
            elif isinstance(message, Idle):
                self._take_stats(message.stats)
                self._audit = message.audit
            elif isinstance(message, Dead):
                self._fail_all(message.error)

    def _take_stats(self, stats: dict) -> None:
        summary = stats.pop("prefix_summary", None)  # rides on some snapshots only
        loras = stats.pop("loras", None)
        if loras is not None:
            self._loras.take(loras)
        if summary is not None:
            self._prefix_summary = summary
        self._stats = stats

    def take(self, request_id: str) -> RequestOutput | None:
        """deferred_text: the output of what the request got since the last take (None: nothing, or
        it was aborted). Call it from one thread."""
        live = self._live.get(request_id)
        if live is None:
            return None
        out, commands = take_output(live, self._fault, time.time())
        if out is not None and out.finished:
            self._live.pop(request_id, None)
        self._send(commands)
        return out

    def _outputs(self, records: Records) -> list:
        if self._deferred:
            return stash_step(self._live, records, time.time())
        now = time.time()
        outputs, stops = [], []
        for rid, samples, finished, cached, final_metrics, prompt_logprobs in records.unpacked():
            live = self._live.get(rid)
            if live is None:
                continue  # aborted by the caller, or already ended here (stop string, failure)
            work = functools.partial(
                live.absorb, samples, finished, cached, final_metrics, now, self._fault, prompt_logprobs
            )
            out, commands = guarded(live, work, now)
            stops += commands
            if out.finished:
                self._live.pop(rid, None)
            outputs.append(out)
        self._send(stops)
        return outputs

    def _send(self, commands: list[Command]) -> None:
        """Queue `commands` for the core (stop strings found here, failed requests) and send them now."""
        if commands:
            with self._lock:
                self._outbox += commands
            self.flush()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        try:
            self._on_step(outputs)
        except Exception:  # a broken consumer must not take the reader down
            log.exception("on_step failed")

    def _core_exited(self) -> None:
        if self._closing:
            return
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:  # the socket broke but the process lingers: end it
            self.proc.kill()
            code = self.proc.wait()
        self._fail_all(f"the engine core process exited (code {code})")

    def _fail_all(self, message: str) -> None:
        with self._lock:
            if self.death is not None:
                return
            self.death = message
            live, self._live = self._live, {}
        log.error("engine core died: %s", message)
        if self._deferred:  # `take` must still find them: back into the table, failed
            for r in live.values():
                r.failure = message
            with self._lock:
                self._live.update(live)
            self._deliver([StepNote(rid, False, True) for rid in live])
            return
        now = time.time()
        self._deliver([r.fail(message, now) for r in live.values()])


class _CoreConnection(Connection):
    def recv_ready(self) -> Ready:
        """The core's first message: its limits once the model is loaded, or why it could not start."""
        try:
            message = self.recv()
        except EOFError:
            raise RuntimeError("the engine core process exited during start-up; see its log above") from None
        if isinstance(message, Failed):
            raise RuntimeError(f"the engine core failed to start: {message.error}")
        return message
