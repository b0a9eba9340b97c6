"""Gemma 3 (text): what differs from Llama.

* sandwich norms (after attention and after the MLP), all RMSNorms scale by (1 + w);
* QK-norm; attention scale query_pre_attn_scalar**-0.5 instead of head_dim**-0.5;
* embeddings multiplied by sqrt(hidden_size) rounded to the weight dtype first, as HF does
  (in bf16 sqrt(3072) = 55.43 becomes 55.5, and the checkpoints were trained with that);
* sliding-window layers use RoPE base rope_local_base_freq without scaling, global layers use
  rope_theta with the configured scaling (linear factor 8 on the 4B+ models);
* optional final-logit softcapping. attn_logit_softcapping is ignored: Gemma 3 replaced Gemma 2's
  attention softcap with QK-norm, and the reference implementation never applies the config field.
The multimodal wrapper (model_type "gemma3") describes the language model in its text_config and stores
the text weights under a language-model prefix, spelled by transformers as "language_model.model." (4.x)
or "model.language_model." (5.x). Without layer_types, every sliding_window_pattern-th layer is global.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from engine.models.config import ModelConfig
from engine.models.layers import LinearFactory, RotaryEmbedding
from engine.models.llama import LlamaForCausalLM

_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


class Gemma3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    sandwich_norms = True
    norm_weight_offset = 1.0
    model_type: ClassVar[str] = "gemma3_text"  # also for the "gemma3" wrapper: only its text is served
    # Defaults of transformers' Gemma3TextConfig.
    config_defaults: ClassVar[dict[str, Any]] = dict(
        vocab_size=262208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        bos_token_id=2,
        eos_token_id=1,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10000.0,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        sliding_window_pattern=6,
    )

    def __init__(self, cfg: ModelConfig, linears: LinearFactory | None = None):
        super().__init__(cfg, linears)
        scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32)
        self.model.register_buffer("embed_scale", scale, persistent=False)

    def build_rotaries(self) -> None:
        super().build_rotaries()
        cfg = self.cfg
        self.model.rotary_emb_local = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_base_freq, None
        )

    def rotary_for_layer(self, layer_idx: int) -> RotaryEmbedding:
        if self.cfg.layer_types[layer_idx] == "sliding_attention":
            return self.model.rotary_emb_local
        return self.model.rotary_emb

    def attention_scale(self) -> float:
        return float(self.cfg.query_pre_attn_scalar) ** -0.5

    def attention_softcap(self) -> float | None:
        return None  # see the module docstring

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * self.model.embed_scale.to(x.dtype)

    @classmethod
    def text_config(cls, raw: dict) -> tuple[dict, bool]:
        if raw.get("model_type") != "gemma3":
            return raw, False
        return dict(raw.get("text_config") or {}), True

    @classmethod
    def local_rope_theta(cls, d: dict) -> float | None:
        return float(d["rope_local_base_freq"])

    @classmethod
    def layer_layout(cls, d: dict, num_layers: int, source: str) -> tuple[Any, list[str]]:
        if d.get("use_bidirectional_attention"):
            raise ValueError(f"{source}: use_bidirectional_attention=true (embedding model) is not supported")
        kinds = d.get("layer_types")
        if kinds is None:
            pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
            kinds = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
            ]
        return d.get("sliding_window"), kinds

    @classmethod
    def checkpoint_name(cls, cfg: ModelConfig, name: str) -> str | None:
        if cfg.is_multimodal_wrapper:
            if name.startswith(_VISION_PREFIXES):  # the vision tower is not served
                return None
            for prefix, replacement in _TEXT_PREFIXES:
                if name.startswith(prefix):
                    name = replacement + name[len(prefix) :]
                    break
        return super().checkpoint_name(cfg, name)
