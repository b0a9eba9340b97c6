"""Structured output and tools without a server (issue 28): request fields -> StructuredOutput, the 400
answers naming the field, tool_choice -> the calls' JSON schema, the per-family parsers, and streamed
tool calls reassembled by the official `openai` SDK's own stream accumulator (ChatCompletionStreamState),
which must give the same message as the non-streaming body."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")  # app/ needs the serving stack (a bare GPU host has none)

from app import structured  # noqa: E402
from app.errors import from_engine_error  # noqa: E402
from app.field_policy import CHAT_UNSUPPORTED, reject_unsupported  # noqa: E402
from app.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from app.sse import ResponseAssembler  # noqa: E402
from app.tool_calls import ToolParsing, make_parser, resolve_parser  # noqa: E402
from engine.errors import InvalidRequestError  # noqa: E402
from engine.sampling_params import StructuredOutput  # noqa: E402
from tests.wire_items import wire_item  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
NAMES = ("get_weather", "now")
CALL = {"name": "get_weather", "parameters": {"city": "P"}}


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **fields)


def _refused(make, field: str, status: int = 400) -> str:
    with pytest.raises(InvalidRequestError) as info:
        make()
    err = from_engine_error(info.value, 1)
    assert (err.status, err.param) == (status, field), (err.status, err.param, err.message)
    assert err.message.startswith(f"{field}: ")
    return err.message


# ---------------------------------------------------------------- request mapping


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        (
            {"response_format": {"type": "json_object"}},
            StructuredOutput("json_object", None, "response_format"),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutput("json", SCHEMA, "response_format.json_schema.schema"),
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            StructuredOutput("json", SCHEMA, "structured_outputs.json"),
        ),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            StructuredOutput("json", SCHEMA, "structured_outputs.json"),
        ),
        (
            {"structured_outputs": {"regex": "[0-9]+", "json": None}},
            StructuredOutput("regex", "[0-9]+", "structured_outputs.regex"),
        ),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            StructuredOutput("choice", ["yes", "no"], "structured_outputs.choice"),
        ),
        (
            {"structured_outputs": {"grammar": 'start: "a"+'}},
            StructuredOutput("grammar", 'start: "a"+', "structured_outputs.grammar"),
        ),
    ],
)
def test_constraints_reach_sampling_params(fields, expected):
    assert CompletionRequest(model="m", prompt="x", **fields).sampling_params().structured == expected
    assert _chat(**fields).sampling_params(16).structured == expected


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
            "response_format.json_schema.strict",
        ),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": [1]}}, "structured_outputs.json"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_field(fields, field):
    _refused(lambda: CompletionRequest(model="m", prompt="x", **fields).sampling_params(), field)
    _refused(lambda: _chat(**fields).sampling_params(16), field)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tools": {"name": "f"}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice.function.name",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        (
            {"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
    ],
)
def test_bad_tool_options_are_400_naming_the_field(fields, field):
    _refused(lambda: _chat(**fields).sampling_params(16), field)


def test_tool_options_that_ask_nothing_are_taken():
    assert _chat(tool_choice="none").constraints() == (None, None)
    assert _chat(tool_choice="auto", parallel_tool_calls=False).constraints() == (None, None)
    assert (
        _chat(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"}).constraints()[1]
        is None
    )
    assert _chat(tools=TOOLS).constraints() == (None, structured.ToolChoice("auto", True, NAMES))


def test_messages_with_tool_calls_and_results():
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    body = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "user", "content": "time?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        ],
    )
    messages = body.engine_messages()
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**call, "function": {"name": "now", "arguments": {}}}],
    }
    assert messages[2] == {"role": "tool", "content": "noon", "tool_call_id": "c1"}
    bad = {**call, "function": {"name": "now", "arguments": "{oops"}}
    _refused(
        lambda: ChatCompletionRequest(
            model="m", messages=[{"role": "assistant", "tool_calls": [bad]}]
        ).engine_messages(),
        "messages[0].tool_calls[0].function.arguments",
        422,
    )
    _refused(
        lambda: ChatCompletionRequest(
            model="m", messages=[{"role": "user", "tool_calls": [call]}]
        ).engine_messages(),
        "messages[0].tool_calls",
        422,
    )
    assert _chat(tools=TOOLS).chat_prompt().tools == TOOLS


def test_field_policy_takes_tools_and_refuses_the_deprecated_fields():
    kept = reject_unsupported(
        {"tools": TOOLS, "tool_choice": "auto", "response_format": {"type": "json_object"}}, CHAT_UNSUPPORTED
    )
    assert set(kept) == {"tools", "tool_choice", "response_format"}
    for field in ("functions", "function_call", "guided_json"):
        with pytest.raises(Exception, match=f"does not support {field}"):
            reject_unsupported({field: {"x": 1}}, CHAT_UNSUPPORTED)


# ---------------------------------------------------------------- tool_choice -> schema


@pytest.mark.parametrize(
    "choice, parallel, names, max_items",
    [
        ("required", None, NAMES, None),
        ("required", False, NAMES, 1),
        ({"type": "function", "function": {"name": "get_weather"}}, None, ("get_weather",), 1),
    ],
)
def test_tool_choice_schema(choice, parallel, names, max_items):
    jsonschema = pytest.importorskip("jsonschema")
    so, mode = _chat(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel).constraints()
    assert (so.kind, so.field, mode.mode, mode.names) == ("json", "tools", "required", names)
    assert so.spec.get("maxItems") == max_items and so.spec["minItems"] == 1
    jsonschema.Draft202012Validator.check_schema(so.spec)
    valid = jsonschema.Draft202012Validator(so.spec)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    assert valid.is_valid(good)
    assert valid.is_valid([{"name": "now", "parameters": {}}]) == ("now" in names)
    assert valid.is_valid(good * 2) == (max_items is None)
    missing = {"name": "get_weather", "parameters": {}}
    for bad in ([], [missing], [{"name": "x", "parameters": {}}], [{**CALL, "extra": 1}], {"name": "now"}):
        assert not valid.is_valid(bad), bad


# ---------------------------------------------------------------- parsers


def _parse(kind: str, text: str) -> tuple[str, list]:
    parsed = make_parser(kind, NAMES).parse(text)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]


PARIS = ("get_weather", {"city": "Paris"})


@pytest.mark.parametrize(
    "kind, text, content, calls",
    [
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
            "",
            [PARIS],
        ),
        (
            "llama3_json",
            'Checking.\n{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "now", "parameters": {}}',
            "Checking.\n",
            [PARIS, ("now", {})],
        ),
        (
            "llama3_json",
            '{"name": "now", "arguments": "{}"}\n{"name": "get_weather", "parameters": {"city": "Paris"}}',
            "",
            [("now", {}), PARIS],
        ),
        (
            "llama3_json",
            '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Paris"}}]',
            "",
            [("now", {}), PARIS],
        ),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Par',
            '{"name": "get_weather", "parameters": {"city": "Par',
            [],
        ),
        (
            "llama3_json",
            '{"name": "delete_all", "parameters": {}}',
            '{"name": "delete_all", "parameters": {}}',
            [],
        ),
        (
            "llama3_json",
            'Use {"name": "now", "parameters": {}} inline',
            'Use {"name": "now", "parameters": {}} inline',
            [],
        ),
        ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
        (
            "qwen3",
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            "\n</tool_call>\n"
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
            "Let me look.\n",
            [PARIS, ("now", {})],
        ),
        ("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "", [PARIS]),
        (
            "qwen3",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\nDone.',
            "\nDone.",
            [PARIS],
        ),
        (
            "qwen3",
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><tool_call>{broken</tool_call>',
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><tool_call>{broken</tool_call>',
            [],
        ),
        ("qwen3", "No tools needed: 4.", "No tools needed: 4.", []),
        ("gemma_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
        (
            "gemma_json",
            'I will check.\n```json\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n```',
            "I will check.\n",
            [PARIS],
        ),
        ("gemma_json", '```\n{"a": 1}\n```', '```\n{"a": 1}\n```', []),
        ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "", [PARIS]),
        (
            "required",
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}',
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}',
            [],
        ),
    ],
)
def test_parsers(kind, text, content, calls):
    assert _parse(kind, text) == (content, calls)


def test_parser_choice_by_family():
    assert [resolve_parser("auto", t) for t in ("llama", "qwen3", "gemma3_text", "mystery", None)] == [
        "llama3_json",
        "qwen3",
        "gemma_json",
        "none",
        "none",
    ]
    assert resolve_parser("qwen3", "llama") == "qwen3"
    with pytest.raises(ValueError, match="tool_call_parser"):
        resolve_parser("hermes", "llama")


# ---------------------------------------------------------------- streaming, reassembled by the SDK


def _item(text: str, completion: int, finish: str | None = None) -> dict:
    return wire_item(text, completion, finish, prompt_tokens=3)


def _run(kind: str, text: str, step: int, parallel: bool = True, reasoning: str = "off"):
    """(SDK-accumulated streamed message and finish_reason, non-streamed message and finish_reason)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    items = [_item(p, i + 1, "stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    tools = ToolParsing(kind, NAMES, parallel)
    stream = ResponseAssembler(True, "id", "m", 1, 1, reasoning=reasoning, tools=tools)
    stream.set_prompt(0, {"prompt_tokens": 3})
    events = stream.role_chunk() + "".join(stream.chunk(0, item) or "" for item in items)
    state = ChatCompletionStreamState()
    for event in events.split("\n\n"):
        if event:
            state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(event[len("data: ") :])))
    choice = state.get_final_completion().choices[0]
    whole = ResponseAssembler(True, "id", "m", 1, 1, reasoning=reasoning, tools=tools)
    for item in items:
        whole.add(0, item)
    body = whole.final()["choices"][0]
    return choice, body


