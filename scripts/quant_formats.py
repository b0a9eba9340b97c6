"""The quantised checkpoint formats `scripts.make_model --quant` writes, as the Hugging Face hub has them.

Only the decoder linears (q/k/v/o_proj, gate/up/down_proj) are quantised; embeddings, norms and lm_head
stay in the checkpoint dtype, as on the hub.

* fp8-block: quant_method "fp8" (Qwen/Qwen3-8B-FP8, DeepSeek-V3): `weight` float8_e4m3fn [N, K] and
  `weight_scale_inv` float32 [ceil(N/128), ceil(K/128)], scale = amax|tile| / 448 per 128x128 tile;
  activations dynamic (per token and 128 columns).
* int8: compressed-tensors "int-quantized" W8A8 (RedHatAI/*-quantized.w8a8): `weight` int8 and
  `weight_scale` float32 [N, 1], scale = amax|row| / 127, weight = round(W / scale); activations int8,
  dynamic per token.
* fp8-channel: compressed-tensors "float-quantized" (RedHatAI/*-FP8-dynamic): `weight` float8_e4m3fn
  and `weight_scale` float32 [N, 1], scale = amax|row| / 448; activations fp8, dynamic per token.
* fp8-tensor: compressed-tensors "float-quantized", one `weight_scale` float32 [1] per tensor, and no
  input_activations: weight-only (activations stay in the model dtype).

`dequantize` gives the float32 weights these tensors stand for (qweight * scale in float32): the
"dequantised twin" checkpoint holds exactly those, so a quantised model can be compared with it.
This module is independent of the engine's loader on purpose: the tests check one against the other.
"""

from __future__ import annotations

import math
import re

import torch

FORMATS = ("fp8-block", "int8", "fp8-channel", "fp8-tensor")
BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"quant format {fmt!r}: use one of {', '.join(FORMATS)}")


def is_quantized(name: str) -> bool:
    """Whether tensor `name` (HF naming) is stored quantised: the decoder projections' weights."""
    return _LINEAR.fullmatch(name) is not None


def scale_name(fmt: str, weight_name: str) -> str:
    leaf = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    return weight_name.removesuffix("weight") + leaf


def _per_row(w: torch.Tensor, qmax: float) -> torch.Tensor:
    amax = w.abs().amax(dim=1, keepdim=True)
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))  # an all-zero row: scale 1


def _tile_scales(w: torch.Tensor) -> torch.Tensor:
    """amax|tile| / 448 per 128x128 tile (edge tiles cover what is left): [ceil(N/128), ceil(K/128)]."""
    n, k = w.shape
    nb, kb = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    padded = torch.nn.functional.pad(w.abs(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    amax = padded.view(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3))
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def _expand_tiles(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]


def quantize(fmt: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale) as stored for weight w [N, K] (any float dtype; quantised from its fp32 value)."""
    w = w.float()
    if fmt == "fp8-block":
        scale = _tile_scales(w)
        return _to_fp8(w / _expand_tiles(scale, *w.shape)), scale
    if fmt == "int8":
        scale = _per_row(w, INT8_MAX)
        return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale
    if fmt == "fp8-channel":
        scale = _per_row(w, FP8_MAX)
        return _to_fp8(w / scale), scale
    check_format(fmt)
    amax = w.abs().amax().reshape(1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return _to_fp8(w / scale), scale


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)  # clamped: w / scale can round a hair past 448


def dequantize(fmt: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight that (weight, scale) stand for: weight.float() * scale, in float32."""
    w = weight.float()
    if fmt == "fp8-block":
        return w * _expand_tiles(scale.float(), *w.shape)
    return w * scale.float().reshape(-1, 1)  # [N, 1] per row, or [1] for the whole tensor


def stored_bytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of the weight and scale that a quantised [N, K] weight is stored as."""
    n, k = shape
    scales = {"fp8-block": math.ceil(n / BLOCK) * math.ceil(k / BLOCK), "fp8-tensor": 1}.get(fmt, n)
    return n * k + 4 * scales


def _ct_args(kind: str, strategy: str, dynamic: bool, observer: str | None) -> dict:
    """One compressed-tensors QuantizationArgs object, every field as llm-compressor saves it."""
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": dynamic,
        "group_size": None,
        "num_bits": 8,
        "observer": observer,
        "observer_kwargs": {},
        "strategy": strategy,
        "symmetric": True,
        "type": kind,
    }


def quantization_config(fmt: str) -> dict:
    """config.json's quantization_config for `fmt`."""
    check_format(fmt)
    if fmt == "fp8-block":
        return {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK],
        }
    kind = "int" if fmt == "int8" else "float"
    strategy = "tensor" if fmt == "fp8-tensor" else "channel"
    acts = None if fmt == "fp8-tensor" else _ct_args(kind, "token", True, None)
    group = {
        "input_activations": acts,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": _ct_args(kind, strategy, False, "minmax"),
    }
    return {
        "config_groups": {"group_0": group},
        "format": "int-quantized" if kind == "int" else "float-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
