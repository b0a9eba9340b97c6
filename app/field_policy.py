"""Which request fields this server takes, ignores or refuses, and how each refusal reads.

Three answers, written down in docs/api.md (field policy):
  * taken: the fields declared on the request models (app/protocol.py);
  * accepted and ignored: OpenAI fields that do not change what is generated (`user`, `metadata`, ...),
    declared on the models too, so their types are still checked;
  * refused with 400 `unsupported_parameter`: OpenAI (and vLLM) fields this server does not implement.
    A `reject_unsupported` validator runs before any field is validated, so such a request is answered
    with that one reason, not with whatever else is wrong with it;
  * anything else is a misspelt or unknown field: 422 `extra_forbidden`, naming the closest known field.

A refused field sent with a value that asks for nothing (null, `best_of` equal to `n`) is dropped
instead: clients that serialise every field with its default then still work. Structured output and
tools (response_format, structured_outputs, tools, tool_choice) are taken (app/structured.py).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from pydantic_core import PydanticCustomError

UNSUPPORTED_CODE = "unsupported_parameter"
_NOT_IMPLEMENTED = "it is not implemented here"
_USE_STRUCTURED = "vLLM's older guided_* fields are not taken: send structured_outputs or response_format"

# field -> why; shared by both endpoints (vLLM extensions that clients send to vLLM-compatible servers)
_VLLM_UNSUPPORTED = {
    "use_beam_search": "beam search is not implemented",
    "length_penalty": "beam search is not implemented",
    "guided_json": _USE_STRUCTURED,
    "guided_regex": _USE_STRUCTURED,
    "guided_choice": _USE_STRUCTURED,
    "guided_grammar": _USE_STRUCTURED,
    "min_tokens": _NOT_IMPLEMENTED,
    "truncate_prompt_tokens": "prompts are never truncated: shorten the prompt instead",
    "allowed_token_ids": _NOT_IMPLEMENTED,
    "bad_words": _NOT_IMPLEMENTED,
    "return_tokens_as_token_ids": _NOT_IMPLEMENTED,
}
COMPLETION_UNSUPPORTED = {
    **_VLLM_UNSUPPORTED,
    "suffix": "its models have no fill-in-the-middle",
    "best_of": "only best_of equal to n (or unset) is accepted: it generates n samples and returns all",
}
CHAT_UNSUPPORTED = {
    **_VLLM_UNSUPPORTED,
    "functions": "the deprecated functions field is not taken: send tools",
    "function_call": "the deprecated function_call field is not taken: send tool_choice",
    "audio": "the models are text only",
    "modalities": "the models are text only",
    "prediction": "predicted outputs are not implemented",
    "web_search_options": "web search is not implemented",
    "reasoning_effort": "reasoning length is not adjustable; see include_reasoning and budget_forcing",
    "verbosity": _NOT_IMPLEMENTED,
    "echo": "chat echo is not implemented (completions take echo)",
    "chat_template": "the server's chat template is fixed per model",
    "documents": _NOT_IMPLEMENTED,
}
MESSAGE_UNSUPPORTED = {
    "function_call": "the deprecated function_call field is not taken: send tool_calls",
    "audio": "the models are text only",
}


def _asks_nothing(field: str, value: Any, raw: dict) -> bool:
    """True when the value of a refused field requests no behaviour (so dropping it changes nothing)."""
    if value is None:
        return True
    if field == "best_of":
        return value == raw.get("n", 1)
    return False


def reject_unsupported(raw: Any, table: dict[str, str], where: str = "") -> Any:
    """A pydantic `model_validator(mode="before")` body: raise on the first refused field that asks for
    something; drop refused fields that ask for nothing. `where` prefixes the field in the message."""
    if not isinstance(raw, dict):
        return raw  # pydantic reports the wrong type itself
    present = [k for k in raw if k in table]
    if not present:
        return raw
    for field in present:
        if not _asks_nothing(field, raw[field], raw):
            message = f"this server does not support {where}{field}: {table[field]} (see docs/api.md)"
            raise PydanticCustomError(UNSUPPORTED_CODE, message, {"field": field})
    return {k: v for k, v in raw.items() if k not in table}


def unknown_field_message(path: str, name: str, known: Iterable[str]) -> str:
    """The 422 text for a field no model declares: the closest known name, when there is one."""
    close = difflib.get_close_matches(name, sorted(set(known)), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown field '{path}': {hint}this server does not take it (docs/api.md lists the fields)"


def model_field_names(*models: type) -> set[str]:
    """Every field name of the models and of the models nested in them (for the closest-name hint)."""
    names: set[str] = set()
    seen: set[type] = set()
    todo: list[type] = list(models)
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, info in model.model_fields.items():
            names.add(name)
            todo.extend(_nested_models(info.annotation))
    return names


def _nested_models(annotation: Any) -> list[type]:
    found: list[type] = []
    stack = [annotation]
    while stack:
        a = stack.pop()
        if isinstance(a, type) and hasattr(a, "model_fields"):
            found.append(a)
        stack.extend(getattr(a, "__args__", ()) or ())
    return found
