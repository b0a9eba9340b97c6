"""The bounded W2 load of the fault benchmark (scripts/chaos.py), and how each request ended.

Each of `users` closed-loop users sends streamed /v1/completions requests drawn as
benchmarks/serve_client.py draws them (loadtests/_workloads.py's W2, lengths scaled for the machine)
until the load stops. Every request ends as one outcome:
  ok           a 200 stream that ended with `data: [DONE]`;
  error_event  a 200 stream that ended with exactly one error event and nothing after it;
  bad_end      a 200 stream with more than one error event, or events after its error;
  cut          a 200 stream that ended without [DONE] and without an error event;
  status       answered with an error status (a 503 must carry Retry-After: `no_retry_after` counts
               those that did not);
  refused      the connection was refused: nothing was serving (counted apart from the losses);
  lost         a connection was made and the request sent, and no answer came (the connection closed
               before a status line, or none came within `timeout_s`).
A fault's `serving_again_s` is read from the same outcomes: see `serving_again`.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx

from benchmarks.serve_client import draw, user_rng

ERROR_EVENT = 'data: {"error"'  # app/sse.py's error event: the error body, compact JSON
OUTCOMES = ("ok", "error_event", "bad_end", "cut", "status", "refused", "lost")


@dataclass
class Outcome:
    start: float  # time.monotonic() when the request was sent
    kind: str
    detail: str = ""
    retry_after: bool = True  # an error status carried Retry-After


@dataclass
class Load:
    url: str
    users: int = 4
    prompt_scale: float = 0.25
    gen_scale: float = 0.25
    timeout_s: float = 120.0
    seed: int = 0
    results: list[Outcome] = field(default_factory=list)

    def start(self, facts: dict) -> None:
        """Run the load on a thread of its own until `stop`."""
        self._stop, self._paused, self._in_flight = threading.Event(), threading.Event(), 0
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(facts),), daemon=True)
        self._thread.start()

    def pause(self, timeout_s: float = 120.0) -> None:
        """No user sends another request; returns once none is in flight (or after timeout_s)."""
        self._paused.set()
        deadline = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.1)

    def resume(self) -> None:
        self._paused.clear()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    async def _run(self, facts: dict) -> None:
        limits = httpx.Limits(max_connections=self.users + 2)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s, limits=limits) as http:
            await asyncio.gather(*(self._user(http, i, facts) for i in range(self.users)))

    async def _user(self, http: httpx.AsyncClient, i: int, facts: dict) -> None:
        rng = user_rng(self.seed, i)
        shape = SimpleNamespace(workload="W2", prompt_scale=self.prompt_scale, gen_scale=self.gen_scale)
        while not self._stop.is_set():
            if self._paused.is_set():
                await asyncio.sleep(0.1)
                continue
            prompt, max_tokens = draw(rng, shape, facts)
            body = {"model": facts["model"], "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            self._in_flight += 1
            outcome = await one_request(http, body)
            self._in_flight -= 1
            self.results.append(outcome)
            if outcome.kind != "ok":  # nothing serves, or it refused: do not spin
                await asyncio.sleep(0.2 + 0.2 * random.random())


async def one_request(http: httpx.AsyncClient, body: dict) -> Outcome:
    start = time.monotonic()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                has_retry = resp.status_code != 503 or "retry-after" in resp.headers
                return Outcome(start, "status", f"{resp.status_code}: {text}", has_retry)
            return Outcome(start, *await _read_stream(resp))
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        return Outcome(start, "refused", repr(exc)[:200])
    except httpx.HTTPError as exc:  # sent, and the connection closed or went silent before a status line
        return Outcome(start, "lost", repr(exc)[:200])


async def _read_stream(resp: httpx.Response) -> tuple[str, str]:
    """(kind, detail) of a 200 stream; a stream broken after its status line is `cut` unless it had
    ended with its error event already."""
    errors, after_error, done = 0, 0, False
    try:
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            after_error += errors > 0
            if line == "data: [DONE]":
                done = True
            elif line.startswith(ERROR_EVENT):
                errors += 1
    except httpx.HTTPError as exc:
        if errors == 0:
            return "cut", repr(exc)[:200]
    if errors == 0:
        return ("ok", "") if done else ("cut", "ended without [DONE] or an error event")
    return ("error_event", "") if errors == 1 and not after_error else ("bad_end", f"{errors} errors")


def count(results: list[Outcome], start: float, end: float) -> dict:
    """Outcomes of the requests sent in [start, end)."""
    window = [r for r in results if start <= r.start < end]
    counts = {kind: sum(r.kind == kind for r in window) for kind in OUTCOMES}
    counts["no_retry_after"] = sum(not r.retry_after for r in window)
    counts["examples"] = sorted({f"{r.kind}: {r.detail}" for r in window if r.kind != "ok"})[:4]
    counts["serving_again_s"] = serving_again(window, start)
    return counts


def serving_again(window: list[Outcome], start: float) -> float | None:
    """Seconds from `start` until the first request served after the last one that nothing served
    (refused, an error status, lost); 0 when none was; None when none was served after it."""
    unserved = [r.start for r in window if r.kind in ("refused", "status", "lost")]
    if not unserved:
        return 0.0
    later = [r.start for r in window if r.kind == "ok" and r.start > max(unserved)]
    return round(min(later) - start, 1) if later else None
