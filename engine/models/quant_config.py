"""Quantised weights: config.json's `quantization_config` (or the `quantization` load option) parsed once
into a validated QuantConfig saying which decoder linears are quantised and how (docs/quantization.md).

Supported:
* quant_method "fp8" with weight_block_size [128, 128] (Qwen3-*-FP8, DeepSeek-V3): float8 e4m3 weights,
  one float32 `weight_scale_inv` per 128x128 block, activations quantised per token and 128 columns;
* quant_method "compressed-tensors", format "int-quantized" (int8) or "float-quantized" (float8 e4m3):
  symmetric 8-bit weights with a per-channel or per-tensor `weight_scale`, activations dynamic per
  token or not quantised (weight-only);
* quantization="fp8" on a float checkpoint: quantised at load to per-channel float8, dynamic per-token
  float8 activations.
Everything else raises a ValueError naming the config field, e.g.
`quantization_config.config_groups.group_0.weights.strategy: 'group' is not supported (...)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NoReturn

import torch

QUANT_BLOCK = 128  # the only block size supported: rows and columns of one scale tile
ONLINE_METHODS = ("fp8",)  # values of the `quantization` load option
_CT_FORMATS = {"int-quantized": "int", "float-quantized": "float"}  # format -> weights.type
_CT_WEIGHT_STRATEGIES = ("channel", "tensor")
_ACT_QUANT = {"int": "int8_token", "float": "fp8_token"}  # dynamic per-token activations of each type


@dataclass(frozen=True)
class LinearQuant:
    """How every quantised linear is stored (engine.models.quant_linear) and read from the checkpoint."""

    weight_dtype: torch.dtype  # torch.float8_e4m3fn or torch.int8
    checkpoint_scale: str  # granularity on disk: "channel" [N, 1], "tensor" [1], "block" [N/128, K/128]
    act_quant: str | None  # None (weight-only), "int8_token", "fp8_token" or "fp8_group128"
    scale_name: str = "weight_scale"  # the scale's tensor name on disk: weight_scale or weight_scale_inv
    online: bool = False  # the checkpoint holds float weights, quantised as they are loaded

    def __post_init__(self) -> None:
        if self.weight_dtype not in (torch.float8_e4m3fn, torch.int8):
            raise ValueError(f"weight_dtype: {self.weight_dtype} is not float8_e4m3fn or int8")
        if self.checkpoint_scale not in ("channel", "tensor", "block"):
            raise ValueError(f"checkpoint_scale: {self.checkpoint_scale!r} is not channel, tensor or block")
        # Block scales go with per-(token, 128 columns) activations, as block-FP8 checkpoints are made.
        block = self.checkpoint_scale == "block"
        allowed = (None, "fp8_group128") if block else (None, "int8_token", "fp8_token")
        if self.act_quant not in allowed:
            raise ValueError(
                f"act_quant: {self.act_quant!r} is not supported with {self.checkpoint_scale} scales "
                f"(supported: {allowed})"
            )

    @property
    def scheme(self) -> str:
        """Scales in memory: "block" as on disk; "channel" ([N]) for channel and tensor checkpoints."""
        return "block" if self.checkpoint_scale == "block" else "channel"

    @property
    def block_size(self) -> int | None:
        return QUANT_BLOCK if self.scheme == "block" else None


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8", "compressed-tensors" or "online-fp8"
    linear: LinearQuant
    ignore: tuple[str, ...] = ()  # modules left in the model dtype
    # How `ignore` entries match a module name: "substring" (transformers' fp8 modules_to_not_convert)
    # or "name" (compressed-tensors: the exact name, a wrapper-prefixed name, or "re:<regex>").
    match: str = "name"
    source: str = "config.json"  # where it came from, for errors

    def __post_init__(self) -> None:
        if self.match not in ("substring", "name"):
            raise ValueError(f"match: {self.match!r} is not substring or name")

    def quantizes(self, module: str) -> bool:
        """Whether the decoder linear `module` (HF name, e.g. model.layers.0.mlp.down_proj) is quantised."""
        return not any(self._matches(entry, module) for entry in self.ignore)

    def _matches(self, entry: str, module: str) -> bool:
        if self.match == "substring":
            return entry in module
        if entry.startswith("re:"):
            return re.match(entry[3:], module) is not None
        return entry == module or entry.endswith("." + module)  # e.g. language_model.model.layers.0...


ONLINE_FP8 = QuantConfig(
    "online-fp8",
    LinearQuant(torch.float8_e4m3fn, "channel", "fp8_token", online=True),
    source="quantization='fp8'",
)


def resolve_quant_config(
    raw: dict, quantization: str | None, tied_embeddings: bool, source: str = "config.json"
) -> QuantConfig | None:
    """The QuantConfig for a checkpoint whose config.json is `raw`, given the `quantization` load
    option; None for a plain checkpoint loaded as it is."""
    qc = raw.get("quantization_config")
    if quantization is not None:
        if quantization not in ONLINE_METHODS:
            raise ValueError(f"quantization: {quantization!r} is not supported (supported: None, 'fp8')")
        if qc is not None:
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise ValueError(
                f"quantization: {quantization!r} quantises a float checkpoint at load, but {source} is "
                f"already quantised (quantization_config.quant_method {method!r}); drop the option"
            )
        return ONLINE_FP8
    if qc is None:
        return None
    quant = parse_quantization_config(qc, source)
    if not tied_embeddings and quant.method == "compressed-tensors" and quant.quantizes("lm_head"):
        raise ValueError(
            f"{source}: quantization_config.ignore does not list lm_head, so the checkpoint quantises "
            "it; a quantised lm_head is not supported (only decoder linears may be quantised)"
        )
    return quant


def parse_quantization_config(qc: dict, source: str = "config.json") -> QuantConfig:
    """Validate config.json's quantization_config; errors name the field and what is supported."""
    if not isinstance(qc, dict):
        raise ValueError(f"{source}: quantization_config: expected an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_fp8(qc, _Fields(source))
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc, _Fields(source))
    raise ValueError(
        f"{source}: quantization_config.quant_method: {method!r} is not supported "
        "(supported: fp8, compressed-tensors)"
    )


