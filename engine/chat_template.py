"""Chat templates: find a checkpoint's Jinja template and render conversations with it.

The environment mirrors the one Hugging Face chat templates are written for (sandboxed, trim_blocks and
lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII, `raise_exception` and `strftime_now`), so
templates shipped with checkpoints render here exactly as in transformers, without calling it.

Where the template comes from, first match wins:
  1. chat_template.jinja in the checkpoint directory (how newer transformers save it),
  2. "chat_template" in tokenizer_config.json (a string, or a list of named templates: "default"),
  3. chat_template.json {"chat_template": ...} (older processor checkpoints),
  4. engine/templates/<family>.jinja for the family named by config.json's model_type.
A conversation with `tools` whose template never mentions them (Gemma 3's own template, for one) is
rendered with the family's template from engine/templates/ instead, which renders tools; without one it
is refused (InvalidRequestError naming `tools`): tools are never dropped silently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequestError

TEMPLATE_DIR = Path(__file__).parent / "templates"
# config.json model_type -> our template family
FAMILY_BY_MODEL_TYPE = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3", "gemma3_text": "gemma3"}


class ChatTemplateError(ValueError):
    """No template could be found for a checkpoint, or it does not compile (a set-up error, not a request's).
    A template that rejects a conversation raises InvalidRequestError(field="messages") instead."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per distinct source; templates are immutable so sharing them is safe."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def model_family(model_dir: str | Path) -> str | None:
    """Our template family for the checkpoint, from config.json's model_type (None if unknown/absent)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return None
    model_type = json.loads(config_path.read_text()).get("model_type")
    return FAMILY_BY_MODEL_TYPE.get(model_type)


def family_template(family: str) -> str:
    path = TEMPLATE_DIR / f"{family}.jinja"
    if not path.is_file():
        raise ChatTemplateError(f"no chat template for family {family!r}: {path} does not exist")
    return path.read_text()


def _from_tokenizer_config(value: Any, path: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, Mapping)}
        if "default" in named:
            return named["default"]
        raise ChatTemplateError(f"{path}: chat_template lists {sorted(named)} but no 'default' template")
    raise ChatTemplateError(f"{path}: chat_template must be a string or a list of named templates")


def find_template_source(model_dir: str | Path) -> tuple[str, str]:
    """(template source, where it came from) for the checkpoint directory; see the module docstring."""
    model_dir = Path(model_dir)
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(), str(jinja_file)
    tok_config = model_dir / "tokenizer_config.json"
    if tok_config.is_file():
        source = _from_tokenizer_config(json.loads(tok_config.read_text()).get("chat_template"), tok_config)
        if source:
            return source, str(tok_config)
    legacy = model_dir / "chat_template.json"
    if legacy.is_file():
        source = json.loads(legacy.read_text()).get("chat_template")
        if isinstance(source, str) and source:
            return source, str(legacy)
    family = model_family(model_dir)
    if family is None:
        known = ", ".join(sorted(FAMILY_BY_MODEL_TYPE))
        raise ChatTemplateError(
            f"{model_dir} has no chat template (no chat_template.jinja, and no chat_template in "
            f"tokenizer_config.json) and its config.json model_type is not one of ours ({known}). "
            f"Fix: add a chat_template.jinja to the checkpoint directory, or add "
            f"engine/templates/<family>.jinja and map the model_type to it in FAMILY_BY_MODEL_TYPE "
            f"(engine/chat_template.py)."
        )
    path = TEMPLATE_DIR / f"{family}.jinja"
    return family_template(family), str(path)


class ChatTemplate:
    """A compiled template plus the special-token strings (bos_token, eos_token, ...) it may reference."""

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str] | None = None,
        origin: str = "<string>",
        family: str | None = None,
    ):
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        self.family = family  # our template family, for tools the template does not render
        self.renders_tools = "tools" in source
        try:
            self._template = compile_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template from {origin} does not compile: {exc}") from exc

    @classmethod
    def from_dir(cls, model_dir: str | Path, special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
        source, origin = find_template_source(model_dir)
        return cls(source, special_tokens, origin, model_family(model_dir))

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render the conversation. kwargs (tools, documents, enable_thinking, ...) reach the template as
        variables; they override special-token names of the same name.

        continue_final_message: the text ends inside the last (assistant) message, so that generation
        continues it; as transformers' apply_chat_template does it: render without a generation prompt,
        then cut after the last occurrence of the final message's text (the template's end-of-turn
        markup after it is dropped). It excludes add_generation_prompt."""
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message: cannot be combined with add_generation_prompt=true",
                "continue_final_message",
            )
        if kwargs.get("tools") and not self.renders_tools:
            return self._tools_template().render(
                messages, add_generation_prompt, continue_final_message, **kwargs
            )
        variables = {**self.special_tokens, **kwargs}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            text = self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. a None where text was expected
            raise InvalidRequestError(
                f"chat template from {self.origin} rejected the messages: {exc}", "messages"
            ) from exc
        return _cut_after_final_message(text, messages) if continue_final_message else text

    def _tools_template(self) -> ChatTemplate:
        """The family's own template (engine/templates/), for a request with tools."""
        if self.family is None:
            raise InvalidRequestError(
                f"tools: the chat template from {self.origin} does not render tools, and the model's "
                "family has no template of ours that does",
                "tools",
            )
        path = TEMPLATE_DIR / f"{self.family}.jinja"
        return ChatTemplate(family_template(self.family), self.special_tokens, str(path), self.family)


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):  # content parts: the last text part is what is continued
        final = next((p.get("text") for p in reversed(final) if isinstance(p, Mapping) and "text" in p), None)
    if not isinstance(final, str) or not final.strip() or final.strip() not in text:
        raise InvalidRequestError(
            "messages: continue_final_message needs a final message with text that the chat template "
            "writes out; the rendered conversation does not contain it",
            "messages",
        )
    at = text.rindex(final.strip())
    # The template kept the message's leading/trailing spaces: cut after all of it; else after the text.
    if text[at : at + len(final.lstrip())] == final:
        return text[: at + len(final.lstrip())]
    return text[: at + len(final.strip())]
