"""TokenSink: the host side of a step whose tokens have arrived.

It appends each sampled token to its sequence (a speculating chunk's verified tokens, in order),
finishes the sequences that stop, fails the requests whose step failed, and turns the requests that
got tokens into outputs: RequestOutputs with text (the offline loop) or compact records (the engine
core). Invariants: a request with tokens not yet turned into outputs is in `touched`; a failed request
waits in `failed` until the engine makes its one final output. What it shares with the engine and the
OutputBuilder (live requests, counters, prompt logprobs) is the EngineState it is given.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from engine.core.messages import Records
from engine.output.state import EngineState
from engine.outputs import RequestOutput
from engine.sampling.sampler import PendingSample, SampleResult
from engine.sampling_params import RequestOutputKind
from engine.sched.output import SchedulerOutput
from engine.sched.request import Request

log = logging.getLogger("engine")


class Received(NamedTuple):
    """A step's drawn ids on the host, and the sequence of each sampling row."""

    result: SampleResult
    samplers: list


class TokenSink:
    def __init__(self, scheduler, processor, outputs, state: EngineState, speculator=None):
        self.scheduler = scheduler
        self.processor = processor  # engine.output.processor.OutputProcessor
        self.outputs = outputs  # engine.output.builder.OutputBuilder
        self.state = state
        self.speculator = speculator
        self.touched: dict[str, Request] = {}
        self.failed: list[Request] = []

    def receive(self, out: SchedulerOutput, pending: PendingSample | None) -> Received | None:
        """Wait for the sampled ids (the step's one host sync); each constrained sample's token goes to
        its grammar at once, so that the next step's mask fill can start before `complete`."""
        if pending is None:
            return None
        try:
            result = pending.resolve()
        except Exception as exc:
            self.fail_chunks(out, exc)
            return None
        # the sequences that drew one token each, in sampling-row order (speculating chunks' tokens
        # arrive as SampleResult.spec_tokens instead)
        samplers = [s for c in out.chunks if not c.num_draft for s in c.samples]
        for seq, token in zip(samplers, result.token_ids, strict=True):
            if seq.grammar is not None and not seq.finished:
                seq.grammar.push(token)
        return Received(result, samplers)

    def complete(self, out: SchedulerOutput, received: Received | None) -> None:
        """Append the received ids: token-level work only."""
        result = received.result if received is not None else None
        if result is not None and result.spec_tokens is not None:
            # before update_computed: it hashes their blocks
            self.accept(out, result.spec_tokens, result.spec_drafts)
        self.scheduler.update_computed(out)
        if result is None:
            return
        if result.prompt is not None:  # before the samples: the request's next output carries them
            self.state.prompt_logprobs.absorb(result.prompt)
        now = time.time()
        for seq, token, logprob in zip(received.samplers, result.token_ids, result.logprobs, strict=True):
            self.append(seq, token, logprob, now)

    def touch(self, request: Request) -> None:
        """The request has news for its next output (tokens, or an end decided outside a step)."""
        self.touched[request.request_id] = request

    def append(self, seq, token: int, logprob, now: float) -> bool:
        """Append one drawn token; False when the sequence is (now) finished or failed."""
        request = seq.request
        if seq.finished:
            return False  # e.g. a stop string ended it while this step was already in flight
        self.touch(request)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = request.metrics.engine_token_time = now
        request.metrics.last_token_time = now
        try:
            reason = self.processor.append(seq, token, logprob)
        except Exception as exc:
            self.fail(request, f"{type(exc).__name__}: {exc}", exc)
            return False
        if reason:
            self.scheduler.finish(seq, reason)
        return not reason

    def accept(
        self, out: SchedulerOutput, spec_tokens: list[list[int]], drafts: list[list[int]] | None = None
    ) -> None:
        """Append each speculating chunk's verified tokens (accepted proposals, then the target's own) in
        order, up to the first that ends its sequence, and count its acceptance. A token that brings
        forced tokens (budget forcing's replacement, a tool's result) is the chunk's last: the positions
        verified after it scored a history the sequence does not have, so their tokens are dropped and
        the chunk keeps only the proposals before it (num_accepted), whose KV holds what the sequence
        holds. Its forced tokens are then computed next step, as after a plain draw. `drafts` (gated-LoRA
        MTP): each chunk's drafts for its next step, which follow its last verified token."""
        now = time.time()
        chunks = [c for c in out.chunks if c.num_draft]
        for i, (chunk, tokens) in enumerate(zip(chunks, spec_tokens, strict=True)):
            chunk.num_accepted = len(tokens) - 1
            if chunk.seq.finished:
                continue
            forced_at = self._append_verified(chunk.seq, tokens, now)
            if forced_at is not None:
                chunk.num_accepted = forced_at
            elif drafts is not None and not chunk.seq.finished:
                self.speculator.keep_drafts(chunk.seq, tokens[-1], drafts[i])
            cut = forced_at is not None and forced_at < len(tokens) - 1
            self.speculator.record(chunk.seq, chunk.num_draft, chunk.num_accepted, cut)

    def _append_verified(self, seq, tokens: list[int], now: float) -> int | None:
        """Append a chunk's verified tokens while each goes in alone and as drawn; the index of the one
        that brought forced tokens (or was replaced by none), where appending stopped; else None."""
        for i, token in enumerate(tokens):
            before = seq.num_tokens
            if not self.append(seq, token, None, now):
                return None  # finished: nothing more of this sequence is computed
            if seq.num_tokens != before + 1 or not seq.masks[-1]:
                return i
        return None

    def emit(self) -> list[RequestOutput]:
        """Text and RequestOutputs for every request that got tokens in the previous step; a FINAL_ONLY
        request's only when it has ended (before that, its text only where a stop string may end it)."""
        touched, self.touched = self.touched, {}
        outputs = []
        for request in touched.values():
            if not self.state.is_live(request):
                continue  # aborted or failed meanwhile; its final output is already out
            final_only = request.params.output_kind is RequestOutputKind.FINAL_ONLY
            if final_only and not request.finished and not request.params.stop:
                continue  # no stop string to look for: its text is made at its end, at once
            try:
                for seq in request.seqs:
                    if self.processor.detokenize(seq):
                        if seq.finished:
                            seq.finish_reason = "stop"
                        else:
                            self.scheduler.finish(seq, "stop")
            except Exception as exc:
                self.fail(request, f"{type(exc).__name__}: {exc}", exc)
                continue
            if request.finished or not final_only:
                outputs.append(self.outputs.output(request))
        return outputs

    def emit_records(self) -> Records:
        """Records of every live request that got tokens in the previous step (no text work)."""
        touched, self.touched = self.touched, {}
        return self.outputs.records(r for r in touched.values() if self.state.is_live(r))

    def fail_chunks(self, out: SchedulerOutput, exc: Exception) -> None:
        for request in {id(c.seq.request): c.seq.request for c in out.chunks}.values():
            self.fail(request, f"model step failed: {exc}", exc)

    def fail(self, request: Request, message: str, exc: Exception | None = None) -> None:
        if request.aborted:
            return  # already failed or aborted: one terminal output only
        log.error("request %s failed: %s", request.request_id, message, exc_info=exc)
        self.state.counters.num_errors += 1
        for seq in request.seqs:
            seq.error = message
        self.scheduler.abort(request, "error")
        self.failed.append(request)

    def take_failed(self) -> list[Request]:
        """The requests failed since the last call, each still owed its final output."""
        failed, self.failed = self.failed, []
        return failed
