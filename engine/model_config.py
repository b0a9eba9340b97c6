"""The architecture facts the model layer needs, parsed once from a checkpoint's config.json.

config.json has been written by many transformers versions, so each field is read under every spelling
seen in the wild: `rope_scaling` + `rope_theta` (4.x) or `rope_parameters` (5.x, nested per layer type
for Gemma 3); `torch_dtype` (4.x) or `dtype` (5.x); Gemma 3 `layer_types` or the older integer
`sliding_window_pattern`. A field missing from config.json takes the default of the transformers config
class of that family (multimodal Gemma 3 text_configs rely on that: they omit head_dim, vocab_size, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "gemma3_text", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Defaults of the transformers config classes (LlamaConfig, Qwen3Config, Gemma3TextConfig).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
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
    ),
    "qwen3": dict(
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
    ),
    "gemma3_text": dict(
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
    ),
}


@dataclass
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
    eos_token_ids: list[int]
    torch_dtype: str | None
    hidden_activation: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    # Gemma 3 (None / defaults elsewhere)
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    sliding_windows: list[int | None] = field(default_factory=list)  # per layer; None = full attention
    is_multimodal_wrapper: bool = False  # gemma3 checkpoint whose text weights sit under language_model
    raw: dict = field(default_factory=dict)

    @staticmethod
    def from_dir(path: str | Path) -> ModelConfig:
        """Parse `<path>/config.json` (and the eos ids of generation_config.json when present)."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path}: not found; give a HF-format checkpoint directory")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path}: not valid JSON ({e})") from e
        cfg = ModelConfig.from_dict(raw, source=str(config_path))
        gen_path = Path(path) / "generation_config.json"
        if gen_path.is_file():
            try:
                extra = json.loads(gen_path.read_text()).get("eos_token_id")
            except json.JSONDecodeError:
                extra = None  # generation_config.json is advisory; a broken one must not block loading
            cfg.eos_token_ids = _unique(cfg.eos_token_ids + _as_list(extra))
        return cfg

    @staticmethod
    def from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported; supported types: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        text = raw
        if model_type == "gemma3":  # multimodal wrapper: the language model is described by text_config
            text = dict(raw.get("text_config") or {})
            text.setdefault("model_type", "gemma3_text")
        family = "gemma3_text" if model_type == "gemma3" else model_type
        d = {**_FAMILY_DEFAULTS[family], **{k: v for k, v in text.items() if v is not None}}
        cfg = _build(family, d, raw, text, source)
        cfg.is_multimodal_wrapper = model_type == "gemma3"
        return cfg


def _build(family: str, d: dict, raw: dict, text: dict, source: str) -> ModelConfig:
    num_heads = int(d["num_attention_heads"])
    rope_theta, rope_scaling, local_base = _parse_rope(family, d, source)
    eos = _as_list(text.get("eos_token_id", d.get("eos_token_id")))
    if text is not raw:  # a wrapper may list more stop ids (e.g. <end_of_turn>) at the top level
        eos = _unique(eos + _as_list(raw.get("eos_token_id")))
    cfg = ModelConfig(
        model_type=family,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // num_heads),
        rms_norm_eps=float(d["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(d["max_position_embeddings"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", d["tie_word_embeddings"])),
        bos_token_id=d.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=eos,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or d.get("torch_dtype") or d.get("dtype"),
        hidden_activation=d.get("hidden_activation") or d.get("hidden_act") or "silu",
        attention_bias=bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
        rope_local_base_freq=local_base,
        query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        attn_logit_softcapping=d.get("attn_logit_softcapping"),
        raw=raw,
    )
    cfg.sliding_window, cfg.layer_types = _parse_layer_types(family, d, cfg.num_layers, source)
    cfg.sliding_windows = [
        cfg.sliding_window if kind == "sliding_attention" else None for kind in cfg.layer_types
    ]
    return cfg


def _parse_rope(family: str, d: dict, source: str) -> tuple[float, dict | None, float | None]:
    """(global theta, global scaling, local theta). Gemma 3's local layers always use plain RoPE."""
    params = d.get("rope_parameters")
    local_base = float(d["rope_local_base_freq"]) if family == "gemma3_text" else None
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


def _parse_layer_types(family: str, d: dict, num_layers: int, source: str) -> tuple[int | None, list[str]]:
    """(window, per-layer kind): kind is "sliding_attention" or "full_attention"."""
    window = d.get("sliding_window")
    if family == "llama":
        return None, ["full_attention"] * num_layers
    if family == "qwen3" and not d.get("use_sliding_window"):
        window = None
    kinds = d.get("layer_types")
    if kinds is None and family == "gemma3_text":
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        kinds = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
        ]
    if kinds is None:  # qwen3: layers from max_window_layers on use the window when it is enabled
        first = int(d.get("max_window_layers", num_layers))
        kinds = [
            "sliding_attention" if window and i >= first else "full_attention" for i in range(num_layers)
        ]
    if len(kinds) != num_layers:
        raise ValueError(f"{source}: layer_types has {len(kinds)} entries, num_hidden_layers is {num_layers}")
    if family == "gemma3_text" and d.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention=true (embedding model) is not supported")
    return (int(window) if window else None), list(kinds)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _unique(values: list[int]) -> list[int]:
    return list(dict.fromkeys(values))