def _calls(message) -> list:
    calls = message.get("tool_calls") if isinstance(message, dict) else message.tool_calls
    if not calls:
        return []
    if isinstance(message, dict):
        return [(c["function"]["name"], json.loads(c["function"]["arguments"]), c["id"][:5]) for c in calls]
    return [(c.function.name, json.loads(c.function.arguments), c.id[:5]) for c in calls]


QWEN = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
LLAMA = '\n{"name": "get_weather", "parameters": {"city": "Paris"}};\n{"name": "now", "parameters": {}}'
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
BOTH = [("get_weather", {"city": "Paris"}, "call_"), ("now", {}, "call_")]


@pytest.mark.parametrize("step", [1, 2, 5, 17, 1000])
@pytest.mark.parametrize(
    "kind, text, content, calls",
    [
        ("qwen3", QWEN, "Let me look.\n", BOTH),
        ("llama3_json", LLAMA, None, BOTH),
        ("required", REQUIRED, None, BOTH),
        ("gemma_json", "Nothing to call {here}.\n{not json", "Nothing to call {here}.\n{not json", []),
        ("qwen3", "partial <tool_ marker", "partial <tool_ marker", []),
    ],
)
def test_streamed_tool_calls_reassemble_in_the_sdk(kind, text, content, calls, step):
    streamed, whole = _run(kind, text, step)
    assert (streamed.message.content, _calls(streamed.message)) == (content, calls)
    assert (whole["message"]["content"], _calls(whole["message"])) == (content, calls)
    finish = "tool_calls" if calls else "stop"
    assert streamed.finish_reason == whole["finish_reason"] == finish
    assert ("tool_calls" in whole["message"]) == bool(calls)


