"""Load a HF-format checkpoint directory (config.json + safetensors) into one of our models.

The model is built directly on the target device in the target dtype with uninitialised parameters
(engine.models.layers allocates with torch.empty), then every checkpoint tensor is copied into its
parameter one at a time from the memory-mapped file, so peak memory is about one copy of the weights.
Every parameter (and every shard of a merged q|k|v or gate|up parameter) must be written exactly by a
checkpoint tensor of the right shape; anything else raises an error naming the file and the tensor.

Quantised checkpoints (config.json's quantization_config, engine/models/quant_config.py) load unchanged: the
model gets quantised linears (engine/models/quant_linear.py), which engine/models/quant_loader.py fills
without converting their dtype; `quantization="fp8"` quantises a float checkpoint tensor by tensor.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from engine.device.placement import resolve_device_dtype
from engine.models import quant_loader
from engine.models.config import ModelConfig
from engine.models.layers import MergedLinear
from engine.models.parallel import Shard, build_parallel, check_tp, loaded_rows, read_slice
from engine.models.quant_config import resolve_quant_config
from engine.models.quant_linear import QuantLinear, QuantLinearFactory, QuantMergedLinear
from engine.models.quant_parallel import QuantParallelLinearFactory
from engine.models.registry import config_from_dir, get_model_class

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# One destination: (parameter name, shard index or None for a whole parameter).
Target = tuple[str, int | None]


def load_model(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
    quantization: str | None = None,
    shard: Shard | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model for `<path>/config.json` and fill it from the safetensors files next to it.

    dtype: a torch dtype or its name ("bfloat16"); None / "auto" means bf16 on CUDA and fp32 on CPU
    (the checkpoint's own dtype is converted on copy; quantised weights keep theirs). device: "cpu",
    "cuda", "cuda:N" or "auto". quantization: None, or "fp8" to quantise a float checkpoint's decoder
    linears at load (per-channel float8 weights, dynamic per-token float8 activations). shard: this
    process's rank of a tensor-parallel group (engine/models/parallel.py): it builds and reads only its
    share; the config returned is the whole model's either way.
    """
    path = Path(path)
    device, dtype = resolve_device_dtype(device, dtype)
    cfg = config_from_dir(path)
    quant = resolve_quant_config(cfg.raw, quantization, cfg.tie_word_embeddings, str(path / "config.json"))
    cls = get_model_class(cfg.model_type)
    files = checkpoint_files(path)
    if shard is not None:
        check_tp(cfg, shard.size, str(path), quantization)
    with torch.device(device), _default_dtype(dtype):
        if shard is not None and shard.size > 1:
            linears = functools.partial(QuantParallelLinearFactory, quant) if quant else None
            model = build_parallel(cls, cfg, shard, linears)
        else:
            model = cls(cfg, QuantLinearFactory(quant) if quant else None)
    model.eval().requires_grad_(False)
    _load_weights(model, cls, cfg, files, progress)
    return model, cfg


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: every shard named by the index, or the single file."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{index}: not a valid safetensors index (need a 'weight_map' object): {e}"
            ) from e
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(
                    f"{f}: shard listed in {index.name} is missing; re-download the checkpoint"
                )
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    hint = (
        " (only PyTorch .bin weights found: convert them to safetensors)" if any(path.glob("*.bin")) else ""
    )
    raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} found{hint}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _expected_targets(model: nn.Module) -> dict[Target, nn.Parameter]:
    """Every destination the checkpoint must fill: whole parameters, or each shard of a merged one."""
    targets: dict[Target, nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            if isinstance(module, (MergedLinear, QuantMergedLinear)):
                targets.update({(name, i): param for i in range(len(module.output_sizes))})
            else:
                targets[(name, None)] = param
    return targets


def _route(cls, cfg: ModelConfig, name: str) -> Target | None:
    """Checkpoint tensor name -> destination, or None when the tensor is a known-harmless extra."""
    mapped = cls.checkpoint_name(cfg, name)
    if mapped is None:
        return None
    parts = mapped.split(".")
    # parts[-2] is the owning module's name, e.g. model.layers.3.self_attn.k_proj.weight -> k_proj
    if len(parts) >= 2 and parts[-2] in cls.packed_modules:
        merged, shard = cls.packed_modules[parts[-2]]
        return ".".join([*parts[:-2], merged, parts[-1]]), shard
    return mapped, None


def _load_weights(model: nn.Module, cls, cfg: ModelConfig, files: list[Path], progress: bool) -> None:
    targets = _expected_targets(model)
    modules = dict(model.named_modules())
    loaded: set[Target] = set()
    unexpected: list[str] = []
    with tqdm(desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for file in files:
            with _open_safetensors(file) as reader:
                names = list(reader.keys())
                bar.total = (bar.total or 0) + len(names)
                for name in names:
                    bar.update(1)
                    target = _route(cls, cfg, name)
                    if target is None:
                        continue
                    target = _parameter_target(target, modules, f"{file}: tensor {name}")
                    if target not in targets:
                        unexpected.append(f"{name} ({file.name})")
                        continue
                    loaded.update(_copy_tensor(file, name, reader, targets[target], modules, target))
    _check_complete(targets, loaded, unexpected, cls, files, modules)


def _parameter_target(target: Target, modules: dict, where: str) -> Target:
    """A checkpoint leaf on a quantised linear -> its parameter (weight -> qweight, ...). A quantisation
    tensor (a scale) for a module kept in the model dtype is an error: never load it as if plain."""
    name, shard = target
    module_path, _, leaf = name.rpartition(".")
    module = modules.get(module_path)
    if isinstance(module, QuantLinear):
        return f"{module_path}.{quant_loader.parameter_leaf(module, leaf, where)}", shard
    if leaf in quant_loader.QUANT_LEAVES and module is not None:
        raise ValueError(
            f"{where}: the checkpoint quantises {module_path}, which minserve keeps in the model dtype "
            "(config.json quantises no such module, or it is an embedding / lm_head: not supported)"
        )
    return target


@contextlib.contextmanager
def _open_safetensors(file: Path):
    try:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            yield reader
    except SafetensorError as e:
        raise ValueError(f"{file}: corrupt or unreadable safetensors file ({e}); re-download it") from e


def _copy_tensor(
    file: Path, name: str, reader, param: nn.Parameter, modules: dict, target: Target
) -> list[Target]:
    """Copy one checkpoint tensor into its parameter (or its rows of a merged parameter); returns the
    destinations it filled (online quantisation fills a weight and its scale at once)."""
    param_name, shard = target
    module_path, leaf = param_name.rsplit(".", 1)
    module = modules[module_path]
    try:
        tensor = read_slice(reader, name, module, leaf, shard)  # a tensor-parallel rank's part only
    except SafetensorError as e:
        raise ValueError(f"{file}: cannot read tensor {name} ({e}); re-download the file") from e
    if isinstance(module, QuantLinear):
        filled = quant_loader.copy_into(module, leaf, shard, tensor, f"{file}: tensor {name}")
        return [(f"{module_path}.{p}", shard) for p in filled]
    if tensor.element_size() == 1 or not tensor.is_floating_point():  # int8 / fp8 where a float belongs
        raise ValueError(
            f"{file}: tensor {name} is {tensor.dtype}, but config.json has no quantization_config "
            "that quantises it; the config and the weights do not match"
        )
    dest = loaded_rows(module, param.data)
    if shard is not None:
        start, rows = module.shard_rows(shard)
        dest = dest.narrow(0, start, rows)
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ValueError(
            f"{file}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)} "
            f"from config.json; the config and the weights do not match"
        )
    dest.copy_(tensor)  # converts dtype and moves to the parameter's device
    return [target]


def _check_complete(
    targets: dict, loaded: set, unexpected: list[str], cls, files: list[Path], modules: dict
) -> None:
    where = files[0].parent
    if unexpected:
        raise ValueError(f"{where}: unexpected tensors not used by {cls.__name__}: {_few(unexpected)}")
    missing = [_hf_name(cls, t, modules) for t in targets if t not in loaded]
    if missing:
        names = ", ".join(f.name for f in files)
        raise ValueError(f"{where}: tensors missing from {names}: {_few(missing)}")


def _hf_name(cls, target: Target, modules: dict) -> str:
    """The checkpoint name a destination expects (merged shards back to their HF projection name, a
    quantised linear's parameters back to their checkpoint leaves)."""
    name, shard = target
    module_path, leaf = name.rsplit(".", 1)
    module = modules.get(module_path)
    if isinstance(module, QuantLinear):
        leaf = {"qweight": "weight", "scale": module.quant.scale_name}.get(leaf, leaf)
        name = f"{module_path}.{leaf}"
    if shard is None:
        return name
    parent, merged = module_path.rsplit(".", 1)
    hf = next(h for h, (m, s) in cls.packed_modules.items() if m == merged and s == shard)
    return f"{parent}.{hf}.{leaf}"


def _few(names: list[str], limit: int = 8) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
