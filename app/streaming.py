"""Stream items of the engine deployment: merging a request's outputs into one item, and pacing items.

Every item is one message through Serve and one SSE event through the HTTP front, so how many there
are per second, not how many tokens, is what the serving path pays for (see `Pacer`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine.outputs import CompletionDelta, RequestOutput


def _empty_sample(index: int) -> dict:
    return {
        "index": index,
        "text": "",
        "token_ids": [],
        "logprobs": None,
        "finish_reason": None,
        "error": None,
    }


def to_wire(outs: list[RequestOutput], token_text: Callable[[int], str]) -> dict:
    """Merge consecutive outputs of one request (deltas, in order) into one item.

    Per sample index: text and token ids concatenate; finish_reason/error come from the delta that set
    them. Usage counts are cumulative in the engine, so the last output's values are the current ones.
    Logprobs carry token strings (the ingress has no tokenizer): {"token", "logprob", "top": [(str, lp)]}.
    Prompt logprobs come on the request's first output only (when it asked for them), so the item that
    holds that output carries them, once: [None, {"token_id", "token", "logprob", "top": [(id, str,
    lp)]}, ...], entry i for prompt position i (the first token has nothing before it to score it).
    """
    samples: dict[int, dict] = {}
    prompt_logprobs = None
    for out in outs:
        if out.prompt_logprobs is not None:
            prompt_logprobs = _prompt_logprobs_wire(out.prompt_logprobs, token_text)
        for d in out.outputs:
            _merge_delta(samples.setdefault(d.index, _empty_sample(d.index)), d, token_text)
    last = outs[-1]
    return {
        "kind": "output",
        "outputs": [samples[i] for i in sorted(samples)],
        "finished": last.finished,
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "cached_tokens": last.cached_tokens,
        "prompt_logprobs": prompt_logprobs,
    }


def _prompt_logprobs_wire(plp: list, token_text: Callable[[int], str]) -> list:
    """[None, {"token_id", "token", "logprob", "top": [(id, str, lp)]}, ...]: see `to_wire`."""
    return [
        None if e is None else
        {"token_id": e.token_id, "token": token_text(e.token_id), "logprob": e.logprob,
         "top": [(t, token_text(t), v) for t, v in e.top]}
        for e in plp
    ]  # fmt: skip


def _merge_delta(sample: dict, d: CompletionDelta, token_text: Callable[[int], str]) -> None:
    """Append one delta of a sample to its wire item `sample` (made by `_empty_sample`)."""
    sample["text"] += d.text
    sample["token_ids"].extend(d.token_ids)
    if d.logprobs:
        entries = [
            {"token": token_text(lp.token_id), "logprob": lp.logprob,
             "top": [(token_text(t), v) for t, v in lp.top]}
            for lp in d.logprobs
        ]  # fmt: skip
        sample["logprobs"] = (sample["logprobs"] or []) + entries
    if d.finish_reason is not None:
        sample["finish_reason"], sample["error"] = d.finish_reason, d.error


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
