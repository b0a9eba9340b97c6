"""Deferred text: a server's reader thread stashes each step's token ids, and a stream turns them into
text when it sends (engine/core_client.py, deferred_text=True).

A served stream sends one item per several engine steps (app/streaming.Pacer), so making text, finish
reasons and a RequestOutput for every request at every step on the reader thread is work that the
replica's event loop, which also takes new requests in, waits behind on the GIL. Here the reader only
stashes each record (LiveRequest.stash) and notes which requests got one (StepNote); `take` absorbs
all of a request's stashed records at once (LiveRequest.take), when its stream is about to send. A stop
string is then found when the stream sends rather than at the step that made it: the core may make a
few more tokens, which are dropped, as after any stop string.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from engine.core.faults import Check
from engine.core.live_request import LiveRequest
from engine.core.messages import Abort, Command, Records, StopSample
from engine.outputs import RequestOutput

log = logging.getLogger("engine")


class StepNote(NamedTuple):
    """A request got records this step; `tokens`: new token ids among them; `finished`: the core ended
    it (or it failed). Its output is CoreClient.take(request_id)."""

    request_id: str
    tokens: bool
    finished: bool


def stash_step(live: dict[str, LiveRequest], records: Records, now: float) -> list[StepNote]:
    """The reader thread's work per step: stash each live request's record; one note each."""
    notes = []
    for rid, samples, finished, cached, final_metrics, prompt_logprobs in records.unpacked():
        request = live.get(rid)
        if request is not None:  # else aborted by the caller, or already ended here
            request.stash(samples, finished, cached, final_metrics, now, prompt_logprobs)
            notes.append(StepNote(rid, any(s[1] for s in samples), finished))
    return notes


def take_output(
    request: LiveRequest, fault: Check | None, now: float
) -> tuple[RequestOutput | None, list[Command]]:
    """(the output of what `request` got since its last take, or None; what to send the core): its
    failure if it failed; its text work failing fails it alone (an Abort for the core)."""
    commands: list[Command] = []
    rid = request.request_id
    if request.failure is not None:
        out = request.fail(request.failure, now)
    else:
        try:
            out = request.take(fault)
        except Exception as exc:  # as on the per-step path (CoreClient._outputs)
            log.error("request %s failed: %s", rid, exc)
            out = request.fail(f"{type(exc).__name__}: {exc}", now)
            commands.append(Abort(rid))
    commands += [StopSample(rid, i) for i in request.take_stops()]
    return out, commands
