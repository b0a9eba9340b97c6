"""Building blocks shared by every model family.

Parameters are allocated with `torch.empty` and never randomly initialised: the loader overwrites every
one of them (and fails loudly when a tensor is missing), so building an 8B model costs only the memory.
Norms, RoPE, activations and attention go through kernels.ops only, so Triton kernels plug in there.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention_context import get_context
from kernels import ops


def _empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b); W: [out_features, in_features] as in HF checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = _empty_param(out_features, in_features)
        self.bias = _empty_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several HF projections stacked along the output dimension (q|k|v, gate|up): one matmul instead
    of several. Shard i owns output rows [sum(output_sizes[:i]), sum(output_sizes[:i+1]))."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """(first row, number of rows) of one shard in the stacked weight / bias."""
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]

    def gated(self, x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
        """act(gate) * up of a [gate | up] projection (GatedMLP): silu, or the tanh GELU; one row on
        CUDA in one kernel."""
        return ops.gated_linear(x, self.weight, self.bias, gelu_tanh)


class LinearFactory:
    """Builds a block's projections by their checkpoint (HF) names, e.g. model.layers.3.mlp.down_proj.

    This one builds plain Linear / MergedLinear; engine.models.quant_linear.QuantLinearFactory builds
    quantised ones for the modules a quantised checkpoint quantises, so model files never see a scheme.
    """

    def __init__(self, prefix: str = ""):
        self.prefix = prefix

    def scoped(self, prefix: str) -> LinearFactory:
        """The same factory for the modules under `prefix` (a full HF module path)."""
        factory = copy.copy(self)
        factory.prefix = prefix
        return factory

    def full_name(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def linear(self, name: str, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
        return Linear(in_features, out_features, bias)

    def merged(
        self, names: list[str], in_features: int, output_sizes: list[int], bias: bool = False
    ) -> nn.Module:
        """One module for the HF projections `names`, stacked in order (shard i = names[i])."""
        return MergedLinear(in_features, output_sizes, bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = _empty_param(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """weight_offset = 1 for Gemma, whose checkpoints store w and scale by (1 + w)."""

    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.weight = _empty_param(dim)
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.weight_offset)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair inverse frequencies [D/2] (fp32, like the reference implementation), with scaling.

    linear: every frequency is divided by `factor` (positions are stretched uniformly).
    llama3: wavelengths shorter than original_max / high_freq_factor are kept, those longer than
    original_max / low_freq_factor are divided by `factor`, and the band between is a linear blend in
    s = original_max / wavelength between the two.
    """
    # Computed on the CPU whatever the default device, so every device gets bit-identical frequencies.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"rope_type {kind!r} is not supported")
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    blend = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelen < original / high, inv_freq, scaled)
    return torch.where(wavelen > original / low, inv_freq / factor, scaled)


class RotaryEmbedding(nn.Module):
    """cos_sin: [max_positions, head_dim] fp32, cos(p * f) in the first D/2 columns, sin in the last."""

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, base, scaling).to(torch.get_default_device())
        freqs = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)


class Attention(nn.Module):
    """GQA self-attention over the packed batch described by get_context().

    `k_cache` / `v_cache` ([num_blocks, block_size, Hkv, D]) are plain attributes the model runner assigns;
    with no cache (parity tests) attention runs over the new tokens alone.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        qk_norm_eps: float | None = None,
        norm_offset: float = 0.0,
        bias: bool = False,
        linears: LinearFactory | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        linears = linears or LinearFactory()
        sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = linears.merged(["q_proj", "k_proj", "v_proj"], hidden_size, sizes, bias)
        self.o_proj = linears.linear("o_proj", self.q_size, hidden_size, bias)
        self.rotary = rotary  # shared by every layer of the same kind; registered once in named_buffers
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        # QK-norm (Qwen3, Gemma 3), enabled by qk_norm_eps: RMSNorm over head_dim of every head, before RoPE.
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, norm_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, norm_offset)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        meta = get_context()
        # The runner's metadata carries slot_mapping and block_tables together; cache-free metadata
        # (parity tests, the activation-profiling forward) carries neither, and nothing is stored.
        if self.k_cache is not None and meta.block_tables is not None:
            # One launch: (QK-norm +) RoPE + cache write. Attention then reads K/V from the paged cache;
            # the (unrotated) k / v passed below only give it the KV head count.
            norm = {}
            if self.q_norm is not None:
                norm = dict(q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight,
                            norm_eps=self.q_norm.eps, norm_offset=self.q_norm.weight_offset)  # fmt: skip
            q = ops.rope_store_kv(
                q, k, v, positions, self.rotary.cos_sin, self.k_cache, self.v_cache, meta.slot_mapping, **norm
            )
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = ops.apply_rotary(q, k, positions, self.rotary.cos_sin)
        out = ops.attention(
            q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window, self.softcap
        )
        return self.o_proj(out.reshape(-1, self.q_size))


_GATED_ACTIVATIONS = {
    "silu": "silu_and_mul",
    "swish": "silu_and_mul",
    "gelu_pytorch_tanh": "gelu_tanh_and_mul",
    "gelu_tanh": "gelu_tanh_and_mul",
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU with the tanh-approximated GELU."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        bias: bool = False,
        linears: LinearFactory | None = None,
    ):
        super().__init__()
        if activation not in _GATED_ACTIVATIONS:
            raise ValueError(
                f"hidden activation {activation!r} is not supported (supported: {sorted(_GATED_ACTIVATIONS)})"
            )
        linears = linears or LinearFactory()
        sizes = [intermediate_size, intermediate_size]
        self.gate_up_proj = linears.merged(["gate_proj", "up_proj"], hidden_size, sizes, bias)
        self.down_proj = linears.linear("down_proj", intermediate_size, hidden_size, bias)
        self.act_name = _GATED_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gelu_tanh = self.act_name == "gelu_tanh_and_mul"
        if getattr(self.down_proj, "takes_act_amax", False) and x.numel() == x.shape[-1]:
            # one row (batch-1 decode) into an int8 W8A8 down_proj: the activation kernel also writes
            # the partial maxima of its output, so the GEMV skips its own pass over the 14k-wide row
            act, amax = ops.gated_and_mul_amax(self.gate_up_proj(x), gelu_tanh)
            return self.down_proj(act, act_amax=amax)
        return self.down_proj(self.gate_up_proj.gated(x, gelu_tanh))


class DecoderLayer(nn.Module):
    """Pre-norm block with a fused residual stream, optionally with Gemma's sandwich norms.

    HF names the norms differently per family and the loader keeps those names:
      plain (Llama, Qwen3): input_layernorm -> attn -> post_attention_layernorm -> mlp
        (post_attention_layernorm is the *pre-MLP* norm here);
      sandwich (Gemma 3): input_layernorm -> attn -> post_attention_layernorm -> (+residual)
        -> pre_feedforward_layernorm -> mlp -> post_feedforward_layernorm -> (+residual).
    forward takes and returns (hidden, residual): the caller's next norm adds hidden into residual, so
    `residual` holds the stream *before* the latest sub-block's output is added.
    """

    def __init__(
        self,
        self_attn: Attention,
        mlp: GatedMLP,
        hidden_size: int,
        eps: float,
        weight_offset: float = 0.0,
        sandwich: bool = False,
    ):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.sandwich = sandwich
        self.input_layernorm = RMSNorm(hidden_size, eps, weight_offset)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, weight_offset)
        if sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden_size, eps, weight_offset)
            self.post_feedforward_layernorm = RMSNorm(hidden_size, eps, weight_offset)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        if self.sandwich:
            hidden = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm.add_forward(hidden, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual
