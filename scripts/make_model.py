"""Write a complete Hugging Face-format checkpoint with deterministic random weights.

    python -m scripts.make_model NAME OUT_DIR [--seed S] [--dtype bf16|fp32] [--device cpu|cuda]
                                 [--quant fp8-block|int8|fp8-channel|fp8-tensor [--dequantized-twin]]
    python -m scripts.make_model --lora-for MODEL_DIR --out OUT_DIR [--rank R] [--targets all] ...
                                 (a random PEFT LoRA adapter: scripts/make_lora.py)
    python -m scripts.make_model --mtp NAME|MODEL_DIR OUT_DIR [--num-mask-tokens 8] [--rank 16] ...
                                 (a random gated-LoRA MTP directory: scripts/make_mtp.py)

NAME is one of scripts/model_shapes.py's SPECS: tiny (the default model of `make serve`), tiny-qwen3,
tiny-gemma3, tiny-quant, or a real shape (llama-3.2-1b, llama-3.1-8b, qwen3-0.6b, gemma-3-1b). The
directory gets config.json, generation_config.json, tokenizer.json, tokenizer_config.json (with our
family chat template) and model.safetensors, or model-0000K-of-0000N.safetensors shards plus
model.safetensors.index.json when the weights exceed one shard (2 GiB by default).

Each tensor is drawn from its own generator, seeded from (seed, tensor name): the same seed gives the
same bytes on the same device type (CPU and CUDA generators differ), and a shard is generated, written
and freed before the next, so an 8B model never sits in memory whole.

--quant FORMAT writes the same weights quantised as the hub stores them (scripts/quant_formats.py:
quantised decoder linears with their scales, a quantization_config in config.json); --dtype is then
the dtype of the weights before quantisation and of the tensors left unquantised. Adding
--dequantized-twin writes instead the float32 checkpoint holding exactly the values that quantised
one stands for (weight * scale, no quantization_config): the reference a quantised model is compared
with, since both come from the same seed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from scripts import quant_formats
from scripts.make_tokenizer import write_tokenizer
from scripts.model_shapes import ModelSpec, get_spec, hf_config, is_norm, param_count, tensor_shapes

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_SHARD_BYTES = 2 * 2**30
TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "engine" / "templates"
NORM_STD = 0.1  # norm weights: 1 + N(0, 0.1) (Gemma: N(0, 0.1), since it scales by 1 + w)
# a flag that makes this command another script's (scripts/<module>.py's main(argv), imported on use):
# a random PEFT adapter for a checkpoint, a random gated-LoRA MTP directory for a shape or checkpoint
SUBCOMMANDS = {"--lora-for": "make_lora", "--mtp": "make_mtp"}


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_tensor(
    spec: ModelSpec, name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: str
) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name))
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        x.mul_(spec.embed_std)
    elif not is_norm(name):
        x.mul_(spec.init_std)
    elif spec.family == "gemma3":
        x.mul_(NORM_STD)
    else:
        x.mul_(NORM_STD).add_(1.0)
    return x.to(dtype)


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most max_bytes (a bigger tensor gets its own);
    sizes: the bytes each generated tensor is written as."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


@dataclass(frozen=True)
class Storage:
    """How generated weights are written: plain in `dtype`, quantised in format `quant`, or as the
    float32 dequantised twin of format `quant`."""

    dtype: torch.dtype
    quant: str | None = None
    twin: bool = False

    def __post_init__(self) -> None:
        if self.quant is not None:
            quant_formats.check_format(self.quant)
        elif self.twin:
            raise ValueError("dequantized twin: give the quantisation format (--quant) it is the twin of")

    def nbytes(self, name: str, shape: tuple[int, ...]) -> int:
        numel = torch.Size(shape).numel()
        if self.twin:
            return 4 * numel
        if self.quant and quant_formats.is_quantized(name):
            return quant_formats.stored_bytes(self.quant, shape)
        return torch.empty((), dtype=self.dtype).element_size() * numel

    def tensors(self, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors generated weight `name` is written as (on the CPU)."""
        if self.quant is None or not quant_formats.is_quantized(name):
            return {name: (w.float() if self.twin else w).cpu()}
        qweight, scale = quant_formats.quantize(self.quant, w)
        if self.twin:
            return {name: quant_formats.dequantize(self.quant, qweight, scale).cpu()}
        return {name: qweight.cpu(), quant_formats.scale_name(self.quant, name): scale.cpu()}


