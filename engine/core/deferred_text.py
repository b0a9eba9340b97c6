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

from typing import NamedTuple

from engine.core.faults import Check
from engine.core.live_request import LiveRequest, guarded
from engine.core.messages import Records
from engine.outputs import RequestOutput


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
            tokens = request.stash(samples, finished, cached, final_metrics, now, prompt_logprobs)
            notes.append(StepNote(rid, tokens, finished))
    return notes


def take_output(request: LiveRequest, fault: Check | None, now: float) -> tuple[RequestOutput | None, list]:
    """(the output of what `request` got since its last take, or None; what to send the core): its
    failure's final output if it failed."""
    if request.failure is not None:
        return request.fail(request.failure, now), []
    return guarded(request, lambda: request.take(fault), now)
