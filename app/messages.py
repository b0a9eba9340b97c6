"""Chat messages of a request, and their view for the chat template (app/chat.py renders them).

Messages forbid unknown fields like every request model; OpenAI message fields this server does not take
are refused with 400 `unsupported_parameter` (app/field_policy.py). An assistant message may carry
`tool_calls` (its content is then often null) and a tool message the `tool_call_id` it answers: they go
to the template in the shape chat templates expect (arguments as an object, not JSON text).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from app.field_policy import MESSAGE_UNSUPPORTED, reject_unsupported
from engine.errors import InvalidRequestError


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


_Strict = StrictModel


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Strict):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text; an object is taken too


class ToolCallIn(_Strict):
    """A call of an earlier assistant turn, as the response carried it."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None  # accepted and ignored (an earlier assistant turn may carry it)
    tool_calls: list[ToolCallIn] | None = None  # assistant turns (content may then be null)
    tool_call_id: str | None = None  # tool turns: the call this is the result of

    @model_validator(mode="before")
    @classmethod
    def refuse_unsupported(cls, raw: Any) -> Any:
        return reject_unsupported(raw, MESSAGE_UNSUPPORTED, "messages[].")

    def as_engine_message(self, i: int = 0) -> dict[str, Any]:
        """The template's view: content as text; tool calls with their arguments as an object (as chat
        templates expect them); tool_call_id and name on tool results. `i`: the index, for errors."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            if self.role != "assistant":
                raise InvalidRequestError(
                    f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                    f"messages[{i}].tool_calls",
                )
            out["tool_calls"] = [
                _engine_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(self.tool_calls)
            ]
        if self.role == "tool":
            out.update({k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name)) if v})
        return out


def _engine_call(call: ToolCallIn, where: str) -> dict[str, Any]:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            raise InvalidRequestError(
                f"{where}.function.arguments: not valid JSON: {exc}", f"{where}.function.arguments"
            ) from exc
    if not isinstance(args, dict):
        raise InvalidRequestError(
            f"{where}.function.arguments: must be a JSON object", f"{where}.function.arguments"
        )
    function = {"name": call.function.name, "arguments": args}
    return {"id": call.id, "type": "function", "function": function}
