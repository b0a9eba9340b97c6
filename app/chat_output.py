"""One chat choice's generated text on its way into a response: the <think> split, then tool calls.

The same pipeline serves streamed and whole answers (app/sse.py feeds it item by item either way), so
both carry the same reasoning, content and calls. Order: the reasoning split (app/reasoning.py) first,
then tool calls are looked for in the content only (app/tool_calls.py).
"""

from __future__ import annotations

from app.reasoning import ThinkSplitter
from app.tool_calls import ToolCall, ToolCallStream


class ChoiceText:
    """reasoning: "split", "drop" or "off" (app/protocol.ChatCompletionRequest.reasoning); tools: the
    choice's tool-call stream, or None when the request looks for no calls."""

    def __init__(self, reasoning: str, tools: ToolCallStream | None, starts_in_think: bool = False):
        self.reasoning = reasoning
        self.split = ThinkSplitter(starts_in_think) if reasoning != "off" else None
        self.tools = tools

    @property
    def holds_back(self) -> bool:
        """Text may be held back, so an item can yield nothing visible."""
        return self.split is not None or self.tools is not None

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, calls) that this piece decides; `finished`: the choice's last piece."""
        reasoning, content = "", text
        if self.split is not None:
            reasoning, content = self.split.feed(text)
            if finished:
                r, c = self.split.finish()
                reasoning, content = reasoning + r, content + c
            if self.reasoning == "drop":
                reasoning = ""
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, finished)
        return reasoning, content, calls

    def finish_reason(self, reason: str | None) -> str | None:
        """tool_calls when the choice ended with calls, else the engine's reason."""
        if reason is not None and self.tools is not None and self.tools.called:
            return "tool_calls"
        return reason
