"""CUDA graphs of a plain step's draw: the LM head over the sampling rows and one token per row, by
row-count bucket.

Run eagerly, a draw is the rows' gather, the LM head's GEMM and the sampling kernel, each launched from
Python every step; the sampling kernel's launch alone costs tens of microseconds of host time, which a
host-bound decode step cannot spare. A step's draw replays a graph when every row is plain: no logprobs,
logit_bias, penalties, top-k / top-p / min-p or grammar, and one row per sampling sequence (no n > 1
fan-out). Others draw eagerly, as before. Greedy rows (T = 0) take the argmax inside the sampling kernel,
so one graph serves greedy, sampled and mixed batches, and a bucket's LM head has the shape the eager
head pads to (cuda_graph.lm_head_rows): the same GEMM, so the same logits.

Static inputs per graph set, read by every bucket's graph through its first B rows: the hidden rows
[max, H] and one int64 buffer holding the rows' keys, counters and temperatures (DrawLayout). Rows past
the step's n keep what an earlier step left there (hidden rows of real tokens: finite), and their ids are
never read. The ids land in a buffer of the graphs' memory pool that another graph's replay may reuse,
so each step's ids are copied out right after its replay.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine.device.uploader import Uploader
from engine.runner.cuda_graph import DEFAULT_BUCKETS
from kernels import ops


class DrawLayout(NamedTuple):
    """The int64 input buffer of a graph set of `stride` rows at most (even, so that every segment starts
    on a 16-byte boundary): keys at 0, counters at stride, the float32 temperatures (two to an int64
    word) at 2 * stride, then the step's hidden-row index, if it has one, at 2.5 * stride."""

    stride: int

    @property
    def temps_at(self) -> int:
        return 2 * self.stride

    @property
    def index_at(self) -> int:
        return 2 * self.stride + self.stride // 2

    def fill(self, buf: np.ndarray, keys: list[int], counters: list[int], temps: list[float], index) -> None:
        """Write one step's rows into `buf` (int64, index_at + len(index) long); padding rows get key 0,
        counter 0 and temperature 0 (an argmax)."""
        n, s = len(keys), self.stride
        buf[:n], buf[n:s] = keys, 0
        buf[s : s + n], buf[s + n : 2 * s] = counters, 0
        buf[self.temps_at : self.index_at] = 0
        buf[self.temps_at : self.index_at].view(np.float32)[:n] = temps
        buf[self.index_at :] = index


class DrawGraphs:
    """One graph per row bucket up to `max_rows`; `draw` replays the smallest that holds the step."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype, hidden_size: int, max_rows: int):
        self.model, self.device = model, device
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_rows] + [max_rows]
        self.layout = DrawLayout(max_rows + max_rows % 2)
        self.hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
        self.rows = torch.zeros(self.layout.index_at + max_rows, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.ids: dict[int, torch.Tensor] = {}

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _draw(self, b: int) -> torch.Tensor:
        lay = self.layout
        temps = self.rows[lay.temps_at : lay.index_at].view(torch.float32)[:b]
        keys, counters = self.rows[:b], self.rows[lay.stride : lay.stride + b]
        return ops.sample(self.model.compute_logits(self.hidden[:b]), temps, keys, counters)

    @torch.inference_mode()
    def capture(self, pool=None):
        """Largest bucket first, each warmed up outside capture (kernels compile there); returns the pool."""
        for b in reversed(self.buckets):
            self._draw(b)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.ids[b] = self._draw(b)
            pool = pool if pool is not None else graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        return pool

    def draw(self, upload: Uploader, hidden: torch.Tensor, index: list[int] | None, rows) -> torch.Tensor:
        """The ids [n] of one step's plain rows (SamplingRows, n <= the largest bucket), drawn from the
        LM head at `hidden`'s rows `index` (None: its first n rows), on the device."""
        n, lay = len(rows), self.layout
        b = self.bucket(n)
        buf = upload.array("draw_rows", lay.index_at + (n if index is not None else 0), torch.int64)
        temps = [r.params.temperature for r in rows]
        lay.fill(buf, [r.key for r in rows], [r.counter for r in rows], temps, index or ())
        staged = upload.send("draw_rows", out=self.rows[: len(buf)])
        if index is None:
            self.hidden[:n].copy_(hidden[:n])
        else:
            torch.index_select(hidden, 0, staged[lay.index_at :], out=self.hidden[:n])
        self.graphs[b].replay()
        return self.ids[b][:n].clone()