def write_weights(
    spec: ModelSpec, out_dir: Path, seed: int, storage: Storage, device: str, max_bytes: int
) -> None:
    shapes = tensor_shapes(spec)
    sizes = {name: storage.nbytes(name, shape) for name, shape in shapes.items()}
    shards = plan_shards(sizes, max_bytes)
    total = sum(sizes.values())
    n = len(shards)
    files = (
        ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )
    weight_map: dict[str, str] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=spec.name, disable=total < 2**26)
    for names, filename in zip(shards, files):
        tensors = {}
        for name in names:
            w = init_tensor(spec, name, shapes[name], seed, storage.dtype, device)
            tensors.update(storage.tensors(name, w))
            bar.update(sizes[name])
        save_file(tensors, str(out_dir / filename), metadata={"format": "pt"})
        (out_dir / filename).chmod(0o644)  # safetensors creates files private to the owner
        weight_map.update(dict.fromkeys(tensors, filename))
        del tensors  # free this shard before generating the next
    bar.close()
    if n > 1:
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
    name: str | ModelSpec,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str | None = None,
    device: str = "cpu",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    quant: str | None = None,
    dequantized_twin: bool = False,
) -> Path:
    """Write checkpoint NAME (or a spec of its own) into out_dir (created if needed; old weights there
    are replaced). quant: one of scripts.quant_formats.FORMATS; dequantized_twin: its float32 twin."""
    spec = name if isinstance(name, ModelSpec) else get_spec(name)
    dtype = dtype or spec.dtype
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {sorted(TORCH_DTYPES)}")
    storage = Storage(TORCH_DTYPES[dtype], quant, dequantized_twin)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").unlink(missing_ok=True)  # written last: its presence marks a complete dir
    _clear_old_weights(out_dir)
    template = (TEMPLATE_DIR / f"{spec.family}.jinja").read_text()
    ids = write_tokenizer(spec.family, spec.vocab_size, out_dir, template, spec.max_position_embeddings)
    write_weights(spec, out_dir, seed, storage, device, max_shard_bytes)
    version = _transformers_version()
    gen_config = {"bos_token_id": ids["bos_id"], "eos_token_id": ids["eos_ids"]}
    if ids["pad_id"] is not None:
        gen_config["pad_token_id"] = ids["pad_id"]
    config = hf_config(
        spec, "fp32" if dequantized_twin else dtype, ids["bos_id"], ids["eos_ids"], ids["pad_id"]
    )
    if quant and not dequantized_twin:
        config["quantization_config"] = quant_formats.quantization_config(quant)
    if version:
        gen_config["transformers_version"] = config["transformers_version"] = version
    _write_json(out_dir / "generation_config.json", gen_config)
    _write_json(out_dir / "config.json", config)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    for flag, module in SUBCOMMANDS.items():
        if flag in argv:
            return importlib.import_module(f"scripts.{module}").main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="checkpoint shape: tiny, tiny-qwen3, tiny-gemma3, llama-3.2-1b, ...")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", choices=sorted(TORCH_DTYPES), default=None, help="default: the shape's own"
    )
    parser.add_argument("--device", default="cpu", help="where weights are generated: cpu or cuda")
    parser.add_argument("--max-shard-gib", type=float, default=DEFAULT_SHARD_BYTES / 2**30)
    parser.add_argument(
        "--quant", choices=quant_formats.FORMATS, default=None, help="write a quantised checkpoint"
    )
    parser.add_argument(
        "--dequantized-twin",
        action="store_true",
        help="with --quant: write the float32 checkpoint of the dequantised weights instead",
    )
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here; use --device cpu")
    if args.dequantized_twin and not args.quant:
        parser.error("--dequantized-twin needs --quant FORMAT (the format it is the twin of)")
    out = make_model(
        args.name,
        args.out_dir,
        args.seed,
        args.dtype,
        args.device,
        int(args.max_shard_gib * 2**30),
        args.quant,
        args.dequantized_twin,
    )
    spec = get_spec(args.name)
    kind = f", {args.quant}{' dequantized twin' if args.dequantized_twin else ''}" if args.quant else ""
    print(f"wrote {args.name} ({spec.family}, {param_count(spec):,} parameters{kind}) to {out}")


if __name__ == "__main__":
    main()
