"""Tensor-parallel layers: one rank's share of a model, for every family alike.

With `tensor_parallel_size` = P, rank r builds the model from `local_config` (its heads, KV heads,
MLP columns and vocabulary rows) and holds:
  * q|k|v and gate|up column-parallel (its output rows of each projection; no communication);
  * o_proj and down_proj row-parallel (its input columns), one all-reduce each, bias added once after;
    with `tensor_parallel_fp32_reduce` their partial sums stay fp32 until the sum over ranks, which is
    then rounded to the model dtype once, as TP=1's GEMM rounds it;
  * the embedding and the LM head vocab-parallel: rows [r * V', (r + 1) * V') of the vocabulary with
    V' = ceil(V / P); the last rank's padding rows are zero and never looked up. An embedding lookup
    is masked to the rank's rows and all-reduced; the LM head gives the rank's logits columns, which
    the caller gathers (engine/runner/tp_model.py).
KV heads are split when there are at least P of them (P must divide them), else each is replicated on
P / Hkv ranks (Hkv must divide P): rank r then reads KV head r // (P / Hkv), the one its query heads use.

Every parameter says which slice of its checkpoint tensor it holds (`tp_slice`), so the loader reads
only that slice from the safetensors file (`read_slice`), never the whole tensor. Quantised
projections (FP8 / INT8, with their scales) have their own parallel forms: engine/models/quant_parallel.py.
All ranks see the same inputs and, after each all-reduce, the same residual stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.all_reduce import all_reduce, fused_for, wide_partials
from engine.models.config import ModelConfig
from engine.models.layers import Linear, LinearFactory, MergedLinear, RMSNorm, _empty_param
from engine.models.quant_shard import check_quant_tp
from kernels import ops

ROW_PARALLEL = ("o_proj", "down_proj")  # LinearFactory.linear names whose input dimension is split
KV_PROJECTIONS = ("k_proj", "v_proj")

# A slice of a checkpoint tensor: (dimension, first index, length).
Slice = tuple[int, int, int]


@dataclass(frozen=True)
class Shard:
    """Which rank of how many this process is."""

    rank: int
    size: int

    def vocab_rows(self, vocab: int) -> tuple[int, int, int]:
        """(first row, rows held, rows that are real) of this rank's vocabulary share."""
        per = -(-vocab // self.size)
        start = min(self.rank * per, vocab)
        return start, per, min(vocab, start + per) - start


def check_tp(cfg: ModelConfig, size: int, where: str, quantization: str | None = None) -> None:
    """Raise ValueError naming tensor_parallel_size and the fix when `size` cannot split this model
    (its heads and MLP, and a block-FP8 checkpoint's scale blocks: engine/models/quant_shard.py)."""
    fits = [p for p in range(1, cfg.num_heads + 1) if _fits(cfg, p)]
    problem = None
    if cfg.num_heads % size:
        problem = f"does not divide the {cfg.num_heads} attention heads"
    elif cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problem = f"neither divides nor is a multiple of the {cfg.num_kv_heads} KV heads"
    elif cfg.intermediate_size % size:
        problem = f"does not divide the MLP width {cfg.intermediate_size}"
    if problem:
        raise ValueError(f"tensor_parallel_size: {size} {problem} of {where}; use one of {fits}")
    check_quant_tp(cfg, size, where, quantization, fits)


def _fits(cfg: ModelConfig, p: int) -> bool:
    kv_ok = cfg.num_kv_heads % p == 0 or p % cfg.num_kv_heads == 0
    return cfg.num_heads % p == 0 and kv_ok and cfg.intermediate_size % p == 0


def local_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The config this rank builds its modules from: its heads, KV heads, MLP width and vocab rows."""
    p = shard.size
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // p,
        num_kv_heads=max(1, cfg.num_kv_heads // p),
        intermediate_size=cfg.intermediate_size // p,
        vocab_size=shard.vocab_rows(cfg.vocab_size)[1],
    )


class RowReduce:
    """The all-reduce of a row-parallel projection (plain or quantised), or none where the norm that
    follows does it (`defer_reduce`, set by `fuse_reductions`: the output is then this rank's partial
    sum, and only that norm may read it)."""

    defer_reduce = False
    bias: torch.Tensor | None

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The all-reduce of this rank's partial product, then the bias (a LoRA layer adds its own
        partial product first: engine/lora/layers.py)."""
        if self.defer_reduce:
            return partial
        out = all_reduce(partial)
        return out if self.bias is None else out + self.bias


class RowParallelLinear(RowReduce, Linear):
    """y = all_reduce(x_r W_r^T) + b: this rank's input columns; the bias is added once, after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, column: int):
        super().__init__(in_features, out_features, bias)
        self.column = column  # first checkpoint column this rank holds

    def tp_slice(self, leaf: str, shard: int | None) -> Slice | None:
        return (1, self.column, self.weight.shape[1]) if leaf == "weight" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not wide_partials() or x.element_size() >= 4:  # widening only: fp32 / fp64 models keep theirs
            return self.reduce(ops.linear(x, self.weight, None))
        partial = ops.linear(x, self.weight, None, torch.float32)
        return partial if self.defer_reduce else self.reduce(partial).to(x.dtype)  # rounded once, after


class ReducingRMSNorm(RMSNorm):
    """The norm after a deferred row-parallel projection: its add_forward all-reduces that partial sum,
    adds the residual and normalises (one kernel where engine/models/all_reduce.py can)."""

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fused = fused_for(x)
        if fused is not None:
            return fused(x, residual, self.weight, self.eps, self.weight_offset)
        total = all_reduce(x).to(residual.dtype)  # an fp32 partial sum is rounded once, after the sum
        return ops.add_rms_norm(total, residual, self.weight, self.eps, self.weight_offset)


def fuse_reductions(model: torch.nn.Module) -> None:
    """Defer each bias-free row-parallel projection's all-reduce to the norm that consumes its output
    (a plain decoder layer's o_proj -> post_attention_layernorm, down_proj -> the next layer's
    input_layernorm or the final norm). Sandwich layers (Gemma) normalise the projection's output
    before the residual add and keep their all-reduces."""
    layers = list(model.model.layers)
    if any(layer.sandwich for layer in layers):
        return
    nexts = [(layer, "input_layernorm") for layer in layers[1:]] + [(model.model, "norm")]
    for layer, (owner, name) in zip(layers, nexts, strict=True):
        for proj, norm_owner, norm_name in (
            (layer.self_attn.o_proj, layer, "post_attention_layernorm"),
            (layer.mlp.down_proj, owner, name),
        ):
            if isinstance(proj, RowReduce) and proj.bias is None:
                proj.defer_reduce = True
                old = getattr(norm_owner, norm_name)
                setattr(norm_owner, norm_name, _reducing(old))


def _reducing(norm: RMSNorm) -> ReducingRMSNorm:
    new = ReducingRMSNorm(norm.weight.shape[0], norm.eps, norm.weight_offset)
    new.weight = norm.weight
    return new


class ColumnParallelMerged(MergedLinear):
    """A merged projection (q|k|v, gate|up) holding this rank's output rows of each part."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, starts: list[int]):
        super().__init__(in_features, output_sizes, bias)
        self.starts = starts  # per part: the first checkpoint row this rank holds

    def tp_slice(self, leaf: str, shard: int | None) -> Slice | None:
        return (0, self.starts[shard], self.output_sizes[shard])


class ParallelLinearFactory(LinearFactory):
    """Builds the decoder projections of one rank (sizes already local: see local_config)."""

    def __init__(self, shard: Shard, kv_replicas: int, prefix: str = ""):
        super().__init__(prefix)
        self.shard, self.kv_replicas = shard, kv_replicas

    def linear(self, name: str, in_features: int, out_features: int, bias: bool = False) -> Linear:
        if name not in ROW_PARALLEL:
            where = self.full_name(name)
            raise NotImplementedError(f"tensor_parallel_size > 1: no parallel layout for {where}")
        return RowParallelLinear(in_features, out_features, bias, self.shard.rank * in_features)

    def merged(
        self, names: list[str], in_features: int, output_sizes: list[int], bias: bool = False
    ) -> MergedLinear:
        return ColumnParallelMerged(in_features, output_sizes, bias, self.starts(names, output_sizes))

    def starts(self, names: list[str], output_sizes: list[int]) -> list[int]:
        """Per part of a merged projection: the first checkpoint row this rank holds."""
        rank = self.shard.rank
        return [
            (rank // self.kv_replicas if name in KV_PROJECTIONS else rank) * size
            for name, size in zip(names, output_sizes, strict=True)
        ]


class VocabParallelEmbedding(torch.nn.Module):
    """This rank's rows of the embedding; ids outside them look up zeros, and the all-reduce sums the
    one rank that holds each id."""

    def __init__(self, rows: int, dim: int, start: int, real_rows: int):
        super().__init__()
        self.weight = _empty_param(rows, dim)
        self.weight.data[real_rows:].zero_()
        self.start, self.real_rows = start, real_rows

    def tp_slice(self, leaf: str, shard: int | None) -> Slice | None:
        return (0, self.start, self.real_rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.real_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class VocabParallelHead(Linear):
    """This rank's rows of the LM head: its columns of the logits (padding rows are zero)."""

    def __init__(self, dim: int, rows: int, start: int, real_rows: int):
        super().__init__(dim, rows)
        self.weight.data[real_rows:].zero_()
        self.start, self.real_rows = start, real_rows

    def tp_slice(self, leaf: str, shard: int | None) -> Slice | None:
        return (0, self.start, self.real_rows)


def build_parallel(
    cls, cfg: ModelConfig, shard: Shard, linears: Callable[[Shard, int], LinearFactory] | None = None
) -> torch.nn.Module:
    """This rank's model of family `cls` (under the caller's device and dtype defaults). linears(shard,
    kv_replicas): the projections' factory (a quantised checkpoint's: engine/models/quant_parallel.py)."""
    kv_replicas = max(1, shard.size // cfg.num_kv_heads)
    model = cls(local_config(cfg, shard), (linears or ParallelLinearFactory)(shard, kv_replicas))
    start, rows, real = shard.vocab_rows(cfg.vocab_size)
    model.model.embed_tokens = VocabParallelEmbedding(rows, cfg.hidden_size, start, real)
    if model.lm_head is not None:
        model.lm_head = VocabParallelHead(cfg.hidden_size, rows, start, real)
    fuse_reductions(model)
    return model


def read_slice(reader, name: str, module: torch.nn.Module, leaf: str, shard: int | None) -> torch.Tensor:
    """The part of checkpoint tensor `name` that `module` holds: a slice read from the file for a
    tensor-parallel module, the whole tensor otherwise."""
    part = module.tp_slice(leaf, shard) if hasattr(module, "tp_slice") else None
    if part is None:
        return reader.get_tensor(name)
    dim, start, length = part
    sliced = reader.get_slice(name)
    index = (slice(None),) * dim + (slice(start, start + length),)
    return sliced[index]


def loaded_rows(module: torch.nn.Module, dest: torch.Tensor) -> torch.Tensor:
    """The rows of `dest` the checkpoint fills (a vocab-parallel module's padding rows stay zero)."""
    real = getattr(module, "real_rows", None)
    return dest if real is None else dest.narrow(0, 0, real)
