"""Random PEFT adapters for the served LoRA tests, written by `peft` itself (save_pretrained) on the tiny
model, so the server reads exactly what a user's fine-tune leaves on disk. peft's init_lora_weights=False
leaves both A and B random (its default makes B zero: an adapter without effect), so every adapter changes
the model's greedy output.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(model_dir: Path, out_dir: Path, names: list[str], rank: int = 8) -> dict[str, str]:
    """{name: directory} of one random rank-`rank` adapter per name on all seven projections."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    paths = {}
    for seed, name in enumerate(names):
        torch.manual_seed(1000 + seed)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), init_lora_weights=False
        )
        model = get_peft_model(copy.deepcopy(base), config)
        path = out_dir / name
        model.save_pretrained(path)
        paths[name] = str(path)
    return paths


def break_tensor(adapter_dir: str, out_dir: Path) -> tuple[str, str]:
    """A copy of the adapter with one lora_A tensor of the wrong width; (its directory, that tensor)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter_dir, out_dir)
    file = out_dir / "adapter_model.safetensors"
    tensors = load_file(file)
    name = sorted(k for k in tensors if "lora_A" in k and "q_proj" in k)[0]
    rank, width = tensors[name].shape
    tensors[name] = torch.zeros(rank, width + 3)
    save_file(tensors, file)
    return str(out_dir), name
