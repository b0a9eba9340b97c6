"""Per-step attention metadata, set once around each forward pass.

Models never see requests. The model runner packs every scheduled sequence's new tokens into one flat
batch (no padding) and describes that batch here; each attention layer reads it with `get_context()`.

Packed layout, for B sequences and T = sum(query_lens) new tokens:
  * tokens of sequence b occupy rows cu_seqlens_q[b] : cu_seqlens_q[b + 1] of q/k/v;
  * seq_lens[b] is the KV length of sequence b *after* this step (cached tokens + new tokens), so the
    new tokens of b sit at absolute positions seq_lens[b] - query_len[b] ... seq_lens[b] - 1;
  * slot_mapping[t] is the flat KV-cache slot that token t writes: block_id * block_size + offset,
    with block_id = block_table[b][pos // block_size] and offset = pos % block_size; -1 means "do not
    store" (used for CUDA-graph padding rows);
  * block_tables[b, i] is the physical block holding positions i*block_size ... (i+1)*block_size - 1.
    Rows are padded with -1 past the sequence's last block.

block_tables is None when no KV cache exists (parity tests, the naive reference): attention then runs
over the new tokens alone, which must then be whole sequences (seq_lens == query_lens).

visibility (TokenVisibility), when set, replaces the causal rule row by row (the verify-and-draft step of
gated LoRA self-speculation, whose mask tokens see keys that are not at their own positions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class TokenVisibility:
    """Which keys each packed row of a step sees, when that is not plain causal. [T] device tensors:

      * ctx_lens (int32 or int64): row t sees its sequence's cache positions < ctx_lens[t] (block_tables);
      * local_start, local_len (int32): and the keys of packed rows local_start[t] ...
        local_start[t] + local_len[t] - 1 of this step, read from the cache at their slot_mapping slots
        (a speculative mask token's K/V lives in a scratch slot, not at its position);
      * positions (int32 or int64): row t's absolute position. With a sliding window a cache key at
        position j is seen only if positions[t] - j < window; local keys are always inside it.

    An ordinary causal row has ctx_lens = position + 1 and local_len = 0 (`causal`). A sequence with one
    query row must be ordinary causal with ctx_lens = seq_len: the decode kernel takes such sequences
    (every sequence of a decode step, the one-query ones of a mixed step) and reads seq_lens alone.
    Visibility needs a KV cache (block_tables)."""

    ctx_lens: torch.Tensor
    local_start: torch.Tensor
    local_len: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def causal(
        query_lens: list[int], seq_lens: list[int], device: torch.device | str = "cpu"
    ) -> TokenVisibility:
        """The visibility of ordinary causal rows: the rule attention applies when there is none."""
        pos = [s - q + i for q, s in zip(query_lens, seq_lens) for i in range(q)]
        positions = torch.tensor(pos, dtype=torch.int32, device=device)
        zeros = torch.zeros_like(positions)
        return TokenVisibility(positions + 1, zeros, zeros.clone(), positions)


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    slot_mapping: torch.Tensor | None  # int64 [T]
    block_tables: torch.Tensor | None  # int32 [B, max_blocks]
    query_lens_cpu: list[int]  # host copies: twins loop over sequences without a device sync
    seq_lens_cpu: list[int]
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int = 16
    # A mixed batch (some sequences with one query, some with more): attention splits it between the
    # decode and prefill kernels by each sequence's query count on the device, with grids from shapes
    # alone, so one CUDA graph per token count serves any mix (engine/runner/mixed_graph.py).
    mixed: bool = False
    # multi-LoRA (engine/lora/layers.py): the adapter slot of each row (int32 [T], -1: none), or None
    # when no row has an adapter (and no CUDA graph reads a LoRA buffer)
    lora_slots: torch.Tensor | None = None
    # per-row visibility of a step that is not plain causal (TokenVisibility); None: causal
    visibility: TokenVisibility | None = None
    # rows whose input vector is given rather than looked up: (rows int64 [M], vectors [M, H]); the
    # gated-LoRA MTP step's mask tokens (engine/runner/mtp_step.py). None: every row embeds its id
    embed_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def is_decode(self) -> bool:
        """Every sequence contributes exactly one new token (the paged-decode / CUDA-graph path)."""
        return self.max_seqlen_q == 1

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @staticmethod
    def for_full_sequences(lengths: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for cache-free causal attention over whole sequences packed back to back."""
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            slot_mapping=None,
            block_tables=None,
            query_lens_cpu=list(lengths),
            seq_lens_cpu=list(lengths),
            max_seqlen_q=max(lengths),
            max_seqlen_k=max(lengths),
        )


_CONTEXT: AttentionMetadata | None = None


def get_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("no attention context is set: wrap the forward pass in attention_context(meta)")
    return _CONTEXT


def set_context(meta: AttentionMetadata | None) -> None:
    global _CONTEXT
    _CONTEXT = meta


@contextlib.contextmanager
def attention_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Make `meta` visible to every attention layer for the duration of one forward pass."""
    previous = _CONTEXT
    set_context(meta)
    try:
        yield meta
    finally:
        set_context(previous)
