"""Responses API answers (POST /v1/responses): the `response` object, or its typed SSE events.

The generated text goes through the chat choice's pipeline (app/chat_output.py: the `<think>` split, then
tool calls), and its three parts become output items: the reasoning as a `reasoning` item (its text in
one `reasoning_text` content part; no summary), the content as an assistant `message` item with one
`output_text` part, each call as a `function_call` item (id `fc_...`, call_id the chat call id).

Streaming follows OpenAI's event order: response.created, response.in_progress; per item
output_item.added, content_part.added, the deltas, the text's .done, content_part.done, output_item.done
(a function call's arguments come whole, in one delta); then response.completed, or response.incomplete
when max_output_tokens ended the answer. Every event carries `type` and a `sequence_number` counting from
0, and its SSE `event:` line names the type; there is no `[DONE]`. A failure mid-stream ends the stream
with one `error` event instead. Invariant: the items of the last event are the items the deltas built,
so streamed and whole answers carry the same output.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable

from app.engine_client import EngineStream, merge
from app.errors import ApiError, internal
from app.responses_api import ResponsesRequest
from app.sse import ResponseAssembler, item_error
from app.tool_calls import ToolCall, ToolParsing

logger = logging.getLogger("ray.serve")
_PART = {"reasoning": "reasoning_text", "message": "output_text"}
_DELTA = {"reasoning": "response.reasoning_text", "message": "response.output_text"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def text_item(kind: str, item_id: str, text: str | None, status: str) -> dict:
    """A reasoning or message output item; `text` None: its content parts are still to come."""
    content = [] if text is None else [text_part(kind, text)]
    if kind == "reasoning":
        return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
    return {"id": item_id, "type": "message", "role": "assistant", "content": content, "status": status}


def call_item(item_id: str, call: ToolCall, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


class ResponsesOutput(ResponseAssembler):
    """One Responses answer: a chat assembler of one choice (usage, the choice's text pipeline) that
    renders the `response` object (`final`) or its events (`events`)."""

    def __init__(self, request: ResponsesRequest, model: str, reasoning: str, tools: ToolParsing | None):
        super().__init__(True, _id("resp"), model, 1, 1, reasoning=reasoning, tools=tools)
        self.request = request
        self._seq = 0
        self._items: list[dict] = []  # streamed output items, in output_index order
        self._open: tuple[str, int, list[str]] | None = None  # (kind, output index, text so far)

    # ------------------------------------------------------------ the response object

    def status(self) -> str:
        return "incomplete" if self._finish[0] == "length" else "completed"

    def body(self, status: str, output: list[dict], with_usage: bool) -> dict:
        r = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [],
            "text": r.text or {"format": {"type": "text"}},
            "reasoning": r.reasoning,
            "store": False,
            "previous_response_id": None,
            "truncation": "disabled",
            "metadata": r.metadata or {},
            "user": r.user,
            "usage": self.response_usage() if with_usage else None,
        }

    def response_usage(self) -> dict:
        """Reasoning tokens are not counted apart (the ingress sees text, not tokens): 0."""
        u = self.usage()
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens,
        }

    def final(self) -> dict:
        """The whole answer (`add` has taken every item): reasoning, then the message, then calls."""
        message = self._choice[0].message()
        output = []
        if message.reasoning_content:
            output.append(text_item("reasoning", _id("rs"), message.reasoning_content, "completed"))
        if message.content:
            output.append(text_item("message", _id("msg"), message.content, "completed"))
        for call in self._choice[0].calls:
            output.append(call_item(_id("fc"), call, call.arguments, "completed"))
        status = self.status()
        if status == "incomplete" and output and output[-1]["type"] != "function_call":
            output[-1]["status"] = "incomplete"
        return self.body(status, output, with_usage=True)

    # ------------------------------------------------------------ events

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def opening(self) -> str:
        body = self.body("in_progress", [], with_usage=False)
        created = self.event("response.created", response=body)
        return created + self.event("response.in_progress", response=body)

    def chunk(self, prompt_index: int, item: dict) -> str | None:
        """The events one engine item decides; None when its text is all held back."""
        self.record_usage(prompt_index, item)
        events: list[str] = []
        choice = self._choice[0]
        for s in item["outputs"]:
            reasoning, content, calls = choice.feed(s["text"], s["finish_reason"] is not None)
            if s["finish_reason"] is not None:
                self._finish[0] = choice.finish_reason(s["finish_reason"])
            if reasoning:
                events += self._delta("reasoning", reasoning)
            if content:
                events += self._delta("message", content)
            for call in calls:
                events += self._call(call)
        return "".join(events) or None

    def closing(self) -> str:
        status = self.status()
        events = self._close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return "".join(events) + self.event(kind, response=self.body(status, self._items, with_usage=True))

    def error_event(self, err: ApiError) -> str:
        return self.event("error", code=err.code, message=err.message, param=err.param)

    def _delta(self, kind: str, delta: str) -> list[str]:
        events = []
        if self._open is not None and self._open[0] != kind:
            events += self._close("completed")
        if self._open is None:
            index = len(self._items)
            item = text_item(kind, _id("rs" if kind == "reasoning" else "msg"), None, "in_progress")
            self._items.append(item)
            self._open = (kind, index, [])
            events.append(self.event("response.output_item.added", output_index=index, item=item))
            events.append(self._part_event("response.content_part.added", text_part(kind, "")))
        _, index, texts = self._open
        texts.append(delta)
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(f"{_DELTA[kind]}.delta", **self._where(), delta=delta, **extra))
        return events

    def _where(self) -> dict:
        assert self._open is not None
        _, index, _ = self._open
        return {"item_id": self._items[index]["id"], "output_index": index, "content_index": 0}

    def _part_event(self, kind: str, part: dict) -> str:
        return self.event(kind, **self._where(), part=part)

    def _close(self, status: str) -> list[str]:
        """The .done events of the open text item, which is then complete in the output."""
        if self._open is None:
            return []
        kind, index, texts = self._open
        text = "".join(texts)
        extra = {"logprobs": []} if kind == "message" else {}
        events = [self.event(f"{_DELTA[kind]}.done", **self._where(), text=text, **extra)]
        events.append(self._part_event("response.content_part.done", text_part(kind, text)))
        self._items[index] = text_item(kind, self._items[index]["id"], text, status)
        events.append(self.event("response.output_item.done", output_index=index, item=self._items[index]))
        self._open = None
        return events

    def _call(self, call: ToolCall) -> list[str]:
        events = self._close("completed")
        index, item_id = len(self._items), _id("fc")
        self._items.append(call_item(item_id, call, "", "in_progress"))
        where = {"item_id": item_id, "output_index": index}
        events.append(self.event("response.output_item.added", output_index=index, item=self._items[index]))
        events.append(self.event("response.function_call_arguments.delta", **where, delta=call.arguments))
        events.append(self.event("response.function_call_arguments.done", **where, arguments=call.arguments))
        self._items[index] = call_item(item_id, call, call.arguments, "completed")
        events.append(self.event("response.output_item.done", output_index=index, item=self._items[index]))
        return events

    async def events(self, streams: list[EngineStream], seen: Callable[[dict], None]) -> AsyncIterator[str]:
        """The SSE body; `seen` is told of each item once its events are taken (the TTFT metric)."""
        try:
            yield self.opening()
            async for index, item in merge(streams):
                err = item if isinstance(item, ApiError) else item_error(item)
                if err is not None:
                    yield self.error_event(err)
                    return
                events = self.chunk(index, item)
                if events is not None:
                    yield events
                    seen(item)
            yield self.closing()
        except Exception as exc:  # a bug here must still end the stream with its one terminal event
            logger.exception("responses stream failed")
            yield self.error_event(internal(f"stream failed: {type(exc).__name__}"))
