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
        for item in inbox:
            if item[0] == "add":
                _, rid, ids, params = item
                try:
                    self.engine.add_request(ids, params, request_id=rid)
                except EngineError as exc:  # e.g. the queue filled up since submit() checked it
                    self._deliver(_error_output(rid, str(exc)))
                    continue
                self.engine.faults.check("loop", self.engine.requests[rid])
            else:
                out = self.engine.abort(item[1])
                if out is not None:
                    self._deliver(out)

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
                sink(_error_output(rid, message))
            except Exception:
                log.exception("output callback for %s failed", rid)


def _error_output(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(
        request_id, [CompletionDelta(0, [], "", finish_reason="error", error=message)], True, 0, 0
    )
