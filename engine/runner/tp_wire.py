"""What rank 0 tells the other tensor-parallel ranks: commands as small int64 headers on a pipe, bulk
tensors by torch.distributed broadcast.

A header is a length-prefixed int64 vector: the command, then its fields. A forward's header gives the
shape of the step (rows, sequences, query and KV lengths, the mixed flag) and where each input tensor
lies in the spans that follow; each span (a contiguous stretch of one storage: in a packed step the
int64 buffer and the int32 buffer of engine/runner/step_inputs.py) then goes in one broadcast. A worker
therefore rebuilds exactly the views rank 0's model reads, after every device-side write rank 0 made
into them (ids fed back from the previous step's samples, draft proposals): the broadcast reads the
buffers in stream order, after those writes. A gated-LoRA MTP step adds its rows' visibility and its
mask rows with their input vectors (engine/runner/mtp_step.py), each a span of its own.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import torch

from engine.models.attention_context import AttentionMetadata, TokenVisibility

FORWARD, LOGITS, COPY, KV, CAPTURE, REPLAY, LORA, EMBED, OWN_LOGITS = range(1, 10)
# span dtype codes: the packed step's integers, and the model's float dtypes (a gated-LoRA MTP step's
# mask-row input vectors)
DTYPES = (torch.int64, torch.int32, torch.bfloat16, torch.float16, torch.float32, torch.float64)
SLOTS = ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables", "lora_slots",
         "vis_ctx", "vis_start", "vis_len", "embed_rows", "embed_vectors")  # fmt: skip
MATRICES = ("block_tables", "embed_vectors")  # the 2-D slots
_LEN = struct.Struct("<q")


def send(fd: int, header: list[int]) -> None:
    """One header down a pipe (a single write: headers stay far below the pipe buffer)."""
    body = np.asarray(header, dtype=np.int64).tobytes()
    os.write(fd, _LEN.pack(len(header)) + body)


def recv(stream) -> list[int] | None:
    """The next header from a binary stream, or None at EOF (rank 0 is gone or closed the group)."""
    raw = stream.read(_LEN.size)
    if len(raw) < _LEN.size:
        return None
    (n,) = _LEN.unpack(raw)
    body = stream.read(8 * n)
    if len(body) < 8 * n:
        return None
    return np.frombuffer(body, dtype=np.int64).tolist()


def _tensors(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> list:
    vis, given = meta.visibility, meta.embed_rows or (None, None)
    vis_tensors = [None] * 3 if vis is None else [vis.ctx_lens, vis.local_start, vis.local_len]
    return [input_ids, positions, meta.slot_mapping, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
            meta.lora_slots, *vis_tensors, *given]  # fmt: skip


def _spans(tensors: list[torch.Tensor | None]) -> tuple[list[torch.Tensor], list[int]]:
    """(spans, placements): one span per distinct storage among `tensors`, a 1-D view from the first
    to the last element they use there; per tensor, (span, offset in it, rows, columns), span -1 for
    an absent one."""
    groups: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None:
            assert t.is_contiguous() and t.dim() <= 2, "step inputs are contiguous views of 1 or 2 dims"
            groups.setdefault((t.untyped_storage().data_ptr(), t.dtype), []).append(t)
    spans, low = [], {}
    for key, members in groups.items():
        lo = min(t.storage_offset() for t in members)
        hi = max(t.storage_offset() + t.numel() for t in members)
        low[key] = (len(spans), lo)
        spans.append(members[0].as_strided((hi - lo,), (1,), lo))
    placements: list[int] = []
    for t in tensors:
        if t is None:
            placements += [-1, 0, 0, 0]
        else:
            at, lo = low[(t.untyped_storage().data_ptr(), t.dtype)]
            placements += [at, t.storage_offset() - lo, t.shape[0], t.shape[1] if t.dim() == 2 else 1]
    return spans, placements


def encode_forward(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
) -> tuple[list[int], list[torch.Tensor]]:
    """(header, spans) of one forward; the spans are broadcast in order after the header."""
    spans, placements = _spans(_tensors(input_ids, positions, meta))
    header = [FORWARD, len(spans)]
    for span in spans:
        header += [DTYPES.index(span.dtype), span.numel()]
    header += placements
    header += [int(meta.mixed), meta.max_seqlen_q, meta.max_seqlen_k, meta.block_size, meta.num_seqs]
    return header + list(meta.query_lens_cpu) + list(meta.seq_lens_cpu), spans


def decode_forward(
    header: list[int], spans: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) as views into `spans`, filled by the broadcasts."""
    at = 2 + 2 * header[1]
    tensors = []
    for i in range(len(SLOTS)):
        span, offset, d0, d1 = header[at + 4 * i : at + 4 * i + 4]
        view = None if span < 0 else spans[span][offset : offset + d0 * d1]
        tensors.append(view.view(d0, d1) if SLOTS[i] in MATRICES and view is not None else view)
    at += 4 * len(SLOTS)
    mixed, max_q, max_k, block_size, n = header[at : at + 5]
    ids, pos, slots, cu, seq_lens, tables, lora_slots, vis_ctx, vis_start, vis_len, rows, vectors = tensors
    meta = AttentionMetadata(
        cu_seqlens_q=cu,
        seq_lens=seq_lens,
        slot_mapping=slots,
        block_tables=tables,
        query_lens_cpu=header[at + 5 : at + 5 + n],
        seq_lens_cpu=header[at + 5 + n : at + 5 + 2 * n],
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        block_size=block_size,
        mixed=bool(mixed),
        lora_slots=lora_slots,
        visibility=None if vis_ctx is None else TokenVisibility(vis_ctx, vis_start, vis_len, pos),
        embed_rows=None if rows is None else (rows, vectors),
    )
    return ids, pos, meta


def span_shapes(header: list[int]) -> list[tuple[torch.dtype, int]]:
    """(dtype, length) of each span a forward's header announces."""
    return [(DTYPES[header[2 + 2 * i]], header[3 + 2 * i]) for i in range(header[1])]


def encode_lora(slot: int, name: str, int_id: int, path: str) -> list[int]:
    """Load adapter (name, int_id, path) into LoRA slot `slot` (each rank reads its share of the file)."""
    raw = json.dumps([name, int_id, path]).encode()
    return [LORA, slot, *raw]


def decode_lora(header: list[int]) -> tuple[int, str, int, str]:
    """(slot, name, int_id, path) of an encode_lora header."""
    name, int_id, path = json.loads(bytes(header[2:]).decode())
    return header[1], name, int_id, path
