"""Test-only fault injection. Enabled by EngineConfig(fault_injection=True), never in production.

A request opts in by carrying the marker `__fault:<point>__` in its prompt text; `check(point,
request)` then raises InjectedFault at that point of that request's path. The point "loop" kills the
engine loop itself (to test health checks and replica replacement). The point "tool" fires where the
calculator runs (a sampled python-end marker) and also at the first sampled token of any request with
the tool enabled, since a small test model rarely samples that marker.

Whether injection is on is fixed at construction. Per-token code binds `checker()` once and skips the
call when it is None, so a production engine never calls into the injector per token; `check` is a
no-op for the per-step and per-request callers of an injector that is off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

POINTS = ("detokenize", "tool", "sample", "loop")

Check = Callable[[str, Any], None]  # (point, request) -> None, or raises InjectedFault


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    def __init__(self, enabled: bool, decode: Callable[[list[int]], str] | None = None):
        self.enabled = enabled
        self.decode = decode  # token ids -> text, to find markers in token-id prompts

    def checker(self) -> Check | None:
        """`check`, for a hot path to bind once; None when injection is off (nothing to call)."""
        return self.check if self.enabled else None

    def wants(self, point: str, request: Any) -> bool:
        if not self.enabled:
            return False
        text = request.__dict__.get("_fault_text")
        if text is None:  # decoded once per request, on its first check
            text = request.__dict__["_fault_text"] = self._text(request)
        return f"__fault:{point}__" in text

    def check(self, point: str, request: Any) -> None:
        if not self.enabled:
            return
        if point == "sample" and getattr(request.params, "tool", None) is not None:
            self.check("tool", request)  # every sampled token passes here (see the module docstring)
        if self.wants(point, request):
            raise InjectedFault(f"injected fault at {point} for request {request.request_id}")

    def _text(self, request: Any) -> str:
        return self.decode(request.prompt_ids) if self.decode else ""
