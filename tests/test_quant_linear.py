"""The torch twin of ops.quant_linear against a naive float64 recompute written from the storage contract.

Each case builds a quantised linear the way the loader does (per-shard checkpoint tensors copied into a
QuantMergedLinear, so scale placement and row_block are under test too), then compares its output with
loops over output rows and 128-column groups in float64 that read the per-shard checkpoint scales
directly. Shards of 192 and 320 rows and K = 320 put 128x128 tile edges inside shards and inside K.
Activation amaxes are powers of two times the format's maximum, so the per-token (or per-group) scale
is exact in float32 and float64 alike and both round the same values.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.models import quant_loader
from engine.models.quant_config import LinearQuant
from engine.models.quant_linear import QuantLinear, QuantMergedLinear, scale_row_blocks
from kernels import ops

pytestmark = pytest.mark.engine

FP8 = torch.float8_e4m3fn
K = 320  # 2.5 tiles of 128 columns
CASES = {  # name: (weight dtype, checkpoint scale, act_quant)
    "fp8-block": (FP8, "block", "fp8_group128"),
    "fp8-block-weight-only": (FP8, "block", None),
    "int8-channel": (torch.int8, "channel", "int8_token"),
    "fp8-channel": (FP8, "channel", "fp8_token"),
    "fp8-tensor-weight-only": (FP8, "tensor", None),
    "fp8-tensor-token": (FP8, "tensor", "fp8_token"),
}
QMAX = {"int8_token": 127.0, "fp8_token": 448.0, "fp8_group128": 448.0}


def _shard_tensors(quant: LinearQuant, rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (weight, scale) pair of one shard, shaped as a checkpoint stores them."""
    if quant.weight_dtype == torch.int8:
        weight = torch.randint(-128, 128, (rows, K), generator=gen, dtype=torch.int8)
    else:
        weight = (torch.randn(rows, K, generator=gen) * 100).clamp(-448, 448).to(FP8)
    shape = {"block": (math.ceil(rows / 128), math.ceil(K / 128)), "channel": (rows, 1), "tensor": (1,)}
    scale = torch.rand(shape[quant.checkpoint_scale], generator=gen) * 1e-3 + 1e-4
    return weight, scale


def _build(quant: LinearQuant, sizes: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    module = QuantMergedLinear(K, sizes, bias=True, quant=quant)
    shards = [_shard_tensors(quant, n, gen) for n in sizes]
    bias = torch.randn(sum(sizes), generator=gen)
    for i, (weight, scale) in enumerate(shards):
        quant_loader.copy_into(module, "qweight", i, weight, "test")
        quant_loader.copy_into(module, "scale", i, scale, "test")
        start, rows = module.shard_rows(i)
        quant_loader.copy_into(module, "bias", i, bias[start : start + rows], "test")
    return module, shards, bias


def _naive_weight(quant: LinearQuant, shards) -> torch.Tensor:
    """W[n, k] = q[n, k] * (the scale the checkpoint gives element (n, k) of its shard), in float64."""
    rows = []
    for weight, scale in shards:
        w = torch.zeros(weight.shape, dtype=torch.float64)
        q, s = weight.double(), scale.double()
        for n in range(w.shape[0]):
            for g in range(0, K, 128):
                if quant.checkpoint_scale == "block":
                    factor = s[n // 128, g // 128]
                else:
                    factor = s.reshape(-1)[n if quant.checkpoint_scale == "channel" else 0]
                w[n, g : g + 128] = q[n, g : g + 128] * factor
        rows.append(w)
    return torch.cat(rows)


def _round_acts(x: torch.Tensor, act_quant: str | None) -> torch.Tensor:
    """x [T, K] float64 as the kernel's activations stand for it (quantised value * scale)."""
    if act_quant is None:
        return x
    out = torch.empty_like(x)
    width = 128 if act_quant == "fp8_group128" else K
    for t in range(x.shape[0]):
        for g in range(0, K, width):
            part = x[t, g : g + width]
            sx = part.abs().max() / QMAX[act_quant]
            if sx == 0:  # an all-zero token stays zero
                out[t, g : g + width] = 0.0
                continue
            if act_quant == "int8_token":
                q = torch.round(part / sx).clamp(-128, 127)
            else:
                q = (part / sx).to(FP8).double()
            out[t, g : g + width] = q * sx
    return out


def _activations(tokens: int, act_quant: str | None, seed: int = 1) -> torch.Tensor:
    """Random x [tokens, K] fp32 whose amax per token (or per 128-column group) is QMAX * 2**-e."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, K, generator=gen)
    width = 128 if act_quant == "fp8_group128" else K
    qmax = QMAX.get(act_quant, 1.0)
    for t in range(tokens):
        for g in range(0, K, width):
            part = x[t, g : g + width]
            x[t, g : g + width] = part / part.abs().max() * (qmax * 2.0 ** -(t + g // 128 + 3))
    x[-1] = 0.0  # an all-zero token: its scale is clamped, never 0 / 0
    return x


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("sizes", [[192, 64, 64], [320, 320], [200]])
def test_twin_matches_naive_float64(case, sizes):
    dtype, granularity, act_quant = CASES[case]
    quant = LinearQuant(
        dtype, granularity, act_quant, "weight_scale_inv" if granularity == "block" else "weight_scale"
    )
    module, shards, bias = _build(quant, sizes)
    x = _activations(5, act_quant)
    ours = module(x)
    expected = _round_acts(x.double(), act_quant) @ _naive_weight(quant, shards).T + bias.double()
    assert ours.dtype == torch.float32 and ours.shape == (5, sum(sizes))
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert torch.equal(ours[-1], bias)  # zero activations: exactly the bias, no NaN


def test_row_block_points_each_row_at_its_shards_tiles():
    # q: 192 rows = tiles 0, 1 (rows 128..191 in tile 1); k: 64 rows = tile 2; v: 64 rows = tile 3
    rows = scale_row_blocks([192, 64, 64], 128).tolist()
    assert rows == [0] * 128 + [1] * 64 + [2] * 64 + [3] * 64
    module = QuantMergedLinear(K, [192, 64, 64], bias=False, quant=LinearQuant(FP8, "block", "fp8_group128"))
    assert module.scale.shape == (4, 3) and module.row_block.dtype == torch.int32
    assert [module.scale_rows(i) for i in range(3)] == [(0, 2), (2, 1), (3, 1)]


def test_output_keeps_leading_dims_and_dtype():
    quant = LinearQuant(FP8, "channel", "fp8_token")
    module, shards, bias = _build(quant, [96])
    x = _activations(6, "fp8_token").reshape(2, 3, K)
    y = module(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 96)
    torch.testing.assert_close(
        y.float(), module(x.bfloat16().float()).reshape(2, 3, 96), atol=0.05, rtol=0.02
    )


def test_dispatch_uses_the_twin_off_cuda():
    quant = LinearQuant(torch.int8, "channel", "int8_token")
    module, _, _ = _build(quant, [64])
    x = _activations(3, "int8_token")
    assert isinstance(module, QuantLinear)
    args = (module.qweight, module.scale, module.row_block, module.bias, "channel", "int8_token")
    from kernels import torch_ops

    assert torch.equal(ops.quant_linear(x, *args), torch_ops.quant_linear(x, *args))
