"""LoRA layers: a base projection plus each row's adapter, from fixed per-layer slot stacks.

Each adaptable projection of a decoder layer is wrapped once at start-up: q|k|v and gate|up (fused in
the base model) take ONE shrink and ONE expand over their slices, o_proj and down_proj one pair each.
Per wrapped layer, `lora_a` [S, n_slices * r, K] and `lora_b` [S, N, r] hold S = max_loras adapter
slots zero-padded to r = max_lora_rank (kernels/torch_lora.py documents the layout). They are fixed
buffers: CUDA graphs read them in place, and loading an adapter into a slot copies into them.

Which slot each row uses comes from the step: `AttentionMetadata.lora_slots` (int32 [T], -1: none).
A forward pre-hook on the model turns it into a device-side grouping (kernels.ops.lora_mapping) once per
forward, which every LoRA layer reads from the shared `LoRAContext`; a forward without lora_slots
(no row with an adapter, eager) runs the base layers alone.

Tensor parallelism: a column-parallel layer holds its rank's output rows, so B is sharded along N and
A is whole; a row-parallel one holds its input columns, so A is sharded along K, B is whole, and the
adapter's partial product joins the base's partial sum before the one all-reduce.

Folding (`LoRALinear.fold`): where one slot is the only one (gated_lora_mtp's gate without
enable_lora), its A is appended to the base weight as extra output rows, so one GEMM gives both the
base output and every row's shrink, and the separate shrink (and the zeroing of its output) is not
launched. The base weight is then a view of the first N rows of that stack, so a forward without
adapted rows runs exactly as before; a forward with some gives y = out[:, :N] and s = out[:, N:]
(strided views: every consumer of a projection's output indexes rows by stride). The GEMM of the wider
weight may reduce in another order than the base one at the same row count, as GEMMs already do
between row counts, so the real rows of such a forward may differ from the base model's in the last
bits; docs/architecture.md says where this applies.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from engine.models.attention_context import get_context
from engine.models.layers import Linear, MergedLinear
from engine.models.parallel import ColumnParallelMerged, RowParallelLinear
from kernels import ops

# wrapped attribute of a layer's block -> the PEFT module names of its slices
WRAPPED = {
    ("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
    ("self_attn", "o_proj"): ("o_proj",),
    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
    ("mlp", "down_proj"): ("down_proj",),
}


class LoRAContext:
    """The step's row-to-slot grouping, shared by every LoRA layer of one model."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.mapping = None  # kernels.lora_mapping.LoraMapping of the current forward, or None

    def before_forward(self, module: nn.Module, args: tuple) -> None:
        slots = get_context().lora_slots
        self.mapping = None if slots is None else ops.lora_mapping(slots, self.num_slots)


class LoRALinear(nn.Module):
    """`base` (Linear, MergedLinear or their tensor-parallel forms) + the rows' adapters."""

    def __init__(self, base: Linear, layer: int, names: tuple[str, ...], ctx: LoRAContext, rank: int):
        super().__init__()
        self.base, self.layer, self.names, self.ctx, self.rank = base, layer, names, ctx, rank
        self.row_parallel = isinstance(base, RowParallelLinear)
        out_features, in_features = base.weight.shape
        sizes = list(base.output_sizes) if isinstance(base, MergedLinear) else [out_features]
        self.sizes = sizes
        self.offsets = [0, *itertools.accumulate(sizes)]
        dtype, device = base.weight.dtype, base.weight.device
        s = ctx.num_slots
        self.register_buffer(
            "lora_a", torch.zeros(s, len(sizes) * rank, in_features, dtype=dtype, device=device)
        )
        self.register_buffer("lora_b", torch.zeros(s, out_features, rank, dtype=dtype, device=device))
        self.stacked: torch.Tensor | None = None  # [N + n_slices * r, K] once folded: base rows, then A
        self.stacked_bias: torch.Tensor | None = None

    def fold(self) -> None:
        """Append the only slot's A to the base weight (see the module docstring). Afterwards the base
        weight and `lora_a` are views of the stack's first N and last rows, so a later load into the
        slot writes the stack."""
        if self.ctx.num_slots != 1 or self.row_parallel or isinstance(self.base, ColumnParallelMerged):
            raise ValueError("LoRALinear.fold: only one slot, and no tensor parallelism")
        weight, bias = self.base.weight, self.base.bias
        n = weight.shape[0]
        self.stacked = torch.cat([weight.data, self.lora_a[0]])
        self.base.weight = nn.Parameter(self.stacked[:n], requires_grad=False)
        self.lora_a = self.stacked[n:].unsqueeze(0)
        if bias is not None:
            self.stacked_bias = torch.cat([bias.data, bias.new_zeros(self.lora_a.shape[1])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stacked is not None and self.ctx.mapping is not None:
            out = ops.linear(x, self.stacked, self.stacked_bias)
            n = self.base.weight.shape[0]
            y = out[:, :n]
            ops.lora_expand(y, out[:, n:], self.lora_b, self.ctx.mapping, self.offsets)
            return y
        if not self.row_parallel:
            y = self.base(x)
            self._add_lora(x, y)
            return y
        y = ops.linear(x, self.base.weight, None)
        self._add_lora(x, y)  # the adapter's partial product joins the partial sum before the all-reduce
        return self.base.reduce(y)

    def gated(self, x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
        """act(gate) * up of a [gate | up] projection, the adapters added before the activation."""
        y = self.forward(x)
        return ops.gelu_tanh_and_mul(y) if gelu_tanh else ops.silu_and_mul(y)

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor) -> None:
        mapping = self.ctx.mapping
        if mapping is None:
            return
        shrunk = ops.lora_shrink(x, self.lora_a, mapping)
        ops.lora_expand(y, shrunk, self.lora_b, mapping, self.offsets)

    def load_slot(self, slot: int, modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy an adapter's tensors of this layer into `slot` (this rank's share); modules the
        adapter does not target stay zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        r = self.rank
        for i, name in enumerate(self.names):
            pair = modules.get((self.layer, name))
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            if self.row_parallel:  # A sharded along K, B whole
                a = a[:, self.base.column : self.base.column + self.lora_a.shape[2]]
            else:  # B sharded along N: this rank's output rows of slice i
                start = self.base.starts[i] if isinstance(self.base, ColumnParallelMerged) else 0
                b = b[start : start + self.sizes[i]]
            self.lora_a[slot, i * r : i * r + rank].copy_(a, non_blocking=True)
            self.lora_b[slot, self.offsets[i] : self.offsets[i + 1], :rank].copy_(b, non_blocking=True)


def wrap_model(model: nn.Module, num_slots: int, rank: int) -> list[LoRALinear]:
    """Wrap every adaptable projection of `model` (a family of engine/models, or one rank's share) in
    place; returns the LoRA layers. Quantised projections are refused."""
    ctx = LoRAContext(num_slots)
    wrapped = []
    for i, layer in enumerate(model.model.layers):
        for (block_name, attr), names in WRAPPED.items():
            block = getattr(layer, block_name)
            base = getattr(block, attr)
            if not isinstance(base, Linear):
                raise ValueError(
                    f"enable_lora: model.layers.{i}.{block_name}.{attr} is a {type(base).__name__}; LoRA on "
                    "quantised (FP8/INT8) base layers is not supported: use a float checkpoint without "
                    "quantization, or enable_lora=False"
                )
            lora = LoRALinear(base, i, names, ctx, rank)
            setattr(block, attr, lora)
            wrapped.append(lora)
    model.register_forward_pre_hook(ctx.before_forward)
    return wrapped
