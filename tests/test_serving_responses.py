"""OpenAI's Responses API (POST /v1/responses, issue 52) against the real server, through the official
`openai` SDK and LangChain's ChatOpenAI(use_responses_api=True); its event and body shapes checked
against the SDK's own types.

The shared default server (conftest) on the tiny model, whose text is random: the tests check structure,
event order, and that a Responses request is answered as the chat request it translates to (greedy, so
the same text and the same prompt tokens), not content.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from app.responses_api import ResponsesRequest
from app.responses_stream import ResponsesOutput
from app.tool_calls import ToolParsing
from tests.serving_fixtures import Server
from tests.test_clients import _run_client
from tests.test_serving_tools import WEATHER as CHAT_WEATHER
from tests.wire_items import wire_item

pytestmark = [pytest.mark.serving, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
# test_serving_tools' function in the Responses shape: its fields at the top level, strict
WEATHER = {"type": "function", **CHAT_WEATHER["function"], "strict": True}
ASK = "What is the weather in Paris?"
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Tokyo"]
    sunny: bool


def _post(server: Server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)


def _sse_events(text: str) -> list[dict]:
    """The events of an SSE body; each `event:` line names its data's type."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        payload = json.loads(lines["data"])
        assert lines["event"] == payload["type"]
        events.append(payload)
    return events


