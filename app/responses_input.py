"""Responses API input, as chat sees it: `input` items as chat messages, `text.format` as response_format,
function tools and tool_choice in chat's shapes (app/responses_api.py uses them; docs/api.md).

Every problem is an InvalidRequestError naming the Responses field (`input[2].call_id`, `text.format`).
Consecutive `function_call` items are one assistant turn (with the text of the assistant message before
them, when there is one); a `function_call_output` item becomes the tool message answering its call,
which must come earlier in the input; `reasoning` items sent back are dropped, as chat templates drop
an earlier turn's reasoning.
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequestError


def fail(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {message}", field)


def check_reasoning(value: Any) -> None:
    """`reasoning` asks for nothing beyond what the server does: thinking models' `<think>` text comes
    back as a reasoning item whenever the server's reasoning_parser is on. An effort is refused (by the
    validator), as chat refuses reasoning_effort; a summary is accepted and ignored (the item carries the
    full text)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise fail("reasoning", 'must be an object such as {"summary": "auto"}')
    unknown = sorted(set(value) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise fail(f"reasoning.{unknown[0]}", "unknown key (summary)")


def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Chat messages of the input items; consecutive function calls are one assistant turn."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool message answering it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise fail(where, "must be an object: a message or a function_call / function_call_output item")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            names[call["id"]] = call["function"]["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn's text, or calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_call_output(item, where, names))
        elif kind != "reasoning":  # an earlier turn's reasoning: dropped, as chat templates drop it
            raise fail(f"{where}.type", f"{kind!r} is not taken: send message, function_call, "
                       "function_call_output or reasoning items")  # fmt: skip
    return messages


def _keys(item: dict, where: str, allowed: set[str]) -> None:
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise fail(f"{where}.{unknown[0]}", f"unknown key (this item takes {', '.join(sorted(allowed))})")


def _message(item: dict, where: str) -> dict[str, Any]:
    _keys(item, where, {"type", "role", "content", "id", "status", "phase"})
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise fail(f"{where}.role", f"must be user, system, developer or assistant, got {role!r}")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or text content parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise fail(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise fail(f"{where}[{j}].type", f"{kind!r} is not taken: the models are text only (input_text)")
        if not isinstance(part.get("text"), str):
            raise fail(f"{where}[{j}].text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _function_call(item: dict, where: str) -> dict[str, Any]:
    # parsed_arguments: the SDK's parsed copy of arguments (responses.parse, responses.stream), sent back
    # when a client passes the output item on as it got it
    _keys(item, where, {"type", "id", "call_id", "name", "arguments", "status", "parsed_arguments"})
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise fail(f"{where}.{key}", "must be a string (as the function_call output item carried it)")
    try:
        json.loads(item["arguments"] or "{}")
    except ValueError as exc:
        raise fail(f"{where}.arguments", f"not valid JSON: {exc}") from exc
    function = {"name": item["name"], "arguments": item["arguments"] or "{}"}
    return {"id": item["call_id"], "type": "function", "function": function}


def _call_output(item: dict, where: str, names: dict[str, str]) -> dict[str, Any]:
    _keys(item, where, {"type", "id", "call_id", "output", "status"})
    call_id = item.get("call_id")
    if call_id not in names:
        why = f"{call_id!r} answers no function_call item before it: send the call item too"
        raise fail(f"{where}.call_id", why)
    output = item.get("output")
    text = output if isinstance(output, str) else _text(output, f"{where}.output")
    return {"role": "tool", "tool_call_id": call_id, "name": names[call_id], "content": text}


def text_format(text: Any) -> dict | None:
    """`text.format` as chat's response_format (app/structured.py checks the schema)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise fail("text", 'must be an object such as {"format": {"type": "text"}}')
    _keys(text, "text", {"format", "verbosity"})
    if text.get("verbosity") is not None:
        raise fail("text.verbosity", "not supported: output length is set by max_output_tokens")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise fail("text.format", 'must be an object such as {"type": "json_schema", "schema": {...}}')
    if fmt.get("type") != "json_schema":
        _keys(fmt, "text.format", {"type"})
        return fmt  # text, json_object, or a wrong type that response_format names
    _keys(fmt, "text.format", {"type", "name", "schema", "strict", "description"})
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def chat_tools(tools: list[Any] | None) -> list[dict] | None:
    """Function tools in chat's shape: {"type": "function", "function": {name, description, ...}}."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise fail(f"tools[{i}].type", f"only function tools are supported, got {kind!r}")
        _keys(tool, f"tools[{i}]", {"type", "name", "description", "parameters", "strict"})
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """ "none", "auto", "required" as they are; {"type": "function", "name"} in chat's shape."""
    if choice is None or isinstance(choice, str):
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise fail("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}')
    _keys(choice, "tool_choice", {"type", "name"})
    return {"type": "function", "function": {"name": choice.get("name")}}
