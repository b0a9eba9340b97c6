"""The KV-cache kernels over an fp8 (e4m3) cache, against their torch twins.

Writers (store_kv, rope_store_kv) must store what torch_ops.to_cache_dtype stores: values clamped to
+-448 and rounded to nearest even, so out-of-range keys saturate instead of turning into NaN. Readers
(decode and prefill attention) must give the twin's result over the same fp8 values, which they upcast
exactly.

The stored bytes must match the twin's exactly. On the GPU the writers get arbitrary values. Under the
interpreter they get values already on the fp8 grid (or beyond +-448): its float -> fp8 conversion
(triton/runtime/interpreter.py, _convert_float) rounds half up and does not carry a mantissa round-up
into the exponent (7.99 becomes 4.0), so only conversions that need no rounding can be checked there.
"""

from __future__ import annotations

from tests.kernel_env import CUDA_OK  # first: it chooses TRITON_INTERPRET

# isort: split
import importlib

import pytest
import torch

pytest.importorskip("triton")

from kernels import torch_ops  # noqa: E402
from tests.kernel_helpers import (  # noqa: E402
    ENVS,
    INTERP_OK,
    INTERP_SKIP,
    Env,
    check_decode_case,
    close,
    fused_qkv,
    nan_like,
    paged_batch,
    rand,
    store_kv_with_twin,
    use_env,
)

pytestmark = pytest.mark.kernels
FP8 = torch.float8_e4m3fn
K = {
    name: importlib.import_module(f"kernels.{name}")
    for name in ("triton_kv", "triton_rope", "triton_decode_attention", "triton_prefill_attention")
}


@pytest.fixture(params=ENVS)
def env(request, monkeypatch) -> Env:
    return use_env(request.param, monkeypatch)


# The readers also under the interpreter with bf16 queries: over an fp8 cache those dot in fp16
# (triton_attn_common.dot_dtype_for), a path fp32 queries never take.
READER_ENVS = [
    *ENVS,
    pytest.param(Env("cpu", torch.bfloat16, 2e-2, 2e-2), id="interp-bf16",
                 marks=pytest.mark.skipif(not INTERP_OK, reason=INTERP_SKIP)),
]  # fmt: skip


def _snap(x: torch.Tensor) -> torch.Tensor:
    """x with every value within +-448 moved onto the fp8 grid (the interpreter cannot round; above)."""
    inside = x.abs() <= torch_ops.FP8_MAX
    return torch.where(inside, torch_ops.to_cache_dtype(x, FP8).to(x.dtype), x)


def _wide_range(env: Env, *shape: int, seed: int) -> torch.Tensor:
    """Random values with a few far beyond fp8's +-448 and a few in its subnormal range."""
    x = rand(env, *shape, seed=seed, scale=4.0).float().cpu()
    flat = x.view(-1)
    flat[::7] *= 500.0  # saturate
    flat[3::11] *= 1e-3  # near zero: fp8 subnormals
    return (x if env.big else _snap(x)).to(env.dtype).to(env.device)


