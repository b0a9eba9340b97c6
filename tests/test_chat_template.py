"""engine.chat_template: our renderer matches transformers' apply_chat_template on the same template,
finds templates in the documented order, and reports missing or rejecting templates clearly."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.chat_template import ChatTemplate, ChatTemplateError, find_template_source
from engine.errors import InvalidRequestError
from engine.tokenizer import Tokenizer
from scripts.make_model import make_model

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. "},
    {"role": "user", "content": "Name a river 🌊 in 日本?"},
    {"role": "assistant", "content": " The Shinano River."},
    {"role": "user", "content": [{"type": "text", "text": "How long"}, {"type": "text", "text": " is it?"}]},
]
FAMILIES = {"tiny": "llama", "tiny-qwen3": "qwen3", "tiny-gemma3": "gemma3"}

# Exercises the environment transformers gives templates: tojson without HTML escaping and with
# non-ASCII kept, loop controls, namespace, raise_exception, and the special-token variables.
ENV_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}
{{ m.role }}: {{ m | tojson }}
{% endfor %}count={{ ns.n }}{% if tools %} tools={{ tools | tojson(indent=2) }}{% endif %}
{% if messages[0].role == 'bad' %}{{ raise_exception('bad first role') }}{% endif %}
{% if add_generation_prompt %}{{ eos_token }}{% endif %}"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {name: make_model(name, root / name) for name in FAMILIES}


def _hf(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_family_template_matches_transformers(dirs, name, add_generation_prompt):
    tok = Tokenizer.from_dir(dirs[name])
    assert tok.chat_template.origin.endswith("tokenizer_config.json")
    assert tok.chat_template.source == (find_template_source(dirs[name])[0])
    expected = _hf(dirs[name]).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ours = tok.render_chat(CONVERSATION, add_generation_prompt=add_generation_prompt)
    assert ours == expected
    assert "How long is it?" in ours and "日本" in ours


def test_family_formats(dirs):
    render = {name: Tokenizer.from_dir(d).render_chat(CONVERSATION) for name, d in dirs.items()}
    assert render["tiny"].startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert render["tiny"].endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render["tiny-qwen3"].startswith("<|im_start|>system\nYou are a terse assistant. <|im_end|>\n")
    assert render["tiny-qwen3"].endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "<think>" not in render["tiny-qwen3"]
    gemma = render["tiny-gemma3"]
    assert gemma.startswith("<bos><start_of_turn>user\nYou are a terse assistant.\n\nName a river")
    assert "<start_of_turn>model\nThe Shinano River.<end_of_turn>\n" in gemma and "system" not in gemma
    assert gemma.endswith("<start_of_turn>model\n")


def test_environment_matches_transformers(dirs):
    hf = _hf(dirs["tiny"])
    special = hf.special_tokens_map
    messages = [
        {"role": "user", "content": "<b>é</b> & 'q'"},
        {"role": "stop"},
        {"role": "user", "content": "x"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for kwargs in [{}, {"tools": tools}]:
        ours = ChatTemplate(ENV_TEMPLATE, special).render(messages, **kwargs)
        theirs = hf.apply_chat_template(
            messages, chat_template=ENV_TEMPLATE, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert ours == theirs
    assert "\"<b>é</b> & 'q'\"" in ours and "count=1" in ours
    with pytest.raises(InvalidRequestError, match="bad first role") as info:
        ChatTemplate(ENV_TEMPLATE, special).render([{"role": "bad"}])
    assert info.value.field == "messages"


def test_gemma_rejects_non_alternating_roles(dirs):
    tok = Tokenizer.from_dir(dirs["tiny-gemma3"])
    with pytest.raises(InvalidRequestError, match="alternate"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_source_order(dirs, tmp_path):
    d = shutil.copytree(dirs["tiny-qwen3"], tmp_path / "d")
    config_path = d / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    config_path.write_text(json.dumps(config))
    assert find_template_source(d)[0] == "D"
    (d / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Tokenizer.from_dir(d).render_chat([{"role": "user", "content": "x"}]) == "J1"
    (d / "chat_template.jinja").unlink()
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    source, origin = find_template_source(d)
    assert origin.endswith("engine/templates/qwen3.jinja") and "<|im_start|>" in source


def test_unknown_family_without_template_says_how_to_fix(dirs, tmp_path):
    d = shutil.copytree(dirs["tiny"], tmp_path / "d")
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    model_config = json.loads((d / "config.json").read_text())
    model_config["model_type"] = "mystery"
    (d / "config.json").write_text(json.dumps(model_config))
    tok = Tokenizer.from_dir(d)  # plain completions still work without a template
    assert tok.decode(tok.encode("ok", add_special_tokens=False)) == "ok"
    with pytest.raises(ChatTemplateError, match=r"engine/templates/<family>\.jinja") as info:
        tok.render_chat([{"role": "user", "content": "x"}])
    assert str(d) in str(info.value) and "chat_template.jinja" in str(info.value)


def test_broken_template_names_its_origin(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match="chat_template.jinja"):
        ChatTemplate.from_dir(tmp_path)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("final", [" The Shinano", "Partial answer  ", "<think>still"])
def test_continue_final_message_matches_transformers(dirs, name, final):
    """The prompt ends inside the last assistant message, cut as transformers cuts it."""
    tok = Tokenizer.from_dir(dirs[name])
    messages = [*CONVERSATION[:2], {"role": "assistant", "content": final}]
    ours = tok.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    theirs = _hf(dirs[name]).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == theirs and ours.rstrip().endswith(final.strip())
    with pytest.raises(InvalidRequestError) as info:
        tok.render_chat(messages, add_generation_prompt=True, continue_final_message=True)
    assert info.value.field == "continue_final_message"


def test_template_kwargs_reach_the_template(dirs):
    """chat_template_kwargs (e.g. Qwen 3's enable_thinking) are template variables, as in transformers."""
    source = "{{ 'think' if enable_thinking is not defined or enable_thinking else 'plain' }}|{{ extra }}"
    hf = _hf(dirs["tiny"])
    for kwargs in [{}, {"enable_thinking": False, "extra": 3}, {"enable_thinking": True, "extra": "x"}]:
        ours = ChatTemplate(source, hf.special_tokens_map).render(CONVERSATION, **kwargs)
        theirs = hf.apply_chat_template(CONVERSATION, chat_template=source, tokenize=False, **kwargs)
        assert ours == theirs
    assert ChatTemplate(source).render(CONVERSATION, enable_thinking=False, extra=1) == "plain|1"
