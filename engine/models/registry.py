"""model_type (config.json) -> model class. A family's class also parses its config.json fields
(engine/model_config.ConfigFamily), so adding a family is its own file plus one entry here."""

from __future__ import annotations

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
