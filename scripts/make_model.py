"""Write a complete Hugging Face-format checkpoint with deterministic random weights.

    python -m scripts.make_model NAME OUT_DIR [--seed S] [--dtype bf16|fp32] [--device cpu|cuda]

NAME is one of scripts/model_shapes.py's SPECS: tiny (the default model of `make serve`), tiny-qwen3,
tiny-gemma3, or a real shape (llama-3.2-1b, llama-3.1-8b, qwen3-0.6b, gemma-3-1b). The directory gets
config.json, generation_config.json, tokenizer.json, tokenizer_config.json (with our family chat
template) and model.safetensors, or model-0000K-of-0000N.safetensors shards plus
model.safetensors.index.json when the weights exceed one shard (2 GiB by default).

Each tensor is drawn from its own generator, seeded from (seed, tensor name): the same seed gives the
same bytes on the same device type (CPU and CUDA generators differ), and a shard is generated, written
and freed before the next, so an 8B model never sits in memory whole.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from scripts.make_tokenizer import write_tokenizer
from scripts.model_shapes import ModelSpec, get_spec, hf_config, is_norm, param_count, tensor_shapes

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_SHARD_BYTES = 2 * 2**30
TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "engine" / "templates"
INIT_STD = 0.02  # like initializer_range: linear and embedding weights
NORM_STD = 0.1  # norm weights: 1 + N(0, 0.1) (Gemma: N(0, 0.1), since it scales by 1 + w)


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_tensor(
    spec: ModelSpec, name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: str
) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name))
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if not is_norm(name):
        x.mul_(INIT_STD)
    elif spec.family == "gemma3":
        x.mul_(NORM_STD)
    else:
        x.mul_(NORM_STD).add_(1.0)
    return x.to(dtype)


def plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, max_bytes: int) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most max_bytes (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = itemsize * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(spec: ModelSpec, out_dir: Path, seed: int, dtype: str, device: str, max_bytes: int) -> None:
    shapes = tensor_shapes(spec)
    torch_dtype = TORCH_DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    shards = plan_shards(shapes, itemsize, max_bytes)
    total = sum(itemsize * torch.Size(s).numel() for s in shapes.values())
    n = len(shards)
    files = (
        ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=spec.name, disable=total < 2**26)
    for names, filename in zip(shards, files):
        tensors = {}
        for name in names:
            tensors[name] = init_tensor(spec, name, shapes[name], seed, torch_dtype, device).cpu()
            bar.update(tensors[name].numel() * itemsize)
        save_file(tensors, str(out_dir / filename), metadata={"format": "pt"})
        (out_dir / filename).chmod(0o644)  # safetensors creates files private to the owner
        del tensors  # free this shard before generating the next
    bar.close()
    if n > 1:
        weight_map = {name: files[k] for k, names in enumerate(shards) for name in names}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _transformers_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _clear_old_weights(out_dir: Path) -> None:
    for old in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)


def make_model(
    name: str,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str | None = None,
    device: str = "cpu",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write checkpoint NAME into out_dir (created if needed; old weights there are replaced)."""
    spec = get_spec(name)
    dtype = dtype or spec.dtype
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {sorted(TORCH_DTYPES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").unlink(missing_ok=True)  # written last: its presence marks a complete dir
    _clear_old_weights(out_dir)
    template = (TEMPLATE_DIR / f"{spec.family}.jinja").read_text()
    ids = write_tokenizer(spec.family, spec.vocab_size, out_dir, template, spec.max_position_embeddings)
    write_weights(spec, out_dir, seed, dtype, device, max_shard_bytes)
    version = _transformers_version()
    gen_config = {"bos_token_id": ids["bos_id"], "eos_token_id": ids["eos_ids"]}
    if ids["pad_id"] is not None:
        gen_config["pad_token_id"] = ids["pad_id"]
    config = hf_config(spec, dtype, ids["bos_id"], ids["eos_ids"], ids["pad_id"])
    if version:
        gen_config["transformers_version"] = config["transformers_version"] = version
    _write_json(out_dir / "generation_config.json", gen_config)
    _write_json(out_dir / "config.json", config)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="checkpoint shape: tiny, tiny-qwen3, tiny-gemma3, llama-3.2-1b, ...")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", choices=sorted(TORCH_DTYPES), default=None, help="default: the shape's own"
    )
    parser.add_argument("--device", default="cpu", help="where weights are generated: cpu or cuda")
    parser.add_argument("--max-shard-gib", type=float, default=DEFAULT_SHARD_BYTES / 2**30)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here; use --device cpu")
    out = make_model(
        args.name, args.out_dir, args.seed, args.dtype, args.device, int(args.max_shard_gib * 2**30)
    )
    spec = get_spec(args.name)
    print(f"wrote {args.name} ({spec.family}, {param_count(spec):,} parameters) to {out}")


if __name__ == "__main__":
    main()
