"""One chat choice's generated text on its way into a response: the <think> split, then tool calls.

The same pipeline serves streamed and whole answers (app/sse.py feeds it item by item either way), so
both carry the same reasoning, content and calls. Order: the reasoning split (app/reasoning.py) first,
then tool calls are looked for in the content only (app/tool_calls.py).
"""

from __future__ import annotations

from app import logprob_shapes as shapes
from app.reasoning import ThinkSplitter
from app.responses import ChatChunkChoice, ChatDelta, ChatResponseMessage, ToolCallDelta, ToolCallOut
from app.tool_calls import ToolCall, ToolCallStream


class ChoiceText:
    """reasoning: "split", "drop" or "off" (app/protocol.ChatCompletionRequest.reasoning); tools: the
    choice's tool-call stream, or None when the request looks for no calls. Whole answers accumulate
    here (`add`, `message`); streamed ones go out piece by piece (`chunk_choice`)."""

    def __init__(self, reasoning: str, tools: ToolCallStream | None, starts_in_think: bool = False):
        self.reasoning = reasoning
        self.split = ThinkSplitter(starts_in_think) if reasoning != "off" else None
        self.tools = tools
        self.calls: list[ToolCall] = []  # every call so far; a call's index is its position here
        self._reasoning: list[str] = []
        self._content: list[str] = []

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
        self.calls += calls
        return reasoning, content, calls

    def finish_reason(self, reason: str | None) -> str | None:
        """tool_calls when the choice ended with calls, else the engine's reason."""
        return "tool_calls" if reason is not None and self.calls else reason

    # ------------------------------------------------------------ streaming

    def chunk_choice(self, index: int, sample: dict) -> ChatChunkChoice | None:
        """The sample's piece of a chat chunk; None when all of it is held back."""
        first = len(self.calls)
        reasoning, content, calls = self.feed(sample["text"], sample["finish_reason"] is not None)
        finish, logprobs = sample["finish_reason"], sample["logprobs"]
        if self.holds_back and not (reasoning or content or calls or finish or logprobs):
            return None  # all held back (a possible partial tag or tool call)
        # content is always set unless text can be held back (as before the split and tool calls existed)
        delta = ChatDelta(content=(content or None) if self.holds_back else content)
        delta.reasoning_content = reasoning or None
        if calls:
            delta.tool_calls = [ToolCallDelta(index=first + k, **c.as_dict()) for k, c in enumerate(calls)]
        return ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=shapes.chat_logprobs(logprobs) if logprobs else None,
            finish_reason=self.finish_reason(finish),
        )

    # ------------------------------------------------------------ whole answers

    def add(self, sample: dict) -> str | None:
        """Accumulate one sample's piece; returns its finish reason (tool_calls after calls)."""
        reasoning, content, _ = self.feed(sample["text"], sample["finish_reason"] is not None)
        self._reasoning.append(reasoning)
        self._content.append(content)
        return self.finish_reason(sample["finish_reason"])

    def message(self) -> ChatResponseMessage:
        content = "".join(self._content)
        calls = [ToolCallOut(**c.as_dict()) for c in self.calls]
        return ChatResponseMessage(
            content=None if calls and not content.strip() else content,
            reasoning_content="".join(self._reasoning) or None,
            tool_calls=calls or None,
        )
