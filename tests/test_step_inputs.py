"""pack / unpack: the two host buffers carry every step input, and every segment is 16-byte aligned
(Triton specialises kernels on pointer alignment, so a misaligned segment means a recompile whenever a
batch's size changes parity)."""

from __future__ import annotations

import random

import pytest

from engine.runner.step_inputs import StepBatch, pack, unpack

pytestmark = pytest.mark.engine


def _batch(rng: random.Random, num_seqs: int, decode: bool) -> StepBatch:
    b = StepBatch()
    for _ in range(num_seqs):
        n = 1 if decode else rng.randint(1, 9)
        start = rng.randint(0, 40)
        b.input_ids += [rng.randrange(1000) for _ in range(n)]
        b.positions += range(start, start + n)
        b.slot_mapping += [rng.randrange(5000) for _ in range(n)]
        b.query_lens.append(n)
        b.seq_lens.append(start + n)
        b.block_tables.append([rng.randrange(300) for _ in range(rng.randint(1, 6))])
    return b


@pytest.mark.parametrize("num_seqs,bucket,decode", [(1, 1, True), (3, 4, True), (5, 8, True), (6, 6, False),
                                                    (7, 7, False), (2, 2, False)])  # fmt: skip
def test_round_trip_and_alignment(num_seqs: int, bucket: int, decode: bool):
    b = _batch(random.Random(num_seqs * 10 + bucket), num_seqs, decode)
    width = 16
    i64, i32 = pack(b, bucket, width)
    ids, pos, meta = unpack(i64, i32, b, bucket, width, block_size=16)
    pad = bucket - num_seqs
    assert ids.tolist() == b.input_ids + [0] * pad
    assert pos.tolist() == list(b.positions) + [0] * pad
    assert meta.slot_mapping.tolist() == b.slot_mapping + [-1] * pad  # padding writes nothing
    lens = b.query_lens + [1] * pad
    assert meta.cu_seqlens_q.tolist() == [sum(lens[:i]) for i in range(bucket + 1)]
    assert meta.seq_lens.tolist() == b.seq_lens + [1] * pad
    for row, blocks in zip(meta.block_tables.tolist(), b.block_tables):
        assert row[: len(blocks)] == blocks
    for view in (ids, pos, meta.slot_mapping, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables):
        assert (view.data_ptr() - view.untyped_storage().data_ptr()) % 16 == 0


@pytest.mark.parametrize("num_seqs,seqs,rows", [(3, 8, 32), (5, 5, 27), (1, 16, 16)])
def test_mixed_graph_padding(num_seqs: int, seqs: int, rows: int):
    """A mixed graph's padding (pad_q 0): padding sequences own no rows and have seq_len 0, the rows
    past the real ones belong to no sequence and write nothing, and the metadata says `mixed`."""
    b = _batch(random.Random(num_seqs), num_seqs, decode=False)
    real = len(b.input_ids)
    i64, i32 = pack(b, seqs, 16, pad_q=0, rows=rows)
    ids, pos, meta = unpack(i64, i32, b, seqs, 16, block_size=16, pad_q=0, rows=rows, mixed=True)
    assert meta.mixed and ids.shape[0] == rows and pos.shape[0] == rows
    assert ids.tolist() == b.input_ids + [0] * (rows - real)
    assert meta.slot_mapping.tolist() == b.slot_mapping + [-1] * (rows - real)
    cu = meta.cu_seqlens_q.tolist()
    assert cu[: num_seqs + 1] == [sum(b.query_lens[:i]) for i in range(num_seqs + 1)]
    assert cu[num_seqs:] == [real] * (seqs - num_seqs + 1)  # padding sequences: no queries
    assert meta.seq_lens.tolist() == b.seq_lens + [0] * (seqs - num_seqs)
    for view in (ids, pos, meta.slot_mapping, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables):
        assert (view.data_ptr() - view.untyped_storage().data_ptr()) % 16 == 0


@pytest.mark.parametrize("pad_q,rows", [(1, None), (0, 64)])
def test_real_tables_only_is_a_prefix_of_the_full_buffers(pad_q: int, rows: int | None):
    """A graph uploads only up to the real sequences' table rows: that prefix equals the full buffer's."""
    b = _batch(random.Random(3), 5, decode=pad_q == 1)
    full64, full32 = pack(b, 16, 32, pad_q, rows)
    part64, part32 = pack(b, 16, 32, pad_q, rows, real_tables_only=True)
    assert part64.tolist() == full64.tolist()
    assert part32.numel() < full32.numel()
    assert part32.tolist() == full32[: part32.numel()].tolist()
    assert (full32[part32.numel() :] == 0).all()  # the rest: padding rows, never read


@pytest.mark.parametrize("max_tokens,max_seqs", [(2048, 256), (512, 48), (4096, 512)])
def test_mixed_graph_buckets_are_the_smallest_that_hold_the_step(max_tokens: int, max_seqs: int):
    """MixedGraphs.bucket picks, among all (tokens, seqs) buckets it captures, the one with the fewest
    tokens and then the fewest sequences that holds the step (checked against a naive search over every
    pair); no bucket holds more sequences than tokens or than max_seqs, and the keys are the indices."""
    import torch

    from engine.runner.cuda_graph import MixedGraphs

    graphs = MixedGraphs(None, torch.device("cpu"), max_tokens, max_seqs, 8, 16, 4, torch.float32)
    pairs = graphs.buckets
    assert len(set(pairs)) == len(pairs) and graphs.keys() == list(range(len(pairs)))
    assert all(s <= min(t, max_seqs) for t, s in pairs)
    assert {t for t, _ in pairs} == {t for t, s in pairs if s == min(t, max_seqs)}  # each T has its cap
    rng = random.Random(max_tokens + max_seqs)
    for _ in range(300):
        rows = rng.randint(1, max_tokens + 8)
        seqs = rng.randint(1, min(rows, max_seqs + 4))
        fits = [p for p in pairs if p[0] >= rows and p[1] >= seqs]
        key = graphs.bucket(rows, seqs)
        assert (key is None) == (not fits)
        if fits:
            assert pairs[key] == min(fits)
            assert graphs._seqs_rows(key) == (pairs[key][1], pairs[key][0])
