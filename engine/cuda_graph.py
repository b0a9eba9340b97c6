"""CUDA-graph decode: capture one graph per batch-size bucket at start-up, replay it every decode step.

A decode step is many small kernels; replaying a captured graph removes their launch gaps. Capture
needs fixed shapes and addresses, so every input lives in a static buffer sized for the largest
bucket, the block-table width is fixed at max_model_len / block_size (the decode kernel derives its
split count from that width, never from the data), and all graphs share one memory pool. Kernels are
compiled by the warm-up run before capture, so capture never JITs or autotunes.

Padding rows (bucket size > batch) write nothing (slot -1) and attend over one position of block 0,
so they stay finite; their outputs are ignored.
"""

from __future__ import annotations

import torch

from engine.attention_context import AttentionMetadata, attention_context

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model, device: torch.device, max_batch: int, max_blocks: int, block_size: int,
                 hidden_size: int, dtype: torch.dtype):
        self.model = model
        self.block_size = block_size
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_batch] + [max_batch]
        n = max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens[: bs + 1], seq_lens=self.seq_lens[:bs],
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            query_lens_cpu=[1] * bs, seq_lens_cpu=[1] * bs, max_seqlen_q=1,
            max_seqlen_k=self.block_tables.shape[1] * self.block_size, block_size=self.block_size)

    def _forward(self, bs: int) -> None:
        with attention_context(self._meta(bs)):
            self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so smaller graphs reuse its pool memory."""
        for bs in reversed(self.buckets):
            self._forward(bs)  # warm-up: compiles every kernel for this shape outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, batch: int) -> bool:
        return bool(self.graphs) and batch <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Copy this step's inputs into the static buffers, replay the bucket's graph, return hidden[:B]."""
        b = input_ids.shape[0]
        bs = next(x for x in self.buckets if x >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.slot_mapping[b:bs].fill_(-1)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.seq_lens[b:bs].fill_(1)
        width = meta.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.block_tables.clamp(min=0))
        self.block_tables[b:bs].zero_()
        self.graphs[bs].replay()
        return self.hidden[:b]
