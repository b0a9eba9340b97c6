"""Whether a quantised checkpoint splits over `tensor_parallel_size` ranks with its scales intact.

Per-channel scales (one per output row) follow the rows whatever the split. Block scales ([N/128,
K/128], one per 128x128 tile) follow both dimensions: a column-parallel rank holds whole tile rows of
each part, and a row-parallel rank whole tile columns, only when every shard boundary falls on a 128
boundary. For fp8_group128 activations this also keeps each 128-column group of the input on one rank,
so a rank quantises exactly the groups the whole layer would. Anything else is refused at start-up.
"""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.quant_config import QuantConfig, resolve_quant_config

# (module under model.layers.N, HF projection, dimension split: "rows" (column-parallel) or "columns")
PROJECTIONS = (
    ("self_attn", "q_proj", "rows"),
    ("self_attn", "k_proj", "rows"),
    ("self_attn", "v_proj", "rows"),
    ("self_attn", "o_proj", "columns"),
    ("mlp", "gate_proj", "rows"),
    ("mlp", "up_proj", "rows"),
    ("mlp", "down_proj", "columns"),
)


def split_sizes(cfg: ModelConfig, size: int, projection: str) -> tuple[int, int]:
    """(whole, per rank) length of the split dimension of `projection` over `size` ranks (a replicated
    KV head: one head per rank)."""
    if projection in ("k_proj", "v_proj"):
        whole = cfg.num_kv_heads * cfg.head_dim
        return whole, max(1, cfg.num_kv_heads // size) * cfg.head_dim
    whole = cfg.num_heads * cfg.head_dim if projection in ("q_proj", "o_proj") else cfg.intermediate_size
    return whole, whole // size


def misaligned(cfg: ModelConfig, size: int, quant: QuantConfig) -> list[str]:
    """The block-quantised projections whose rank shards would cut a scale tile, as error text."""
    block = quant.linear.block_size
    if block is None or size == 1:
        return []
    problems = []
    for parent, name, dim in PROJECTIONS:
        names = [f"model.layers.{i}.{parent}.{name}" for i in range(cfg.num_layers)]
        if not any(quant.quantizes(n) for n in names):
            continue
        whole, local = split_sizes(cfg, size, name)
        if local % block and local != whole:
            problems.append(f"{name} ({whole} {dim}, {local} per rank)")
    return problems


def check_quant_tp(
    cfg: ModelConfig, size: int, where: str, quantization: str | None, fits: list[int]
) -> None:
    """Raise ValueError naming tensor_parallel_size and the fix when a block-scaled checkpoint's shards
    would not start on block boundaries. `fits`: the sizes that split the model's heads and MLP."""
    if size == 1:
        return
    quant = resolve_quant_config(cfg.raw, quantization, cfg.tie_word_embeddings, f"{where}/config.json")
    if quant is None:
        return
    problems = misaligned(cfg, size, quant)
    if problems:
        ok = [p for p in fits if not misaligned(cfg, p, quant)]
        block = quant.linear.block_size
        raise ValueError(
            f"tensor_parallel_size: {size} cuts the {block}x{block} scale blocks of {where}'s block-FP8 "
            f"weights: {', '.join(problems)}; each rank's share must be a multiple of {block}. "
            f"Use tensor_parallel_size one of {ok}, or a float checkpoint with quantization='fp8' "
            "(per-channel scales split at any row)"
        )
