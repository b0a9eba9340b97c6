"""The ingress's side of the engine deployment: start engine streams, await their first item, merge them.

A request with P prompts is P engine requests. `open` starts them all and waits for each one's first
item (accepted, or an ApiError), so the caller knows the HTTP status before it sends a byte; each
stream keeps its accepted item (`accepted`: prompt facts the replica reports, app/prompts.py). `merge`
then yields (prompt index, item) pairs as they arrive. A failed Ray call (replica gone, backpressure)
becomes an ApiError item, so the caller has a single error path. `cancel` on a stream that has not
finished cancels the engine request (the replica's generator sees CancelledError and aborts).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.errors import ApiError, internal, overloaded
from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")
Item = dict | ApiError


def call_failure(exc: BaseException, retry_after: int) -> ApiError:
    """A failed call to the engine deployment (as opposed to an error the engine reported)."""
    if isinstance(exc, BackPressureError):
        return overloaded(f"server busy: {exc}", retry_after)
    if isinstance(exc, (DeploymentUnavailableError, RayActorError)):
        message = f"engine unavailable: {type(exc).__name__}"
        return ApiError(503, message, "server_error", code="engine_unavailable", retry_after=retry_after)
    logger.error("engine call failed: %r", exc)
    return internal(f"engine call failed: {type(exc).__name__}: {exc}")


class EngineStream:
    """One engine request's item stream, tagged with its prompt index."""

    def __init__(self, index: int, gen: DeploymentResponseGenerator, retry_after: int):
        self.index, self.gen, self.retry_after = index, gen, retry_after
        self.done = False  # the engine side has returned: nothing to cancel
        self.accepted: dict = {}  # the first item, once `open` has it

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.gen.cancel()

    async def next(self) -> Item:
        """The next item; the stream is done after an ApiError or the finished output."""
        try:
            item = await self.gen.__anext__()
        except StopAsyncIteration:
            self.done = True
            return internal("engine stream ended without a final output")
        except Exception as exc:
            self.done = True
            return call_failure(exc, self.retry_after)
        self.done = isinstance(item, ApiError) or item.get("finished", False)
        return item


class EngineClient:
    def __init__(self, handle: DeploymentHandle, retry_after: int):
        self.handle = handle
        self._stream = handle.options(stream=True)  # built once: options() per request is not free
        self._retry_after = retry_after

    async def open(
        self,
        prompts: list,
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        echo: bool = False,
    ) -> list[EngineStream] | ApiError:
        """Start one engine request per prompt; return the streams once all accepted, else the first error.
        arrival_time: the ingress's time.time() at the request's arrival (the latency metrics' origin)."""
        generate = self._stream.generate
        streams = [
            EngineStream(
                i, generate.remote(p, params, f"{request_id}-{i}", arrival_time, echo), self._retry_after
            )
            for i, p in enumerate(prompts)
        ]
        try:
            firsts = await asyncio.gather(*(s.next() for s in streams))
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


def cancel_all(streams: list[EngineStream]) -> None:
    for s in streams:
        s.cancel()


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
