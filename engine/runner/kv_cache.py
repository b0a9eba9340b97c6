"""The KV-cache pool: how many blocks fit (a run-time value, never a config field) and the tensors.

Per layer, k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim]; block b of every
layer holds the same token positions, so one block table serves all layers. Their element type is the
model's, or float8 e4m3 with kv_cache_dtype="fp8" (half the bytes per block, so twice the blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import CacheConfig
from engine.models.config import ModelConfig
from kernels import torch_ops


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def kv_cache_dtype(cache: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The caches' element type: the model's for "auto", float8 e4m3 for "fp8" (kernels.torch_ops)."""
    return torch_ops.FP8_DTYPE if cache.kv_cache_dtype == "fp8" else model_dtype


def plan_kv_cache(
    cache: CacheConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    activation_bytes: int = 0,
    extra_block_bytes: int = 0,
) -> KVCacheSpec:
    """Size the pool: an explicit block count, else a byte budget on CPU, else a fraction of GPU memory
    minus what the weights and the profiled activation peak already take. `extra_block_bytes`: what
    each block also costs elsewhere (a draft model's KV for the same positions)."""
    spec = KVCacheSpec(0, cache.block_size, model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # our share of the card, less what we hold already, and never more than is actually free
        free_for_kv = min(total * cache.gpu_memory_utilization - torch.cuda.memory_allocated(device), free)
        num_blocks = int((free_for_kv - activation_bytes) // (spec.bytes_per_block + extra_block_bytes))
    else:
        num_blocks = cache.cpu_kv_cache_bytes // (spec.bytes_per_block + extra_block_bytes)
    if num_blocks < 1:
        raise RuntimeError(
            f"no room for the KV cache ({spec.bytes_per_block} bytes per block): raise "
            "gpu_memory_utilization / cpu_kv_cache_bytes, or use a smaller model or max_num_batched_tokens"
        )
    return KVCacheSpec(
        num_blocks, cache.block_size, model.num_layers, model.num_kv_heads, model.head_dim, dtype
    )


def allocate_kv_cache(spec: KVCacheSpec, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V caches, [num_blocks, block_size, kv_heads, head_dim] each: contiguous views
    of one allocation, K then V layer by layer, so that one strided view reaches a block in every cache
    at once (the host tier moves a block with one gather or scatter: KVOffload)."""
    shape = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    pool = torch.zeros((spec.num_layers, 2, *shape), dtype=spec.dtype, device=device)
    return [(pool[layer, 0], pool[layer, 1]) for layer in range(spec.num_layers)]
