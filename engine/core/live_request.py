"""One request as the server's replica sees it while the engine core generates it.

The core sends token ids (engine/core/process.py); `absorb` turns one step's samples into a RequestOutput with
text, the way LLMEngine.step() does in-process: the same TextStream per sample, so the text, the stop
strings and the finish reasons are the same. A stop string found here ends the sample at once (later
tokens the core made before it heard of the stop are dropped) and is queued for the core
(`take_stops`), which then frees the sample's KV blocks.

Deferred text (a server's reader thread, engine/core_client.py): `stash` keeps each step's record as it
came, and `take` turns everything stashed since the last take into one RequestOutput, when the stream
is about to send it. A stream that sends one item per several steps then pays for one text update, not
one per step; the text is the same, since detokenization and stop strings see the same ids in order.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.faults import Check
from engine.core.messages import Abort, Command, FinalMetrics, StopSample
from engine.output.text import TextStream
from engine.outputs import CompletionDelta, RequestMetrics, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams

log = logging.getLogger("engine")


@dataclass
class _Sample:
    text: TextStream
    done: bool = False


class LiveRequest:
    def __init__(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float, tokenizer
    ):
        self.request_id = request_id
        self.prompt_ids = prompt_ids  # also read by FaultInjector
        self.params = params
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._tokenizer = tokenizer
        self._samples: dict[int, _Sample] = {}
        self._stops: list[int] = []
        # deferred text: records stashed by the reader thread, taken on the server's event loop (a deque:
        # append and popleft are atomic, so the two threads need no lock); `failure`: the request failed
        self._inbox: deque[tuple] = deque()
        self.failure: str | None = None

    def absorb(
        self,
        samples: list,
        finished: bool,
        cached: int,
        final_metrics: FinalMetrics | None,
        now: float,
        fault: Check | None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> RequestOutput:
        """One core record (a row of Records.unpacked: `samples` are rows of Sample's fields) -> the
        RequestOutput of this step (text deltas, finish reasons). `prompt_logprobs`, on the one record
        that carries them: passed on as they are."""
        self.cached_tokens = cached or self.cached_tokens
        if final_metrics is not None:
            m, f = self.metrics, final_metrics
            m.first_scheduled_time, m.engine_token_time = f.first_scheduled_time, f.first_token_time
            m.spec_draft_tokens, m.spec_accepted_tokens = f.spec_draft_tokens, f.spec_accepted_tokens
            m.added_time = f.added_time
        if fault is not None:  # fault injection (tests only)
            fault("detokenize", self)
        deltas = [d for d in (self._delta(*s) for s in samples) if d is not None]
        if any(d.token_ids for d in deltas):
            self.metrics.first_token_time = self.metrics.first_token_time or now
            self.metrics.last_token_time = now
        output = self._output(deltas, finished, now)
        output.prompt_logprobs = prompt_logprobs
        return output

    def stash(
        self,
        samples: list,
        finished: bool,
        cached: int,
        final_metrics: FinalMetrics | None,
        now: float,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> bool:
        """Keep one core record for `take` (deferred text); whether it brings token ids, whose first one's
        time is stamped as it comes."""
        tokens = any(s[1] for s in samples)
        if tokens:
            self.metrics.first_token_time = self.metrics.first_token_time or now
        self._inbox.append((samples, finished, cached, final_metrics, now, prompt_logprobs, tokens))
        return tokens

    def take(self, fault: Check | None) -> RequestOutput | None:
        """The RequestOutput of every record stashed since the last take (None: nothing new), absorbed
        at once: the records' samples merged per index, the other fields as their last (or only) value."""
        records = []
        while self._inbox:  # popleft, not a swap: a record the reader appends meanwhile stays queued
            records.append(self._inbox.popleft())
        if not records:
            return None
        finished, cached, final_metrics, prompt_logprobs, last_token = False, 0, None, None, None
        for _, ended, c, metrics, now, plp, tokens in records:  # the fields `stash` appended
            finished = finished or ended
            cached = c or cached  # the last non-zero count
            final_metrics = metrics if final_metrics is None else final_metrics  # sent once
            prompt_logprobs = plp if prompt_logprobs is None else prompt_logprobs  # sent once
            last_token = now if tokens else last_token
        samples = merge_samples([r[0] for r in records])
        out = self.absorb(samples, finished, cached, final_metrics, now, fault, prompt_logprobs)
        if last_token is not None:
            self.metrics.last_token_time = last_token
        return out

    def _delta(self, index, ids, masks, logprobs, reason, error, stop_token) -> CompletionDelta | None:
        sample = self._sample(index)
        if sample.done:
            return None  # ended here by a stop string: what the core made after it is dropped
        taken = sample.text.push(ids[:-1] if stop_token and ids else ids)
        if taken is not None:
            ids, masks, logprobs = ids[:taken], masks[:taken], logprobs[:taken] if logprobs else logprobs
            if reason is None:
                self._stops.append(index)
            reason, error = "stop", None
        elif reason is not None:
            sample.text.finish()
        sample.done = reason is not None
        self.completion_tokens += len(ids)
        text = sample.text.take(final=sample.done)
        return CompletionDelta(index, ids, text, logprobs, masks, reason, error)

    def fail(self, message: str, now: float) -> RequestOutput:
        """The final output of a request that failed here or in the core: every open sample errs."""
        deltas = []
        for index in range(self.params.n):
            sample = self._sample(index)
            if not sample.done:
                sample.done = True
                deltas.append(CompletionDelta(index, [], "", finish_reason="error", error=message))
        return self._output(deltas, True, now)

    def take_stops(self) -> list[int]:
        """Samples ended by a stop string since the last call: the core must stop generating them."""
        stops, self._stops = self._stops, []
        return stops

    def _sample(self, index: int) -> _Sample:
        if index not in self._samples:
            p = self.params
            self._samples[index] = _Sample(
                TextStream(self._tokenizer, self.prompt_ids, p.stop, p.include_stop_str_in_output)
            )
        return self._samples[index]

    def _output(self, deltas: list[CompletionDelta], finished: bool, now: float) -> RequestOutput:
        finished = finished or (
            len(self._samples) == self.params.n and all(s.done for s in self._samples.values())
        )
        if finished:
            self.metrics.finished_time = now
        return RequestOutput(
            self.request_id,
            deltas,
            finished,
            len(self.prompt_ids),
            self.completion_tokens,
            self.cached_tokens,
            self.metrics,
        )


def guarded(
    request: LiveRequest, work: Callable[[], RequestOutput | None], now: float
) -> tuple[RequestOutput | None, list[Command]]:
    """(`work`'s output, what to send the core: a StopSample per stop string it found). A failure of
    this request's text work fails it alone: its final output, and an Abort for the core."""
    commands: list[Command] = []
    try:
        out = work()
    except Exception as exc:
        log.error("request %s failed: %s", request.request_id, exc)
        out = request.fail(f"{type(exc).__name__}: {exc}", now)
        commands.append(Abort(request.request_id))
    commands += [StopSample(request.request_id, i) for i in request.take_stops()]
    return out, commands


def merge_samples(steps: list[list]) -> list[list]:
    """Several steps' samples (rows of Sample's fields) as one step's: per sample index, in the order
    first seen, the ids, masks and logprobs concatenated; the finish fields from its last row (a sample
    ends in its last row: the core sends nothing for it afterwards)."""
    merged: dict[int, list] = {}
    for samples in steps:
        for index, ids, masks, logprobs, reason, error, stop_token in samples:
            m = merged.get(index)
            if m is None:
                logprobs = None if logprobs is None else list(logprobs)
                merged[index] = [index, list(ids), list(masks), logprobs, reason, error, stop_token]
                continue
            m[1] += ids
            m[2] += masks
            if logprobs is not None:
                m[3] = (m[3] or []) + list(logprobs)
            m[4], m[5], m[6] = reason, error, stop_token
    return list(merged.values())
