"""An adapter's tensors in host memory, ready to copy into GPU slots.

Per (layer, module): A [r, in_features] and B [out_features, r] in the model dtype, with PEFT's scale
(lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA) folded into B in fp32 before the cast, so the
kernels take no scale. On CUDA the tensors are pinned, so loading a slot is an asynchronous copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from engine.lora.adapter import AdapterSpec, adapter_error
from engine.lora.request import LoRARequest


@dataclass
class AdapterWeights:
    request: LoRARequest
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (A, scaled B)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def load_adapter(
    request: LoRARequest, spec: AdapterSpec, dtype: torch.dtype, pin: bool = False
) -> AdapterWeights:
    """Read the checked adapter `spec` (engine.lora.adapter.check_adapter) into host memory."""
    modules = {}
    try:
        with safe_open(str(spec.weights_file), framework="pt", device="cpu") as f:
            for key, (a_name, b_name, rank) in spec.modules.items():
                a = f.get_tensor(a_name).to(dtype)
                b = (f.get_tensor(b_name).float() * spec.scaling(rank)).to(dtype)
                if pin:
                    a, b = a.pin_memory(), b.pin_memory()
                modules[key] = (a, b)
    except (OSError, SafetensorError) as exc:
        raise adapter_error(
            spec.weights_file, f"cannot be read ({exc}); save the adapter again with peft"
        ) from None
    return AdapterWeights(request, modules)
