"""Mixed batches (one-query and many-query sequences in one step) through kernels.ops.attention.

The mixed path (AttentionMetadata.mixed) splits a packed batch between the decode kernel, which takes
the one-query sequences by their cu_seqlens_q rows, and the flat-grid prefill kernel, which takes the
rest: together they must give the torch twin's result on every owned row, for any order of the
sequences, with CUDA-graph padding (sequences with no queries and seq_len 0, rows that no sequence
owns) changing nothing. Each kernel alone must write only its own rows (NaN-poisoned outputs).
Run like tests/test_kernels.py: under TRITON_INTERPRET on CPU, compiled on the GPU (marker gpu).
"""

from __future__ import annotations

from tests.kernel_env import CUDA_OK  # noqa: F401  first: it chooses TRITON_INTERPRET

# isort: split
import dataclasses
import importlib

import pytest
import torch

pytest.importorskip("triton")

from kernels import ops, torch_ops  # noqa: E402
from tests.kernel_helpers import ENVS, Env, close, nan_like, paged_batch, poisoned_empty, rand, use_env  # noqa: E402

pytestmark = pytest.mark.kernels
DECODE = importlib.import_module("kernels.triton_decode_attention")
PREFILL = importlib.import_module("kernels.triton_prefill_attention")


@pytest.fixture(params=ENVS)
def env(request, monkeypatch) -> Env:
    return use_env(request.param, monkeypatch)


# (group, kv_heads, head_dim, page, window, softcap, ctx_lens, q_lens)
MIXED_CASES = [
    (4, 2, 64, 16, None, None, [20, 0, 33, 5], [1, 9, 1, 17]),
    (1, 2, 64, 16, 24, 30.0, [0, 40, 0], [33, 1, 2]),
    (8, 1, 128, 32, None, None, [70, 3, 0, 12, 1], [1, 1, 40, 1, 5]),
    (5, 2, 64, 16, None, None, [33, 0, 70], [1, 50, 19]),
]


def _padded(meta, env: Env, pad_seqs: int, pad_rows: int):
    """`meta` as a CUDA graph of a bigger bucket sees it: pad_seqs sequences with no queries and
    seq_len 0 after the real ones, and pad_rows rows that no sequence owns after the real rows."""
    end = int(meta.cu_seqlens_q[-1])
    dev = meta.cu_seqlens_q.device
    pad_i32 = lambda n, v: torch.full((n,), v, dtype=torch.int32, device=dev)  # noqa: E731
    tables = meta.block_tables
    return dataclasses.replace(
        meta,
        cu_seqlens_q=torch.cat([meta.cu_seqlens_q, pad_i32(pad_seqs, end)]),
        seq_lens=torch.cat([meta.seq_lens, pad_i32(pad_seqs, 0)]),
        block_tables=torch.cat([tables, torch.zeros_like(tables[:1]).expand(pad_seqs, -1)]),
        query_lens_cpu=meta.query_lens_cpu + [0] * pad_seqs,
        seq_lens_cpu=meta.seq_lens_cpu + [0] * pad_seqs,
        mixed=True,
    ), end + pad_rows


@pytest.mark.parametrize("case", MIXED_CASES, ids=lambda c: f"g{c[0]}-d{c[2]}-p{c[3]}-w{c[4]}")
@pytest.mark.parametrize("pad", [(0, 0), (3, 21)], ids=["exact", "padded"])
def test_mixed_batch_matches_twin(env: Env, case, pad, monkeypatch) -> None:
    group, kv_heads, head_dim, page, window, softcap, ctx_lens, q_lens = case
    if env.big:
        ctx_lens, q_lens = ctx_lens + [900, 0], q_lens + [1, 300]
    scale = head_dim**-0.5
    meta, k_cache, v_cache = paged_batch(env, ctx_lens, q_lens, page, kv_heads, head_dim, seed=41)
    ref_q = rand(env, sum(q_lens), group * kv_heads, head_dim, seed=42)
    k_new = ref_q[:, :kv_heads]
    want = torch_ops.attention(ref_q, k_new, k_new, k_cache, v_cache, meta, scale, window, softcap)
    mixed, rows = _padded(meta, env, *pad)
    poisoned_empty(monkeypatch)  # a row neither kernel writes stays NaN
    if env.device == "cpu":  # the Triton branch on CPU tensors: the interpreter
        monkeypatch.setattr(ops, "use_triton", lambda x: True)
    q = torch.cat([ref_q, rand(env, rows - len(ref_q), group * kv_heads, head_dim, seed=43)])
    got = ops.attention(q, q[:, :kv_heads], q[:, :kv_heads], k_cache, v_cache, mixed, scale, window, softcap)
    close(got[: len(ref_q)], want, env)


def test_each_kernel_writes_only_its_own_rows(env: Env) -> None:
    """Decode rows from the decode kernel alone, the others from the flat prefill kernel alone."""
    q_lens, ctx = [1, 7, 1, 16, 2], [30, 0, 17, 4, 50]
    meta, k_cache, v_cache = paged_batch(env, ctx, q_lens, 16, 2, 64, seed=44)
    q = rand(env, sum(q_lens), 8, 64, seed=45)
    want = torch_ops.attention(q, q[:, :2], q[:, :2], k_cache, v_cache, meta, 0.125)
    single = torch.tensor([n == 1 for n in q_lens for _ in range(n)], device=q.device)
    dec = DECODE.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125,
                                  out=nan_like(q), cu_seqlens_q=meta.cu_seqlens_q)  # fmt: skip
    pre = PREFILL.prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, None, 0.125,
                                    block_tables=meta.block_tables, out=nan_like(q), mixed=True)  # fmt: skip
    close(dec[single], want[single], env)
    assert dec[~single].isnan().all()
    close(pre[~single], want[~single], env)
    assert pre[single].isnan().all()


def test_many_sequences_find_their_tiles(env: Env) -> None:
    """The flat grid's tile -> sequence search (cu_q // BLOCK_M + b) over 13 sequences of random query
    counts (zeros among them), 16-row tiles, so most sequences have one: every row as the twin."""
    g = torch.Generator().manual_seed(46)
    q_lens = [int(n) for n in torch.randint(0, 12, (13,), generator=g)]
    q_lens[0], q_lens[5] = 0, 1
    ctx = [int(n) for n in torch.randint(0, 30, (13,), generator=g)]
    meta, k_cache, v_cache = paged_batch(env, ctx, q_lens, 16, 1, 64, seed=47)
    meta = dataclasses.replace(meta, max_seqlen_q=max(q_lens))
    q = rand(env, sum(q_lens), 2, 64, seed=48)
    want = torch_ops.attention(q, q[:, :1], q[:, :1], k_cache, v_cache, meta, 0.125)
    many = torch.tensor([n > 1 for n in q_lens for _ in range(n)], device=q.device)
    pre = PREFILL.prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, None, 0.125,
                                    block_tables=meta.block_tables, block_m=16, block_n=16,
                                    out=nan_like(q), mixed=True)  # fmt: skip
    close(pre[many], want[many], env)
