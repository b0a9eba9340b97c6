"""Shared pieces of the kernel tests (tests/test_kernels*.py): where they run, inputs, paged batches.

Env says where a case runs: the Triton interpreter on CPU tensors (fp32, small shapes) or compiled
kernels on CUDA (bigger shapes). Outputs are poisoned with NaN (nan_like, poisoned_empty) and KV-cache
slots that no sequence owns hold NaN, so a missed store or a stray read shows up as a NaN mismatch.
"""

from __future__ import annotations

from tests.kernel_env import CUDA_OK, interpreter_usable  # first: it chooses TRITON_INTERPRET

# isort: split
import math
from dataclasses import dataclass

import pytest
import torch

from engine.models.attention_context import AttentionMetadata
from kernels import torch_ops

INTERP_OK = interpreter_usable()
INTERP_SKIP = (
    "needs TRITON_INTERPRET=1 set before triton is first imported (else test_interpreter_subprocess)"
)


@dataclass(frozen=True)
class Env:
    device: str
    dtype: torch.dtype
    atol: float
    rtol: float

    @property
    def big(self) -> bool:
        return self.device == "cuda"


ENVS = [
    pytest.param(Env("cpu", torch.float32, 3e-5, 1e-5), id="interp",
                 marks=pytest.mark.skipif(not INTERP_OK, reason=INTERP_SKIP)),
    pytest.param(Env("cuda", torch.bfloat16, 2e-2, 2e-2), id="gpu-bf16",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")]),
    pytest.param(Env("cuda", torch.float32, 1e-4, 1e-4), id="gpu-fp32",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")]),
]  # fmt: skip


def use_env(env: Env, monkeypatch) -> Env:
    """Body of each kernel test module's `env` fixture (params=ENVS)."""
    if env.device == "cuda":  # fp32 twins must not silently drop to TF32 matmuls
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    return env


def rand(env: Env, *shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(env.dtype).to(env.device)


def nan_like(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def close(actual: torch.Tensor, expected: torch.Tensor, env: Env, scale: float = 1.0) -> None:
    torch.testing.assert_close(actual, expected, atol=env.atol * scale, rtol=env.rtol)


def paged_batch(
    env: Env, ctx_lens, q_lens, page: int, kv_heads: int, head_dim: int, seed: int = 0, cache_dtype=None
):
    """Random paged caches for len(q_lens) sequences with shuffled block tables (-1 padded, one spare
    column); slots no sequence owns hold NaN. Returns (meta, k_cache, v_cache); meta.slot_mapping holds
    the slots of the q_lens new tokens. The caches are of env.dtype, or of cache_dtype (e.g. fp8) with
    the values stored as torch_ops.to_cache_dtype rounds them."""
    cache_dtype = cache_dtype or env.dtype
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    needed = [math.ceil(s / page) for s in seq_lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), max(needed) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(needed):
        tables[b, :n] = order[used : used + n].to(torch.int32)
        used += n
    # slot of position p of sequence b: table[b, p // page] * page + p % page
    slots = [[int(tables[b, p // page]) * page + p % page for p in range(s)] for b, s in enumerate(seq_lens)]
    owned = torch.tensor([x for row in slots for x in row], dtype=torch.long)
    caches = []
    for i in range(2):
        cache = torch.full((num_blocks, page, kv_heads, head_dim), float("nan"), dtype=cache_dtype)
        values = rand(env, len(owned), kv_heads, head_dim, seed=seed + i).cpu()
        cache.view(-1, kv_heads, head_dim)[owned] = torch_ops.to_cache_dtype(values, cache_dtype)
        caches.append(cache.to(env.device))
    new_slots = torch.tensor([x for c, row in zip(ctx_lens, slots) for x in row[c:]], dtype=torch.long)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=env.device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=env.device),
        slot_mapping=new_slots.to(env.device),
        block_tables=tables.to(env.device),
        query_lens_cpu=list(q_lens),
        seq_lens_cpu=seq_lens,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
        block_size=page,
    )
    return meta, caches[0], caches[1]


def fused_qkv(env: Env, tokens: int, q_heads: int, kv_heads: int, head_dim: int, seed: int):
    """q, k, v as strided views of one fused qkv projection [T, (Hq + 2 Hk) * D], as the layer splits it."""
    qkv = rand(env, tokens, q_heads + 2 * kv_heads, head_dim, seed=seed)
    return qkv[:, :q_heads], qkv[:, q_heads : q_heads + kv_heads], qkv[:, q_heads + kv_heads :]


def store_kv_with_twin(store_kv, kv: torch.Tensor, kv_heads: int, k_cache, v_cache, slots):
    """Split kv [T, 2 Hk, D] into strided k / v views (as from a fused projection), store them into the
    caches with `store_kv` and into clones with the twin; returns the twin's (k_cache, v_cache)."""
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_ops.store_kv(k, v, ref_k, ref_v, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    return ref_k, ref_v


def poisoned_empty(monkeypatch) -> None:
    """torch.empty hands out NaN-filled float tensors, so an output element the kernel misses shows up."""
    real = torch.empty

    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", empty)


def check_decode_case(env: Env, case, monkeypatch, cache_dtype=None) -> None:
    """Paged decode attention against its twin for one (group, kv_heads, head_dim, page, window, softcap,
    seq_lens, num_splits) case over caches of env.dtype or cache_dtype; partial buffers start as NaN."""
    from kernels import arrivals
    from kernels import triton_decode_attention as dec

    group, kv_heads, head_dim, page, window, softcap, seq_lens, splits = case
    if env.big:
        kv_heads, seq_lens = kv_heads * 4, seq_lens + [777, 2053]
    real_alloc = dec._alloc_partials
    monkeypatch.setattr(dec, "_alloc_partials", lambda *a: tuple(nan_like(t) for t in real_alloc(*a)))
    if not env.big:  # short rows: 16-key tiles, so a row spans several non-empty splits to merge,
        monkeypatch.setattr(dec, "decode_config", lambda *_: (16, 4, 2))
        monkeypatch.setattr(dec, "MERGE_TILE", 256)  # which the last split merges a few at a time
    meta, k_cache, v_cache = paged_batch(env, [s - 1 for s in seq_lens], [1] * len(seq_lens), page,
                                         kv_heads, head_dim, cache_dtype=cache_dtype)  # fmt: skip
    q = rand(env, len(seq_lens), group * kv_heads, head_dim, seed=11)
    scale = head_dim**-0.5
    k_new = q[:, :kv_heads]  # the twin reads keys from the cache; k only fixes the head count
    ref = torch_ops.attention(q, k_new, k_new, k_cache, v_cache, meta, scale, window, softcap)
    out = dec.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window,
                               softcap, num_splits=splits, out=nan_like(q))  # fmt: skip
    close(out, ref, env)
    assert not arrivals._BUFFERS[q.device][-1].any()  # every merging split reset its arrival counter
