"""EngineState: what LLMEngine, its TokenSink and its OutputBuilder share, in one object passed to each.

Requests enter `requests` in LLMEngine.add_request and leave it when their final output is built
(OutputBuilder retires them); a request still in it is live. The counters only grow.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.output.processor import PromptLogprobs
from engine.sched.request import Request


@dataclass
class Counters:
    num_aborts: int = 0
    num_errors: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class EngineState:
    requests: dict[str, Request] = field(default_factory=dict)  # the live requests by id
    counters: Counters = field(default_factory=Counters)
    prompt_logprobs: PromptLogprobs = field(default_factory=PromptLogprobs)  # of requests that ask

    def is_live(self, request: Request) -> bool:
        """Not yet retired (an aborted or failed request is retired once its final output is built)."""
        return request.request_id in self.requests
