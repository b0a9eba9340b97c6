"""The architecture facts the model layer needs, parsed once from a checkpoint's config.json.

config.json has been written by many transformers versions, so each field is read under every spelling
seen in the wild: `rope_scaling` + `rope_theta` (4.x) or `rope_parameters` (5.x, nested per layer type
for Gemma 3); `torch_dtype` (4.x) or `dtype` (5.x); Gemma 3 `layer_types` or the older integer
`sliding_window_pattern`. A field missing from config.json takes the default of the transformers config
class of that family (multimodal Gemma 3 text_configs rely on that: they omit head_dim, vocab_size, ...).

This module holds the parsing every family shares. What differs per family (those defaults, where a
multimodal wrapper keeps the language model's fields, a local RoPE base, which layers use a sliding
window) lives on the family's model class in engine/models, registered in engine/models/registry.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigFamily(Protocol):
    """What a model family's class tells the parser; d is config.json over the family's defaults."""

    model_type: str  # ModelConfig.model_type of the family
    config_defaults: Mapping[str, Any]  # defaults of the family's transformers config class

    def text_config(self, raw: dict) -> tuple[dict, bool]:
        """(the fields describing the language model, whether raw is a multimodal wrapper)."""

    def local_rope_theta(self, d: dict) -> float | None:
        """RoPE base of the sliding-window layers where it differs from rope_theta."""

    def layer_layout(self, d: dict, num_layers: int, source: str) -> tuple[Any, list[str]]:
        """(window, per-layer kind): kind is "sliding_attention" or "full_attention"."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # the family: "llama", "qwen3" or "gemma3_text" (a gemma3 wrapper is unwrapped)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # base of the global (full-attention) layers
    rope_scaling: dict | None  # normalised: always has "rope_type"; None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json's, then a wrapper's, then generation_config.json's
    torch_dtype: str | None
    hidden_activation: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    # Gemma 3 (None / defaults elsewhere)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "sliding_attention" or "full_attention"
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    is_multimodal_wrapper: bool = False  # gemma3 checkpoint whose text weights sit under language_model
    raw: dict = field(default_factory=dict)  # config.json as read; never written to

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Per layer: the attention window, None for full attention."""
        window = self.sliding_window
        return tuple(window if kind == "sliding_attention" else None for kind in self.layer_types)


def read_config_json(path: str | Path) -> tuple[dict, str, list[int]]:
    """`<path>/config.json` as a dict, its path for messages, and generation_config.json's eos ids."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: not found; give a HF-format checkpoint directory")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from e
    return raw, str(config_path), _generation_eos(Path(path))


def parse(family: ConfigFamily, raw: dict, source: str, extra_eos: list[int]) -> ModelConfig:
    """config.json's fields under the family's defaults and spellings (the registry picks the family)."""
    text, wrapped = family.text_config(raw)
    d = {**family.config_defaults, **{k: v for k, v in text.items() if v is not None}}
    num_heads = int(d["num_attention_heads"])
    num_layers = int(d["num_hidden_layers"])
    rope_theta, rope_scaling, local_base = _parse_rope(d, family.local_rope_theta(d), source)
    window, layer_types = _parse_layer_types(family, d, num_layers, source)
    eos = _as_list(text.get("eos_token_id", d.get("eos_token_id")))
    if wrapped:  # a wrapper may list more stop ids (e.g. <end_of_turn>) at the top level
        eos += _as_list(raw.get("eos_token_id"))
    return ModelConfig(
        model_type=family.model_type,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // num_heads),
        rms_norm_eps=float(d["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(d["max_position_embeddings"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", d["tie_word_embeddings"])),
        bos_token_id=d.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=tuple(dict.fromkeys(eos + extra_eos)),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or d.get("torch_dtype") or d.get("dtype"),
        hidden_activation=d.get("hidden_activation") or d.get("hidden_act") or "silu",
        attention_bias=bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
        sliding_window=window,
        layer_types=layer_types,
        rope_local_base_freq=local_base,
        query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        attn_logit_softcapping=d.get("attn_logit_softcapping"),
        is_multimodal_wrapper=wrapped,
        raw=raw,
    )


def _parse_rope(d: dict, local_base: float | None, source: str) -> tuple[float, dict | None, float | None]:
    """(global theta, global scaling, local theta); local_base is the family's local theta as 4.x spells
    it, which a 5.x nested rope_parameters overrides. Gemma 3's local layers always use plain RoPE."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        local = params.get("sliding_attention") or {}  # 5.x Gemma 3: one dict per layer type
        local_base = float(local.get("rope_theta", local_base or 10000.0))
        if _rope_type(local) != "default":
            raise ValueError(f"{source}: rope_parameters.sliding_attention must be plain RoPE")
        params = params.get("full_attention")
    # 5.x: rope_parameters holds theta and scaling together; 4.x: rope_theta + rope_scaling.
    spec = dict(params or d.get("rope_scaling") or {})
    theta = float(spec.pop("rope_theta", d["rope_theta"]))
    rope_type = _rope_type(spec)
    if rope_type == "default":
        return theta, None, local_base
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    spec.pop("type", None)
    spec["rope_type"] = rope_type
    if rope_type == "llama3":
        spec.setdefault("original_max_position_embeddings", int(d["max_position_embeddings"]))
    return theta, spec, local_base


def _rope_type(spec: dict) -> str:
    return spec.get("rope_type") or spec.get("type") or "default"


def _parse_layer_types(
    family: ConfigFamily, d: dict, num_layers: int, source: str
) -> tuple[int | None, tuple[str, ...]]:
    window, kinds = family.layer_layout(d, num_layers, source)
    if len(kinds) != num_layers:
        raise ValueError(f"{source}: layer_types has {len(kinds)} entries, num_hidden_layers is {num_layers}")
    return (int(window) if window else None), tuple(kinds)


def _generation_eos(path: Path) -> list[int]:
    """The eos ids of generation_config.json; the file is advisory, so a broken one is ignored."""
    gen_path = path / "generation_config.json"
    if not gen_path.is_file():
        return []
    try:
        extra = json.loads(gen_path.read_text()).get("eos_token_id")
    except json.JSONDecodeError:
        return []
    return _as_list(extra)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
