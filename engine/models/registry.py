"""model_type (config.json) -> model class."""

from __future__ import annotations

from torch import nn

from engine.model_config import SUPPORTED_MODEL_TYPES
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,  # multimodal wrapper: only its language model is built
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_MODEL_TYPES), "keep model_config.SUPPORTED_MODEL_TYPES in sync"


def get_model_class(model_type: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported types: {', '.join(MODEL_REGISTRY)}"
        ) from None