def test_stream_sends_text_before_a_call_at_once_and_no_parallel_keeps_one():
    tools = ToolParsing("qwen3", NAMES, True)
    out = ResponseAssembler(True, "id", "m", 1, 1, tools=tools)
    first = out.chunk(0, _item("Let me look. <tool", 1))
    assert json.loads(first[len("data: ") :])["choices"][0]["delta"] == {"content": "Let me look. "}
    assert out.chunk(0, _item('_call>\n{"name": "now",', 2)) is None  # held back: nothing to send
    streamed, whole = _run("required", REQUIRED, 7, parallel=False)
    assert _calls(streamed.message) == _calls(whole["message"]) == BOTH[:1]


def test_reasoning_then_tool_calls():
    text = "<think>the user wants weather</think>" + QWEN
    streamed, whole = _run("qwen3", text, 3, reasoning="split")
    assert whole["message"]["reasoning_content"] == "the user wants weather"
    assert (whole["message"]["content"], _calls(whole["message"])) == ("Let me look.\n", BOTH)
    assert (streamed.message.content, _calls(streamed.message)) == ("Let me look.\n", BOTH)


def test_required_calls_go_out_when_the_array_completes():
    """required / named: the calls are sent as soon as the JSON array is whole, before the finish."""
    out = ResponseAssembler(True, "id", "m", 1, 1, tools=ToolParsing("required", NAMES, True))
    assert out.chunk(0, _item(REQUIRED[:30], 1)) is None
    first = json.loads(out.chunk(0, _item(REQUIRED[30:], 2))[len("data: ") :])["choices"][0]
    assert first["finish_reason"] is None
    assert [c["function"]["name"] for c in first["delta"]["tool_calls"]] == ["get_weather", "now"]
    assert [c["index"] for c in first["delta"]["tool_calls"]] == [0, 1]
    last = json.loads(out.chunk(0, _item("", 3, "stop"))[len("data: ") :])["choices"][0]
    assert last == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}


def test_auto_needs_the_servers_parser():
    """tool_choice auto on a server with tool_call_parser none is a 400 naming tool_choice; required
    and named choices need no parser (their output is the forced JSON array)."""
    pytest.importorskip("ray")
    from app.ingress import Ingress

    ingress = Ingress.func_or_class.__new__(Ingress.func_or_class)
    ingress._tool_parser = "none"
    _refused(lambda: ingress._tool_parsing(structured.ToolChoice("auto", True, NAMES)), "tool_choice")
    required = ingress._tool_parsing(structured.ToolChoice("required", False, ("now",)))
    assert required == ToolParsing("required", ("now",), False)
    ingress._tool_parser = "qwen3"
    assert ingress._tool_parsing(structured.ToolChoice("auto", True, NAMES)) == ToolParsing(
        "qwen3", NAMES, True
    )
