"""How the loader (engine/models/loader.py) fills a quantised linear (engine/models/quant_linear.py).

Checkpoint leaves map to the module's parameters: `weight` -> qweight, the scale (`weight_scale`, or
`weight_scale_inv` for block FP8) -> scale, `bias` -> bias. A quantised weight is copied without any
dtype conversion and must already have the dtype the config announces (an fp8 weight where int8 is
expected, or a bf16 one, is an error). Scales become float32 and land on their shard's rows: the
shard's output rows for "channel" (a per-tensor scale repeated over them), its tile rows for "block".
With online quantisation a float `weight` is quantised here, on the target device, one tensor at a
time, filling qweight and scale together, so peak memory stays one quantised model plus one tensor.
"""

from __future__ import annotations

import torch

from engine.models.quant_linear import QuantLinear
from kernels.torch_ops import FP8_DTYPE, FP8_MAX

# Tensor leaves that only a quantised module has: on a module kept in the model dtype they are an error.
QUANT_LEAVES = ("weight_scale", "weight_scale_inv", "input_scale", "weight_zero_point", "input_zero_point")


def parameter_leaf(module: QuantLinear, leaf: str, where: str) -> str:
    """The parameter of `module` that checkpoint leaf `leaf` fills. Unknown leaves come back unchanged
    (the loader reports them as unexpected); known unsupported ones raise here."""
    if leaf == "weight":
        return "qweight"
    if leaf == module.quant.scale_name and not module.quant.online:
        return "scale"
    if leaf in ("input_scale", "input_zero_point"):
        raise ValueError(f"{where}: static activation scales are not supported (only dynamic activations)")
    if leaf == "weight_zero_point":
        raise ValueError(f"{where}: asymmetric weights (a zero point) are not supported")
    return leaf


def copy_into(
    module: QuantLinear, leaf: str, shard: int | None, tensor: torch.Tensor, where: str
) -> list[str]:
    """Copy one checkpoint tensor into `module` (shard `shard` of a merged one); returns the parameter
    leaves it filled. `where` names the file and the tensor for errors."""
    if leaf == "qweight" and module.quant.online:
        _quantize_into(module, shard, tensor, where)
        return ["qweight", "scale"]
    if leaf == "qweight":
        _copy_qweight(module, shard, tensor, where)
    elif leaf == "scale":
        _copy_scale(module, shard, tensor, where)
    else:  # bias: in the model dtype, like any plain parameter
        start, rows = module.shard_rows(shard)
        dest = module.bias.data.narrow(0, start, rows)
        _check_float(tensor, where, "the bias")
        _check_shape(tensor, tuple(dest.shape), where)
        dest.copy_(tensor)
    return [leaf]


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 of w [N, K]: scale = amax|row| / 448 (fp32; 1 for an all-zero row, which
    quantises to zeros), qweight = w / scale rounded to e4m3 (clamped to +-448 against rounding up)."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _copy_qweight(module: QuantLinear, shard: int | None, tensor: torch.Tensor, where: str) -> None:
    start, rows = module.shard_rows(shard)
    dest = module.qweight.data.narrow(0, start, rows)
    if tensor.dtype != dest.dtype:
        raise ValueError(
            f"{where} is {tensor.dtype}, but config.json's quantization_config makes it {dest.dtype}; "
            "the config and the weights do not match"
        )
    _check_shape(tensor, tuple(dest.shape), where)
    dest.copy_(tensor)


def _copy_scale(module: QuantLinear, shard: int | None, tensor: torch.Tensor, where: str) -> None:
    _check_float(tensor, where, "a scale")
    start, rows = module.scale_rows(shard)
    dest = module.scale.data.narrow(0, start, rows)
    granularity = module.quant.checkpoint_scale
    if granularity == "block":
        _check_shape(tensor, tuple(dest.shape), where)
    elif granularity == "channel":
        _check_shape(tensor, (rows, 1), where, also=[(rows,)])
        tensor = tensor.reshape(rows)
    else:  # one scale for the whole tensor, repeated over its rows
        _check_shape(tensor, (1,), where, also=[(), (1, 1)])
        tensor = tensor.reshape(1).expand(rows)
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{where}: the scales hold NaN or inf; the checkpoint is corrupt")
    dest.copy_(tensor)  # to float32


def _quantize_into(module: QuantLinear, shard: int | None, tensor: torch.Tensor, where: str) -> None:
    _check_float(tensor, where, "a weight quantised at load (quantization='fp8')")
    start, rows = module.shard_rows(shard)
    _check_shape(tensor, (rows, module.in_features), where)
    qweight, scale = quantize_fp8_rows(tensor.to(module.qweight.device))
    module.qweight.data[start : start + rows] = qweight
    module.scale.data[start : start + rows] = scale


def _check_float(tensor: torch.Tensor, where: str, what: str) -> None:
    if not tensor.is_floating_point() or tensor.element_size() == 1:
        raise ValueError(f"{where} is {tensor.dtype}; {what} must be a float tensor (fp32, bf16 or fp16)")


def _check_shape(
    tensor: torch.Tensor, expected: tuple[int, ...], where: str, also: list[tuple[int, ...]] = ()
) -> None:
    if tuple(tensor.shape) != expected and tuple(tensor.shape) not in also:
        raise ValueError(
            f"{where} has shape {tuple(tensor.shape)}, expected {expected} from config.json; "
            "the config and the weights do not match"
        )
