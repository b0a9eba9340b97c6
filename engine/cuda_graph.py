"""CUDA-graph decode: capture one graph per batch-size bucket at start-up, replay it every decode step.

A decode step is many small kernels; replaying a captured graph removes their launch gaps. Capture
needs fixed shapes and addresses, so each bucket owns static input buffers in the layout of
engine/step_inputs.py, the block-table width is fixed at max_model_len / block_size (the decode kernel
derives its split count from that width, never from the data), and all graphs share one memory pool.
Kernels are compiled by the warm-up run before capture, so capture never JITs or autotunes.
A step then costs two host-to-device copies into the bucket's buffers and one replay.
"""

from __future__ import annotations

import torch

from engine.attention_context import attention_context
from engine.step_inputs import StepBatch, pack, unpack
from engine.uploader import Uploader

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(
        self,
        model,
        device: torch.device,
        max_batch: int,
        width: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
    ):
        self.model = model
        self.device = device
        self.width = width
        self.block_size = block_size
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_batch] + [max_batch]
        self.hidden = torch.zeros((max_batch, hidden_size), dtype=dtype, device=device)
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _forward(self, bs: int) -> None:
        i64, i32 = self.inputs[bs]
        ids, pos, meta = unpack(
            i64, i32, StepBatch(query_lens=[1], seq_lens=[1]), bs, self.width, self.block_size
        )
        with attention_context(meta):
            self.hidden[:bs] = self.model(ids, pos)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so smaller graphs reuse its pool memory."""
        for bs in reversed(self.buckets):
            i64, i32 = pack(
                StepBatch(
                    input_ids=[0],
                    positions=[0],
                    slot_mapping=[-1],
                    query_lens=[1],
                    seq_lens=[1],
                    block_tables=[[0]],
                ),
                bs,
                self.width,
            )
            self.inputs[bs] = (i64.to(self.device), i32.to(self.device))
            self._forward(bs)  # warm-up: compiles every kernel for this shape outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def bucket(self, batch: int) -> int | None:
        """The smallest captured batch size that holds `batch` decodes, or None when none does."""
        return next((b for b in self.buckets if b >= batch), None)

    def run(self, batch: StepBatch, upload: Uploader, fed_back: torch.Tensor | None = None) -> torch.Tensor:
        """Copy this step's inputs into the bucket's buffers, replay its graph, return hidden[:B].
        `fed_back`: input ids still on the device (a step scheduled ahead), written over the packed ones."""
        n = len(batch.seq_lens)
        bs = self.bucket(n)
        i64, i32 = pack(batch, bs, self.width)
        static64, static32 = self.inputs[bs]
        upload("i64", i64, out=static64)
        upload("i32", i32, out=static32)
        if fed_back is not None:
            static64[:n].copy_(fed_back)  # input_ids are the first rows of the int64 buffer
        self.graphs[bs].replay()
        return self.hidden[:n]
