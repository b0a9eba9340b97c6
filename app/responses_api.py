"""OpenAI's Responses API (POST /v1/responses), stateless: its request, and its translation into the chat
request the ingress already serves (docs/api.md, Responses API).

A Responses request is answered as the chat completion it translates to, so sampling, structured output,
tools, the `<think>` split and every refusal behave as on /v1/chat/completions:
  * `instructions` becomes a system message first; `input` items become chat messages, `text.format`
    becomes `response_format`, function `tools` and `tool_choice` the chat shapes (app/responses_input.py);
    `max_output_tokens` becomes `max_tokens`;
  * nothing is stored: `store: true`, `previous_response_id` and the other fields that need stored
    state are refused with 400, since the server keeps no responses and its replicas share no state.
Errors of the chat fields are reported under the Responses field names (`renamed`).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError, model_validator
from pydantic_core import PydanticCustomError

from app.errors import ApiError
from app.field_policy import UNSUPPORTED_CODE, reject_unsupported
from app.messages import StrictModel
from app.protocol import ChatCompletionRequest
from app.responses_input import (
    chat_tool_choice,
    chat_tools,
    check_reasoning,
    fail,
    input_messages,
    text_format,
)
from engine.errors import InvalidRequestError

_STATELESS = "this server keeps no responses (it is stateless and its replicas share no state)"
RESPONSES_UNSUPPORTED = {
    "previous_response_id": f"{_STATELESS}: send the whole conversation as input",
    "conversation": f"{_STATELESS}: send the whole conversation as input",
    "background": f"{_STATELESS}, so a response cannot be fetched later",
    "prompt": "stored prompt templates are not kept here: send instructions and input",
    "context_management": "context compaction is not implemented",
    "max_tool_calls": "tools run on the client, one model turn per request",
    "top_logprobs": "logprobs are not implemented on this endpoint (chat completions has them)",
    "include": "no extra output data is implemented (logprobs, encrypted reasoning)",
    "moderation": "moderation is not implemented",
    "prompt_cache_options": "the prefix cache is automatic",
    "prompt_cache_retention": "the prefix cache is automatic",
    "access_programs": "not implemented",
    "image": "the models are text only",
    "background_options": f"{_STATELESS}, so a response cannot be fetched later",
}
_REASONING_EFFORT = "reasoning length is not adjustable; thinking models' <think> text is the reasoning item"
# chat field prefix -> Responses field prefix, for errors the chat path reports (longest first)
_RENAMES = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function", "tool_choice"),
    ("max_tokens", "max_output_tokens"),
)


class ResponsesRequest(StrictModel):
    """The request fields taken (docs/api.md); `input` items, `text`, `tools`, `tool_choice` and
    `reasoning` are typed loosely and checked by the translation, so that every problem is a 4xx naming
    the exact field (`refusal`)."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning: Any = None
    stream: bool = False
    store: bool | None = None  # absent or false: not stored; true is refused (stateless)
    # accepted and ignored: they do not change what is generated
    stream_options: dict[str, Any] | None = None
    truncation: str | None = None  # "disabled" (the default): prompts are never truncated
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def refuse_unsupported(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and raw.get("store") is True:
            raise_unsupported("store", f"{_STATELESS}; omit store or send false")
        if isinstance(raw, dict) and raw.get("truncation") not in (None, "disabled"):
            raise_unsupported("truncation", "prompts are never truncated: send 'disabled' or omit it")
        effort = raw.get("reasoning") if isinstance(raw, dict) else None
        if isinstance(effort, dict) and effort.get("effort") is not None:
            raise_unsupported("reasoning.effort", f"{_REASONING_EFFORT}; omit it")
        return reject_unsupported(raw, RESPONSES_UNSUPPORTED)

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request this one is answered as."""
        messages = self.chat_messages()
        if not messages:
            raise fail("input", "holds no message: send at least one message item")
        try:
            return self._chat_request(messages)
        except ValidationError as exc:  # a value the translation passed on that the chat model refuses
            first = exc.errors()[0]
            raise fail("input", f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from exc

    def _chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            response_format=text_format(self.text),
            tools=chat_tools(self.tools),
            tool_choice=chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls,
            stream=self.stream,
        )

    def chat_messages(self) -> list[dict[str, Any]]:
        check_reasoning(self.reasoning)
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*system, {"role": "user", "content": self.input}]
        if not self.input:
            raise InvalidRequestError("input: must not be empty", "input")
        return system + input_messages(self.input)


def raise_unsupported(field: str, why: str) -> None:
    """As app/field_policy.reject_unsupported refuses a field: 400 unsupported_parameter naming it."""
    message = f"this server does not support {field}: {why} (see docs/api.md)"
    raise PydanticCustomError(UNSUPPORTED_CODE, message, {"field": field})


def refusal(exc: InvalidRequestError) -> ApiError:
    """A translation error: 400 for the constraint fields (text, tools, tool_choice), as chat answers
    response_format and tools; 422 for a malformed input item, as chat answers a malformed message."""
    root = (exc.field or "").split(".")[0].split("[")[0]
    status = 400 if root in ("text", "tools", "tool_choice", "parallel_tool_calls") else 422
    return ApiError(status, str(exc), "invalid_request_error", exc.field, "invalid_value")


def renamed(response: Response) -> Response:
    """An error answer of the chat path, with its field named as the Responses request names it."""
    if response.status_code < 400 or not isinstance(response, JSONResponse):
        return response
    body = json.loads(bytes(response.body))
    err = body.get("error") or {}
    old = err.get("param")
    new = _rename(old)
    if old is None or new == old:
        return response
    err["param"] = new
    err["message"] = err["message"].replace(old, new, 1)
    headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
    return JSONResponse(body, status_code=response.status_code, headers=headers or None)


def _rename(param: str | None) -> str | None:
    if param is None:
        return None
    if param.startswith("messages"):  # message indexes differ from input indexes (instructions)
        return "input"
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function", "", 1)  # tools[0].function.name -> tools[0].name
    for old, new in _RENAMES:
        if param == old or param.startswith((old + ".", old + "[")):
            return new + param[len(old) :]
    return param
