"""Attention with per-row visibility (AttentionMetadata.visibility, gated LoRA self-speculation).

A speculating sequence's chunk is [x0, m1..mk, x1, m1..mk, ..., xa, m1..mk]: real token x_j at position
base + j is stored at its cache position and sees the cache causally; mask m_i after x_j (position
base + j + i) sees cache positions <= base + j and the masks m_1..m_i of its own group, whose K/V sit in
scratch slots of the pool (slot_mapping), not at their positions. Batches mix such sequences with
chunked prefills and one-query decodes. The reference is a dense softmax over an explicit list of cache
slots per row, built here from that description alone; the torch twin and the Triton kernels (the
per-sequence grid and the mixed path: decode kernel + flat prefill grid, CUDA-graph padding included)
must match it. Causal values in the visibility must give attention without visibility, bit for bit in
the twin. Run like tests/test_kernels.py: under TRITON_INTERPRET on CPU, compiled on the GPU.
"""

from __future__ import annotations

from tests.kernel_env import CUDA_OK  # noqa: F401  first: it chooses TRITON_INTERPRET

# isort: split
import dataclasses
import importlib
import math
import random
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from engine.models.attention_context import AttentionMetadata, TokenVisibility  # noqa: E402
from kernels import ops, torch_ops  # noqa: E402
from tests.kernel_helpers import ENVS, Env, close, paged_batch, poisoned_empty, rand, use_env  # noqa: E402

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]
PREFILL = importlib.import_module("kernels.triton_prefill_attention")
FP8 = torch.float8_e4m3fn


@pytest.fixture(params=ENVS)
def env(request, monkeypatch) -> Env:
    return use_env(request.param, monkeypatch)


@dataclass(frozen=True)
class Seq:
    ctx: int  # positions cached before this step (base)
    q_len: int = 1  # ordinary causal rows (chunked prefill, or a decode when 1); unused when k > 0
    k: int = 0  # mask tokens after each real token: the speculative layout when > 0
    a: int = 0  # proposals x1..xa

    def rows(self) -> list[tuple[int, int, int | None]]:
        """(position, ctx_len, i) per row, in packed order; i: the mask index, None for a stored token."""
        if not self.k:
            return [(self.ctx + j, self.ctx + j + 1, None) for j in range(self.q_len)]
        out = []
        for j in range(self.a + 1):
            pos = self.ctx + j
            out += [(pos, pos + 1, None)] + [(pos + i, pos + 1, i) for i in range(1, self.k + 1)]
        return out

    @property
    def seq_len(self) -> int:  # positions in the cache after this step: real tokens only
        return self.ctx + (self.a + 1 if self.k else self.q_len)


SEQS = [Seq(5, q_len=7), Seq(9), Seq(6, k=2), Seq(3, k=3, a=1), Seq(2), Seq(11, k=2, a=2),
        Seq(1, k=3, a=3), Seq(0, q_len=18), Seq(7, k=5, a=5), Seq(20)]  # fmt: skip
# (group, kv_heads, head_dim, page, window, softcap, cache dtype: None = the env's)
CASES = [
    (2, 2, 16, 4, None, None, None),
    (4, 1, 32, 16, 5, None, None),
    (1, 2, 16, 16, None, 20.0, None),
    (2, 1, 16, 4, 7, 10.0, FP8),
]


