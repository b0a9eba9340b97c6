"""Shape tables for the checkpoints `scripts.make_model` can write.

Each `ModelSpec` holds the architecture numbers of one model. The real shapes copy the published
config.json values of Llama-3.2-1B, Llama-3.1-8B, Qwen3-0.6B and gemma-3-1b; the tiny ones are small
stand-ins of each family for tests. tiny-quant is a Llama whose q, gate and up shards and hidden size
are not multiples of 128, so quantisation's 128x128 scale tiles end inside a fused q|k|v or gate|up;
its larger embedding and lm_head make logits far from uniform while each layer adds only a small
update to the residual stream, as in a trained model (a random model whose layers dominate the stream
amplifies rounding, so no quantised format could match its dequantised twin). `hf_config` turns a
spec into the config.json transformers would load, and `tensor_shapes` lists every tensor under the
exact name transformers saves it with.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILY_ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
FAMILY_MODEL_TYPE = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text"}
DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}

# Llama 3.1/3.2 long-context RoPE scaling ("llama3" rope type); only the factor differs between them.
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # llama | qwen3 | gemma3
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    dtype: str  # bf16 | fp32: the default dtype of the written weights
    rms_norm_eps: float
    rope_scaling: dict | None = None
    # Gemma 3 only: every `sliding_window_pattern`-th layer is global, the others use a local window.
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    init_std: float = 0.02  # std of the random decoder linears (config.json's initializer_range)
    embed_std: float = 0.02  # std of the random embedding and lm_head

    def layer_types(self) -> list[str]:
        if self.family != "gemma3":
            return ["full_attention"] * self.num_layers
        p = self.sliding_window_pattern
        return ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(self.num_layers)]


_GEMMA_1B_LOCAL = dict(sliding_window=512, sliding_window_pattern=6, rope_local_base_freq=10000.0)
_TINY_GEMMA_LOCAL = dict(sliding_window=32, sliding_window_pattern=3, rope_local_base_freq=10000.0)

# fmt: off
# One row per checkpoint; columns are the ModelSpec fields in order (intermediate: the MLP width):
# name, family, hidden, layers, heads, kv_heads, head_dim, inter, vocab, max_pos, theta, tie, dtype, eps
SPECS: dict[str, ModelSpec] = {s.name: s for s in [
  ModelSpec("tiny",         "llama",    64,  2,  4, 2,  16,   128,   2048,   4096, 1e4, False, "fp32", 1e-5),
  ModelSpec("tiny-qwen3",   "qwen3",    64,  2,  4, 2,  32,   128,   2048,   4096, 1e6, True,  "fp32", 1e-6),
  ModelSpec("tiny-gemma3",  "gemma3",   64,  4,  4, 1,  32,   128,   2048,   4096, 1e6, True,  "fp32", 1e-6,
            query_pre_attn_scalar=32, **_TINY_GEMMA_LOCAL),
  ModelSpec("tiny-quant",   "llama",   192,  2,  6, 2,  32,   320,   2048,   4096, 1e4, False, "fp32", 1e-5,
            embed_std=0.3),
  ModelSpec("llama-3.2-1b", "llama",  2048, 16, 32, 8,  64,  8192, 128256, 131072, 5e5, True,  "bf16", 1e-5,
            rope_scaling={**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192}),
  ModelSpec("llama-3.1-8b", "llama",  4096, 32, 32, 8, 128, 14336, 128256, 131072, 5e5, False, "bf16", 1e-5,
            rope_scaling={**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192}),
  ModelSpec("llama-3.1-70b", "llama", 8192, 80, 64, 8, 128, 28672, 128256, 131072, 5e5, False, "bf16", 1e-5,
            rope_scaling={**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192}),
  ModelSpec("qwen3-0.6b",   "qwen3",  1024, 28, 16, 8, 128,  3072, 151936,  40960, 1e6, True,  "bf16", 1e-6),
  ModelSpec("gemma-3-1b",   "gemma3", 1152, 26,  4, 1, 256,  6912, 262144,  32768, 1e6, True,  "bf16", 1e-6,
            query_pre_attn_scalar=256, **_GEMMA_1B_LOCAL),
]}
# fmt: on


def get_spec(name: str) -> ModelSpec:
    if name not in SPECS:
        raise ValueError(f"unknown model name {name!r}: choose one of {sorted(SPECS)}")
    return SPECS[name]


def _rope_fields(spec: ModelSpec) -> dict:
    """RoPE in both spellings: rope_theta/rope_scaling (published checkpoints, transformers 4.x) and
    rope_parameters (transformers 5.x); transformers 5 reads either, and so can any other loader."""
    if spec.family == "gemma3":
        params = {
            "full_attention": {"rope_type": "default", "rope_theta": spec.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": spec.rope_local_base_freq},
        }
        return {
            "rope_theta": spec.rope_theta,
            "rope_local_base_freq": spec.rope_local_base_freq,
            "rope_scaling": None,
            "rope_parameters": params,
        }
    params = {"rope_type": "default", **(spec.rope_scaling or {}), "rope_theta": spec.rope_theta}
    return {"rope_theta": spec.rope_theta, "rope_scaling": spec.rope_scaling, "rope_parameters": params}


def _family_fields(spec: ModelSpec) -> dict:
    if spec.family == "llama":
        return {"hidden_act": "silu", "mlp_bias": False, "pretraining_tp": 1}
    if spec.family == "qwen3":
        return {
            "hidden_act": "silu",
            "max_window_layers": spec.num_layers,
            "sliding_window": None,
            "use_sliding_window": False,
            "layer_types": spec.layer_types(),
        }
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": spec.query_pre_attn_scalar,
        "sliding_window": spec.sliding_window,
        "sliding_window_pattern": spec.sliding_window_pattern,
        "layer_types": spec.layer_types(),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "cache_implementation": "hybrid",
    }


def hf_config(spec: ModelSpec, dtype: str, bos_id: int, eos_ids: list[int], pad_id: int | None) -> dict:
    """config.json contents. `dtype` is bf16|fp32; it is written as both torch_dtype (4.x) and dtype (5.x)."""
    dtype_name = DTYPE_NAMES[dtype]
    cfg = {
        "architectures": [FAMILY_ARCH[spec.family]],
        "model_type": FAMILY_MODEL_TYPE[spec.family],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0],
        "pad_token_id": pad_id,
        "head_dim": spec.head_dim,
        "hidden_size": spec.hidden_size,
        "initializer_range": spec.init_std,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }
    cfg.update(_rope_fields(spec))
    cfg.update(_family_fields(spec))
    return dict(sorted(cfg.items()))


def _layer_shapes(spec: ModelSpec, i: int) -> dict[str, tuple[int, ...]]:
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    p = f"model.layers.{i}."
    shapes = {
        p + "self_attn.q_proj.weight": (spec.num_heads * d, h),
        p + "self_attn.k_proj.weight": (spec.num_kv_heads * d, h),
        p + "self_attn.v_proj.weight": (spec.num_kv_heads * d, h),
        p + "self_attn.o_proj.weight": (h, spec.num_heads * d),
    }
    if spec.family in ("qwen3", "gemma3"):  # per-head RMSNorm on q and k
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
    shapes[p + "mlp.gate_proj.weight"] = (inter, h)
    shapes[p + "mlp.up_proj.weight"] = (inter, h)
    shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes[p + "input_layernorm.weight"] = (h,)
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    if spec.family == "gemma3":  # Gemma wraps the MLP in its own pre/post norms
        shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
        shapes[p + "post_feedforward_layernorm.weight"] = (h,)
    return shapes


def tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every saved tensor, in state_dict order. Tied models save no lm_head (it is the embedding)."""
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size)}
    for i in range(spec.num_layers):
        shapes.update(_layer_shapes(spec, i))
    shapes["model.norm.weight"] = (spec.hidden_size,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    return shapes


def param_count(spec: ModelSpec) -> int:
    total = 0
    for shape in tensor_shapes(spec).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")
