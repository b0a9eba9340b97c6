"""Engine-replica stream items (app/streaming.to_wire's shape) for tests of the ingress's response
assembly, without a server."""

from __future__ import annotations


def wire_item(text: str, completion: int, finish: str | None = None, prompt_tokens: int = 4) -> dict:
    """One item of a one-sample request: `text` is new, `completion` tokens so far."""
    sample = {
        "index": 0,
        "text": text,
        "token_ids": [],
        "logprobs": None,
        "finish_reason": finish,
        "error": None,
    }
    return {
        "kind": "output",
        "outputs": [sample],
        "finished": finish is not None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "cached_tokens": 0,
        "prompt_logprobs": None,
    }