def _check_order(events: list[dict]) -> None:
    """Sequence numbers count from 0; created and in_progress open, completed/incomplete close; each
    item's events sit between its added and done events."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    open_index = None
    for e in events[2:-1]:
        EVENTS.validate_python(e)
        if e["type"] == "response.output_item.added":
            assert open_index is None
            open_index = e["output_index"]
        elif e["type"] == "response.output_item.done":
            assert e["output_index"] == open_index
            open_index = None
        else:
            assert e["output_index"] == open_index, e
    assert open_index is None
    Response.model_validate(events[-1]["response"])


# ---------------------------------------------------------------- units: assembly without a server


def _assemble(texts: list[str], tools: ToolParsing | None = None, stream: bool = True) -> tuple[list, dict]:
    request = ResponsesRequest(model="m", input="hi")
    out = ResponsesOutput(request, "m", "split", tools)
    out.set_prompt(0, {"prompt_tokens": 4, "starts_in_think": False})
    items = [wire_item(t, i + 1, "stop" if i == len(texts) - 1 else None) for i, t in enumerate(texts)]
    if not stream:
        for item in items:
            out.add(0, item)
        return [], out.final()
    body = out.opening() + "".join(out.chunk(0, item) or "" for item in items) + out.closing()
    events = _sse_events(body)
    return events, events[-1]["response"]


def test_reasoning_message_and_calls_assemble_as_the_sdk_reads_them():
    texts = ["<think>ab", "c</th", "ink>Hi", "!"]
    events, streamed = _assemble(texts)
    _check_order(events)
    _, whole = _assemble(texts, stream=False)
    Response.model_validate(whole)
    for body in (streamed, whole):
        assert [o["type"] for o in body["output"]] == ["reasoning", "message"]
        assert body["output"][0]["content"][0]["text"] == "abc"
        assert body["output"][1]["content"][0]["text"] == "Hi!"
        assert body["usage"]["total_tokens"] == 4 + 4 and body["status"] == "completed"
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "abc"
    call = '[{"name": "f", "parameters": {"a": 1}}]'
    events, streamed = _assemble([call[:9], call[9:]], ToolParsing("required", ("f",), False))
    _check_order(events)
    (item,) = streamed["output"]
    assert (item["type"], item["name"], json.loads(item["arguments"])) == ("function_call", "f", {"a": 1})
    assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")


# ---------------------------------------------------------------- served


def test_create_is_the_chat_answer_it_translates_to(client, server):
    """Greedy: the same text and prompt tokens as the chat request with instructions as a system turn."""
    kw = {"model": server.model, "max_output_tokens": 8, "temperature": 0}
    resp = client.responses.create(**kw, instructions="Answer briefly.", input=ASK)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status in ("completed", "incomplete") and resp.model == server.model
    chat = client.chat.completions.create(
        model=server.model,
        max_tokens=8,
        temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}],
    )
    assert resp.output_text == chat.choices[0].message.content
    usage = resp.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    parts = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    again = client.responses.create(**kw, instructions="Answer briefly.", input=parts)
    assert again.output_text == resp.output_text


def test_stream_events_in_order_and_equal_to_the_whole_answer(client, server):
    kw = {"model": server.model, "input": ASK, "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(**kw)
    events = [e.model_dump(exclude_none=True) for e in client.responses.create(**kw, stream=True)]
    _check_order(events)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole.output_text
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.status == whole.status
    with client.responses.stream(**kw) as stream:
        kinds = [e.type for e in stream]
    # how the text is cut into deltas depends on timing: compare runs of one kind
    runs = lambda ks: [k for i, k in enumerate(ks) if i == 0 or ks[i - 1] != k]
    assert runs(kinds) == runs([e["type"] for e in events])


def test_json_schema_text_format_parses_and_validates(client, server):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {**Weather.model_json_schema(), "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}}
    kw = {"model": server.model, "input": ASK, "max_output_tokens": 48, "temperature": 0}
    resp = client.responses.create(**kw, text=fmt)
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)
    with client.responses.stream(**kw, text_format=Weather) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Weather)
    assert final.output_parsed == Weather.model_validate_json(resp.output_text)  # greedy: the same answer


def _call_round(client, server, stream: bool):
    kw = {"model": server.model, "input": ASK, "tools": [WEATHER], "max_output_tokens": 64, "temperature": 0}
    kw["tool_choice"] = {"type": "function", "name": "get_weather"}
    if not stream:
        return client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        kinds = [e.type for e in s]
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
        return s.get_final_response()


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(client, server, stream):
    """The forced call, then its output sent back as input with the call, then a final text answer;
    the second prompt is the chat rendering of the same turns (checked through /tokenize)."""
    jsonschema = pytest.importorskip("jsonschema")
    first = _call_round(client, server, stream)
    (call,) = first.output
    assert (call.type, call.name, call.status, first.status) == (
        "function_call",
        "get_weather",
        "completed",
        "completed",
    )
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    back = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    turns = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), back]
    final = client.responses.create(
        model=server.model, input=turns, tools=[WEATHER], tool_choice="none", max_output_tokens=4
    )
    assert [o.type for o in final.output] in (["message"], [])
    assert isinstance(final.output_text, str)
    calls = [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    ]
    messages = [turns[0], {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]  # fmt: skip
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    tokens = httpx.post(
        f"{server.url}/tokenize", json={"messages": messages, "tools": chat_tools}, timeout=60
    )
    assert final.usage.input_tokens == tokens.json()["count"]


@pytest.mark.parametrize(
    "fields, status, param",
    [
        ({"store": True}, 400, "store"),
        ({"previous_response_id": "resp_123"}, 400, "previous_response_id"),
        ({"reasoning": {"effort": "high"}}, 400, "reasoning.effort"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}}, 400,
         "text.format.schema"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name"),
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, 422,
         "input[0].call_id"),
        ({"max_output_tokens": -1}, 422, "max_output_tokens"),
        ({"max_output_tokenz": 4}, 422, "max_output_tokenz"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(server, fields, status, param):
    resp = _post(server, {"model": server.model, "input": ASK, "max_output_tokens": 4, **fields})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_store_absent_or_false_is_not_stored_and_true_is_refused_by_the_sdk(client, server):
    kw = {"model": server.model, "input": ASK, "max_output_tokens": 2}
    assert client.responses.create(**kw, store=False).status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(**kw, store=True)


def test_wire_format_and_a_failure_mid_stream(server):
    """Raw SSE: `event:` lines naming each type, no [DONE]; a failure inside the engine after the
    headers ends the stream with one `error` event; not streaming it is a 500."""
    body = {"model": server.model, "input": "__fault:sample__ go", "max_output_tokens": 8, "stream": True}
    resp = _post(server, body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in resp.text
    events = _sse_events(resp.text)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert [e["sequence_number"] for e in events] == [0, 1, 2] and events[-1]["code"] == "generation_error"
    assert _post(server, {**body, "stream": False}).status_code == 500


LANGCHAIN_RESPONSES = """
import json, sys
from langchain_openai import ChatOpenAI
url, model = sys.argv[1:3]
llm = ChatOpenAI(base_url=url + "/v1", api_key="x", model=model, temperature=0, max_tokens=12, max_retries=0,
                 use_responses_api=True)
messages = [("system", "You answer in one short sentence."), ("human", "What is a paged KV cache?")]
text = lambda m: m.text() if callable(m.text) else m.text
inv = llm.invoke(messages)
chunks = list(llm.stream(messages))
whole = chunks[0]
for c in chunks[1:]:
    whole = whole + c
print(json.dumps({"invoke": text(inv), "usage": inv.usage_metadata, "stream": text(whole),
                  "stream_usage": whole.usage_metadata}))
"""


def test_langchain_use_responses_api_invoke_and_stream(server):
    out = _run_client("langchain_openai", LANGCHAIN_RESPONSES, server.url, server.model)
    assert out["invoke"] and out["stream"] == out["invoke"]
    assert out["usage"]["output_tokens"] == out["stream_usage"]["output_tokens"] > 0