def build(env: Env, seqs: list[Seq], page: int, kv_heads: int, head_dim: int, window, cache_dtype, seed=0):
    """(meta with visibility, k_cache, v_cache, visible): shuffled blocks, the masks' K/V in scratch
    slots outside every block table, NaN in unowned slots; visible[t] lists the flat cache slots row t
    sees, from the layout alone."""
    rng = random.Random(seed)
    blocks = [math.ceil(s.seq_len / page) for s in seqs]
    n_masks = sum(i is not None for s in seqs for *_, i in s.rows())
    num_blocks = sum(blocks) + math.ceil(n_masks / page) + 2
    order = rng.sample(range(num_blocks), num_blocks)
    tables, used = [], 0
    for n in blocks:
        tables.append(order[used : used + n])
        used += n
    scratch = [b * page + o for b in order[used:] for o in range(page)]
    rng.shuffle(scratch)
    slot_of = lambda b, p: tables[b][p // page] * page + p % page  # noqa: E731
    slots, vis, visible, cu = [], [], [], [0]
    for b, s in enumerate(seqs):
        group_start = None
        for pos, ctx_len, i in s.rows():
            row = len(slots)
            if i == 1:
                group_start = row
            slots.append(slot_of(b, pos) if i is None else scratch.pop())
            local = [] if i is None else list(range(group_start, row + 1))
            vis.append((ctx_len, local[0] if local else 0, len(local), pos))
            cached = [slot_of(b, j) for j in range(ctx_len) if window is None or pos - j < window]
            visible.append(cached + [slots[r] for r in local])
        cu.append(len(slots))
    owned = sorted({slot_of(b, p) for b, s in enumerate(seqs) for p in range(s.seq_len)} | set(slots))
    caches = []
    for n in range(2):
        cache = torch.full((num_blocks * page, kv_heads, head_dim), float("nan"), dtype=cache_dtype)
        values = rand(env, len(owned), kv_heads, head_dim, seed=seed + n).cpu()
        cache[owned] = torch_ops.to_cache_dtype(values, cache_dtype)
        caches.append(cache.view(num_blocks, page, kv_heads, head_dim).to(env.device))
    width = max(blocks) + 1
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=env.device)  # noqa: E731
    cols = list(zip(*vis))
    meta = AttentionMetadata(
        cu_seqlens_q=i32(cu),
        seq_lens=i32([s.seq_len for s in seqs]),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=env.device),
        block_tables=table.to(env.device),
        query_lens_cpu=[b - a for a, b in zip(cu, cu[1:])],
        seq_lens_cpu=[s.seq_len for s in seqs],
        max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])),
        max_seqlen_k=max(s.seq_len for s in seqs),
        block_size=page,
        visibility=TokenVisibility(i32(cols[0]), i32(cols[1]), i32(cols[2]), i32(cols[3]).long()),
    )
    return meta, caches[0], caches[1], visible


def reference(q, k_cache, v_cache, visible, group: int, scale: float, softcap) -> torch.Tensor:
    """float64 softmax attention of each row over exactly the cache slots it lists."""
    k_flat, v_flat = k_cache.flatten(0, 1).double(), v_cache.flatten(0, 1).double()
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for t, slots in enumerate(visible):
        idx = torch.tensor(slots, device=q.device)
        keys = k_flat[idx].repeat_interleave(group, dim=1)  # [n, Hq, D]
        values = v_flat[idx].repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[t].double(), keys) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        out[t] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), values)
    return out


def padded(meta, pad_seqs: int, pad_rows: int):
    """`meta` as a mixed CUDA graph of a bigger bucket sees it: sequences with no queries and seq_len 0,
    then rows no sequence owns (visibility 0, slot -1)."""
    end, dev = int(meta.cu_seqlens_q[-1]), meta.cu_seqlens_q.device
    fill = lambda t, n, v: torch.cat([t, torch.full((n,), v, dtype=t.dtype, device=dev)])  # noqa: E731
    vis = meta.visibility
    tables = meta.block_tables
    return dataclasses.replace(
        meta,
        cu_seqlens_q=fill(meta.cu_seqlens_q, pad_seqs, end),
        seq_lens=fill(meta.seq_lens, pad_seqs, 0),
        slot_mapping=fill(meta.slot_mapping, pad_rows, -1),
        block_tables=torch.cat([tables, torch.zeros_like(tables[:1]).expand(pad_seqs, -1)]),
        query_lens_cpu=meta.query_lens_cpu + [0] * pad_seqs,
        seq_lens_cpu=meta.seq_lens_cpu + [0] * pad_seqs,
        mixed=True,
        visibility=TokenVisibility(
            *(fill(getattr(vis, f.name), pad_rows, 0) for f in dataclasses.fields(vis))
        ),
    )


def small_tiles(monkeypatch) -> None:
    """16 x 16 prefill tiles: long rows cross tile edges, a tile's local rows need two passes."""
    monkeypatch.setattr(PREFILL, "prefill_config", lambda *a, **kw: (16, 16, 4, 1))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"g{c[0]}-d{c[2]}-p{c[3]}-w{c[4]}-cap{c[5]}-{c[6]}")
def test_twin_matches_reference(case) -> None:
    group, kv_heads, head_dim, page, window, softcap, cache_dtype = case
    env = Env("cpu", torch.float64, 1e-12, 1e-12)
    meta, k_cache, v_cache, visible = build(
        env, SEQS, page, kv_heads, head_dim, window, cache_dtype or env.dtype
    )
    q = rand(env, len(visible), group * kv_heads, head_dim, seed=5)
    scale = head_dim**-0.5
    k_cache, v_cache = k_cache.double(), v_cache.double()  # the fp8 values, exactly
    got = torch_ops.attention(
        q, q[:, :kv_heads], q[:, :kv_heads], k_cache, v_cache, meta, scale, window, softcap
    )
    close(got, reference(q, k_cache, v_cache, visible, group, scale, softcap), env)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"g{c[0]}-d{c[2]}-p{c[3]}-w{c[4]}-cap{c[5]}-{c[6]}")
