"""Structured output and tool choice: request fields -> the engine's StructuredOutput (issue 28).

What is checked here is the shape of the request fields: their types, exactly one constraint,
function names, conflicts between options. Whether a schema, regex or grammar can be compiled is the
engine's to say (engine/sched/admission.check raises InvalidRequestError naming `StructuredOutput.field`).
Every error here is an InvalidRequestError naming the offending field; app/errors.py answers errors
of these fields with 400.

Invariants:
  * at most one constraint per request: response_format (json_object / json_schema), structured_outputs,
    or the tool-call schema of tool_choice `required` / a named function;
  * a constraint is never dropped: what cannot be honoured is refused;
  * tool_choice `required` and named functions are constrained to a JSON array of calls
    `[{"name": <an allowed name>, "parameters": <that function's parameters>}, ...]` (`tool_call_schema`),
    the same for every model family; app/tool_calls.py parses that array back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutput

# Request fields whose errors are 400 (app/errors.py): a constraint the server cannot honour as given.
STRUCTURED_FIELDS = frozenset(
    {"response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls"}
)
_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_NO_PARAMETERS = {"type": "object", "properties": {}}
# structured_outputs keys (vLLM's StructuredOutputsParams) -> our kind; exactly one may be set.
_SO_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


@dataclass(frozen=True)
class ToolChoice:
    """How a chat answer's tool calls are found. mode: "auto" (the family's format, parsed) or
    "required" (the JSON array that `tool_call_schema` forces; a named function is "required" with one
    allowed name). parallel: more than one call allowed. names: the functions that may be called."""

    mode: str
    parallel: bool
    names: tuple[str, ...]


def fail(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {message}", field)


def response_format(value: Any) -> StructuredOutput | None:
    """OpenAI's response_format: text (no constraint), json_object, json_schema."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise fail("response_format", 'must be an object such as {"type": "json_object"}')
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise fail(f"response_format.{extra[0]}", "unknown key")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", None, "response_format")
    if kind == "json_schema":
        return _json_schema(value.get("json_schema"))
    raise fail("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _json_schema(value: Any) -> StructuredOutput:
    where = "response_format.json_schema"
    if not isinstance(value, dict):
        raise fail(where, 'must be an object: {"name": ..., "schema": {...}, "strict": true}')
    extra = sorted(set(value) - {"name", "schema", "strict", "description"})
    if extra:
        raise fail(f"{where}.{extra[0]}", "unknown key")
    name = value.get("name")
    if name is not None and not (isinstance(name, str) and _FUNCTION_NAME.match(name)):
        raise fail(f"{where}.name", "must be 1 to 64 letters, digits, '_' or '-'")
    if value.get("strict") is not None and not isinstance(value["strict"], bool):
        raise fail(f"{where}.strict", "must be a boolean")
    schema = value.get("schema")
    if not isinstance(schema, dict):
        raise fail(f"{where}.schema", "must be a JSON schema object")
    return StructuredOutput("json", schema, f"{where}.schema")


def structured_outputs(value: Any) -> StructuredOutput | None:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar (null keys are unset)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise fail("structured_outputs", 'must be an object such as {"regex": "[0-9]+"}')
    unknown = sorted(k for k, v in value.items() if k not in _SO_KINDS and v not in (None, False))
    if unknown:
        raise fail(f"structured_outputs.{unknown[0]}", "not supported here (json, regex, choice, grammar)")
    given = [k for k in _SO_KINDS if value.get(k) is not None]
    if len(given) != 1:
        raise fail("structured_outputs", f"give exactly one of json, regex, choice, grammar (got {given})")
    key = given[0]
    field, spec = f"structured_outputs.{key}", value[key]
    if key == "json":
        spec = _schema_arg(field, spec)
    elif key == "choice":
        if not (isinstance(spec, list) and spec and all(isinstance(c, str) for c in spec)):
            raise fail(field, "must be a non-empty list of strings")
    elif not (isinstance(spec, str) and spec):
        raise fail(field, "must be a non-empty string")
    return StructuredOutput(_SO_KINDS[key], spec, field)


def _schema_arg(field: str, spec: Any) -> dict:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as exc:
            raise fail(field, f"not valid JSON: {exc}") from exc
    if not isinstance(spec, dict):
        raise fail(field, "must be a JSON schema object")
    return spec


def one_constraint(response: Any, outputs: Any) -> StructuredOutput | None:
    """The constraint of response_format or structured_outputs; both at once is a conflict."""
    a, b = response_format(response), structured_outputs(outputs)
    if a is not None and b is not None:
        raise fail("structured_outputs", "cannot be combined with response_format: give one of them")
    return a or b


def function_parameters(tools: Any) -> dict[str, dict]:
    """{name: parameters schema} of the request's tools (OpenAI's function definitions)."""
    if not isinstance(tools, list) or not tools:
        raise fail("tools", "must be a non-empty list of function definitions")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise fail(f"{where}.type", "only function tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise fail(f"{where}.function", "must be an object with name and parameters")
        name = fn.get("name")
        if not (isinstance(name, str) and _FUNCTION_NAME.match(name)):
            raise fail(f"{where}.function.name", "must be 1 to 64 letters, digits, '_' or '-'")
        if name in out:
            raise fail(f"{where}.function.name", f"{name!r} is defined twice")
        params = fn.get("parameters", _NO_PARAMETERS)
        if not isinstance(params, dict):
            raise fail(f"{where}.function.parameters", "must be a JSON schema object")
        out[name] = params
    return out


def tool_call_schema(parameters: dict[str, dict], names: tuple[str, ...], parallel: bool) -> dict:
    """The JSON schema of what tool_choice required / named forces: an array of 1 (or, parallel, more)
    calls, each the name of an allowed function and arguments valid against its parameters."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": parameters[name]},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name in names
    ]
    schema: dict = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_choice(
    tools: Any, choice: Any, parallel: bool | None
) -> tuple[ToolChoice | None, StructuredOutput | None]:
    """(how to find calls, the constraint that forces them). tool_choice defaults to auto with tools;
    an empty tools list is no tools (clients that always send the field)."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise fail("tool_choice", "a required or named tool choice needs tools")
        return None, None
    params = function_parameters(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None, None
    if parallel is not None and not isinstance(parallel, bool):
        raise fail("parallel_tool_calls", "must be a boolean")
    many = parallel is not False
    if choice == "auto":
        return ToolChoice("auto", many, tuple(params)), None
    if choice == "required":
        names = tuple(params)
    else:
        names, many = (_named(choice, params),), False
    schema = tool_call_schema(params, names, many)
    return ToolChoice("required", many, names), StructuredOutput("json", schema, "tools")


def _named(choice: Any, params: dict[str, dict]) -> str:
    shape = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise fail("tool_choice", f"must be {shape}")
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or name not in params:
        raise fail("tool_choice.function.name", f"{name!r} is not one of the tools ({', '.join(params)})")
    return name


def resolve(
    response: Any, outputs: Any, tools: Any = None, choice: Any = None, parallel: bool | None = None
) -> tuple[StructuredOutput | None, ToolChoice | None]:
    """All of a request's constraint fields -> (the one constraint, how to find tool calls)."""
    constraint = one_constraint(response, outputs)
    mode, forced = tool_choice(tools, choice, parallel)
    if mode is not None and constraint is not None:
        field = "response_format" if response_format(response) is not None else "structured_outputs"
        raise fail(
            field,
            f"cannot be combined with tools and tool_choice {mode.mode!r}: the answer cannot both follow "
            "the format and call tools; drop one (or set tool_choice to 'none')",
        )
    return forced or constraint, mode
