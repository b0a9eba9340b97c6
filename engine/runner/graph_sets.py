"""Which CUDA graphs a runner captures, and in which order: mixed steps by token count
(config.load.mixed_graphs), then uniform steps by batch size for query length 1 (decode) and, when
speculating, k + 1 (verification), all in one memory pool.

With tensor parallelism every rank calls `capture_sets` with the same arguments (engine/runner/tp_worker.py):
the graphs capture the collectives, so the ranks must capture the same buckets in the same order.
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.runner.cuda_graph import DecodeGraphs, MixedGraphs


def max_graph_batch(config: EngineConfig) -> int:
    return min(config.scheduler.max_num_seqs, 512)


def capture_sets(
    model, device: torch.device, dtype: torch.dtype, config: EngineConfig, max_model_len: int, hidden: int
) -> tuple[dict[int, DecodeGraphs], MixedGraphs | None]:
    """(uniform graph sets by query length, the mixed set or None), captured."""
    block_size, max_batch = config.cache.block_size, max_graph_batch(config)
    width = -(-max_model_len // block_size)
    pool, mixed = None, None
    if config.load.mixed_graphs:
        tokens = config.scheduler.max_num_batched_tokens
        mixed = MixedGraphs(model, device, tokens, max_batch, width, block_size, hidden, dtype)
        mixed.lora = config.enable_lora
        pool = mixed.capture()
    spec = config.speculative
    graphs = {}
    verify = spec is not None and spec.method != "gated_lora_mtp"  # MTP steps run eagerly
    for q in [1] + ([spec.num_speculative_tokens + 1] if verify else []):
        g = DecodeGraphs(model, device, max_batch, width, block_size, hidden, dtype, q)
        g.lora = config.enable_lora  # the LoRA layers read each row's slot from the step's buffers
        pool = g.capture(pool)
        graphs[q] = g
    return graphs, mixed
