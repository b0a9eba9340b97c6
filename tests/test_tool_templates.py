"""Tools in the fallback chat templates (engine/templates/*.jinja, issue 28).

Each family's template renders tools and a tool round trip (assistant tool_calls, tool results) in the
family's format; our renderer (engine/chat_template.py) is checked against transformers'
apply_chat_template on the same template string. The calls a template writes for an assistant turn are
read back by that family's tool-call parser (app/tool_calls.py), so what the model is shown is what the
server parses. Messages come through the API's request models (app/protocol.py), as the server sends
them to the template.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")  # app/'s request models (a bare GPU host may lack the serving stack)

from app.protocol import ChatCompletionRequest  # noqa: E402
from app.tool_calls import make_parser  # noqa: E402
from engine.chat_template import ChatTemplate, family_template  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time (no arguments)"}},
]


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# OpenAI's shape, as a client sends the conversation back: arguments as JSON text, content null
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Tōkyō?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            _call("call_1", "get_weather", '{"city": "Paris"}'),
            _call("call_2", "get_weather", '{"city": "Tōkyō", "unit": "C"}'),
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "22 C"},
    {"role": "assistant", "content": "Paris 18 C, Tōkyō 22 C."},
    {"role": "user", "content": "Thanks"},
]  # fmt: skip
PARSER = {"llama": "llama3_json", "qwen3": "qwen3", "gemma3": "gemma_json"}
FAMILIES = sorted(PARSER)
ASSISTANT_TURN = {  # how an assistant turn opens and ends, per family
    "llama": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "qwen3": ("<|im_start|>assistant\n", "<|im_end|>"),
    "gemma3": ("<start_of_turn>model\n", "<end_of_turn>"),
}


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


def _engine_messages(messages: list[dict]) -> list[dict]:
    return ChatCompletionRequest(model="m", messages=messages).engine_messages()


def _both(hf, family: str, messages: list[dict], **kwargs) -> str:
    source = family_template(family)
    ours = ChatTemplate(source, hf.special_tokens_map).render(messages, **kwargs)
    theirs = hf.apply_chat_template(
        messages, chat_template=source, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert ours == theirs
    return ours


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_and_round_trip_match_transformers(hf, family):
    messages = _engine_messages(ROUND_TRIP)
    assert messages[2]["tool_calls"][1]["function"]["arguments"] == {"city": "Tōkyō", "unit": "C"}
    text = _both(hf, family, messages, tools=TOOLS)
    assert "Current weather for a city" in text and '"now"' in text
    assert "Tōkyō" in text and "18 C" in text and "22 C" in text
    plain = _both(
        hf, family, _engine_messages([m for m in ROUND_TRIP if m["role"] in ("system", "user")][:2])
    )
    assert "get_weather" not in plain  # no tools, no tool text


@pytest.mark.parametrize("family", FAMILIES)
def test_rendered_calls_parse_back(hf, family):
    """The assistant turn's calls, as the template writes them, are what the family's parser reads."""
    text = _both(hf, family, _engine_messages(ROUND_TRIP), tools=TOOLS)
    open_turn, end_turn = ASSISTANT_TURN[family]
    start = text.index(open_turn) + len(open_turn)
    end = text.index(end_turn, start)
    parsed = make_parser(PARSER[family], ("get_weather", "now")).parse(text[start:end])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Tōkyō", "unit": "C"}),
    ]
    assert not parsed.content.strip()


def test_family_formats(hf):
    messages = _engine_messages(ROUND_TRIP)
    llama = _both(hf, "llama", messages, tools=TOOLS)
    first_user = llama.index("<|start_header_id|>user<|end_header_id|>\n\n")
    assert llama.index('"name": "get_weather"') > first_user  # definitions in the first user turn
    assert llama.count("<|start_header_id|>ipython<|end_header_id|>\n\n") == 2
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}\n{"name"' in llama
    in_system = _both(hf, "llama", messages, tools=TOOLS, tools_in_user_message=False)
    assert in_system.index('"name": "get_weather"') < in_system.index("<|start_header_id|>user")
    qwen = _both(hf, "qwen3", messages, tools=TOOLS)
    assert qwen.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n" in qwen
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in qwen
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n22 C" in qwen
    no_system = _both(hf, "qwen3", messages[1:2], tools=TOOLS)
    assert no_system.startswith("<|im_start|>system\n# Tools\n")
    gemma = _both(hf, "gemma3", messages, tools=TOOLS)
    assert gemma.count("<start_of_turn>user\n") == 3  # the two results share one user turn
    assert "Be brief.\n\nYou can call the functions" in gemma and "system" not in gemma
    assert "```tool_output\n18 C\n```\n```tool_output\n22 C\n```<end_of_turn>" in gemma


def test_llama_tools_need_a_user_turn(hf):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="first user message"):
        ChatTemplate(family_template("llama")).render([{"role": "system", "content": "x"}], tools=TOOLS)


def test_a_template_without_tools_falls_back_to_the_family_template(hf):
    """Gemma 3's own template, for one, never mentions tools: a request with tools is rendered by the
    family's template of ours; with no family to fall back on, it is refused, never dropped."""
    pytest.importorskip("fastapi")
    from app.errors import from_engine_error
    from engine.errors import InvalidRequestError

    no_tools = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    messages = _engine_messages(ROUND_TRIP[:2])
    special = hf.special_tokens_map
    plain = ChatTemplate(no_tools, special, family="gemma3")
    assert plain.render(messages) == "system: Be brief.\nuser: Weather in Paris and Tōkyō?\n"
    expected = ChatTemplate(family_template("gemma3"), special).render(messages, tools=TOOLS)
    assert plain.render(messages, tools=TOOLS) == expected and "get_weather" in expected
    with pytest.raises(InvalidRequestError, match="does not render tools") as info:
        ChatTemplate(no_tools, special).render(messages, tools=TOOLS)
    assert from_engine_error(info.value, 1).status == 400 and info.value.field == "tools"
