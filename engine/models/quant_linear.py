"""Linear layers with quantised weights, and the factory that builds them for a quantised checkpoint.

Storage (shared with the kernels, kernels/ops.quant_linear):
* qweight [N, K]: float8_e4m3fn or int8, contiguous (rows of K);
* scale: float32. Scheme "channel": [N], one per output row (per-tensor checkpoints are expanded to
  rows). Scheme "block": [NB, ceil(K/128)], one per 128x128 tile, where the NB tile rows are each
  shard's ceil(n_i/128) rows concatenated in shard order;
* row_block: int32 [N] for scheme "block" only (None otherwise): the scale row of output row n. For
  shard i starting at row s_i whose tiles start at scale row o_i it is o_i + (n - s_i) // 128, so a
  merged q|k|v or gate|up stays right when a shard's size is not a multiple of 128;
* bias: model dtype, or None.
Like every parameter here, the loader fills them all (engine/models/quant_loader.py); nothing is initialised.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.models.layers import LinearFactory
from engine.models.quant_config import LinearQuant, QuantConfig
from kernels import ops


def _empty_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def scale_row_blocks(output_sizes: list[int], block: int) -> torch.Tensor:
    """row_block for shards of `output_sizes` rows: each shard's rows use its own tiles."""
    rows, offset = [], 0
    for n in output_sizes:
        rows.append(offset + torch.arange(n, dtype=torch.int32) // block)
        offset += math.ceil(n / block)
    return torch.cat(rows)


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W = dequantised qweight; one HF projection (shard 0 holds every row)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        quant: LinearQuant,
        output_sizes: list[int] | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.output_sizes = list(output_sizes or [out_features])
        self.quant = quant
        self.scheme, self.act_quant, self.block_size = quant.scheme, quant.act_quant, quant.block_size
        self.qweight = _empty_param(out_features, in_features, dtype=quant.weight_dtype)
        if self.scheme == "block":
            tile_rows = sum(math.ceil(n / self.block_size) for n in self.output_sizes)
            self.scale = _empty_param(
                tile_rows, math.ceil(in_features / self.block_size), dtype=torch.float32
            )
            row_block = scale_row_blocks(self.output_sizes, self.block_size).to(self.qweight.device)
        else:
            self.scale = _empty_param(out_features, dtype=torch.float32)
            row_block = None
        self.register_buffer("row_block", row_block, persistent=False)
        self.bias = _empty_param(out_features) if bias else None

    def shard_rows(self, shard: int | None) -> tuple[int, int]:
        """(first row, number of rows) of one shard in qweight / bias (and in a channel scale)."""
        shard = shard or 0
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]

    def scale_rows(self, shard: int | None) -> tuple[int, int]:
        """(first row, number of rows) of one shard in the scale: its tile rows for scheme "block"."""
        if self.scheme != "block":
            return self.shard_rows(shard)
        tiles = [math.ceil(n / self.block_size) for n in self.output_sizes]
        shard = shard or 0
        return sum(tiles[:shard]), tiles[shard]

    def forward(self, x: torch.Tensor, act_amax: torch.Tensor | None = None) -> torch.Tensor:
        """act_amax: partial maxima of |x| from x's producer (see kernels.ops.quant_linear), or None."""
        return ops.quant_linear(
            x, self.qweight, self.scale, self.row_block, self.bias, self.scheme, self.act_quant, act_amax
        )

    @property
    def takes_act_amax(self) -> bool:
        """Whether a single row's GEMV reads amax from its producer (the DP4A kernel), so a producer that
        can should write it."""
        return ops.quant_gemv_reads_act_amax(self.qweight, self.scheme, self.act_quant)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.output_sizes}, {self.quant.weight_dtype}, "
            f"scheme={self.scheme}, act_quant={self.act_quant}"
        )


class QuantMergedLinear(QuantLinear):
    """Several HF projections stacked along the output dimension, like MergedLinear; shard i owns rows
    [sum(output_sizes[:i]), sum(output_sizes[:i+1])) and, for block scales, its own tile rows."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, quant: LinearQuant):
        super().__init__(in_features, sum(output_sizes), bias, quant, output_sizes)

    def gated(self, x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
        """act(gate) * up of a [gate | up] projection (GatedMLP); one row on CUDA in one kernel."""
        return ops.quant_gated_linear(
            x, self.qweight, self.scale, self.row_block, self.bias, self.scheme, self.act_quant, gelu_tanh
        )


class QuantLinearFactory(LinearFactory):
    """Quantised modules for the projections `quant` quantises, plain ones for those it ignores."""

    def __init__(self, quant: QuantConfig, prefix: str = ""):
        super().__init__(prefix)
        self.quant = quant

    def linear(self, name: str, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
        if not self.quant.quantizes(self.full_name(name)):
            return super().linear(name, in_features, out_features, bias)
        return QuantLinear(in_features, out_features, bias, self.quant.linear)

    def merged(
        self, names: list[str], in_features: int, output_sizes: list[int], bias: bool = False
    ) -> nn.Module:
        if not quantizes_all(self.quant, [self.full_name(n) for n in names]):
            return super().merged(names, in_features, output_sizes, bias)
        return QuantMergedLinear(in_features, output_sizes, bias, self.quant.linear)


def quantizes_all(quant: QuantConfig, full: list[str]) -> bool:
    """Whether `quant` quantises the projections `full` that one merged module fuses (all or none)."""
    quantized = [quant.quantizes(n) for n in full]
    if any(quantized) != all(quantized):
        raise ValueError(
            f"{quant.source}: quantization_config.ignore: {', '.join(full)} are fused into one "
            "matmul here, so they must be quantised alike, but only some of them are ignored"
        )
    return all(quantized)
