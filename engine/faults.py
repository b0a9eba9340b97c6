"""Test-only fault injection. Enabled by EngineConfig(fault_injection=True), never in production.

A request opts in by carrying the marker `__fault:<point>__` in its prompt text; `check(point,
request)` then raises InjectedFault at that point of that request's path. The point "loop" kills the
engine loop itself (to test health checks and replica replacement). The point "tool" fires where the
calculator runs (a sampled python-end marker) and also at the first sampled token of any request with
the tool enabled, since a small test model rarely samples that marker.
"""

from __future__ import annotations

POINTS = ("detokenize", "tool", "sample", "loop")


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    def __init__(self, enabled: bool, decode=None):
        self.enabled = enabled
        self.decode = decode  # token ids -> text, to find markers in token-id prompts

    def wants(self, point: str, request) -> bool:
        if not self.enabled:
            return False
        text = request.__dict__.setdefault("_fault_text", self._text(request))
        return f"__fault:{point}__" in text

    def check(self, point: str, request) -> None:
        if point == "sample" and getattr(request.params, "tool", None) is not None:
            self.check("tool", request)  # every sampled token passes here (see the module docstring)
        if self.wants(point, request):
            raise InjectedFault(f"injected fault at {point} for request {request.request_id}")

    def _text(self, request) -> str:
        return self.decode(request.prompt_ids) if self.decode else ""
