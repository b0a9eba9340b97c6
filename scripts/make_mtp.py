"""Write a random gated-LoRA MTP directory (speculative method gated_lora_mtp) for a target model.

    python -m scripts.make_model --mtp MODEL OUT_DIR [--num-mask-tokens 8] [--rank 16] [--alpha 32]
                                 [--seed S] [--dtype bf16|fp32] [--draft-vocab-size N]

MODEL is a shape of scripts/model_shapes.py (tiny, llama-3.2-1b, llama-3.1-8b, qwen3-0.6b, gemma-3-1b,
...; no checkpoint needed) or a checkpoint directory (its config.json gives the shapes). OUT_DIR gets
what engine/spec/mtp_head.py reads: adapter_config.json and adapter_model.safetensors (a LoRA on all
seven projections of every layer, named as peft names them, so peft loads it too), mtp_config.json and
mtp_head.safetensors. The weights are small and random so the target stays numerically sane in bf16:
A ~ N(0, 1/in_features), B ~ N(0, B_STD^2), mask embeddings with the std of the target's embedding
output (Gemma's scale included), fc1 ~ N(0, 1/(2H)), fc2 ~ N(0, (FC2_GAIN^2)/H), norm 1 + N(0, 0.1^2).
Each tensor is drawn from its own generator, seeded from (seed, tensor name). With --draft-vocab-size N
the head drafts among N tokens (draft_token_ids): here N distinct ids drawn at random, where a trained
head would list its corpus's N most frequent tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.lora.adapter import SUPPORTED_MODULES, ModuleShapes
from engine.models.config import ModelConfig
from engine.models.registry import config_from_dict, config_from_dir
from engine.spec import mtp_head
from scripts import make_lora
from scripts.make_lora import adapter_config
from scripts.make_model import NORM_STD, TORCH_DTYPES, tensor_seed
from scripts.model_shapes import SPECS, ModelSpec, hf_config

B_STD = 0.01  # the adapter nudges the hidden states at mask positions without swamping them
FC2_GAIN = 0.1  # the sampler's residual update stays small next to h (which has rms ~1)
_EMBED_ROWS = 1024  # rows of a checkpoint's embedding read to measure its std


def _random(seed: int, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    return torch.randn(shape, generator=gen) * std + mean


def _measured_embed_std(model_dir: Path) -> float | None:
    """The std of the first rows of the checkpoint's embedding matrix, or None when it has none."""
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight"):
                    return f.get_slice(name)[:_EMBED_ROWS].float().std().item()
    return None


def target(model: str | Path | ModelSpec) -> tuple[ModelConfig, str, float, str]:
    """(the target's config, its label, the std of its embedding matrix, its default dtype) for a shape
    name, a ModelSpec or a checkpoint directory."""
    if isinstance(model, ModelSpec) or (str(model) in SPECS and not Path(model).is_dir()):
        spec = model if isinstance(model, ModelSpec) else SPECS[str(model)]
        cfg = config_from_dict(hf_config(spec, spec.dtype, 1, [2], None), f"shape {spec.name}")
        return cfg, spec.name, spec.embed_std, spec.dtype
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"{model!r}: neither a shape ({', '.join(SPECS)}) nor a checkpoint directory")
    cfg = config_from_dir(path)
    std = _measured_embed_std(path) or float(cfg.raw.get("initializer_range", 0.02))
    return cfg, str(path), std, "fp32" if cfg.torch_dtype == "float32" else "bf16"


