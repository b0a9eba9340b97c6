"""Reading and checking a PEFT LoRA adapter directory against the base model, without loading weights.

A directory as `peft` saves it: adapter_config.json (r, lora_alpha, use_rslora, target_modules, ...) and
adapter_model.safetensors with tensors such as
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, in_features]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [out_features, r]
Only the safetensors header (a JSON table of names, dtypes and shapes) is read, so this check is cheap
and runs in the caller's process before a request is accepted; torch is not imported. Every problem
raises LoRAError naming the file, the tensor and the fix.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import LoRAError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTN_MODULES + MLP_MODULES
FLOAT_DTYPES = ("F32", "F16", "BF16")
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_MAX_HEADER = 100 * 2**20
_NOT_TEXT = ("vision", "multi_modal_projector")  # modules of a multimodal wrapper outside its language model


@dataclass(frozen=True)
class ModuleShapes:
    """(in_features, out_features) of each adaptable projection of the base model, and its layer count."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @staticmethod
    def of(cfg) -> ModuleShapes:
        """From an engine.models.config.ModelConfig (the whole model's, not a rank's share)."""
        q, kv, h, i = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.hidden_size,
            cfg.intermediate_size,
        )
        shapes = dict(q_proj=(h, q), k_proj=(h, kv), v_proj=(h, kv), o_proj=(q, h),
                      gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))  # fmt: skip
        return ModuleShapes(cfg.num_layers, shapes)


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: per (layer, module), its A and B tensor names and its rank."""

    path: Path
    rank: int  # adapter_config.json's r
    alpha: float
    use_rslora: bool
    modules: dict[tuple[int, str], tuple[str, str, int]] = field(default_factory=dict)

    def scaling(self, rank: int) -> float:
        """PEFT's scale of B @ A for a module of `rank`: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (rank**0.5 if self.use_rslora else rank)

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS_FILE


def adapter_error(where: Path | str, message: str) -> LoRAError:
    return LoRAError(f"LoRA adapter {where}: {message}", field="lora_path")


