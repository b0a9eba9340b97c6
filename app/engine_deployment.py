"""The engine deployment: one AsyncEngine per replica, streamed to the ingress item by item.

`generate` is an async generator called through `DeploymentHandle.options(stream=True)`. Per request:
the engine thread calls `on_output`, which hands the RequestOutput to this replica's event loop with
`loop.call_soon_threadsafe` onto a per-request asyncio.Queue; the generator drains that queue.

Items are plain dicts (cheap to pickle, no engine classes needed by the caller):
  {"kind": "accepted", "request_id"}  first, once the engine took the request;
  ApiError                            first and only, when it did not (overload, bad prompt, ...);
  {"kind": "output", ...}             see `to_wire`; the one with finished=True is the last.

Streaming cost: every yielded item is one Ray object. The first output is yielded at once (TTFT); later
outputs that arrive within `stream_interval_ms` of the previous yield are merged into one item.
Cancellation: when the caller goes away, Serve cancels this generator (asyncio.CancelledError at the
`await`), and the `finally` aborts the request so the engine frees its KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable

from ray import serve

from app.errors import ApiError, from_engine_error, internal, overloaded
from app.metrics import ServerMetrics
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")


def _empty_sample(index: int) -> dict:
    return {
        "index": index,
        "text": "",
        "token_ids": [],
        "logprobs": None,
        "finish_reason": None,
        "error": None,
    }


def to_wire(outs: list[RequestOutput], token_text: Callable[[int], str]) -> dict:
    """Merge consecutive outputs of one request (deltas, in order) into one item.

    Per sample index: text and token ids concatenate; finish_reason/error come from the delta that set
    them. Usage counts are cumulative in the engine, so the last output's values are the current ones.
    Logprobs carry token strings (the ingress has no tokenizer): {"token", "logprob", "top": [(str, lp)]}.
    """
    samples: dict[int, dict] = {}
    for out in outs:
        for d in out.outputs:
            s = samples.setdefault(d.index, _empty_sample(d.index))
            s["text"] += d.text
            s["token_ids"].extend(d.token_ids)
            if d.logprobs:
                entries = [
                    {"token": token_text(lp.token_id), "logprob": lp.logprob,
                     "top": [(token_text(t), v) for t, v in lp.top]}
                    for lp in d.logprobs
                ]  # fmt: skip
                s["logprobs"] = (s["logprobs"] or []) + entries
            if d.finish_reason is not None:
                s["finish_reason"], s["error"] = d.finish_reason, d.error
    last = outs[-1]
    return {
        "kind": "output",
        "outputs": [samples[i] for i in sorted(samples)],
        "finished": last.finished,
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "cached_tokens": last.cached_tokens,
    }


def _rss_bytes() -> int | None:
    """Resident memory of this process (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


@serve.deployment(name="EngineDeployment", health_check_period_s=5, health_check_timeout_s=30)
class EngineDeployment:
    def __init__(
        self,
        model: str,
        engine_options: dict,
        served_model_name: str | None = None,
        max_ongoing_requests: int = 256,
        stream_interval_ms: float = 0.0,
        retry_after_s: int = 1,
        stats_interval_s: float = 1.0,
    ):
        from engine.async_engine import AsyncEngine  # torch is imported only inside the replica

        self.engine = AsyncEngine(EngineConfig.from_kwargs(model, **engine_options))
        self._limit = max_ongoing_requests
        self._interval_s = stream_interval_ms / 1000.0
        self._retry_after = retry_after_s
        self._ongoing = 0  # streams between accept and finish; only touched on the event loop
        self._name = served_model_name or self.engine.model_name
        self._metrics = ServerMetrics(self._name)
        self._stop = threading.Event()
        self._poller = threading.Thread(
            target=self._poll_stats, args=(stats_interval_s,), daemon=True, name="minserve-stats"
        )
        self._poller.start()

    async def generate(
        self, prompt: str | list[int] | list[dict], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[dict | ApiError]:
        queue: asyncio.Queue[tuple[float, RequestOutput]] = asyncio.Queue()
        rid = self._submit(prompt, params, request_id, queue)
        if isinstance(rid, ApiError):
            yield rid
            return
        self._ongoing += 1
        finished = False
        try:
            yield {"kind": "accepted", "request_id": rid}
            async for item in self._coalesce(queue):
                finished = item["finished"]
                yield item
        finally:
            self._ongoing -= 1
            if not finished:  # cancelled by the caller (client disconnect) or failed mid-way
                self.engine.abort(rid)

    def _submit(
        self, prompt, params: SamplingParams, request_id: str | None, queue: asyncio.Queue
    ) -> str | ApiError:
        """Admission check, then hand the request to the engine; its outputs will land in `queue`."""
        if self._ongoing >= self._limit:
            message = (
                f"server busy: {self._ongoing} requests in flight on this replica "
                f"(max_ongoing_requests={self._limit}); retry later"
            )
            return overloaded(message, self._retry_after)
        loop = asyncio.get_running_loop()

        def on_output(out: RequestOutput) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (time.perf_counter(), out))
            except RuntimeError:  # the replica's loop is closed: nobody is listening any more
                pass

        try:
            return self.engine.submit(prompt, params, on_output, request_id=request_id)
        except EngineError as exc:
            return from_engine_error(exc, self._retry_after)
        except Exception as exc:  # a bug, not the client's fault: say so instead of hanging the request
            logger.exception("submit failed")
            return internal(f"engine rejected the request: {type(exc).__name__}: {exc}")

    async def _coalesce(self, queue: asyncio.Queue) -> AsyncIterator[dict]:
        """Yield the first output at once, then merge what arrives within the stream interval."""
        last_yield: float | None = None
        prev_token_t: float | None = None
        while True:
            batch = [await queue.get()]
            if last_yield is not None and self._interval_s > 0 and not batch[-1][1].finished:
                delay = last_yield + self._interval_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            while not queue.empty():
                batch.append(queue.get_nowait())
            for t, out in batch:  # inter-token latency: time between engine steps that produced tokens
                if any(d.token_ids for d in out.outputs):
                    if prev_token_t is not None:
                        self._metrics.observe_itl(t - prev_token_t)
                    prev_token_t = t
            outs = [out for _, out in batch]
            item = to_wire(outs, self._token_text)
            if item["finished"]:
                self._metrics.observe_finished(outs[-1])
            last_yield = time.perf_counter()
            yield item
            if item["finished"]:
                return

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _poll_stats(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self._metrics.update(self.engine.stats(), self._ongoing)
            except Exception:  # metrics must never take the replica down
                logger.exception("metrics update failed")

    def stats(self) -> dict:
        return {
            **self.engine.stats(),
            "ongoing_requests": self._ongoing,
            "max_ongoing_requests": self._limit,
            "pid": os.getpid(),  # the replica process: soak tests watch its memory
            "rss_bytes": _rss_bytes(),
        }

    def audit(self) -> list[str]:
        return self.engine.audit()

    def info(self) -> dict:
        return {
            "model": self._name,
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.tokenizer.vocab_size,
        }

    def is_alive(self) -> bool:
        return self.engine.is_alive()

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy and Serve replaces it."""
        if not self.engine.is_alive():
            raise RuntimeError("engine loop thread is dead; this replica will be restarted")

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
