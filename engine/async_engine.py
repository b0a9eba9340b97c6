"""AsyncEngine: the LLMEngine driven by a dedicated loop thread, for servers.

Other threads call submit() / abort(); the loop thread owns the LLMEngine exclusively. Requests and
aborts cross over through a lock-protected inbox and are applied at step boundaries. Each request's
outputs are delivered through its `on_output` callback, called on the loop thread: a server hands
them to its event loop with `loop.call_soon_threadsafe`. Every request gets exactly one final output,
also when it is aborted, fails, or the loop dies.
"""

from __future__ import annotations

import logging
import threading
import traceback
import uuid

from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineError, InvalidRequestError, QueueFullError
from engine.llm_engine import LLMEngine, OnOutput, Prompt
from engine.outputs import CompletionDelta, RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger("engine")


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_name = config.load.model.rstrip("/").split("/")[-1]
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._inbox: list = []  # ("add", rid, prompt_ids, params) | ("abort", rid)
        self._sinks: dict[str, OnOutput] = {}
        self._stats: dict = self.engine.get_stats()
        self._audit: list[str] = []
        self.death: str | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from any thread
    def submit(
        self, prompt: Prompt, params: SamplingParams, on_output: OnOutput, request_id: str | None = None
    ) -> str:
        """Validate and queue a request; raises EngineError subclasses synchronously."""
        if not self.is_alive():
            raise EngineDeadError("the engine loop is not running")
        ids = self.engine.tokenize(prompt)  # tokenizers are thread-safe; validation happens here
        self.engine._admission_check(ids, params)
        with self._lock:
            if (
                len(self._sinks)
                >= self.engine.config.scheduler.max_waiting + self.engine.config.scheduler.max_num_seqs
            ):
                raise QueueFullError("the engine is at capacity: retry later")
            request_id = request_id or f"req-{uuid.uuid4().hex}"
            if request_id in self._sinks:
                raise InvalidRequestError(f"request_id: {request_id!r} is in use", field="request_id")
            self._sinks[request_id] = on_output
            self._inbox.append(("add", request_id, ids, params))
        self._wake.set()
        return request_id

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.death is None

    def stats(self) -> dict:
        return dict(self._stats)

    def audit(self) -> list[str]:
        """KV leak problems seen at the last idle point (blocks held with no live request)."""
        return list(self._audit)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the loop thread
    def _loop(self) -> None:
        try:
            while not self._stop:
                self._apply_inbox()
                if not self.engine.has_unfinished():
                    self._audit = self.engine.audit()
                    self._stats = self.engine.get_stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out)
                self._stats = self.engine.get_stats()
        except BaseException as exc:  # the loop is dead: end every stream with an error event
            self.death = f"{type(exc).__name__}: {exc}"
            log.error("engine loop died: %s\n%s", self.death, traceback.format_exc())
            self._fail_all(self.death)

    def _apply_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        deferred: list = []  # adds the scheduler queue has no room for yet, in arrival order
        for item in inbox:
            if item[0] == "add":
                if not self._add(item):
                    deferred.append(item)
            elif any(d[1] == item[1] for d in deferred):  # aborted before the engine took it
                deferred = [d for d in deferred if d[1] != item[1]]
                self.engine.stats["num_aborts"] += 1
                self._deliver(_final_output(item[1], "abort"))
            else:
                out = self.engine.abort(item[1])
                if out is not None:
                    self._deliver(out)
        if deferred:  # ahead of newer items, so that FCFS order holds
            with self._lock:
                self._inbox[:0] = deferred

    def _add(self, item: tuple) -> bool:
        """Hand one accepted request to the engine; False when its queue is full for now.

        submit() admitted the request against the engine's capacity (its sink holds the place), but
        the scheduler's queue can have grown since (requests accepted in the same pass, preempted
        sequences): the request then waits in the inbox instead of failing after the caller was told
        it was accepted."""
        _, rid, ids, params = item
        try:
            self.engine.add_request(ids, params, request_id=rid)
        except QueueFullError:
            return False
        except EngineError as exc:
            self._deliver(_final_output(rid, "error", str(exc)))
            return True
        self.engine.faults.check("loop", self.engine.requests[rid])
        return True

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
        if sink is None:
            return
        try:
            sink(out)
        except Exception:  # a broken consumer must not take the loop down
            log.exception("output callback for %s failed", out.request_id)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            try:
                sink(_final_output(rid, "error", message))
            except Exception:
                log.exception("output callback for %s failed", rid)


def _final_output(request_id: str, reason: str, message: str | None = None) -> RequestOutput:
    """The one final output of a request the LLMEngine never held (failed or aborted on the way in)."""
    return RequestOutput(
        request_id, [CompletionDelta(0, [], "", finish_reason=reason, error=message)], True, 0, 0
    )
