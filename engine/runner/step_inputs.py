"""Packing one scheduled step into flat tensors: the only request -> tensor translation.

All integer inputs of a step travel to the device in two host buffers (one int64, one int32), so a
step costs two pinned host-to-device copies however many sequences it has:

    int64: input_ids[R] | positions[R] | slot_mapping[R]
    int32: cu_seqlens_q[S + 1] | seq_lens[S] | lora_slots[R] | block_tables[S * W]

R rows of tokens and S sequences, padded beyond the real batch when a CUDA graph bucket is bigger:
padding tokens have slot -1 (write nothing), padding sequences have one query token, seq_len 1 and
block 0 (finite reads, ignored outputs). W is the block-table width. lora_slots (each row's adapter
slot, -1: none; padding rows -1) is there only with multi-LoRA: a step with an adapter row, or any step
of a CUDA graph captured with LoRA.

Every segment starts on a 16-byte boundary (`Layout`; unused gap entries are never read). Triton
specialises a kernel on whether each pointer argument is 16-byte aligned, so segments at offsets that
follow R or S would compile a new kernel variant whenever a batch's parity changes, a stall of about
a second in the middle of serving (and a first-run penalty in benchmarks).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.device.uploader import NUMPY_DTYPES
from engine.models.attention_context import AttentionMetadata
from engine.sched.output import SchedulerOutput


@dataclass
class StepBatch:
    """Host-side description of one packed step."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # packed index of each sampling chunk's last token
    sample_rows: list[int] = field(default_factory=list)  # for each sampling sequence, its logits row
    samplers: list = field(default_factory=list)
    draw_positions: list[int] = field(default_factory=list)  # for each sampler, the position it draws
    # chunks with proposals (speculative decoding): their sequence, proposal count, and the packed rows
    # whose logits score them (1 + num_draft each, in order); the rows holding the proposals themselves
    # (a draft model's are written on the device: the host packs 0 there)
    spec_samplers: list = field(default_factory=list)
    spec_num_draft: list[int] = field(default_factory=list)
    spec_logit_rows: list[int] = field(default_factory=list)
    spec_draft_rows: list[int] = field(default_factory=list)
    lora_slots: list[int] | None = None  # each row's LoRA adapter slot (-1: none); None: no adapter row
    # (TableMirror, each table's row in it): `pack` gathers the tables from there instead of from
    # block_tables (the same lists); None: from block_tables
    table_rows: tuple | None = None
    # gated-LoRA MTP chunks (engine/runner/mtp_step.py): the rows of their mask tokens (k after each real
    # token, their K/V in scratch slots), and per speculating chunk the row of its pending token
    mask_rows: list[int] = field(default_factory=list)
    mtp_first: list[int] = field(default_factory=list)

    @property
    def shares_logit_rows(self) -> bool:
        """n > 1 siblings draw from one logits row: sample_rows is not one row per logit row."""
        return self.sample_rows != list(range(len(self.logit_rows)))

    @property
    def logits_at_every_row(self) -> bool:
        """Every packed row is a logit row (decode steps): the forward's rows need no gather."""
        return self.logit_rows == list(range(len(self.input_ids)))

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @property
    def uniform_q(self) -> int | None:
        """The query length every sequence shares (CUDA graphs need one), else None."""
        q = self.query_lens[0] if self.query_lens else None
        return q if all(n == q for n in self.query_lens) else None


