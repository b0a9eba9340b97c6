"""What the engine hands out for a request's news: RequestOutputs (offline, with text) or the rows of
Records (the engine core's step message, no text). One per request and step with news; a finished
request's output also retires it: it leaves the live table, its tokens are counted, and its prompt
logprobs are dropped. The pending tokens of every sample are handed over exactly once."""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine.core.messages import FinalMetrics, Record, Records
from engine.output.processor import OutputProcessor
from engine.output.state import EngineState
from engine.outputs import CompletionDelta, RequestOutput
from engine.sched.request import Request


class OutputBuilder:
    def __init__(self, processor: OutputProcessor, state: EngineState, detokenize: bool):
        self.processor, self.state, self.detokenize = processor, state, detokenize
        self._prompt_ready = state.prompt_logprobs.ready  # read for every output: empty almost always

    # ------------------------------------------------------------------ RequestOutputs (offline)
    def output(self, request: Request) -> RequestOutput:
        return self.finish_output(request) if request.finished else self._output(request)

    def finish_output(self, request: Request) -> RequestOutput:
        request.metrics.finished_time = time.time()
        output = self._output(request)
        self._retire(request)
        return output

    def _output(self, request: Request) -> RequestOutput:
        deltas = [
            CompletionDelta(index, ids, text, logprobs, masks, reason, error)
            for index, ids, masks, logprobs, reason, error, text in self._take_samples(request)
        ]
        return RequestOutput(
            request.request_id,
            deltas,
            request.finished,
            request.num_prompt,
            request.completion_tokens,
            request.cached_tokens,
            request.metrics,
            self._prompt_ready.pop(request, None) if self._prompt_ready else None,
        )

    # ------------------------------------------------------------------ Records (engine core)
    def records(self, requests: Iterable[Request]) -> Records:
        """The records of `requests`, in order; the finished ones are retired."""
        heads, samples = [], []
        for request in requests:
            self._add_record(request, heads, samples)
            if request.finished:
                self._retire(request)
        return Records.from_rows(heads, samples)

    def finish_record(self, request: Request) -> Record:
        heads, samples = [], []
        self._add_record(request, heads, samples)
        self._retire(request)
        return next(Records.from_rows(heads, samples).rows())

    def _add_record(self, request: Request, heads: list[tuple], samples: list[tuple]) -> None:
        """Append the request's row of Records' request columns, and its samples' rows."""
        first = len(samples)
        samples += self._take_samples(request)
        final_metrics = None
        if request.finished:
            m = request.metrics
            final_metrics = FinalMetrics(
                m.first_scheduled_time,
                m.first_token_time,
                m.spec_draft_tokens,
                m.spec_accepted_tokens,
                m.added_time,
            )
        # the prompt logprobs once, on the first record after the prompt was scored
        prompt_lps = self._prompt_ready.pop(request, None) if self._prompt_ready else None
        heads.append(
            (request.request_id, request.finished, request.cached_tokens, final_metrics, prompt_lps,
             len(samples) - first)
        )  # fmt: skip

    # ------------------------------------------------------------------ shared
    def _retire(self, request: Request) -> None:
        """After its final output was built (which may still read its prompt logprobs)."""
        self.state.requests.pop(request.request_id, None)
        for seq in request.seqs:
            if seq.grammar is not None:
                seq.grammar.release()
        self.state.counters.generation_tokens_total += request.completion_tokens
        if request.params.prompt_logprobs is not None:
            self.state.prompt_logprobs.drop(request)

    def _take_samples(self, request: Request):
        """Per sample with news, a row of Sample's fields (index, ids, masks, logprobs, finish reason,
        error, stop_token), but when this engine detokenizes the last field is the sample's new text
        instead. The pending tokens are handed over."""
        want_logprobs = request.params.logprobs is not None
        for seq in request.seqs:
            st = seq.state
            final = seq.finished and not st.reported
            if not (st.pending_ids or final):
                continue
            last = self.processor.take_text(seq, seq.finished) if self.detokenize else st.ends_with_stop_token
            yield (
                seq.index,
                st.pending_ids,
                st.pending_masks,
                st.pending_logprobs if want_logprobs else None,
                seq.finish_reason if final else None,
                seq.error if final else None,
                last,
            )
            st.pending_ids, st.pending_masks, st.pending_logprobs = [], [], []
            st.reported = seq.finished
