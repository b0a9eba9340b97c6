"""What the engine hands out for a request's news: RequestOutputs (offline, with text) or compact
Records (the engine core's step message, no text). One per request and step with news; a finished
request's output also retires it: it leaves the live table, its tokens are counted, and its prompt
logprobs are dropped. The pending tokens of every sample are handed over exactly once."""

from __future__ import annotations

import time

from engine.core_messages import Record
from engine.output_processor import OutputProcessor, PromptLogprobs
from engine.outputs import CompletionDelta, RequestOutput
from engine.request import Request


class OutputBuilder:
    """Shares the engine's live-request table and stats (the same dict objects, never replaced)."""

    def __init__(
        self,
        processor: OutputProcessor,
        prompt_logprobs: PromptLogprobs,
        requests: dict[str, Request],
        stats: dict,
        detokenize: bool,
    ):
        self.processor, self.prompt_logprobs = processor, prompt_logprobs
        self._prompt_ready = prompt_logprobs.ready  # read for every output: empty almost always
        self.requests, self.stats, self.detokenize = requests, stats, detokenize

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
    def record(self, request: Request) -> Record:
        return self.finish_record(request) if request.finished else self._record(request)

    def finish_record(self, request: Request) -> Record:
        record = self._record(request)
        self._retire(request)
        return record

    def _record(self, request: Request) -> Record:
        samples, m = list(self._take_samples(request)), request.metrics
        final_metrics = None
        if request.finished:
            final_metrics = (
                m.first_scheduled_time,
                m.first_token_time,
                m.spec_draft_tokens,
                m.spec_accepted_tokens,
            )
        # the prompt logprobs once, on the first record after the prompt was scored
        prompt_lps = self._prompt_ready.pop(request, None) if self._prompt_ready else None
        return request.request_id, samples, request.finished, request.cached_tokens, final_metrics, prompt_lps

    # ------------------------------------------------------------------ shared
    def _retire(self, request: Request) -> None:
        """After its final output was built (which may still read its prompt logprobs)."""
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            if seq.grammar is not None:
                seq.grammar.release()
        self.stats["generation_tokens_total"] += request.completion_tokens
        if request.params.prompt_logprobs is not None:
            self.prompt_logprobs.drop(request)

    def _take_samples(self, request: Request):
        """Per sample with news: (index, ids, masks, logprobs, finish reason, error, text or stop-token
        flag). The pending tokens are handed over. Text only when this engine detokenizes; otherwise the
        last field says whether the final token is a stop token / EOS, which is never part of the text."""
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
