"""The ingress's own aborts (app/aborts.py, app/engine_client.py): the replica's memory of early aborts,
the batching of abort calls outside the cancelled request's context, and the SSE response that cancels
its engine streams also when Starlette never starts its body. The end-to-end path through a real
engine replica is in tests/test_hardening.py."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from app import engine_client
from app.aborts import EarlyAborts
from app.engine_client import EngineClient, EngineStream, StreamsResponse

pytestmark = pytest.mark.serving


def test_early_aborts_refuse_once_and_forget_by_age_and_count(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("app.aborts.time.monotonic", lambda: now[0])
    aborts = EarlyAborts(ttl_s=10.0, max_ids=3)
    aborts.add("a")
    assert aborts.take("a") and not aborts.take("a")  # refused once: ids are not reused
    assert not aborts.take(None) and not aborts.take("never-aborted")
    for rid in "bcde":
        aborts.add(rid)
    assert len(aborts) == 3 and not aborts.take("b")  # the oldest went first when over max_ids
    now[0] += 5.0
    aborts.add("f")  # over max_ids again: c goes, though younger than the ttl
    assert len(aborts) == 3 and not aborts.take("c") and aborts.take("d")
    now[0] += 11.0
    assert not aborts.take("e")  # older than the ttl: not refused even before a prune
    aborts.add("g")
    assert len(aborts) == 1  # f (11 s old) pruned on the way in


class _Gen:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _Method:
    def __init__(self, seen: list) -> None:
        self.seen = seen

    def remote(self, **kwargs):
        self.seen.append((kwargs, _REQUEST.get()))


class _Handle:
    def __init__(self) -> None:
        self.calls: list = []
        self.abort = _Method(self.calls)

    def options(self, **_):
        return self


_REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar("request", default=None)


def test_aborts_of_one_burst_share_one_call_made_outside_the_request_context(monkeypatch):
    monkeypatch.setattr(engine_client, "ABORT_BATCH_S", 0.01)
    handle = _Handle()
    client = EngineClient(handle, retry_after=1)

    async def cancel_in_a_request(rids: list[str], done: bool = False) -> list[EngineStream]:
        _REQUEST.set("parent")  # as Serve's request context is set in a handler
        streams = [EngineStream(i, rid, _Gen(), client._abort, 1) for i, rid in enumerate(rids)]
        for s in streams:
            s.done = done
        engine_client.cancel_all(streams)
        return streams

    async def scenario() -> list[EngineStream]:
        first = await cancel_in_a_request(["r-0", "r-1"])
        second = await cancel_in_a_request(["q-0"])
        finished = await cancel_in_a_request(["f-0"], done=True)  # a finished stream needs no abort
        assert handle.calls == []  # nothing sent until the batch interval has passed
        await asyncio.sleep(0.05)
        return first + second + finished

    streams = asyncio.run(scenario())
    assert [s.gen.cancelled for s in streams] == [True, True, True, False]
    assert handle.calls == [
        ({"request_ids": ["r-0", "r-1", "q-0"]}, None)
    ]  # one call, no parent request context


def test_sse_response_cancels_its_streams_when_the_body_never_starts():
    """The client left before the response began: Starlette sees the disconnect and gives up on the
    response before it starts the body generator, whose own `finally` therefore never runs."""
    started: list[bool] = []

    async def body():
        started.append(True)
        yield "data: x\n\n"

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(1.0)  # the socket is slow; the disconnect wins

    streams = [EngineStream(0, "r-0", _Gen(), lambda rid: None, 1)]
    scope = {"type": "http", "asgi": {"spec_version": "2.0"}, "method": "POST", "path": "/"}
    asyncio.run(StreamsResponse(body(), streams)(scope, receive, send))
    assert started == [] and streams[0].gen.cancelled and streams[0].done
