"""Qwen3 (dense): Llama plus an RMSNorm on every query and key head before RoPE."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
