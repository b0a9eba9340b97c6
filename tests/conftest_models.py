"""Helpers for the model-layer tests: tiny random HF checkpoints and hand-built attention metadata.

Each tiny config exercises what makes its family special: Llama with llama3 RoPE scaling whose
original_max_position_embeddings (64) is far below the 300-token prompts; Qwen3 with QK-norm and tied
embeddings; Gemma 3 with alternating sliding (window 16) / global layers, linear RoPE scaling on the
global layers, query_pre_attn_scalar != head_dim and both softcaps.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.models.attention_context import AttentionMetadata

FAMILIES = ("llama", "qwen3", "gemma3")

_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.1,  # large enough that logits (and greedy choices) are far from uniform
    attn_implementation="eager",
)


def tiny_hf_config(family: str):
    import transformers

    if family == "llama":
        rope = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        return transformers.LlamaConfig(
            **_COMMON, num_hidden_layers=2, rope_theta=500000.0, rope_scaling=rope, tie_word_embeddings=False
        )
    if family == "qwen3":
        return transformers.Qwen3Config(
            **_COMMON, num_hidden_layers=2, rope_theta=1_000_000.0, tie_word_embeddings=True
        )
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **_COMMON,
            num_hidden_layers=4,
            sliding_window=16,
            sliding_window_pattern=2,  # layers: sliding, full, sliding, full
            rope_scaling={"rope_type": "linear", "factor": 4.0},
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
        )
    raise ValueError(family)


def tiny_hf_model(family: str):
    """A random HF model in fp32 eval mode; norm weights are perturbed so a wrong (1 + w) offset or a
    missing norm shows up in the logits."""
    import transformers

    torch.manual_seed(0)
    cfg = tiny_hf_config(family)
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
    }[family]
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def save_checkpoint(model, directory: Path, sharded: bool) -> Path:
    """save_pretrained once as one model.safetensors, or as several shards plus an index."""
    kwargs = {"max_shard_size": "60KB"} if sharded else {}
    model.save_pretrained(directory, **kwargs)
    return directory


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


def paged_step_metadata(
    new_tokens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> AttentionMetadata:
    """Metadata for one step of a paged batch: sequence b adds new_tokens[b] tokens, reaching seq_lens[b].

    Token i of sequence b sits at position p = seq_lens[b] - new_tokens[b] + i and is stored at
    slot block_tables[b][p // block_size] * block_size + p % block_size.
    """
    slots, cu = [], [0]
    for n, total, table in zip(new_tokens, seq_lens, block_tables):
        for p in range(total - n, total):
            slots.append(table[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + n)
    width = max(len(t) for t in block_tables)
    padded = [t + [-1] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        query_lens_cpu=list(new_tokens),
        seq_lens_cpu=list(seq_lens),
        max_seqlen_q=max(new_tokens),
        max_seqlen_k=max(seq_lens),
        block_size=block_size,
    )


def shuffled_block_tables(final_lens: list[int], block_size: int, spare: int, seed: int = 0):
    """Block tables drawing from a shuffled pool, so no sequence owns contiguous or ordered blocks."""
    needed = [math.ceil(n / block_size) for n in final_lens]
    num_blocks = sum(needed) + spare
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start : start + n])
        start += n
    return tables, num_blocks
