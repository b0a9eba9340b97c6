"""Structured output and tool calling against the real server (issue 28), through the official `openai`
SDK and LangChain's ChatOpenAI.

The shared default server (conftest: Ray Serve, serve_config.yaml, `tool_call_parser: auto` ->
llama3_json for the tiny Llama), on the tiny model, whose template is the current engine/templates/
llama.jinja (conftest's tiny_model_dir makes sure). The model is random: without a constraint its text
is noise, so those tests check shapes only; with one, every output that finishes must validate.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from tests.serving_fixtures import Server
from tests.test_clients import _run_client

pytestmark = [pytest.mark.serving, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}
# closed schemas (additionalProperties false): an open one lets the random model add keys until max_tokens
NOW = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}  # fmt: skip
JSON_OBJECT = {"type": "json_object"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Tokyo"]
    sunny: bool


# `server` and `client`: the shared server and the openai client on it (tests/conftest.py).


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def _error(resp: httpx.Response, status: int, param: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err
    return err


def _chat(server: Server, **fields) -> dict:
    return {"model": server.model, "messages": ASK, "max_tokens": 96, "temperature": 0, **fields}


def _sdk_stream(client: openai.OpenAI, kw: dict):
    """The choice the SDK's stream helper accumulates (its snapshot: get_final_completion refuses a
    finish_reason of length, which the random model often gives)."""
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        return stream.current_completion_snapshot.choices[0]


# ---------------------------------------------------------------- shapes and refusals


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "response_format": JSON_OBJECT}, "structured_outputs"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": JSON_OBJECT}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "now"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ],
)  # fmt: skip
def test_conflicts_and_bad_options_are_400_before_any_byte(server, fields, param, stream):
    _error(_post(server, "/v1/chat/completions", _chat(server, stream=stream, **fields)), 400, param)


def test_constraint_is_never_ignored(server):
    body = {"model": server.model, "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "[ab]+"}}
    resp = _post(server, "/v1/completions", body)
    assert resp.status_code == 200 and set(resp.json()["choices"][0]["text"]) <= {"a", "b"}


def test_auto_tools_with_the_sdk_streaming_and_not(client, server):
    """tool_choice auto on a random model: whatever comes out has OpenAI's shape, and the stream,
    reassembled by the SDK's own helper, gives what the non-streaming answer gives (greedy)."""
    kw = {"model": server.model, "messages": ASK, "tools": [WEATHER, NOW], "max_tokens": 48, "temperature": 0}
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    streamed = _sdk_stream(client, kw)
    assert streamed.message.content == choice.message.content
    calls = lambda m: [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    assert calls(streamed.message) == calls(choice.message)
    for call in choice.message.tool_calls or []:
        assert call.id.startswith("call_") and call.function.name in ("get_weather", "now")
        assert isinstance(json.loads(call.function.arguments), dict)


def test_tool_round_trip_messages(client, server):
    """An assistant turn with tool_calls (content null) and tool results go through the template; the
    prompt is the template's rendering with the tools (checked through /tokenize)."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]  # fmt: skip
    out = client.chat.completions.create(
        model=server.model, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    tokens = _post(server, "/tokenize", {"messages": messages, "tools": [WEATHER]}).json()
    assert out.usage.prompt_tokens == tokens["count"] and out.choices[0].message.tool_calls is None
    assert tokens["count"] > _post(server, "/tokenize", {"messages": ASK}).json()["count"] + 50


def test_langchain_bind_tools_auto(server):
    """tool_choice auto through LangChain's bind_tools: the server finds the call in the answer's text
    (llama3_json) and LangChain gets it parsed. The random model is steered onto a call: logit_bias
    makes "W" its greedy token at every step, and budget forcing replaces the first one with the call's
    JSON (the "W"s after it are content)."""
    resp = _post(server, "/tokenize", {"model": server.model, "prompt": "W", "add_special_tokens": False})
    (w,) = resp.json()["tokens"]
    call = json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}})
    out = _run_client("langchain_openai", LANGCHAIN_AUTO, server.url, server.model, str(w), call)
    assert out["type"] == "ai"
    assert [(c["name"], c["args"]) for c in out["tool_calls"]] == [("get_weather", {"city": "Paris"})]


LANGCHAIN_AUTO = """
import json, sys
from typing import Literal
from langchain_openai import ChatOpenAI
url, model, w, call = sys.argv[1:5]
def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
    \"\"\"Current weather for a city.\"\"\"
forcing = {"suppress": "W", "replacements": [call], "min_tokens": 1}
llm = ChatOpenAI(base_url=url + "/v1", api_key="x", model=model, temperature=0, max_tokens=48, max_retries=0,
                 logit_bias={int(w): 100}, extra_body={"budget_forcing": forcing})
msg = llm.bind_tools([get_weather]).invoke("Weather in Paris?")
print(json.dumps({"type": msg.type, "tool_calls": msg.tool_calls}))
"""


# ---------------------------------------------------------------- constraints enforced


def test_json_schema_and_parse(client, server):
    schema = Weather.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}
    kw = {"model": server.model, "messages": ASK, "max_tokens": 96, "temperature": 0}
    out = client.chat.completions.create(**kw, response_format=fmt)
    Weather.model_validate_json(out.choices[0].message.content)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    parsed = parse(**kw, response_format=Weather)
    assert isinstance(parsed.choices[0].message.parsed, Weather)
    # An open object never ends on the random model (it writes one key until max_tokens): logit_bias
    # makes "}" its choice wherever the grammar admits it, so the object closes and is always checked.
    close = _post(server, "/tokenize", {"model": server.model, "prompt": "}", "add_special_tokens": False})
    (brace,) = close.json()["tokens"]
    obj = client.chat.completions.create(**kw, response_format=JSON_OBJECT, logit_bias={str(brace): 100})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: foo\n"}}, "structured_outputs.grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
         "response_format.json_schema.schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"if": {}}}}],
          "tool_choice": "required"}, "tools"),
    ],
)  # fmt: skip
def test_what_the_engine_cannot_compile_is_400_naming_the_field(server, fields, param, stream):
    _error(_post(server, "/v1/chat/completions", _chat(server, stream=stream, **fields)), 400, param)


@pytest.mark.parametrize("so", [{"regex": "(yes|no)[0-9]{2}"}, {"choice": ["red", "green"]}])
def test_structured_outputs_extra_body(client, server, so):
    out = client.completions.create(
        model=server.model, prompt="x", max_tokens=8, temperature=0, extra_body={"structured_outputs": so}
    )
    text = out.choices[0].text
    assert text in so["choice"] if "choice" in so else re.fullmatch(so["regex"], text)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_choice(client, server, choice, stream):
    """One call (parallel_tool_calls false; a named function allows one anyway): with several allowed,
    the greedy random model repeats valid calls until max_tokens."""
    jsonschema = pytest.importorskip("jsonschema")
    kw = {
        "model": server.model,
        "messages": ASK,
        "tools": [WEATHER, NOW],
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "max_tokens": 96,
        "temperature": 0,
    }
    if stream:
        out = _sdk_stream(client, kw)
    else:
        out = client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.tool_calls
    assert len(out.message.tool_calls) == 1
    for call in out.message.tool_calls:
        params = {"get_weather": WEATHER, "now": NOW}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), params)


def test_langchain_structured_output_and_required_tools(server):
    out = _run_client("langchain_openai", LANGCHAIN_ENFORCED, server.url, server.model)
    Weather.model_validate(out["structured"])
    for key in ("required", "named"):
        assert out[key] and all(
            c["name"] == "get_weather" and c["args"]["city"] in ("Paris", "Tokyo") for c in out[key]
        )


LANGCHAIN_ENFORCED = """
import json, sys
from typing import Literal
from pydantic import BaseModel
from langchain_openai import ChatOpenAI
url, model = sys.argv[1:3]
class Weather(BaseModel):
    city: Literal["Paris", "Tokyo"]
    sunny: bool
def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
    \"\"\"Current weather for a city.\"\"\"
llm = ChatOpenAI(base_url=url + "/v1", api_key="x", model=model, temperature=0, max_tokens=96, max_retries=0)
structured = llm.with_structured_output(Weather).invoke("Weather in Paris?")
# strict: the parameters schema is closed (the random model would add keys to an open one)
required = llm.bind_tools([get_weather], tool_choice="required", strict=True).invoke("Weather in Paris?")
named = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True).invoke("Weather in Paris?")
print(json.dumps({"structured": structured.model_dump(), "required": required.tool_calls,
                  "named": named.tool_calls}))
"""
