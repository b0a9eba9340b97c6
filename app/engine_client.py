"""The ingress's side of the engine deployment: start engine streams, await their first item, merge them.

A request with P prompts is P engine requests. `open` starts them all and waits for each one's first
item (accepted, or an ApiError), so the caller knows the HTTP status before it sends a byte; each
stream keeps its accepted item (`accepted`: prompt facts the replica reports, app/prompts.py). `merge`
then yields (prompt index, item) pairs as they arrive. A failed Ray call (replica gone, backpressure)
becomes an ApiError item, so the caller has a single error path. `cancel` on a stream that has not
finished cancels the engine request (the replica's generator sees CancelledError and aborts), and
also sends the replica an explicit abort, because Serve now and then loses that cancellation
(app/aborts.py).

`StreamsResponse` streams SSE and cancels its engine streams when the response ends in any way. The
body generator's own `finally` is not enough: a client that leaves before the response headers are
sent makes Starlette give up before it ever starts the generator, and a never-started generator runs
no `finally`, so the engine requests would generate to their end.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi.responses import StreamingResponse
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app import routing_table
from app.errors import ApiError, internal, overloaded
from app.prefix_keys import PrefixKeys
from app.router import HASHES_KWARG
from engine import LoRARequest
from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")
Item = dict | ApiError
# An engine call whose replica could not take it (the replica is gone, or its engine core died) is made
# again after each of these pauses; Serve routes it anew each time. A dead core refuses at once, so its
# replica looks the least loaded until Serve stops routing to it, after three failed health checks in a
# row (EngineDeployment's health_check_period_s apart): the pauses add up to well beyond that.
RETRY_DELAYS_S = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0)
RETRY_CODES = ("engine_unavailable", "engine_dead")
# Where no replica is left, Serve holds a call until a new one is up (a model load): the calls made again
# get this long in all, and then the request is answered with its error (503 with Retry-After).
RETRY_BUDGET_S = 12.0
MAX_ADAPTER_HANDLES = 1024  # per-adapter handles kept (one per adapter name)
ABORT_BATCH_S = 0.05  # explicit aborts wait this long to share one call (Serve's own cancel goes at once)


def engine_unavailable(message: str, retry_after: int) -> ApiError:
    """503 engine_unavailable: no engine replica can take the call now (one may be starting or replaced)."""
    return ApiError(503, message, "server_error", code="engine_unavailable", retry_after=retry_after)


def call_failure(exc: BaseException, retry_after: int) -> ApiError:
    """A failed call to the engine deployment (as opposed to an error the engine reported)."""
    if isinstance(exc, BackPressureError):
        return overloaded(f"server busy: {exc}", retry_after)
    if isinstance(exc, (DeploymentUnavailableError, RayActorError)):
        return engine_unavailable(f"engine unavailable: {type(exc).__name__}", retry_after)
    logger.error("engine call failed: %r", exc)
    return internal(f"engine call failed: {type(exc).__name__}: {exc}")


class EngineStream:
    """One engine request's item stream, tagged with its prompt index."""

    def __init__(
        self,
        index: int,
        request_id: str,
        gen: DeploymentResponseGenerator,
        abort: Callable[[str], None],
        retry_after: int,
    ):
        self.index, self.request_id, self.gen, self.retry_after = index, request_id, gen, retry_after
        self._abort = abort
        self.done = False  # the engine side has returned: nothing to cancel
        self.started = False  # an output (or the end) has come: its prefill is no longer pending
        self.accepted: dict = {}  # the first item, once `open` has it

    def cancel(self) -> None:
        self._mark_started()
        if not self.done:
            self.done = True
            self.gen.cancel()
            self._abort(self.request_id)

    def _mark_started(self) -> None:
        """Tell the router (app/routing_table.py) that this request's prefill is no longer ahead of others."""
        if not self.started:
            self.started = True
            routing_table.started(self.request_id)

    async def next(self) -> Item:
        """The next item; the stream is done after an ApiError or the finished output."""
        try:
            item = await self.gen.__anext__()
        except StopAsyncIteration:
            self.done = True
            self._mark_started()
            return internal("engine stream ended without a final output")
        except Exception as exc:
            self.done = True
            self._mark_started()
            return call_failure(exc, self.retry_after)
        self.done = isinstance(item, ApiError) or item.get("finished", False)
        if self.done or item.get("kind") != "accepted":
            self._mark_started()
        return item