@pytest.mark.parametrize("mixed", [False, True], ids=["varlen", "mixed-padded"])
def test_triton_matches_reference(env: Env, case, mixed: bool, monkeypatch) -> None:
    group, kv_heads, head_dim, page, window, softcap, cache_dtype = case
    meta, k_cache, v_cache, visible = build(
        env, SEQS, page, kv_heads, head_dim, window, cache_dtype or env.dtype
    )
    rows = len(visible)
    if mixed:
        meta, rows = padded(meta, 2, 5), rows + 5
    q = rand(env, rows, group * kv_heads, head_dim, seed=5)
    scale = head_dim**-0.5
    want = reference(q[: len(visible)], k_cache, v_cache, visible, group, scale, softcap)
    small_tiles(monkeypatch)
    poisoned_empty(monkeypatch)  # a row no kernel writes stays NaN
    monkeypatch.setattr(ops, "use_triton", lambda x: True)
    got = ops.attention(q, q[:, :kv_heads], q[:, :kv_heads], k_cache, v_cache, meta, scale, window, softcap)
    close(got[: len(visible)].double(), want.to(env.dtype).double(), env)


@pytest.mark.parametrize("k", [3, 4])
def test_shipped_tiles_match_reference_on_mtp_chunks(env: Env, k: int, monkeypatch) -> None:
    """The tiles prefill_config ships for (k + 1)^2-row chunks (16 rows at k = 3, one 32-row tile at
    k = 4), not the small test tiles: every row of a chunk sits in one tile, keys past the context
    span several BLOCK_N tiles, and the local rows take the second loop."""
    seqs = [Seq(70, k=k, a=k), Seq(9, k=k, a=k), Seq(33, k=k, a=1)]
    meta, k_cache, v_cache, visible = build(env, seqs, 16, 2, 32, None, env.dtype, seed=3)
    assert PREFILL.prefill_config(32, False, meta.max_seqlen_q)[0] == (16 if k == 3 else 32)
    q = rand(env, len(visible), 4, 32, seed=4)
    want = reference(q, k_cache, v_cache, visible, 2, 32**-0.5, None)
    poisoned_empty(monkeypatch)
    monkeypatch.setattr(ops, "use_triton", lambda x: True)
    got = ops.attention(q, q[:, :2], q[:, :2], k_cache, v_cache, meta, 32**-0.5)
    close(got.double(), want.to(env.dtype).double(), env)


@pytest.mark.parametrize("window", [None, 6])
def test_causal_visibility_is_attention_without_it(env: Env, window, monkeypatch) -> None:
    ctx_lens, q_lens = [5, 9, 0, 2, 30], [7, 1, 18, 3, 1]
    meta, k_cache, v_cache = paged_batch(env, ctx_lens, q_lens, 4, 2, 16, seed=7)
    vis = dataclasses.replace(meta, visibility=TokenVisibility.causal(q_lens, meta.seq_lens_cpu, env.device))
    q = rand(env, sum(q_lens), 4, 16, seed=8)
    args = (q, q[:, :2], q[:, :2], k_cache, v_cache)
    want = torch_ops.attention(*args, meta, 0.25, window, 30.0)
    assert torch.equal(torch_ops.attention(*args, vis, 0.25, window, 30.0), want)
    small_tiles(monkeypatch)
    monkeypatch.setattr(ops, "use_triton", lambda x: True)
    for mixed in (False, True):
        plain = ops.attention(*args, dataclasses.replace(meta, mixed=mixed), 0.25, window, 30.0)
        close(ops.attention(*args, dataclasses.replace(vis, mixed=mixed), 0.25, window, 30.0), plain, env)
        close(plain, want, env)


def test_one_query_sequence_must_be_causal() -> None:
    """The decode kernel knows no visibility, so the twin refuses a one-query row with local keys."""
    env = Env("cpu", torch.float32, 0, 0)
    meta, k_cache, v_cache, visible = build(env, [Seq(4, k=2), Seq(3)], 4, 1, 16, None, torch.float32)
    meta.visibility.local_len[-1], meta.visibility.local_start[-1] = 1, 1
    q = rand(env, len(visible), 1, 16, seed=9)
    with pytest.raises(ValueError, match="one-query"):
        torch_ops.attention(q, q, q, k_cache, v_cache, meta, 0.25)
