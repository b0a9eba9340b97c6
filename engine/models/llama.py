"""Llama (2, 3, 3.x): the plain decoder-only transformer, which is also the generic model.

Every other family subclasses LlamaForCausalLM and overrides only what differs: the class switches
(qk_norm, sandwich_norms, norm_weight_offset) or the small hooks (build_rotaries, rotary_for_layer,
attention_scale, attention_softcap, embed, checkpoint_name), and for config.json (engine/model_config)
its model_type, config_defaults and the parsing hooks (text_config, local_rope_theta, layer_layout).
Module names follow HF checkpoints (model.layers.N.self_attn...) so the loader maps tensor names one to
one, except q/k/v and gate/up, which are merged (packed_modules).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from engine.models.attention_context import get_context
from engine.models.config import ModelConfig
from engine.models.layers import (
    Attention,
    DecoderLayer,
    Embedding,
    GatedMLP,
    Linear,
    LinearFactory,
    RMSNorm,
    RotaryEmbedding,
)
from kernels import ops


class LlamaForCausalLM(nn.Module):
    model_type: ClassVar[str] = "llama"  # ModelConfig.model_type of the checkpoints this class builds
    # Defaults of transformers' LlamaConfig: a field missing from config.json takes these.
    config_defaults: ClassVar[dict[str, Any]] = dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    qk_norm = False  # RMSNorm on q and k per head before RoPE (Qwen3, Gemma 3)
    sandwich_norms = False  # extra norms after attention and after the MLP (Gemma 3)
    norm_weight_offset = 0.0  # 1.0 where checkpoints store w for a (1 + w) scale (Gemma)
    # HF projection name -> (merged module name, shard index); the loader routes tensors with it.
    packed_modules: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, linears: LinearFactory | None = None):
        """linears: builds the decoder projections (a quantised checkpoint's factory quantises them);
        embeddings, norms and lm_head always stay in the model dtype."""
        super().__init__()
        self.cfg = cfg
        self.linears = linears or LinearFactory()
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.build_rotaries()
        self.model.layers = nn.ModuleList([self.build_layer(i) for i in range(cfg.num_layers)])
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_weight_offset)
        # Tied checkpoints carry no lm_head tensor: compute_logits reuses the embedding matrix.
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)

    # ---- hooks a family may override -------------------------------------------------------------
    def build_rotaries(self) -> None:
        cfg = self.cfg
        self.model.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    def rotary_for_layer(self, layer_idx: int) -> RotaryEmbedding:
        return self.model.rotary_emb

    def attention_scale(self) -> float:
        return self.cfg.head_dim**-0.5

    def attention_softcap(self) -> float | None:
        return self.cfg.attn_logit_softcapping

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    @classmethod
    def checkpoint_name(cls, cfg: ModelConfig, name: str) -> str | None:
        """A checkpoint tensor name in this module's naming, or None for a known-harmless extra."""
        if name.endswith("rotary_emb.inv_freq"):  # RoPE tables are recomputed, never loaded
            return None
        if cfg.tie_word_embeddings and name == "lm_head.weight":  # a saved copy of the tied matrix
            return None
        return name

    # ---- config.json hooks (engine/models/config.ConfigFamily) -------------------------------------
    @classmethod
    def text_config(cls, raw: dict) -> tuple[dict, bool]:
        return raw, False

    @classmethod
    def local_rope_theta(cls, d: dict) -> float | None:
        return None

    @classmethod
    def layer_layout(cls, d: dict, num_layers: int, source: str) -> tuple[Any, list[str]]:
        return None, ["full_attention"] * num_layers

    # ---- model -----------------------------------------------------------------------------------
    def build_layer(self, i: int) -> DecoderLayer:
        cfg = self.cfg
        attn = Attention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.rotary_for_layer(i),
            self.attention_scale(),
            sliding_window=cfg.sliding_windows[i],
            softcap=self.attention_softcap(),
            qk_norm_eps=cfg.rms_norm_eps if self.qk_norm else None,
            norm_offset=self.norm_weight_offset,
            bias=cfg.attention_bias,
            linears=self.linears.scoped(f"model.layers.{i}.self_attn"),
        )
        mlp = GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.hidden_activation,
            cfg.mlp_bias,
            self.linears.scoped(f"model.layers.{i}.mlp"),
        )
        return DecoderLayer(
            attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, self.norm_weight_offset, self.sandwich_norms
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] for the packed batch set in the attention context -> hidden [T, H]
        (final norm applied)."""
        hidden = self.embed(input_ids)
        given = get_context().embed_rows
        if given is not None:  # mask tokens of a gated-LoRA MTP step carry their own input vectors
            hidden.index_copy_(0, given[0], given[1].to(hidden.dtype))
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        if residual is None:  # zero layers
            return self.model.norm(hidden)
        hidden, _ = self.model.norm.add_forward(hidden, residual)
        return hidden

    def logits_weight(self) -> torch.Tensor:
        """The LM head's weight [V, H]: the embedding's when they are tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in the model dtype (with the final softcap if configured)."""
        logits = ops.linear(hidden, self.logits_weight())
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
