"""The inference engine: models, paged KV cache, scheduler, runner, sampler. No network, no Ray.

from engine import LLM, SamplingParams
LLM("models/tiny-llama").generate(["Hello"], SamplingParams(max_tokens=8))
"""

from engine.sampling_params import BudgetForcing, RequestOutputKind, SamplingParams, ToolConfig


def __getattr__(name: str):
    # Lazy: importing `engine` for SamplingParams must not load torch-heavy modules.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "CoreClient":
        from engine.core_client import CoreClient

        return CoreClient
    if name == "LoRARequest":  # a request's LoRA adapter (vLLM's name)
        from engine.lora.request import LoRARequest

        return LoRARequest
    if name == "Tokenizer":  # the engine's tokenizer and chat templates, for work done before the engine
        from engine.tokenizer import Tokenizer

        return Tokenizer
    if name == "prompt_block_hashes":  # a prompt's prefix-cache key, for request routers
        from engine.sched.block_manager import prompt_block_hashes

        return prompt_block_hashes
    raise AttributeError(name)


__all__ = [
    "LLM",
    "LLMEngine",
    "CoreClient",
    "SamplingParams",
    "RequestOutputKind",
    "ToolConfig",
    "BudgetForcing",
    "Tokenizer",
    "prompt_block_hashes",
    "LoRARequest",
]
