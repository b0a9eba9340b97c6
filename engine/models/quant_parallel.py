"""Tensor-parallel quantised linears: engine/models/parallel.py's layout for FP8 / INT8 weights.

A rank holds, besides its slice of qweight (rows for q|k|v and gate|up, input columns for o and down),
the matching slice of the scales, which the loader reads from the file like any other slice:
  * per-channel scales ([N, 1] on disk) follow the output rows: a column-parallel rank reads its rows, a
    row-parallel rank (all output rows) the whole vector;
  * per-tensor scales ([1]) are read whole and repeated over the rank's rows;
  * block scales ([N/128, K/128]) follow both dimensions: a column-parallel rank reads its parts' tile
    rows, a row-parallel rank its tile columns. engine/models/quant_shard.py refuses at start-up any
    split whose shard boundaries are not on 128 boundaries, so each rank's tiles are whole tiles.
Row-parallel layers all-reduce their partial products and add the bias once, after.

Dynamic activation scales are computed by each rank from the input it holds. Column-parallel inputs are
whole, so their scales are the whole layer's. A row-parallel rank quantises its own columns: with
fp8_group128 (128-column groups on block boundaries) those are exactly the whole layer's groups; with
per-token int8 / fp8 each rank's per-token scale covers only its columns (a finer scale, as vLLM does,
rather than an extra all-reduce of the maxima per layer). `quantization="fp8"` likewise quantises a
row-parallel rank's slice per row over the columns it holds.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.models.parallel import ROW_PARALLEL, ParallelLinearFactory, RowReduce, Shard, Slice
from engine.models.quant_config import LinearQuant, QuantConfig
from engine.models.quant_linear import QuantLinear, QuantMergedLinear, quantizes_all
from kernels import ops


class QuantColumnParallelMerged(QuantMergedLinear):
    """A quantised merged projection holding this rank's output rows of each part, and their scales."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, quant: LinearQuant, starts: list[int]
    ):
        super().__init__(in_features, output_sizes, bias, quant)
        self.starts = starts  # per part: the first checkpoint row this rank holds

    def tp_slice(self, leaf: str, shard: int | None) -> Slice | None:
        start, rows = self.starts[shard], self.output_sizes[shard]
        if leaf != "scale":  # qweight (or the float weight quantised at load) and bias
            return (0, start, rows)
        if self.quant.checkpoint_scale == "tensor":
            return None
        if self.scheme == "block":
            return (0, start // self.block_size, math.ceil(rows / self.block_size))
        return (0, start, rows)


class QuantRowParallelLinear(RowReduce, QuantLinear):
    """y = all_reduce(x_r W_r^T) + b with W_r this rank's input columns of the quantised weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: LinearQuant, column: int):
        super().__init__(in_features, out_features, bias, quant)
        self.column = column  # first checkpoint column this rank holds

    def tp_slice(self, leaf: str, shard: int | None) -> Slice | None:
        if leaf == "qweight":
            return (1, self.column, self.in_features)
        if leaf == "scale" and self.scheme == "block":
            return (1, self.column // self.block_size, self.scale.shape[1])
        return None  # per-row scales and the bias cover the output rows, which are not split

    def forward(self, x: torch.Tensor, act_amax: torch.Tensor | None = None) -> torch.Tensor:
        partial = ops.quant_linear(
            x, self.qweight, self.scale, self.row_block, None, self.scheme, self.act_quant, act_amax
        )
        return self.reduce(partial)


class QuantParallelLinearFactory(ParallelLinearFactory):
    """ParallelLinearFactory for a quantised checkpoint: quantised parallel modules for the projections
    `quant` quantises, plain parallel ones for those it ignores."""

    def __init__(self, quant: QuantConfig, shard: Shard, kv_replicas: int, prefix: str = ""):
        super().__init__(shard, kv_replicas, prefix)
        self.quant = quant

    def linear(self, name: str, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
        if name not in ROW_PARALLEL or not self.quant.quantizes(self.full_name(name)):
            return super().linear(name, in_features, out_features, bias)
        column = self.shard.rank * in_features
        return QuantRowParallelLinear(in_features, out_features, bias, self.quant.linear, column)

    def merged(
        self, names: list[str], in_features: int, output_sizes: list[int], bias: bool = False
    ) -> nn.Module:
        if not quantizes_all(self.quant, [self.full_name(n) for n in names]):
            return super().merged(names, in_features, output_sizes, bias)
        starts = self.starts(names, output_sizes)
        return QuantColumnParallelMerged(in_features, output_sizes, bias, self.quant.linear, starts)
