"""Model families (Llama, Qwen3, Gemma 3) built from shared layers; see registry.get_model_class."""

from engine.models.registry import MODEL_REGISTRY, get_model_class

__all__ = ["MODEL_REGISTRY", "get_model_class"]
