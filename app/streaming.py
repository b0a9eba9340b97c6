"""Stream items of the engine deployment: a request's output as one item, and pacing items.

Every item is one message through Serve and one SSE event through the HTTP front, so how many there
are per second, not how many tokens, is what the serving path pays for (see `Pacer`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine.outputs import CompletionDelta, RequestOutput


def to_wire(out: RequestOutput, token_text: Callable[[int], str]) -> dict:
    """One output of a request as one stream item. The engine replica's `LiveRequest.take` has merged
    every step since the previous item into it, one delta per sample index.

    Usage counts are cumulative in the engine, so the output's values are the current ones. Logprobs
    carry token strings (the ingress has no tokenizer): {"token", "logprob", "top": [(str, lp)]}.
    Prompt logprobs come on the request's first output only (when it asked for them): [None,
    {"token_id", "token", "logprob", "top": [(id, str, lp)]}, ...], entry i for prompt position i (the
    first token has nothing before it to score it).
    """
    plp = out.prompt_logprobs
    return {
        "kind": "output",
        "outputs": [_sample_wire(d, token_text) for d in sorted(out.outputs, key=lambda d: d.index)],
        "finished": out.finished,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "prompt_logprobs": None if plp is None else _prompt_logprobs_wire(plp, token_text),
    }


def _prompt_logprobs_wire(plp: list, token_text: Callable[[int], str]) -> list:
    """[None, {"token_id", "token", "logprob", "top": [(id, str, lp)]}, ...]: see `to_wire`."""
    return [
        None if e is None else
        {"token_id": e.token_id, "token": token_text(e.token_id), "logprob": e.logprob,
         "top": [(t, token_text(t), v) for t, v in e.top]}
        for e in plp
    ]  # fmt: skip


def _sample_wire(d: CompletionDelta, token_text: Callable[[int], str]) -> dict:
    """One sample's delta on the wire: its text, token ids, logprobs (see `to_wire`), finish reason."""
    logprobs = None
    if d.logprobs:
        logprobs = [
            {"token": token_text(lp.token_id), "logprob": lp.logprob,
             "top": [(token_text(t), v) for t, v in lp.top]}
            for lp in d.logprobs
        ]  # fmt: skip
    error = d.error if d.finish_reason is not None else None  # an error only ends a sample
    return {"index": d.index, "text": d.text, "token_ids": list(d.token_ids), "logprobs": logprobs,
            "finish_reason": d.finish_reason, "error": error}  # fmt: skip


class Pacer:
    """How long a stream waits between items: open streams / stream_items_per_s, at least min_interval_s.

    The first item never waits. The budget is per replica: with several ingress or engine replicas the
    proxy sees their sum, so it is sized for one proxy per engine replica (serve_config.yaml)."""

    def __init__(self, min_interval_s: float, items_per_s: float):
        self.min_interval_s = min_interval_s
        self.items_per_s = items_per_s

    def interval(self, open_streams: int) -> float:
        return max(self.min_interval_s, open_streams / self.items_per_s)


class Stream:
    """One request's stream: woken by `_fan_out` on the event loop when the engine has more for it."""

    __slots__ = ("final", "wake", "prev_token_t", "gap_sum", "gaps", "received", "sent", "abandoned")

    def __init__(self, received: float = 0.0, sent: float | None = None) -> None:
        self.received = received  # time.time() when this replica got the request (engine TTFT origin)
        self.sent = sent  # time.time() when the ingress called this replica (None: not told)
        self.final = False  # the engine ended the request: its last item goes without waiting
        self.wake = asyncio.Event()
        self.prev_token_t: float | None = None  # when the last step that brought tokens reached us
        self.gap_sum, self.gaps = 0.0, 0  # inter-token gaps since the last yield
        self.abandoned = False  # the ingress aborted it: end the stream without a final output
