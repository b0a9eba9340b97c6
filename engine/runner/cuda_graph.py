"""CUDA graphs of whole steps: captured at start-up per bucket, replayed instead of launching kernels.

A step is hundreds of small kernels; replaying a captured graph removes their launch gaps and the
Python that issues them. Capture needs fixed shapes and addresses, so each bucket owns static input
buffers in the layout of engine/runner/step_inputs.py, the block-table width is fixed at
max_model_len / block_size (the decode kernel derives its split count from that width, never from the
data), and all graphs share one memory pool. Kernels are compiled by a warm-up run before capture, so
capture never JITs or autotunes. A step then costs two host-to-device copies and one replay.

Two kinds, chosen per step by `forward_batch`:
  * DecodeGraphs, by batch size, for steps whose sequences all have `query_len` new tokens (decode:
    1; speculative verification: k + 1). Padding sequences have query_len tokens that write nothing;
  * MixedGraphs, by token count and sequence count, for any other step (prefill chunks beside
    decodes): attention splits the batch between the decode and prefill kernels on the device
    (AttentionMetadata.mixed), with grids from the bucket's shapes alone. Padding sequences have no
    tokens and seq_len 0; padding rows belong to no sequence, write nothing, and their hidden rows are
    garbage no caller reads. The attention grids hold a program per padded sequence and KV head,
    which exits at once but still costs its launch: hence sequence buckets too.
"""

from __future__ import annotations

import torch

from engine.device.uploader import Uploader
from engine.models.attention_context import attention_context
from engine.runner.step_inputs import StepBatch, pack, table_width, unpack

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
# Token counts of mixed graphs: fine steps where padding would cost most, coarser above.
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048, 3072, 4096)
# Sequence counts of mixed graphs below a token bucket's own cap (min(max_seqs, tokens)).
SEQ_BUCKETS = (32, 64, 128, 256)


def lm_head_rows(n: int) -> int:
    """The rows an eager LM head computes for `n` wanted ones: the smallest batch bucket that holds
    them (n itself above the largest), so that its GEMM shapes repeat from step to step."""
    return next((b for b in DEFAULT_BUCKETS if b >= n), n)


def pad_rows(hidden: torch.Tensor, m: int) -> torch.Tensor:
    """`hidden` [n, H] with its last row repeated up to m rows (lm_head_rows' count); as it is if n >= m.
    Under tensor parallelism every rank pads its own rows this way (engine/runner/tp_worker.py)."""
    n = hidden.shape[0]
    return torch.cat([hidden, hidden[-1:].expand(m - n, -1)]) if m > n else hidden


class _GraphSet:
    """Graphs by bucket key, static (int64, int32) input buffers per bucket, one output buffer."""

    pad_q = 1  # query tokens of a padding sequence
    mixed = False  # attention by query count on the device (AttentionMetadata.mixed)
    lora = False  # multi-LoRA: every bucket has a lora_slots buffer (set before capture)

    def __init__(self, model, device: torch.device, width: int, block_size: int, hidden: torch.Tensor):
        self.model, self.device, self.width, self.block_size = model, device, width, block_size
        self.hidden = hidden
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.buckets: list[int] = []

    def keys(self) -> list[int]:
        """Graph keys, smallest bucket first."""
        return self.buckets

    def _seqs_rows(self, key: int) -> tuple[int, int | None]:
        """(padded sequence count, padded row count or None: as the padding sequences make it)."""
        raise NotImplementedError

    def _dummy(self) -> StepBatch:
        """The capture batch: one sequence that writes nothing; a replay reads only the buffers."""
        q = max(self.pad_q, 1)
        return StepBatch([0] * q, list(range(q)), [-1] * q, [q], [q], [[0]])

    def _forward(self, key: int, shape: StepBatch) -> None:
        i64, i32 = self.inputs[key]
        seqs, rows = self._seqs_rows(key)
        args = (seqs, self.width, self.block_size, self.pad_q, rows, self.mixed, self.lora)
        ids, pos, meta = unpack(i64, i32, shape, *args)
        with attention_context(meta):
            self.hidden[: ids.shape[0]] = self.model(ids, pos)

    @torch.inference_mode()
    def capture(self, pool=None):
        """Largest bucket first, so smaller graphs reuse its pool memory; returns the pool."""
        shape = self._dummy()
        for key in reversed(self.keys()):
            seqs, rows = self._seqs_rows(key)
            i64, i32 = pack(shape, seqs, self.width, self.pad_q, rows, lora=self.lora)
            self.inputs[key] = (i64.to(self.device), i32.to(self.device))
            self._forward(key, shape)  # warm-up: compiles every kernel for this shape outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(key, shape)
            pool = pool if pool is not None else graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        return pool

    def pool(self):
        """The memory pool its graphs were captured in, for graphs captured after them to share."""
        return next(iter(self.graphs.values())).pool()

    def _replay(self, key: int, batch: StepBatch, upload: Uploader, fed_back, draft_ids) -> torch.Tensor:
        """Copy this step's inputs into the bucket's buffers, replay its graph, return the hidden rows
        of the real tokens. `fed_back`: the input ids of the first rows, decodes of a step scheduled ahead,
        still on the device; `draft_ids`: (rows, ids) of proposals on the device; both written over the
        packed ids (input_ids are the first rows of the int64 buffer; fed-back rows come first)."""
        seqs, rows = self._seqs_rows(key)
        into = {"real_tables_only": True, "lora": self.lora, "alloc": upload.array}  # the pinned buffers
        _, i32 = pack(batch, seqs, self.width, self.pad_q, rows, **into)
        static64, static32 = self.inputs[key]
        upload.send("i64", out=static64)
        upload.send("i32", out=static32[: i32.numel()])  # the padding rows' tables are never needed
        if fed_back is not None:
            static64[: fed_back.shape[0]].copy_(fed_back)
        if draft_ids is not None:
            static64.index_copy_(0, *draft_ids)
        self.graphs[key].replay()
        return self.hidden[: len(batch.input_ids)]


