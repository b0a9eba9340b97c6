"""Qwen3 (dense): Llama plus an RMSNorm on every query and key head before RoPE.

config.json: a sliding window applies only with use_sliding_window, and then (without layer_types) to
the layers from max_window_layers on.
"""

from __future__ import annotations

from typing import Any, ClassVar

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    model_type: ClassVar[str] = "qwen3"
    # Defaults of transformers' Qwen3Config.
    config_defaults: ClassVar[dict[str, Any]] = dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
    )

    @classmethod
    def layer_layout(cls, d: dict, num_layers: int, source: str) -> tuple[Any, list[str]]:
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
        kinds = d.get("layer_types")
        if kinds is None:
            first = int(d.get("max_window_layers", num_layers))
            kinds = [
                "sliding_attention" if window and i >= first else "full_attention" for i in range(num_layers)
            ]
        return window, kinds
