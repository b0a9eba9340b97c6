"""Setting up a runner for gated-LoRA MTP (speculative_config method gated_lora_mtp): its head, the
LoRA slot of its gate, and scratch KV blocks past the pool for the mask tokens (engine/runner/mtp_step.py
runs the steps)."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.lora.layers import LoRALinear, wrap_model
from engine.runner.graph_sets import max_graph_batch
from engine.runner.kv_cache import KVCacheSpec
from engine.runner.mtp_step import MtpGraphs
from engine.spec.mtp_chain import DraftChain
from engine.spec.mtp_head import MtpDir, MtpHead, check_mtp_dir, load_mtp_head, load_mtp_lora

log = logging.getLogger(__name__)
# where the gate's A joins the base GEMM: on CUDA its separate shrink costs more than the wider GEMM; the
# CPU keeps the separate shrink, so real rows stay bit-identical to the base model there
FOLD_DEVICES = ("cuda",)
# with a draft vocabulary the head's k passes run as a DraftChain (fc1 split, a table over the vocabulary)
DRAFT_CHAIN = True


def _mtp_spec(config: EngineConfig):
    """The speculative config of an MTP engine, else None."""
    spec = config.speculative
    return spec if spec is not None and spec.method == "gated_lora_mtp" else None


def load_head(config: EngineConfig, model, model_config, dtype: torch.dtype, device) -> MtpHead | None:
    """The checked head of an MTP engine, else None; its draft vocabulary (if any) bound to the LM head
    of `model`, unless `model` is a tensor-parallel share (the head then drafts over every token), and
    then drafting through `head.chain`, a DraftChain."""
    if (spec := _mtp_spec(config)) is None:
        return None
    head = load_mtp_head(spec.model, model_config, spec.num_speculative_tokens, dtype, device)
    if config.tensor_parallel_size == 1:
        head.bind_logits_weight(model.logits_weight())
    elif head.draft_token_ids is not None:
        log.info("gated_lora_mtp: drafting over the whole vocabulary (rank 0 holds a share of the LM head)")
    if spec.quantization == "fp8":
        head.quantize_fp8()
    if DRAFT_CHAIN and head.draft_weight is not None:  # before the KV pool is sized: its table takes memory
        head.chain = DraftChain(head, model.embed)
        table = head.chain.table
        log.info("gated_lora_mtp: the sampler head's table over %d draft tokens takes %.0f MiB",
                 table.shape[0], table.numel() * table.element_size() / 2**20)  # fmt: skip
    return head


def mtp_source(config: EngineConfig, model_config) -> MtpDir | None:
    """The checked MTP directory of an MTP engine (its gate's adapter), else None: what a
    tensor-parallel worker needs, which runs the forward but never the sampler head."""
    if (spec := _mtp_spec(config)) is None:
        return None
    return check_mtp_dir(spec.model, model_config, spec.num_speculative_tokens)


def lora_layers(
    model, config: EngineConfig, mtp: MtpDir | None, dtype: torch.dtype
) -> tuple[list[LoRALinear], int]:
    """(LoRA layers, the gate's slot): the adapters' slots (enable_lora: max_loras) and, with an MTP
    directory, one slot more, the last, holding its gate's adapter (this rank's share of it). A gate
    alone on one device of FOLD_DEVICES is folded into the base projections (engine/lora/layers.py):
    each of its forwards then runs one GEMM and one expand per projection instead of three kernels."""
    slots = (config.max_loras if config.enable_lora else 0) + (mtp is not None)
    rank = max(config.max_lora_rank if config.enable_lora else 0, mtp.lora_rank if mtp else 0)
    layers = wrap_model(model, slots, rank)
    if mtp is not None:
        modules = load_mtp_lora(mtp, dtype).modules
        for layer in layers:
            layer.load_slot(slots - 1, modules)
        if slots == 1 and config.tensor_parallel_size == 1 and layers[0].lora_a.device.type in FOLD_DEVICES:
            for layer in layers:
                layer.fold()
            log.info("gated_lora_mtp: the gate's A folded into %d base projections", len(layers))
    return layers, slots - 1


def scratch_tokens(k: int, max_num_seqs: int, max_num_batched_tokens: int, batch_cut: int | None) -> int:
    """Scratch KV slots the mask tokens of one step may need: k (k + 1) per MTP chunk, whose (k + 1)^2
    rows count against the step's token budget, for at most max_num_seqs (or the batch cut-off) chunks."""
    chunks = min(max_num_seqs, batch_cut or max_num_seqs, max_num_batched_tokens // (k + 1) ** 2)
    return max(chunks, 1) * k * (k + 1)


def scratch_blocks(config: EngineConfig, kv_spec: KVCacheSpec) -> tuple[KVCacheSpec, int]:
    """(the pool the block manager gets, scratch blocks after it): with a pool sized to memory the
    scratch comes out of it, an explicit num_blocks stays whole."""
    spec, sched = config.speculative, config.scheduler
    k = spec.num_speculative_tokens
    tokens = scratch_tokens(k, sched.max_num_seqs, sched.max_num_batched_tokens, spec.batch_limit)
    blocks = -(-tokens // kv_spec.block_size)
    if config.cache.num_blocks is None:
        kv_spec = replace(kv_spec, num_blocks=kv_spec.num_blocks - blocks)
        if kv_spec.num_blocks < 1:
            raise ValueError(
                f"speculative_config: gated_lora_mtp's {blocks} scratch KV blocks take the whole pool; "
                "give the KV cache more memory, or lower num_speculative_tokens or disable_by_batch_size"
            )
    return kv_spec, blocks


def capture_graphs(
    model, head: MtpHead, device, dtype, config: EngineConfig, max_model_len: int, hidden: int, pool
):
    """The MTP steps' graphs, batch sizes up to the batch cut-off (above it nobody speculates), captured
    in `pool`, the memory pool of the runner's other graphs."""
    spec, size = config.speculative, config.cache.block_size
    top = max_graph_batch(config)
    graphs = MtpGraphs(model, head, spec.num_speculative_tokens, device, min(top, spec.batch_limit or top),
                       -(-max_model_len // size), size, hidden, dtype)  # fmt: skip
    graphs.capture(pool)
    return graphs
