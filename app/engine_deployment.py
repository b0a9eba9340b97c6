"""The engine deployment: one engine core process per replica, its outputs fanned out to Serve streams.

The replica holds the GPU (Serve gives it `num_gpus`) but runs no model: it starts the engine core
process (engine/core/process.py, through engine/core_client.CoreClient), which inherits the GPU and runs the
step loop alone. This process does admission, request intake, detokenization and the fan-out of the
core's outputs to streams; its event loop never shares a GIL with the forward passes.

`generate` is an async generator called through `DeploymentHandle.options(stream=True)`, one call per
request (so Serve's router picks the replica). Items are plain dicts (cheap to pickle):
  {"kind": "accepted", "request_id"}  first, once the engine took the request;
  ApiError                            first and only, when it did not (overload, bad prompt, ...);
  {"kind": "output", ...}             see `to_wire`; the one with finished=True is the last.

Per engine step, the client's reader thread stashes every request's token ids (deferred text,
engine/core_client.py) and hands this replica's event loop ONE call with a note per request
(`_fan_out`), which wakes its stream. A stream turns what was stashed into text only when it sends an
item (`CoreClient.take`), so text work is paid per item, not per step.

Streaming cost: every yielded item is one Ray object, and the HTTP proxy handles every SSE event, so
items are coalesced by load (`Pacer`): the first output of a stream is yielded at once (TTFT); later
ones wait until the stream's interval has passed, so that all open streams together yield at most
`stream_items_per_s` items a second (and each at most one per `stream_interval_ms`).
Cancellation: when the caller goes away, Serve cancels this generator (asyncio.CancelledError at the
`await`), and the `finally` aborts the request: the core frees its KV blocks at its next step. The
ingress also calls `abort` itself, because Serve now and then loses that cancellation (app/aborts.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import ray
from ray import serve

from app import prompts
from app.aborts import EarlyAborts
from app.chat import ChatPrompt
from app.errors import ApiError, from_engine_error, internal, overloaded
from app.lora_replica import ReplicaAdapters
from app.metrics import ServerMetrics
from app.replica_support import flush_log_buffer, log_finished, rss_bytes
from app.streaming import Pacer, Stream, to_wire
from app.tp_placement import core_env
from engine import LoRARequest
from engine.config import EngineConfig
from engine.errors import EngineError, PromptTooLongError
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.core_client import StepNote  # the replica imports the client itself (see __init__)

logger = logging.getLogger("ray.serve")
ITL_FLUSH_S = 0.1
SWITCH_INTERVAL_S = 0.001


# A replica whose engine core died refuses every request at once, which makes it look the least loaded:
# Serve must notice it soon (`check_health`, a cheap call; Serve acts on the third failure in a row) and
# stop routing to it, within the ingress's retries of a refused request (app/engine_client.py).
@serve.deployment(name="EngineDeployment", health_check_period_s=1, health_check_timeout_s=30)
class EngineDeployment:
    def __init__(
        self,
        model: str,
        engine_options: dict,
        served_model_name: str | None = None,
        max_ongoing_requests: int = 256,
        stream_interval_ms: float = 0.0,
        stream_items_per_s: float = 2000.0,
        retry_after_s: int = 1,
        stats_interval_s: float = 1.0,
        null_core_step_ms: float | None = None,
        prefix_summary: bool = False,  # the core publishes its prefix cache's summary (for the router)
    ):
        from engine.core_client import CoreClient  # the tokenizer is loaded only inside the replica

        self._loop: asyncio.AbstractEventLoop | None = None  # the loop serving `generate`, set on first use
        self._streams: dict[str, Stream] = {}
        self._early_aborts = EarlyAborts()
        self._node_id = ray.get_runtime_context().get_node_id()  # stats: where Ray placed this replica
        # replicas sharing an accelerator share its queue of work: the router adds their pending work up
        gpus = ",".join(str(g) for g in ray.get_gpu_ids())
        self._device_key = f"{self._node_id}:{gpus or 'cpu'}"
        self._flush_scheduled = False
        # threads share the GIL (event loop, core reader, Ray's): one woken by I/O should not wait 5 ms
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        config = EngineConfig.from_kwargs(model, **engine_options)
        env = core_env(config.tensor_parallel_size)  # with TP on GPUs: every rank's GPU, rank 0's first
        self.engine = CoreClient(  # deferred text: streams detokenize when they send
            config, self._on_step, null_core_step_ms, False, prefix_summary, env, deferred_text=True
        )
        self._limit, self._retry_after = max_ongoing_requests, retry_after_s
        self._pacer = Pacer(stream_interval_ms / 1000.0, stream_items_per_s)
        self._name = served_model_name or self.engine.model_name
        self._adapters = ReplicaAdapters(self.engine, config.lora_host_slots)  # LoRA: app/lora_replica.py
        self._metrics = ServerMetrics(self._name)
        self._stop = threading.Event()
        self._poller = threading.Thread(
            target=self._poll_stats, args=(stats_interval_s,), daemon=True, name="minserve-stats"
        )
        self._poller.start()

    async def generate(
        self,
        prompt: str | list[int] | ChatPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        echo: bool = False,
        prefix_hashes: list[int] | None = None,
        lora_request: LoRARequest | None = None,
        prompt_ids: bool = False,
        sent_time: float | None = None,
    ) -> AsyncIterator[dict | ApiError]:
        """arrival_time: when the ingress received the request (time.time()), the origin of the TTFT,
        queue and e2e histograms. echo: the accepted item carries the prompt's tokens (app/prompts.py).
        prefix_hashes: the routing key, read by app/router.py only. lora_request: the adapter named in
        the request's `model` (the call's multiplexed model id is its name). prompt_ids: the accepted
        item carries the prompt's token ids (return_token_ids). sent_time: when the ingress made the call."""
        received = time.time()
        if self._early_aborts.take(request_id):
            return  # the ingress gave up on it before it came: nobody reads this stream
        failed = await self.load_lora(lora_request) if lora_request is not None else None
        submitted = failed or self._submit(
            prompt, params, request_id, arrival_time, echo, lora_request, prompt_ids
        )
        if isinstance(submitted, ApiError):
            yield submitted
            return
        rid, facts = submitted
        stream = self._streams[rid] = Stream(received, sent_time)
        finished = False
        try:
            yield {"kind": "accepted", "request_id": rid, **facts}
            async for item in self._coalesce(stream, rid):
                finished = item["finished"]
                yield item
        finally:
            del self._streams[rid]
            if not finished:  # cancelled by the caller (client disconnect) or failed mid-way
                self.engine.abort(rid)
                self._schedule_flush()

    def record_routing_stats(self) -> dict:
        """Serve calls this every request_routing_stats_period_s; app/router.py reads the result."""
        stride, hashes, host_hashes = self.engine.prefix_summary()
        stats = self.engine.stats()
        return {
            "prefix_stride": stride,
            "prefix_hashes": hashes,
            "prefix_host_hashes": host_hashes,  # in the host KV tier: cached at a lower weight
            "device": self._device_key,
            "num_running": stats.get("num_running", 0),
            "num_waiting": stats.get("num_waiting", 0),
        }

    async def abort(self, request_ids: list[str]) -> None:
        """The ingress gave up on these requests (their clients left); see app/aborts.py."""
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is None:
                self._early_aborts.add(rid)
            else:  # its generator ends, and its `finally` aborts it in the engine
                stream.abandoned = True
                stream.wake.set()

    async def load_lora(self, lora_request: LoRARequest) -> ApiError | None:
        """Have the adapter in this replica (Serve's multiplexer: LRU over max_cpu_loras adapters); the
        ingress also calls it to check an adapter loaded at runtime. An ApiError when it cannot be used."""
        self._loop = self._loop or asyncio.get_running_loop()
        try:
            await self._adapters.acquire(lora_request)
        except EngineError as exc:
            return from_engine_error(exc, self._retry_after)
        except Exception as exc:
            logger.exception("loading adapter %s failed", lora_request.lora_name)
            return internal(f"loading adapter {lora_request.lora_name!r} failed: {type(exc).__name__}: {exc}")
        finally:  # the core's adapter commands (a load, an eviction) travel with this turn's batch
            self._schedule_flush()
        return None

    async def unload_lora(self, lora_name: str) -> bool:
        """The ingress unloaded the adapter: the core drops it (False: it did not hold it)."""
        self._loop = self._loop or asyncio.get_running_loop()
        dropped = self._adapters.drop(lora_name)
        self._schedule_flush()
        return dropped

    def _submit(
        self,
        prompt,
        params: SamplingParams,
        request_id: str | None,
        arrival_time: float | None,
        echo: bool,
        lora: LoRARequest | None = None,
        prompt_ids: bool = False,
    ) -> tuple[str, dict] | ApiError:
        """Admission check, then hand the request to the engine core."""
        if len(self._streams) >= self._limit:
            message = (
                f"server busy: {len(self._streams)} requests in flight on this replica "
                f"(max_ongoing_requests={self._limit}); retry later"
            )
            return overloaded(message, self._retry_after)
        self._loop = self._loop or asyncio.get_running_loop()
        chat = isinstance(prompt, ChatPrompt)
        try:
            prompt, facts = prompts.prepare(self.engine.tokenizer, prompt, echo, prompt_ids)
            try:
                rid = self.engine.submit(
                    prompt, params, request_id=request_id, arrival_time=arrival_time, lora_request=lora
                )
            except PromptTooLongError as exc:
                raise prompts.prompt_too_long(
                    exc, self.engine.tokenizer, prompt, params, self.engine.limits, chat
                ) from exc
        except EngineError as exc:
            return from_engine_error(exc, self._retry_after)
        except Exception as exc:  # a bug, not the client's fault: say so instead of hanging the request
            logger.exception("submit failed")
            return internal(f"engine rejected the request: {type(exc).__name__}: {exc}")
        self._schedule_flush()
        return rid, facts

    def _schedule_flush(self) -> None:
        """Send what this turn of the event loop queued for the core, once, at the end of the turn."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self.engine.flush()

    async def _coalesce(self, stream: Stream, rid: str) -> AsyncIterator[dict]:
        """Yield the first output at once, then whatever arrived by the end of each stream interval."""
        last_yield: float | None = None
        while True:
            await stream.wake.wait()
            if stream.abandoned:
                return
            if last_yield is not None and not stream.final:
                delay = last_yield + self._pacer.interval(len(self._streams)) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            stream.wake.clear()
            out = self.engine.take(rid)
            if out is None:
                continue  # an earlier take already sent what this wake announced
            if out.finished:
                self._metrics.observe_finished(out, stream.received)
                log_finished(out, stream.received, stream.sent)
            item = to_wire(out, self._token_text)
            if stream.gaps:  # one ITL observation per item: the mean gap of the steps it carries
                self._metrics.observe_itl(stream.gap_sum / stream.gaps)
                stream.gap_sum, stream.gaps = 0.0, 0
            last_yield = time.perf_counter()
            yield item
            if item["finished"]:
                return

    # ------------------------------------------------------------------ engine outputs, once per step
    def _on_step(self, notes: list[StepNote]) -> None:
        """Called on the client's reader thread: one hop to the event loop for the whole step."""
        loop = self._loop
        if loop is None:
            return  # no request was ever submitted through this replica's loop
        try:
            loop.call_soon_threadsafe(self._fan_out, notes, time.perf_counter())
        except RuntimeError:  # the loop is closed: the replica is shutting down
            pass

    def _fan_out(self, notes: list[StepNote], arrived: float) -> None:
        for note in notes:
            stream = self._streams.get(note.request_id)
            if stream is None:
                continue  # the stream ended meanwhile (cancelled)
            if note.tokens:
                if stream.prev_token_t is not None:
                    stream.gap_sum += arrived - stream.prev_token_t
                    stream.gaps += 1
                stream.prev_token_t = arrived
            stream.final = stream.final or note.finished
            stream.wake.set()

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    # ------------------------------------------------------------------ control
    def _poll_stats(self, interval_s: float) -> None:
        """Gauges and counters every interval_s; the ITL buckets every 0.1 s, so that replaying them
        into Ray (one call per observation) never holds the GIL away from the event loop for long."""
        next_stats = time.monotonic()
        while not self._stop.wait(ITL_FLUSH_S):
            try:
                self._metrics.flush_itl()
                if time.monotonic() >= next_stats:
                    next_stats += interval_s
                    self._metrics.update(self.engine.stats(), len(self._streams))
                    flush_log_buffer()
            except Exception:  # metrics must never take the replica down
                logger.exception("metrics update failed")

    def stats(self) -> dict:
        stats = self.engine.stats()
        replica, core = rss_bytes(os.getpid()), rss_bytes(stats["core_pid"])
        return {
            **stats,
            **self._adapters.stats(),
            "ongoing_requests": len(self._streams),
            "max_ongoing_requests": self._limit,
            "pid": os.getpid(),  # the replica process: soak tests watch its memory (with the core's)
            "node_id": self._node_id,
            "rss_bytes": (replica or 0) + (core or 0) if replica is not None else None,
            "core_rss_bytes": core,
        }

    def audit(self) -> list[str]:
        return self.engine.audit()

    def info(self) -> dict:
        return {
            "model": self._name,
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.tokenizer.vocab_size,
        }

    def tokenize(self, source: str | ChatPrompt, add_special_tokens: bool | None) -> dict | ApiError:
        try:
            return prompts.tokenize(
                self.engine.tokenizer, source, add_special_tokens, self.engine.max_model_len
            )
        except EngineError as exc:
            return from_engine_error(exc, self._retry_after)

    def tokenizer_info(self) -> dict:
        return prompts.tokenizer_info(self.engine.tokenizer, self.engine.max_model_len)

    def detokenize(self, tokens: list[int]) -> dict | ApiError:
        try:
            return prompts.detokenize(self.engine.tokenizer, tokens)
        except EngineError as exc:
            return from_engine_error(exc, self._retry_after)

    def is_alive(self) -> bool:
        return self.engine.is_alive()

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy and Serve replaces it."""
        if not self.engine.is_alive():
            raise RuntimeError(f"engine core is dead ({self.engine.death}); this replica will be restarted")

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
