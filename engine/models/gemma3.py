"""Gemma 3 (text): what differs from Llama.

* sandwich norms (after attention and after the MLP), all RMSNorms scale by (1 + w);
* QK-norm; attention scale query_pre_attn_scalar**-0.5 instead of head_dim**-0.5;
* embeddings multiplied by sqrt(hidden_size) rounded to the weight dtype first, as HF does
  (in bf16 sqrt(3072) = 55.43 becomes 55.5, and the checkpoints were trained with that);
* sliding-window layers use RoPE base rope_local_base_freq without scaling, global layers use
  rope_theta with the configured scaling (linear factor 8 on the 4B+ models);
* optional final-logit softcapping. attn_logit_softcapping is ignored: Gemma 3 replaced Gemma 2's
  attention softcap with QK-norm, and the reference implementation never applies the config field.
The multimodal wrapper (model_type "gemma3") stores the text weights under a language-model prefix,
spelled by transformers as "language_model.model." (4.x) or "model.language_model." (5.x).
"""

from __future__ import annotations

import torch

from engine.model_config import ModelConfig
from engine.models.layers import RotaryEmbedding
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

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
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
    def checkpoint_name(cls, cfg: ModelConfig, name: str) -> str | None:
        if cfg.is_multimodal_wrapper:
            if name.startswith(_VISION_PREFIXES):  # the vision tower is not served
                return None
            for prefix, replacement in _TEXT_PREFIXES:
                if name.startswith(prefix):
                    name = replacement + name[len(prefix) :]
                    break
        return super().checkpoint_name(cfg, name)