def read_config(path: Path, max_lora_rank: int) -> dict:
    """adapter_config.json, checked for what this engine supports."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise adapter_error(path, f"no {CONFIG_FILE}; give the directory peft's save_pretrained wrote")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise adapter_error(file, f"is not valid JSON ({exc}); save the adapter again with peft") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise adapter_error(
            file, f"peft_type {cfg.get('peft_type')!r} is not supported; only LORA adapters are"
        )
    _reject_unsupported(file, cfg)
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise adapter_error(file, f"r={r!r} must be a whole number >= 1")
    if r > max_lora_rank:
        raise adapter_error(
            file, f"rank r={r} is above max_lora_rank={max_lora_rank}; raise max_lora_rank to >= {r}"
        )
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = [t for t in targets if t.split(".")[-1] not in SUPPORTED_MODULES]
        if bad:
            raise adapter_error(
                file, f"unsupported target module(s) {bad}; supported: {list(SUPPORTED_MODULES)}"
            )
    return cfg


_UNSUPPORTED = (
    ("use_dora", "DoRA adapters are not supported; train without use_dora"),
    ("modules_to_save", "full modules saved beside the adapter are not supported"),
    ("alpha_pattern", "per-module lora_alpha is not supported; use one lora_alpha"),
)


def _reject_unsupported(file: Path, cfg: dict) -> None:
    for key, why in _UNSUPPORTED:
        if cfg.get(key):
            raise adapter_error(file, f"{key}={cfg.get(key)!r}: {why}")
    if cfg.get("bias", "none") != "none":
        raise adapter_error(
            file, f"bias={cfg.get('bias')!r}: LoRA biases are not supported; train with bias='none'"
        )


def read_header(file: Path) -> dict[str, dict]:
    """The safetensors header: tensor name -> {"dtype", "shape", ...} (no tensor data is read)."""
    if not file.is_file():
        hint = "save it with safe_serialization=True (peft's default)"
        raise adapter_error(file.parent, f"no {WEIGHTS_FILE}; {hint}")
    try:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise adapter_error(
            file, f"is not a safetensors file ({exc}); save the adapter again with peft"
        ) from None
    header.pop("__metadata__", None)
    return header


def check_adapter(path: str | Path, shapes: ModuleShapes, max_lora_rank: int) -> AdapterSpec:
    """Check the adapter at `path` against the base model's projection shapes and the rank limit."""
    path = Path(path)
    if not path.is_dir():
        raise adapter_error(path, "is not a directory; give the directory peft's save_pretrained wrote")
    cfg = read_config(path, max_lora_rank)
    spec = AdapterSpec(path, cfg["r"], float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora")))
    pairs: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    file = spec.weights_file
    for name, info in read_header(file).items():
        layer, module, side = _parse_name(file, name, shapes)
        if info.get("dtype") not in FLOAT_DTYPES:
            raise adapter_error(
                file, f"tensor {name} has dtype {info.get('dtype')}; use one of {FLOAT_DTYPES}"
            )
        pairs.setdefault((layer, module), {})[side] = (name, list(info.get("shape", [])))
    for (layer, module), sides in sorted(pairs.items()):
        spec.modules[(layer, module)] = _check_pair(file, sides, shapes.shapes[module], cfg, max_lora_rank)
    if not spec.modules:
        raise adapter_error(
            file, "holds no LoRA tensors (names like ...layers.0.self_attn.q_proj.lora_A.weight)"
        )
    return spec


def _parse_name(file: Path, name: str, shapes: ModuleShapes) -> tuple[int, str, str]:
    m = _TENSOR.search(name)
    if m is None or any(part in name for part in _NOT_TEXT):  # a multimodal checkpoint's vision side
        what = (
            "a LoRA tensor of an unsupported target module" if ".lora_" in name else "not a LoRA A/B weight"
        )
        raise adapter_error(file, f"tensor {name} is {what}; supported modules: {list(SUPPORTED_MODULES)}")
    layer, block, module, side = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    allowed = ATTN_MODULES if block == "self_attn" else MLP_MODULES
    if module not in allowed:
        raise adapter_error(
            file, f"tensor {name}: unsupported target module {module!r}; supported: {list(SUPPORTED_MODULES)}"
        )
    if layer >= shapes.num_layers:
        fix = "use an adapter trained on this base model"
        raise adapter_error(
            file, f"tensor {name}: layer {layer}, but the base model has {shapes.num_layers} layers; {fix}"
        )
    return layer, module, side


def _check_pair(
    file: Path, sides: dict, shape: tuple[int, int], cfg: dict, max_rank: int
) -> tuple[str, str, int]:
    """(A name, B name, rank) of one module, after checking both shapes against the base projection."""
    in_f, out_f = shape
    if set(sides) != {"A", "B"}:
        name = next(iter(sides.values()))[0]
        missing = "lora_B" if "A" in sides else "lora_A"
        raise adapter_error(file, f"tensor {name} has no {missing} partner; the file is incomplete")
    (a_name, a_shape), (b_name, b_shape) = sides["A"], sides["B"]
    r = a_shape[0] if len(a_shape) == 2 else -1
    fix = "use an adapter trained on this base model"
    if len(a_shape) != 2 or a_shape[1] != in_f:
        raise adapter_error(
            file, f"tensor {a_name} has shape {a_shape}, expected [r, {in_f}] for this base model; {fix}"
        )
    if b_shape != [out_f, r]:
        raise adapter_error(
            file, f"tensor {b_name} has shape {b_shape}, expected [{out_f}, {r}] for this base model; {fix}"
        )
    if r > max_rank:
        raise adapter_error(
            file, f"tensor {a_name} has rank {r}, above max_lora_rank={max_rank}; raise max_lora_rank"
        )
    if not cfg.get("rank_pattern") and r != cfg["r"]:
        raise adapter_error(
            file, f"tensor {a_name} has rank {r} but {CONFIG_FILE} says r={cfg['r']}; save the adapter again"
        )
    return a_name, b_name, r