class _Fields:
    """Raises errors that name a field of quantization_config."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, message: str) -> NoReturn:
        raise ValueError(f"{self.source}: quantization_config.{path}: {message}")

    def expect(self, section: dict, key: str, path: str, allowed: tuple, default=None) -> object:
        value = section.get(key, default)
        if value not in allowed:
            shown = ", ".join(repr(a) if a is None or isinstance(a, bool) else str(a) for a in allowed)
            self.fail(f"{path}{key}", f"{value!r} is not supported (supported: {shown})")
        return value

    def names(self, section: dict, key: str) -> tuple[str, ...]:
        value = section.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.fail(key, f"expected a list of module names, got {value!r}")
        return tuple(value)


def _parse_fp8(qc: dict, f: _Fields) -> QuantConfig:
    f.expect(qc, "fmt", "", ("e4m3",), default="e4m3")
    f.expect(qc, "activation_scheme", "", ("dynamic",), default="dynamic")
    block = qc.get("weight_block_size")
    if block is None:
        f.fail("weight_block_size", "missing: only block-wise FP8 checkpoints ([128, 128]) are supported")
    if not isinstance(block, list) or block != [QUANT_BLOCK, QUANT_BLOCK]:
        f.fail("weight_block_size", f"{block!r} is not supported (supported: [128, 128])")
    linear = LinearQuant(torch.float8_e4m3fn, "block", "fp8_group128", scale_name="weight_scale_inv")
    ignore = f.names(qc, "modules_to_not_convert") + f.names(qc, "ignored_layers")
    return QuantConfig("fp8", linear, ignore, match="substring", source=f.source)


def _parse_compressed_tensors(qc: dict, f: _Fields) -> QuantConfig:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        f.fail("config_groups", "expected exactly one group (mixed schemes are not supported)")
    (name, group), = groups.items()  # fmt: skip
    path = f"config_groups.{name}."
    if not isinstance(group, dict):
        f.fail(path[:-1], "expected an object")
    fmt = qc.get("format") or group.get("format")
    if fmt not in _CT_FORMATS:
        f.fail("format", f"{fmt!r} is not supported (supported: {', '.join(_CT_FORMATS)})")
    kind = _CT_FORMATS[fmt]
    if group.get("targets") != ["Linear"]:
        f.fail(path + "targets", f"{group.get('targets')!r} is not supported (supported: ['Linear'])")
    strategy = _check_weights(group.get("weights"), path + "weights.", kind, f)
    act_quant = _check_activations(group.get("input_activations"), path + "input_activations.", kind, f)
    f.expect(group, "output_activations", path, (None,))
    f.expect(qc, "kv_cache_scheme", "", (None,))
    f.expect(qc, "quantization_status", "", ("compressed",), default="compressed")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        f.fail("sparsity_config.format", f"{sparsity.get('format')!r} is not supported (supported: dense)")
    dtype = torch.int8 if kind == "int" else torch.float8_e4m3fn
    linear = LinearQuant(dtype, strategy, act_quant)
    return QuantConfig("compressed-tensors", linear, f.names(qc, "ignore"), match="name", source=f.source)


def _check_common(args: dict, path: str, kind: str, f: _Fields) -> None:
    f.expect(args, "num_bits", path, (8,))
    f.expect(args, "type", path, (kind,))
    f.expect(args, "symmetric", path, (True,), default=True)
    f.expect(args, "group_size", path, (None,))
    f.expect(args, "block_structure", path, (None,))


def _check_weights(args: dict | None, path: str, kind: str, f: _Fields) -> str:
    if not isinstance(args, dict):
        f.fail(path[:-1], "missing: a quantised checkpoint must describe its weights")
    _check_common(args, path, kind, f)
    f.expect(args, "actorder", path, (None, False))
    f.expect(args, "dynamic", path, (False,), default=False)
    return f.expect(args, "strategy", path, _CT_WEIGHT_STRATEGIES)


def _check_activations(args: dict | None, path: str, kind: str, f: _Fields) -> str | None:
    if args is None:
        return None  # weight-only: activations stay in the model dtype
    if not isinstance(args, dict):
        f.fail(path[:-1], "expected an object or null")
    _check_common(args, path, kind, f)
    if args.get("dynamic") is not True:
        f.fail(path + "dynamic", f"{args.get('dynamic')!r}: static activation scales (input_scale) are "
               "not supported (supported: true, scales computed per token at run time)")  # fmt: skip
    f.expect(args, "strategy", path, ("token",))
    return _ACT_QUANT[kind]
