"""CUDA-graph decode: capture one graph per batch-size bucket at start-up, replay it every decode step.

A decode step is many small kernels; replaying a captured graph removes their launch gaps. Capture
needs fixed shapes and addresses, so each bucket owns static input buffers in the layout of
engine/runner/step_inputs.py, the block-table width is fixed at max_model_len / block_size (the decode kernel
derives its split count from that width, never from the data), and all graphs share one memory pool.
Kernels are compiled by the warm-up run before capture, so capture never JITs or autotunes.
A step then costs two host-to-device copies into the bucket's buffers and one replay.

The same holds for any step whose sequences all have `query_len` new tokens (speculative verification:
the pending token and k proposals; a draft model's catch-up): such graphs run the varlen attention
kernel, whose grid depends only on the bucket and query_len, and pad with sequences of query_len
tokens that write nothing.
"""

from __future__ import annotations

import torch

from engine.device.uploader import Uploader
from engine.models.attention_context import attention_context
from engine.runner.step_inputs import StepBatch, pack, table_width, unpack

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
        query_len: int = 1,
    ):
        self.model = model
        self.q = query_len
        self.device = device
        self.width = width
        self.block_size = block_size
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_batch] + [max_batch]
        self.hidden = torch.zeros((max_batch * query_len, hidden_size), dtype=dtype, device=device)
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _forward(self, bs: int) -> None:
        i64, i32 = self.inputs[bs]
        q = self.q
        shape = StepBatch(query_lens=[q], seq_lens=[q])
        ids, pos, meta = unpack(i64, i32, shape, bs, self.width, self.block_size, pad_q=q)
        with attention_context(meta):
            self.hidden[: bs * q] = self.model(ids, pos)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so smaller graphs reuse its pool memory."""
        for bs in reversed(self.buckets):
            q = self.q
            one = StepBatch(
                input_ids=[0] * q,
                positions=list(range(q)),
                slot_mapping=[-1] * q,
                query_lens=[q],
                seq_lens=[q],
                block_tables=[[0]],
            )
            i64, i32 = pack(one, bs, self.width, pad_q=q)
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

    def run(self, batch: StepBatch, upload: Uploader, fed_back=None, draft_ids=None) -> torch.Tensor:
        """Copy this step's inputs into the bucket's buffers, replay its graph, return the hidden rows
        of the real tokens. `fed_back`: input ids still on the device (a step scheduled ahead);
        `draft_ids`: (rows, ids) of proposals on the device; both written over the packed ids."""
        n = len(batch.seq_lens)
        bs = self.bucket(n)
        i64, i32 = pack(batch, bs, self.width, pad_q=self.q)
        static64, static32 = self.inputs[bs]
        upload("i64", i64, out=static64)
        upload("i32", i32, out=static32)
        if fed_back is not None:
            static64[:n].copy_(fed_back)  # input_ids are the first rows of the int64 buffer
        if draft_ids is not None:
            static64.index_copy_(0, *draft_ids)
        self.graphs[bs].replay()
        return self.hidden[: n * self.q]


def forward_batch(
    model,
    graphs: dict[int, DecodeGraphs],
    upload: Uploader,
    batch: StepBatch,
    block_size: int,
    fed_back: torch.Tensor | None = None,
    draft_ids: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One forward of a packed step: the captured graph of its query length (`graphs`, by query length)
    when every sequence has the same one and a bucket fits, else eager. `fed_back`: the input ids of an
    all-decode step, still on the device. `draft_ids`: (rows, ids) of proposals on the device, written
    over the 0s packed at those input rows."""
    n = len(batch.seq_lens)
    g = graphs.get(batch.uniform_q)
    if g is not None and g.bucket(n) is not None:
        return g.run(batch, upload, fed_back, draft_ids)
    width = table_width(batch)
    i64, i32 = pack(batch, n, width)
    i64, i32 = upload("i64", i64), upload("i32", i32)
    input_ids, positions, meta = unpack(i64, i32, batch, n, width, block_size)
    if fed_back is not None:
        input_ids.copy_(fed_back)  # a step scheduled ahead is all decodes: one id per row
    if draft_ids is not None:
        input_ids.index_copy_(0, *draft_ids)
    with attention_context(meta):
        return model(input_ids, positions)
