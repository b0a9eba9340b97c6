"""Write a random LoRA adapter for a checkpoint, in the format `peft` saves (tests and benchmarks).

    python -m scripts.make_model --lora-for MODEL_DIR --out OUT_DIR [--rank 8] [--alpha 16]
                                 [--targets all|attn|mlp|q_proj,v_proj,...] [--rslora] [--seed S]

OUT_DIR gets adapter_config.json and adapter_model.safetensors with tensors named as peft names them
(base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight [r, in], ...lora_B.weight [out, r]),
so `peft.PeftModel.from_pretrained` loads it. Unlike peft's initialisation, B is not zero: the adapter
changes the model's output, so a test comparing adapters against each other or the base can fail.
Each tensor is drawn from its own generator, seeded from (seed, tensor name).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.lora.adapter import ATTN_MODULES, MLP_MODULES, SUPPORTED_MODULES, ModuleShapes
from engine.models.registry import config_from_dir
from scripts.make_model import TORCH_DTYPES, tensor_seed

TARGET_SETS = {"all": SUPPORTED_MODULES, "attn": ATTN_MODULES, "mlp": MLP_MODULES}
B_STD = 0.05  # large enough that greedy outputs differ from the base model's


def parse_targets(targets: str | list[str]) -> list[str]:
    names = list(TARGET_SETS.get(targets, targets.split(","))) if isinstance(targets, str) else list(targets)
    bad = [t for t in names if t not in SUPPORTED_MODULES]
    if bad or not names:
        raise ValueError(
            f"targets: {bad or names} not supported; use all, attn, mlp or names from {SUPPORTED_MODULES}"
        )
    return names


def _random(seed: int, name: str, shape: tuple[int, int], std: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    return torch.randn(shape, generator=gen) * std


def lora_tensors(
    shapes: ModuleShapes, modules: list[str], rank: int, seed: int, b_std: float, salt: str = ""
) -> dict[str, torch.Tensor]:
    """Random LoRA pairs under peft's tensor names on `modules` of every layer: A ~ N(0, 1/in), B ~
    N(0, b_std^2); `salt` keeps another writer's draws apart from these."""
    tensors = {}
    for layer in range(shapes.num_layers):
        for module in modules:
            in_f, out_f = shapes.shapes[module]
            block = "self_attn" if module in ATTN_MODULES else "mlp"
            base = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{base}.lora_A.weight"] = _random(seed, f"{salt}{base}.A", (rank, in_f), in_f**-0.5)
            tensors[f"{base}.lora_B.weight"] = _random(seed, f"{salt}{base}.B", (out_f, rank), b_std)
    return tensors


def adapter_config(model_dir: Path, rank: int, alpha: float, targets: list[str], use_rslora: bool) -> dict:
    """adapter_config.json as peft writes it for a causal-LM LoRA."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": targets,
        "use_rslora": use_rslora, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
        "use_dora": False, "layers_to_transform": None, "layers_pattern": None, "revision": None,
    }  # fmt: skip


def make_lora(
    model_dir: str | Path,
    out_dir: str | Path,
    rank: int = 8,
    alpha: float = 16,
    targets: str | list[str] = "all",
    use_rslora: bool = False,
    seed: int = 0,
    dtype: str = "fp32",
) -> Path:
    """Write a random adapter of `rank` on `targets` of every layer of the checkpoint at model_dir."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    names = parse_targets(targets)
    shapes = ModuleShapes.of(config_from_dir(model_dir))
    tensors = lora_tensors(shapes, names, rank, seed, B_STD)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(TORCH_DTYPES[dtype]).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = adapter_config(model_dir, rank, alpha, names, use_rslora)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.make_model --lora-for", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--lora-for", type=Path, required=True, help="the base checkpoint directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16)
    parser.add_argument(
        "--targets", default="all", help="all, attn, mlp, or a comma list such as q_proj,v_proj"
    )
    parser.add_argument("--rslora", action="store_true", help="rsLoRA scaling: alpha / sqrt(rank)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="fp32")
    args = parser.parse_args(argv)
    out = make_lora(
        args.lora_for, args.out, args.rank, args.alpha, args.targets, args.rslora, args.seed, args.dtype
    )
    print(f"wrote a rank-{args.rank} LoRA adapter for {args.lora_for} to {out}")