def build_batch(out: SchedulerOutput, block_size: int, scratch: int = 0) -> StepBatch:
    """The step's rows; `scratch`: the first KV slot the mask tokens of gated-LoRA MTP chunks write."""
    b = StepBatch()
    for chunk in out.chunks:
        seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
        blocks = seq.table.blocks
        # position p lives in block blocks[p // block_size] at offset p % block_size
        if end - start == 1:  # the decode case, kept cheap: it runs for every sequence every step
            # a step scheduled ahead feeds back a token the host has not seen: 0 holds its place
            # until the runner copies the sampled id in on the device
            b.input_ids.append(seq.token_ids[start] if start < len(seq.token_ids) else 0)
            b.positions.append(start)
            b.slot_mapping.append(blocks[start // block_size] * block_size + start % block_size)
        elif chunk.num_draft and seq.mask_tokens:
            _add_mtp_chunk(b, chunk, block_size, scratch)
        elif chunk.num_draft:
            _add_spec_chunk(b, chunk, block_size)
        else:
            b.input_ids += seq.token_ids[start:end]
            b.positions += range(start, end)
            b.slot_mapping += slots(blocks, range(start, end), block_size)
        b.query_lens.append(chunk.num_tokens * (1 + seq.mask_tokens) if chunk.num_draft else chunk.num_tokens)
        b.seq_lens.append(end)
        b.block_tables.append(blocks)
        if chunk.num_draft:
            continue  # its rows are scored by verification, not drawn from
        if chunk.samples:
            b.logit_rows.append(len(b.input_ids) - 1)
            for s in chunk.samples:  # the sampled token lands at position `end`
                b.sample_rows.append(len(b.logit_rows) - 1)
                b.samplers.append(s)
                b.draw_positions.append(end)
    return b


def slots(blocks: list[int], positions, block_size: int) -> list[int]:
    """The flat KV slots of `positions` of a sequence whose block table is `blocks`."""
    return [blocks[p // block_size] * block_size + p % block_size for p in positions]


def _add_spec_chunk(b: StepBatch, chunk, block_size: int) -> None:
    """A decode chunk with proposals: the pending token, then the proposals (host ones, or 0 where a
    draft model writes them on the device), each position scored."""
    seq, start, d = chunk.seq, chunk.start, chunk.num_draft
    first = len(b.input_ids)
    b.input_ids.append(seq.token_ids[start])
    b.input_ids += seq.draft + [0] * (d - len(seq.draft))  # 0: a padded or a draft model's position
    b.positions += range(start, start + d + 1)
    b.slot_mapping += slots(seq.table.blocks, range(start, start + d + 1), block_size)
    b.spec_samplers.append(seq)
    b.spec_num_draft.append(d)
    b.spec_logit_rows += range(first, first + d + 1)
    b.spec_draft_rows += range(first + 1, first + d + 1)


def _add_mtp_chunk(b: StepBatch, chunk, block_size: int, scratch: int) -> None:
    """A gated-LoRA MTP chunk: [x0, m1..mk, x1, m1..mk, ..., xd, m1..mk], x0 the pending token and x1..xd
    the proposals (0 where padded). x_j sits at position start + j in its KV slot; its masks m_i at
    start + j + i write scratch slots (no position of the sequence) and get their input vectors and the
    gated LoRA from the runner. Only the x_j rows are scored."""
    seq, start, d, k = chunk.seq, chunk.start, chunk.num_draft, chunk.seq.mask_tokens
    real = [seq.token_ids[start], *seq.draft, *[0] * (d - len(seq.draft))]
    real_slots = slots(seq.table.blocks, range(start, start + d + 1), block_size)
    b.mtp_first.append(len(b.input_ids))
    for j, (token, slot) in enumerate(zip(real, real_slots)):
        row, free = len(b.input_ids), scratch + len(b.mask_rows)
        b.input_ids += [token] + [0] * k
        b.positions += range(start + j, start + j + k + 1)
        b.slot_mapping += [slot, *range(free, free + k)]
        b.spec_logit_rows.append(row)
        b.mask_rows += range(row + 1, row + k + 1)
    b.spec_samplers.append(seq)
    b.spec_num_draft.append(d)


@dataclass
class PromptLogprobRows:
    """The packed rows whose logits score prompt tokens (SamplingParams.prompt_logprobs): the logits of
    rows[i] predict token targets[i]. Per marked chunk, one span (sequence, prompt position of its first
    target, number of targets, whether the chunk completes the prompt): a chunk over positions
    [start, end) scores the tokens at start + 1 .. min(end, num_prompt - 1); the prompt's last position
    predicts the first output token, the sampler's job."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    spans: list[tuple] = field(default_factory=list)
    k: int = 0  # the widest top-k any span asks for


def prompt_logprob_rows(out: SchedulerOutput, b: StepBatch) -> PromptLogprobRows:
    """The rows of `out.prompt_logprob_chunks` (only built for steps that have some)."""
    offsets = [0, *itertools.accumulate(b.query_lens)]
    plan = PromptLogprobRows()
    for i in out.prompt_logprob_chunks:
        chunk = out.chunks[i]
        seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
        count = max(0, min(end, seq.num_prompt - 1) - start)
        plan.rows += range(offsets[i], offsets[i] + count)
        plan.targets += seq.token_ids[start + 1 : start + 1 + count]
        plan.spans.append((seq, start + 1, count, end >= seq.num_prompt))
        plan.k = max(plan.k, seq.request.params.prompt_logprobs)
    return plan


def _up(n: int, k: int) -> int:
    return -(-n // k) * k


def table_width(b: StepBatch) -> int:
    """Block-table width of an eager step: the longest table, rounded up to 16 entries. The width is
    the table's row stride, a kernel argument, and Triton compiles one variant for strides divisible
    by 16 and another for the rest."""
    return _up(max(len(t) for t in b.block_tables), 16)


@dataclass(frozen=True)
class Layout:
    """Segment offsets (in elements) of the two buffers for `rows` tokens and `num_seqs` sequences:
    each rounded up to 16 bytes, i.e. 2 int64 or 4 int32 entries."""

    rows: int
    num_seqs: int
    lora: bool = False  # a lora_slots segment between seq_lens and the block tables

    @property
    def row_stride(self) -> int:  # int64 segments: ids at 0, positions at 1x, slots at 2x this
        return _up(self.rows, 2)

    @property
    def seq_lens_at(self) -> int:  # int32: cu_seqlens_q at 0
        return _up(self.num_seqs + 1, 4)

    @property
    def lora_at(self) -> int:
        return self.seq_lens_at + _up(self.num_seqs, 4)

    @property
    def tables_at(self) -> int:
        return self.lora_at + (_up(self.rows, 4) if self.lora else 0)


# alloc(slot, n, dtype): the array a packed buffer is written into
Alloc = Callable[[str, int, torch.dtype], np.ndarray]


def _fresh(slot: str, n: int, dtype: torch.dtype) -> np.ndarray:
    return np.empty(n, dtype=NUMPY_DTYPES[dtype])


def pack(
    b: StepBatch,
    num_seqs: int,
    width: int,
    pad_q: int = 1,
    rows: int | None = None,
    real_tables_only: bool = False,
    lora: bool | None = None,
    alloc: Alloc | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two host buffers, padded to `num_seqs` sequences (>= the real count; padding only for
    CUDA-graph steps) and block-table width `width`. Padding sequences have `pad_q` query tokens and
    seq_len pad_q; unless `rows` is given (a mixed graph's bucket), the row count follows from them.

    real_tables_only: the int32 buffer ends after the real sequences' table rows, a prefix of the full
    one for a graph's static buffer: the padding rows there keep what an earlier step left, block ids
    of the pool, which a padding sequence reads at most one key of and never uses.
    lora: write the lora_slots segment (None: when the batch has adapter rows).
    alloc(slot, n, dtype): the numpy array each buffer is written into ("i64", "i32"; the Uploader's
    pinned buffers on a GPU), every entry of it written here; default a fresh array."""
    pad = num_seqs - len(b.seq_lens)
    if rows is None:
        rows = len(b.input_ids) + pad * pad_q
    lay = Layout(rows, num_seqs, b.lora_slots is not None if lora is None else lora)
    alloc = alloc or _fresh
    i64 = alloc("i64", 3 * lay.row_stride, torch.int64)
    _pack_rows(i64, b, lay)
    table_rows = len(b.block_tables) if real_tables_only else num_seqs
    i32 = alloc("i32", lay.tables_at + table_rows * width, torch.int32)
    i32[: lay.tables_at] = 0
    i32[1 : len(b.query_lens) + 1] = np.cumsum(b.query_lens)
    i32[len(b.query_lens) + 1 : num_seqs + 1] = i32[len(b.query_lens)] + pad_q * np.arange(1, pad + 1)
    i32[lay.seq_lens_at : lay.seq_lens_at + num_seqs] = b.seq_lens + [pad_q] * pad
    if lay.lora:
        i32[lay.lora_at : lay.lora_at + rows] = -1
        i32[lay.lora_at : lay.lora_at + len(b.lora_slots or ())] = b.lora_slots or ()
    _pack_tables(i32[lay.tables_at :].reshape(table_rows, width), b)
    return torch.from_numpy(i64), torch.from_numpy(i32)


def _pack_rows(i64: np.ndarray, b: StepBatch, lay: Layout) -> None:
    """ids | positions | slots, each segment `row_stride` long: padding ids and positions 0, padding
    slots -1 (they write nothing)."""
    r, n = lay.row_stride, len(b.input_ids)
    i64[:n] = b.input_ids
    i64[n:r] = 0
    i64[r : r + len(b.positions)] = b.positions
    i64[r + len(b.positions) : 2 * r] = 0
    i64[2 * r : 2 * r + len(b.slot_mapping)] = b.slot_mapping
    i64[2 * r + len(b.slot_mapping) :] = -1


def _pack_tables(tables: np.ndarray, b: StepBatch) -> None:
    """The real sequences' block tables, then 0 (block 0) in any padding rows. Entries past a
    sequence's last block are never read, whatever they hold."""
    n = len(b.block_tables)
    if b.table_rows is not None:
        b.table_rows[0].gather(b.table_rows[1], tables[:n])
    else:
        tables[:n] = 0
        for row, blocks in zip(tables, b.block_tables):
            row[: len(blocks)] = blocks
    tables[n:] = 0


def unpack(
    i64: torch.Tensor,
    i32: torch.Tensor,
    b: StepBatch,
    num_seqs: int,
    width: int,
    block_size: int,
    pad_q: int = 1,
    rows: int | None = None,
    mixed: bool = False,
    lora: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) as views into the two buffers, on whatever device they are;
    padding as `pack` made it. `mixed`: attention splits the batch by query count on the device
    (AttentionMetadata.mixed), which any batch allows and a mixed graph needs. lora: as in `pack`."""
    pad = num_seqs - len(b.seq_lens)
    lora = b.lora_slots is not None if lora is None else lora
    lay = Layout(sum(b.query_lens) + pad * pad_q if rows is None else rows, num_seqs, lora)
    rows, r = lay.rows, lay.row_stride
    meta = AttentionMetadata(
        cu_seqlens_q=i32[: num_seqs + 1],
        seq_lens=i32[lay.seq_lens_at : lay.seq_lens_at + num_seqs],
        slot_mapping=i64[2 * r : 2 * r + rows],
        block_tables=i32[lay.tables_at :].view(num_seqs, width),
        query_lens_cpu=b.query_lens + [pad_q] * pad,
        seq_lens_cpu=b.seq_lens + [pad_q] * pad,
        max_seqlen_q=max(b.query_lens),
        max_seqlen_k=max(b.seq_lens) if pad == 0 else width * block_size,
        block_size=block_size,
        mixed=mixed,
        lora_slots=i32[lay.lora_at : lay.lora_at + rows] if lora else None,
    )
    return i64[:rows], i64[r : r + rows], meta