def lora_tensors(shapes: ModuleShapes, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A rank-`rank` LoRA on all seven projections of every layer, under peft's tensor names."""
    return make_lora.lora_tensors(shapes, list(SUPPORTED_MODULES), rank, seed, B_STD, salt="mtp.")


def head_tensors(
    cfg: ModelConfig, num_mask_tokens: int, embed_std: float, seed: int
) -> dict[str, torch.Tensor]:
    """mtp_head.safetensors' tensors. A mask embedding stands where model.embed's output would, so it
    takes that output's scale: the matrix's std, times sqrt(H) for Gemma (its embed scale)."""
    h = cfg.hidden_size
    input_std = embed_std * (h**0.5 if cfg.model_type == "gemma3_text" else 1.0)
    stds = {
        "mask_embeddings": (input_std, 0.0),
        "sampler.fc1.weight": ((2 * h) ** -0.5, 0.0),
        "sampler.fc2.weight": (FC2_GAIN * h**-0.5, 0.0),
        "sampler.norm.weight": (NORM_STD, 1.0),
    }
    shapes = mtp_head.tensor_shapes(num_mask_tokens, h)
    return {name: _random(seed, f"mtp.{name}", shapes[name], *stds[name]) for name in shapes}


def write_mtp_dir(
    path: str | Path,
    model: str | Path | ModelSpec,
    num_mask_tokens: int = 8,
    rank: int = 16,
    seed: int = 0,
    dtype: str | None = None,
    alpha: float | None = None,
    draft_vocab_size: int | None = None,
) -> Path:
    """Write a random MTP directory for `model` (a shape name, a ModelSpec or a checkpoint directory)
    into `path`; dtype bf16 | fp32 (default: the target's); alpha defaults to 2 * rank; with
    draft_vocab_size N, a draft vocabulary of N random ids."""
    cfg, label, embed_std, default_dtype = target(model)
    torch_dtype = TORCH_DTYPES[dtype or default_dtype]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / mtp_head.CONFIG_FILE).unlink(missing_ok=True)  # written last: its presence marks a complete dir

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        tensors = {
            k: (v if k == mtp_head.DRAFT_IDS else v.to(torch_dtype)).contiguous() for k, v in tensors.items()
        }
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        (out / name).chmod(0o644)  # safetensors creates files private to the owner

    save(lora_tensors(ModuleShapes.of(cfg), rank, seed), "adapter_model.safetensors")
    config = adapter_config(label, rank, float(alpha or 2 * rank), list(SUPPORTED_MODULES), False)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    head = head_tensors(cfg, num_mask_tokens, embed_std, seed)
    if draft_vocab_size:
        if not 1 <= draft_vocab_size <= cfg.vocab_size:
            raise ValueError(
                f"draft_vocab_size {draft_vocab_size}: give 1..{cfg.vocab_size} (the vocabulary)"
            )
        gen = torch.Generator().manual_seed(tensor_seed(seed, f"mtp.{mtp_head.DRAFT_IDS}"))
        head[mtp_head.DRAFT_IDS] = torch.randperm(cfg.vocab_size, generator=gen)[:draft_vocab_size]
    save(head, mtp_head.HEAD_FILE)
    mtp = {"format": mtp_head.FORMAT, "version": mtp_head.VERSION, "num_mask_tokens": num_mask_tokens,
           "hidden_size": cfg.hidden_size}  # fmt: skip
    if draft_vocab_size:
        mtp["draft_vocab_size"] = draft_vocab_size
    (out / mtp_head.CONFIG_FILE).write_text(json.dumps(mtp, indent=2) + "\n")
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.make_model --mtp", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--mtp", required=True, metavar="MODEL", help="a shape (tiny, ...) or a checkpoint dir"
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--num-mask-tokens", type=int, default=8, help="K: at least num_speculative_tokens")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: 2 * rank)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default=None, help="default: the target's")
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="N: draft among N tokens")
    args = parser.parse_args(argv)
    if args.num_mask_tokens < 1 or args.rank < 1:
        parser.error("--num-mask-tokens and --rank must be >= 1")
    out = write_mtp_dir(
        args.out_dir, args.mtp, args.num_mask_tokens, args.rank, args.seed, args.dtype, args.alpha,
        args.draft_vocab_size,
    )  # fmt: skip
    print(
        f"wrote a gated-LoRA MTP directory (K={args.num_mask_tokens}, rank {args.rank}) of {args.mtp}: {out}"
    )
