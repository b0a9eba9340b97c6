"""What the engine hands back each step: incremental, per request and per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class CompletionDelta:
    """New output of one sample (index i of n) since the previous RequestOutput."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    token_masks: list[int] = field(default_factory=list)  # 1 sampled, 0 forced (tool output / budget)
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None  # message when finish_reason == "error"


@dataclass
class RequestMetrics:
    arrival_time: float
    # when the engine took the request: the engine core's add in the server (arrival_time is the
    # ingress's), add_request offline
    added_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # when the engine sampled the first token, by its own clock: in the server that is the engine core
    # process, and first_token_time is when the replica received it; offline the two are equal
    engine_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # speculative decoding: proposals verified for this request and how many were accepted
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionDelta]
    finished: bool  # every sample is finished; this is the request's last output
    prompt_tokens: int
    completion_tokens: int  # over all samples, so far
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None  # the request's live timestamps (updated by the engine thread)
    # with SamplingParams.prompt_logprobs, on the request's first output that carries them (None on
    # every other): one entry per prompt token, entry 0 None (nothing predicts the first token), entry
    # i TokenLogprob(prompt_ids[i], logprob given prompt_ids[:i], top k at position i)
    prompt_logprobs: list[TokenLogprob | None] | None = None
