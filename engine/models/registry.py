"""model_type (config.json) -> model class. A family's class also parses its config.json fields
(engine/models/config.ConfigFamily), so adding a family is its own file plus one entry here."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from engine.models.config import ModelConfig, parse, read_config_json
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,  # multimodal wrapper: only its language model is built
}


def get_model_class(model_type: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[model_type]
    except (KeyError, TypeError):  # TypeError: an unhashable model_type in a malformed config.json
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported types: {', '.join(MODEL_REGISTRY)}"
        ) from None


def config_from_dir(path: str | Path) -> ModelConfig:
    """Parse `<path>/config.json` (and the eos ids of generation_config.json when present)."""
    raw, source, extra_eos = read_config_json(path)
    return config_from_dict(raw, source, extra_eos)


def config_from_dict(raw: dict, source: str = "config.json", extra_eos: Iterable[int] = ()) -> ModelConfig:
    """extra_eos: more stop ids (generation_config.json's), listed after config.json's."""
    try:
        family = get_model_class(raw.get("model_type"))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return parse(family, raw, source, list(extra_eos))