class EngineClient:
    def __init__(self, handle: DeploymentHandle, retry_after: int, prefix_keys: PrefixKeys | None = None):
        """prefix_keys: with a prefix-aware router (app/router.py), each call carries its routing key."""
        self.handle = handle
        self._keys = prefix_keys
        self._stream = handle.options(stream=True)  # built once: options() per request is not free
        self._adapter_streams: dict[str, DeploymentHandle] = {}  # the same, per adapter (multiplexed id)
        self._abort_method = handle.abort
        self._aborts: list[str] = []
        self._retry_after = retry_after

    def _abort(self, request_id: str) -> None:
        """Queue an abort; one call carries all those queued within ABORT_BATCH_S. A Serve call costs the
        ingress about a millisecond: one per cancelled stream would, in a disconnect storm, put seconds
        of backlog in front of every other request."""
        if not self._aborts:
            # scheduled in an empty context: inside the cancelled request's own context Serve would count
            # the call as that request's child, and cancel it along with its parent
            loop = asyncio.get_running_loop()
            loop.call_later(ABORT_BATCH_S, self._send_aborts, context=contextvars.Context())
        self._aborts.append(request_id)

    def _send_aborts(self) -> None:
        """One call per replica the requests went to, as far as the router knows (app/router.py)."""
        groups: dict[object, list[str]] = {}
        for rid in self._aborts:
            groups.setdefault(routing_table.replica_of(rid), []).append(rid)
        self._aborts = []
        for ids in groups.values():
            self._abort_method.remote(request_ids=ids)

    def _handle_for(self, lora: LoRARequest | None) -> DeploymentHandle:
        if lora is None:
            return self._stream
        handle = self._adapter_streams.get(lora.lora_name)
        if handle is None:
            if len(self._adapter_streams) >= MAX_ADAPTER_HANDLES:
                self._adapter_streams.clear()
            handle = self._stream.options(multiplexed_model_id=lora.lora_name)
            self._adapter_streams[lora.lora_name] = handle
        return handle

    async def open(
        self,
        prompts: list,
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        echo: bool = False,
        lora: LoRARequest | None = None,
        prompt_ids: bool = False,
    ) -> list[EngineStream] | ApiError:
        """Start one engine request per prompt; return the streams once all accepted, else the first error.
        arrival_time: the ingress's time.time() at the request's arrival (the latency metrics' origin).
        lora: the adapter the request names; its calls carry its name as Serve's multiplexed model id.
        prompt_ids: each accepted item carries its prompt's token ids (return_token_ids)."""
        generate = self._handle_for(lora).generate
        extra = {"lora_request": lora} if lora is not None else {}
        if prompt_ids:
            extra["prompt_ids"] = True
        streams, calls = [], []
        for i, p in enumerate(prompts):
            rid = f"{request_id}-{i}"
            if self._keys is not None:
                extra[HASHES_KWARG] = self._keys(p, lora)
            call = partial(_call, generate, p, params, rid, arrival_time, echo, dict(extra))
            streams.append(EngineStream(i, rid, call(), self._abort, self._retry_after))
            calls.append(call)
        try:
            firsts = await asyncio.gather(*(_first(s, call) for s, call in zip(streams, calls)))
        except BaseException:  # cancelled (client gone) while waiting: release the engine requests
            cancel_all(streams)
            raise
        errors = [f for f in firsts if isinstance(f, ApiError)]
        if errors:
            cancel_all(streams)
            return errors[0]
        for s, first in zip(streams, firsts):
            s.accepted = first
        return streams


def _call(generate, prompt, params, rid, arrival_time, echo, extra) -> DeploymentResponseGenerator:
    """One call of the replica's `generate`, stamped with when the ingress made it (sent_time): the
    replica's log line splits the time before it began into the ingress's part and Serve's hop."""
    return generate.remote(
        prompt, params, request_id=rid, arrival_time=arrival_time, echo=echo, sent_time=time.time(), **extra
    )


async def _first(stream: EngineStream, call: Callable[[], DeploymentResponseGenerator]) -> Item:
    """The stream's first item. A request its replica could not take (the replica or its engine core
    died) loses nothing yet: the call is made again, and Serve routes it to a live replica. When none
    takes it by the last of RETRY_DELAYS_S or within RETRY_BUDGET_S, its error (503 with Retry-After) is
    the answer."""
    item = await stream.next()
    deadline = time.monotonic() + RETRY_BUDGET_S
    for attempt, delay in enumerate(RETRY_DELAYS_S):
        if not (isinstance(item, ApiError) and item.code in RETRY_CODES):
            break
        if attempt == 0:
            logger.warning("engine call %s: %s; calling again", stream.request_id, item.message)
        await asyncio.sleep(delay)
        stream.gen, stream.done, stream.started = call(), False, False
        try:
            item = await asyncio.wait_for(stream.next(), max(0.1, deadline - time.monotonic()))
        except TimeoutError:  # no replica took it: none is left until Serve starts one
            stream.cancel()
            break
    return item


def cancel_all(streams: list[EngineStream]) -> None:
    for s in streams:
        s.cancel()


class StreamsResponse(StreamingResponse):
    """An SSE response over engine streams; the streams are cancelled when it ends, however it ends."""

    def __init__(self, body: AsyncIterator[str], streams: list[EngineStream]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            cancel_all(self.streams)


async def merge(streams: list[EngineStream]) -> AsyncIterator[tuple[int, Item]]:
    """(prompt index, item) from all streams as they come, until every stream is done."""
    if len(streams) == 1:
        s = streams[0]
        while not s.done:
            yield s.index, await s.next()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def forward(s: EngineStream) -> None:
        while not s.done:
            await queue.put((s.index, await s.next()))
        await queue.put(None)

    tasks = [asyncio.create_task(forward(s)) for s in streams]
    try:
        remaining = len(streams)
        while remaining:
            pair = await queue.get()
            if pair is None:
                remaining -= 1
            else:
                yield pair
    finally:
        for t in tasks:
            t.cancel()
