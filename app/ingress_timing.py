"""When a request reached the ingress, and when its first text left it: the origin and the end of the
TTFT the ingress observes (app/metrics.py)."""

from __future__ import annotations

import time

from fastapi import Request

from app.metrics import IngressMetrics


class FirstText:
    """Observes a response's TTFT once, at the first engine item that carries generated text: where a
    client's TTFT ends. Streaming, right after the HTTP server took the chunk that carries it."""

    def __init__(self, metrics: IngressMetrics, arrival: float):
        self._metrics, self._arrival, self._done = metrics, arrival, False

    def seen(self, item: dict) -> None:
        if not self._done and any(s["text"] for s in item["outputs"]):
            self._done = True
            self._metrics.first_text(self._arrival)


def arrival_time(request: Request) -> float:
    """When the ingress received the request: the security middleware stamps it before reading the
    body; time.time(), because the engine replica and core compare it with their own time.time()."""
    return getattr(request.state, "arrival_time", None) or time.time()