def _same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two fp8 caches hold the same bytes (NaN, the unwritten slots, included)."""
    assert got.dtype == want.dtype == FP8
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _nan_caches(env: Env, blocks: int, page: int, kv_heads: int, head_dim: int):
    cache = torch.full((blocks, page, kv_heads, head_dim), float("nan"), dtype=FP8, device=env.device)
    return cache, cache.clone()


@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_store_kv_into_fp8_cache(env: Env, tokens: int) -> None:
    kv_heads, head_dim = (8, 128) if env.big else (2, 64)
    k_cache, v_cache = _nan_caches(env, tokens + 2, 16, kv_heads, head_dim)
    slots = torch.randperm(k_cache.shape[0] * 16, generator=torch.Generator().manual_seed(1))[:tokens]
    slots[1::3] = -1  # CUDA-graph padding rows store nothing
    slots = slots.to(env.device)
    kv = _wide_range(env, tokens, 2 * kv_heads, head_dim, seed=2)
    ref_k, ref_v = store_kv_with_twin(K["triton_kv"].store_kv, kv, kv_heads, k_cache, v_cache, slots)
    _same_fp8(k_cache, ref_k)
    _same_fp8(v_cache, ref_v)
    written = k_cache.view(-1, kv_heads, head_dim)[slots[slots >= 0]].float()
    assert not written.isnan().any() and written.abs().max() == torch_ops.FP8_MAX  # saturated, not NaN
    assert k_cache.float().isnan().sum() == ref_k.float().isnan().sum()  # unwritten slots stay NaN


@pytest.mark.parametrize("norm_offset", [None, 1.0], ids=["no-norm", "norm-offset1"])
def test_rope_store_kv_into_fp8_cache(env: Env, norm_offset) -> None:
    if norm_offset is not None and not env.big:
        pytest.skip("the interpreter cannot round to fp8, and a normalised k is off the grid (docstring)")
    tokens, q_heads, kv_heads, head_dim = (33, 32, 8, 128) if env.big else (7, 6, 2, 64)
    q, k, v = fused_qkv(env, tokens, q_heads, kv_heads, head_dim, seed=3)
    k.copy_(_wide_range(env, tokens, kv_heads, head_dim, seed=7))
    v.copy_(_wide_range(env, tokens, kv_heads, head_dim, seed=8))
    g = torch.Generator().manual_seed(4)
    positions = torch.randint(0, 64, (tokens,), generator=g).to(env.device)
    cos_sin = rand(env, 64, head_dim, seed=5).float()
    if not env.big:  # the identity rotation (cos 1, sin 0) keeps k on the fp8 grid
        cos_sin = torch.cat([torch.ones(64, head_dim // 2), torch.zeros(64, head_dim // 2)], dim=1)
    k_cache, v_cache = _nan_caches(env, tokens + 2, 16, kv_heads, head_dim)
    slots = torch.randperm(k_cache.shape[0] * 16, generator=g)[:tokens]
    slots[::4] = -1
    slots = slots.to(env.device)
    norm = {}
    if norm_offset is not None:
        w = rand(env, 2, head_dim, seed=6, scale=0.5)
        norm = dict(q_norm_weight=w[0], k_norm_weight=w[1], norm_eps=1e-6, norm_offset=norm_offset)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q_ref = torch_ops.rope_store_kv(q, k, v, positions, cos_sin, ref_k, ref_v, slots, **norm)
    q_out = K["triton_rope"].rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, **norm)
    close(q_out, q_ref, env, 4)  # q is never quantized
    _same_fp8(k_cache, ref_k)
    _same_fp8(v_cache, ref_v)
    assert v_cache.float().abs().nan_to_num(0.0).max() == torch_ops.FP8_MAX


# (group, kv_heads, head_dim, page, window, softcap, seq_lens, num_splits); None splits = auto.
DECODE_CASES = [
    (4, 2, 128, 16, None, None, [33, 7, 64], 3),
    (2, 2, 64, 32, 24, 25.0, [33, 5, 90], 1),
]


@pytest.mark.parametrize("env", READER_ENVS, indirect=True)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"g{c[0]}-d{c[2]}-w{c[4]}-splits{c[7]}")
def test_decode_attention_over_fp8_cache(env: Env, case, monkeypatch) -> None:
    check_decode_case(env, case, monkeypatch, cache_dtype=FP8)


@pytest.mark.parametrize("env", READER_ENVS, indirect=True)
def test_prefill_attention_over_fp8_cache(env: Env) -> None:
    ctx_lens, q_lens = [0, 5, 40], [7, 1, 33]
    if env.big:
        ctx_lens, q_lens = ctx_lens + [1000], q_lens + [300]
    group, kv_heads, head_dim = 4, 2, 128
    meta, k_cache, v_cache = paged_batch(env, ctx_lens, q_lens, 16, kv_heads, head_dim, cache_dtype=FP8)
    q = rand(env, sum(q_lens), group * kv_heads, head_dim, seed=12)
    tiles = (None, None) if env.big else (16, 16)
    out = K["triton_prefill_attention"].prefill_attention(
        q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.max_seqlen_q, 0.1, meta.block_tables,
        None, None, *tiles, out=nan_like(q),
    )  # fmt: skip
    k_new = q[:, :kv_heads]
    close(out, torch_ops.attention(q, k_new, k_new, k_cache, v_cache, meta, 0.1), env)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")]),
    ],
)
def test_fp8_cache_block_copy(tiny_model_dir, device: str) -> None:
    """Copy-on-write block copies (engine.runner.model_runner.ModelRunner._copy_blocks) copy the bytes of
    every layer's fp8 K and V blocks, and touch no other block."""
    from engine.config import EngineConfig
    from engine.runner.model_runner import ModelRunner

    config = EngineConfig.from_kwargs(
        str(tiny_model_dir), device=device, kv_cache_dtype="fp8", num_blocks=8, enforce_eager=True
    )
    runner = ModelRunner(config)
    g = torch.Generator().manual_seed(9)
    for k_cache, v_cache in runner.kv_caches:
        assert k_cache.dtype == v_cache.dtype == FP8 and k_cache.device.type == device
        for cache in (k_cache, v_cache):  # any byte, NaN codes included: a copy moves bytes, not values
            cache.view(torch.uint8).copy_(torch.randint(0, 256, cache.shape, generator=g, dtype=torch.uint8))
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner._copy_blocks([(0, 4), (2, 5), (7, 1)])
    for layer, (caches, olds) in enumerate(zip(runner.kv_caches, before, strict=True)):
        for name, got, old in zip("KV", caches, olds):
            want = old.view(torch.uint8).clone()
            want[4], want[5], want[1] = want[0].clone(), want[2].clone(), want[7].clone()
            assert torch.equal(got.view(torch.uint8), want), f"layer {layer} {name}: not the expected copy"