class DecodeGraphs(_GraphSet):
    """Graphs by batch size for steps whose sequences all have `query_len` new tokens."""

    def __init__(self, model, device, max_batch: int, width: int, block_size: int, hidden_size: int,
                 dtype: torch.dtype, query_len: int = 1):  # fmt: skip
        hidden = torch.zeros((max_batch * query_len, hidden_size), dtype=dtype, device=device)
        super().__init__(model, device, width, block_size, hidden)
        self.q = self.pad_q = query_len
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_batch] + [max_batch]

    def _seqs_rows(self, key: int) -> tuple[int, int | None]:
        return key, None

    def bucket(self, batch: int) -> int | None:
        """The smallest captured batch size that holds `batch` sequences, or None when none does."""
        return next((b for b in self.buckets if b >= batch), None)

    def run(self, batch: StepBatch, upload: Uploader, fed_back=None, draft_ids=None) -> torch.Tensor:
        return self._replay(self.bucket(len(batch.seq_lens)), batch, upload, fed_back, draft_ids)


class MixedGraphs(_GraphSet):
    """Graphs by (token count T, sequence count S) for any step, S up to min(max_seqs, T); a graph's
    key is its bucket's index in `buckets` (an int, as tensor-parallel replays announce it)."""

    pad_q = 0
    mixed = True

    def __init__(self, model, device, max_tokens: int, max_seqs: int, width: int, block_size: int,
                 hidden_size: int, dtype: torch.dtype):  # fmt: skip
        top = min(max_tokens, TOKEN_BUCKETS[-1])  # bigger steps run eagerly: launches are a small share
        hidden = torch.zeros((top, hidden_size), dtype=dtype, device=device)
        super().__init__(model, device, width, block_size, hidden)
        self.buckets = []  # (tokens, seqs), by tokens then seqs
        for t in [t for t in TOKEN_BUCKETS if t < top] + [top]:
            cap = min(max_seqs, t)
            self.buckets += [(t, s) for s in SEQ_BUCKETS if s < cap] + [(t, cap)]
        self.max_seqs = max_seqs
        self.replays = 0  # steps run through these graphs (tests and stats read it)

    def keys(self) -> list[int]:
        return list(range(len(self.buckets)))

    def _seqs_rows(self, key: int) -> tuple[int, int | None]:
        tokens, seqs = self.buckets[key]
        return seqs, tokens

    def bucket(self, rows: int, seqs: int) -> int | None:
        """The key of the smallest bucket (fewest tokens, then fewest sequences) that holds `rows`
        tokens of `seqs` sequences, or None."""
        return next((i for i, (t, s) in enumerate(self.buckets) if t >= rows and s >= seqs), None)

    def run(self, batch: StepBatch, upload: Uploader, fed_back=None, draft_ids=None) -> torch.Tensor:
        key = self.bucket(len(batch.input_ids), len(batch.seq_lens))
        self.replays += 1
        return self._replay(key, batch, upload, fed_back, draft_ids)


def forward_batch(
    model,
    graphs: dict[int, DecodeGraphs],
    upload: Uploader,
    batch: StepBatch,
    block_size: int,
    fed_back: torch.Tensor | None = None,
    draft_ids: tuple[torch.Tensor, torch.Tensor] | None = None,
    mixed: MixedGraphs | None = None,
) -> torch.Tensor:
    """One forward of a packed step: the captured graph of its query length (`graphs`, by query length)
    when every sequence has the same one and a bucket fits, else a mixed graph (`mixed`) when a token
    bucket fits, else eager. `fed_back`: the input ids of a step's first rows (decodes scheduled ahead),
    on the device. `draft_ids`: (rows, ids) of proposals on the device, written over the 0s packed at
    those input rows."""
    n = len(batch.seq_lens)
    g = graphs.get(batch.uniform_q)
    if g is not None and g.bucket(n) is not None:
        return g.run(batch, upload, fed_back, draft_ids)
    if mixed is not None and mixed.bucket(len(batch.input_ids), n) is not None:
        return mixed.run(batch, upload, fed_back, draft_ids)
    input_ids, positions, meta = eager_inputs(batch, upload, block_size)
    if fed_back is not None:
        input_ids[: fed_back.shape[0]].copy_(fed_back)  # a step scheduled ahead: its first rows
    if draft_ids is not None:
        input_ids.index_copy_(0, *draft_ids)
    with attention_context(meta):
        return model(input_ids, positions)


def eager_inputs(batch: StepBatch, upload: Uploader, block_size: int):
    """(input_ids, positions, metadata) of an eager step on the device, from its two packed buffers; a
    batch of mixed query lengths takes the same attention kernels as a mixed graph."""
    n, width = len(batch.seq_lens), table_width(batch)
    pack(batch, n, width, alloc=upload.array)  # into the uploader's pinned buffers
    i64, i32 = upload.send("i64"), upload.send("i32")
    return unpack(i64, i32, batch, n, width, block_size, mixed=batch.uniform_q is None)
