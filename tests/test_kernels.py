"""Triton kernels against their torch twins (kernels.torch_ops), on fresh random inputs.

Two ways to run the same checks:
  * CPU (`make test`): TRITON_INTERPRET=1 (set by tests/kernel_env.py, or earlier by conftest.py)
    makes the launchers run on CPU tensors in fp32 with small shapes. Triton reads the flag when it is first
    imported; if something imported it earlier, test_interpreter_subprocess reruns them in a fresh process;
  * GPU (marker `gpu`): compiled kernels on CUDA tensors, bigger shapes, bf16 and fp32.
Outputs are poisoned with NaN before each call (kernels write into `out=`), and KV-cache slots that
no sequence owns hold NaN, so a missed store or a stray read shows up as a NaN mismatch (the shared
pieces are in tests/kernel_helpers.py; the fp8 KV cache's cases in tests/test_kernels_fp8_kv.py).

test_hopper_compile (no GPU needed) runs `python -m tests.hopper_compile kernels` in a subprocess
(the interpreter flag is fixed per process): every kernel is built for Hopper (sm_90) through its real
launcher with a stand-in driver, and must fit shared memory and use 16-byte global loads.
"""

from __future__ import annotations

from tests.kernel_env import CUDA_OK, INTERPRET  # first: it chooses TRITON_INTERPRET

# isort: split
import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from engine.models.attention_context import AttentionMetadata, attention_context  # noqa: E402
from kernels import arrivals, ops, torch_ops  # noqa: E402
from tests.kernel_helpers import (  # noqa: E402
    ENVS,
    INTERP_OK,
    Env,
    check_decode_case,
    close,
    fused_qkv,
    nan_like,
    paged_batch,
    poisoned_empty,
    rand,
    store_kv_with_twin,
    use_env,
)

pytestmark = [
    pytest.mark.kernels,
    # the interpreter's numpy exp overflows to inf inside sigmoid / tanh, which is the intended saturation
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]
K = {
    name: importlib.import_module(f"kernels.{name}")
    for name in ("triton_act", "triton_norm", "triton_rope", "triton_kv", "triton_decode_attention",
                 "triton_prefill_attention")
}  # fmt: skip


@pytest.fixture(params=ENVS)
def env(request, monkeypatch) -> Env:
    return use_env(request.param, monkeypatch)


# ----------------------------------------------------------------------------------------- elementwise


@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_and_fused_add(env: Env, tokens: int, offset: float) -> None:
    hidden = 4096 if env.big else 200  # 200: not a power of two, so the row mask matters
    x, res = rand(env, tokens, hidden, seed=1), rand(env, tokens, hidden, seed=2)
    w = rand(env, hidden, seed=3)
    out = K["triton_norm"].rms_norm(x, w, 1e-6, offset, out=nan_like(x))
    close(out, torch_ops.rms_norm(x, w, 1e-6, offset), env, 4)
    normed, summed = K["triton_norm"].add_rms_norm(
        x, res, w, 1e-6, offset, out=nan_like(x), residual_out=nan_like(x)
    )
    ref_normed, ref_summed = torch_ops.add_rms_norm(x, res, w, 1e-6, offset)
    close(summed, ref_summed, env)
    close(normed, ref_normed, env, 4)


@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(64, 4, 4), (128, 8, 2), (128, 8, 1)])
def test_rotary_strided_qkv(env: Env, tokens: int, head_dim: int, q_heads: int, kv_heads: int) -> None:
    if env.big:
        q_heads, kv_heads = q_heads * 4, kv_heads * 4
    # q and k are views into one fused qkv projection, as the attention layer produces them.
    qkv = rand(env, tokens, (q_heads + 2 * kv_heads) * head_dim, seed=4)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    max_pos = 4096 if env.big else 64
    g = torch.Generator().manual_seed(5)
    positions = torch.randint(0, max_pos, (tokens,), generator=g).to(env.device)
    cos_sin = rand(env, max_pos, head_dim, seed=6).float()
    q_out, k_out = K["triton_rope"].apply_rotary(q, k, positions, cos_sin, nan_like(q), nan_like(k))
    q_ref, k_ref = torch_ops.apply_rotary(q, k, positions, cos_sin)
    close(q_out, q_ref, env, 4)
    close(k_out, k_ref, env, 4)


@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("kind", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_gated_activation(env: Env, tokens: int, kind: str) -> None:
    inter = 14336 if env.big else 1500  # 1500 > BLOCK and not a multiple of it
    x = rand(env, tokens, 2 * inter, seed=7, scale=3.0)
    out = getattr(K["triton_act"], kind)(x, out=nan_like(x[:, :inter]))
    close(out, getattr(torch_ops, kind)(x), env, 10)


@pytest.mark.parametrize("rows,gather", [(1, False), (3, True), (5, False)])
def test_add_silu_with_strided_rows_and_a_gathered_table(env: Env, rows: int, gather: bool) -> None:
    """silu(a + b[idx]) of the MTP head's chain: a is one mask's column of [rows, k, H] (strided rows),
    b a table whose rows idx picks (or b's rows in order)."""
    width = 4096 if env.big else 1500
    a = rand(env, rows, 4, width, seed=8, scale=3.0)[:, 2]
    b = rand(env, 11 if gather else rows, width, seed=9, scale=3.0)
    idx = torch.tensor([10, 0, 10][:rows], device=env.device) if gather else None
    out = K["triton_act"].add_silu(a, b, idx)
    want = torch_ops.add_silu(a, b, idx)
    assert out.is_contiguous() and out.shape == want.shape
    close(out, want, env, 10)
    picked = b if idx is None else b[idx]
    s = (a.float() + picked.float()).to(a.dtype).double()
    close(out, (s * torch.sigmoid(s)).to(a.dtype), env, 10)


# ----------------------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("tokens,page,head_dim", [(1, 16, 64), (7, 32, 128), (33, 16, 128)])
def test_store_kv_skips_padding_slots(env: Env, tokens: int, page: int, head_dim: int) -> None:
    kv_heads = 8 if env.big else 2
    k_cache = torch.full((2 * tokens + 2, page, kv_heads, head_dim), float("nan"), dtype=env.dtype)
    k_cache, v_cache = k_cache.to(env.device), k_cache.clone().to(env.device)
    slots = torch.randperm(k_cache.shape[0] * page, generator=torch.Generator().manual_seed(8))[:tokens]
    slots[::3] = -1  # CUDA-graph padding rows store nothing
    slots = slots.to(env.device)
    kv = rand(env, tokens, 2 * kv_heads, head_dim, seed=9)
    ref_k, ref_v = store_kv_with_twin(K["triton_kv"].store_kv, kv, kv_heads, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(64, 4, 4), (128, 6, 2), (128, 12, 4), (64, 8, 1)])
@pytest.mark.parametrize("norm_offset", [None, 0.0, 1.0], ids=["no-norm", "norm", "norm-offset1"])
def test_rope_store_kv_matches_twin(
    env: Env, monkeypatch, tokens: int, head_dim: int, q_heads: int, kv_heads: int, norm_offset
) -> None:
    if env.big:
        q_heads, kv_heads = q_heads * 4, kv_heads * 4
    q, k, v = fused_qkv(env, tokens, q_heads, kv_heads, head_dim, seed=60)
    max_pos, page = (4096, 16) if env.big else (64, 16)
    g = torch.Generator().manual_seed(61)
    positions = torch.randint(0, max_pos, (tokens,), generator=g).to(env.device)
    cos_sin = rand(env, max_pos, head_dim, seed=62).float()
    k_cache = torch.full((tokens + 2, page, kv_heads, head_dim), float("nan"), dtype=env.dtype)
    k_cache, v_cache = k_cache.to(env.device), k_cache.clone().to(env.device)
    slots = torch.randperm(k_cache.shape[0] * page, generator=g)[:tokens]
    slots[1::3] = -1  # CUDA-graph padding rows: q is still rotated, the caches stay untouched
    slots = slots.to(env.device)
    norm = {}
    if norm_offset is not None:  # Gemma-style offset 1 with weights near 0, Qwen3-style offset 0 near 1
        w_q, w_k = rand(env, head_dim, seed=63, scale=0.5), rand(env, head_dim, seed=64, scale=0.5)
        norm = dict(q_norm_weight=w_q + 1 - norm_offset, k_norm_weight=w_k + 1 - norm_offset,
                    norm_eps=1e-6, norm_offset=norm_offset)  # fmt: skip
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q_ref = torch_ops.rope_store_kv(q, k, v, positions, cos_sin, ref_k, ref_v, slots, **norm)
    qkv_before = q.clone(), k.clone(), v.clone()
    with monkeypatch.context() as m:
        poisoned_empty(m)
        q_out = K["triton_rope"].rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, **norm)
    assert q_out.is_contiguous() and q_out.shape == q.shape and q_out.dtype == q.dtype
    close(q_out, q_ref, env, 4)
    written = slots[slots >= 0]
    close(k_cache.view(-1, kv_heads, head_dim)[written], ref_k.view(-1, kv_heads, head_dim)[written], env, 4)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)  # v is copied exactly
    assert k_cache.isnan().sum() == ref_k.isnan().sum()  # every other slot is still NaN
    for before, after in zip(qkv_before, (q, k, v)):  # the inputs are read only
        torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_rope_store_kv_rejects_bad_arguments() -> None:
    env = Env("cpu", torch.float32, 0, 0)
    q, k, v = fused_qkv(env, 3, 4, 2, 64, seed=65)
    pos, slots, cos_sin = torch.arange(3), torch.arange(3), torch.zeros(8, 64)
    cache = torch.zeros(2, 16, 2, 64)
    fn = K["triton_rope"].rope_store_kv
    bad = [
        ("caches", dict(k_cache=torch.zeros(2, 16, 4, 64))),
        ("must be contiguous", dict(k_cache=torch.zeros(2, 2, 16, 64).transpose(1, 2))),
        ("slot_mapping", dict(slot_mapping=torch.arange(4))),
        ("cos_sin", dict(cos_sin=torch.zeros(8, 32))),
        ("v must match k", dict(v=q)),
        ("or neither", dict(q_norm_weight=torch.ones(64))),
        ("k_norm_weight must be", dict(q_norm_weight=torch.ones(64), k_norm_weight=torch.ones(32))),
    ]
    base = dict(q=q, k=k, v=v, positions=pos, cos_sin=cos_sin, k_cache=cache, v_cache=cache)
    base["slot_mapping"] = slots
    for match, override in bad:
        with pytest.raises(ValueError, match=match):
            fn(**{**base, **override})


# ----------------------------------------------------------------------------------------- attention

# (group, kv_heads, head_dim, page, window, softcap, seq_lens, num_splits); None splits = auto.
DECODE_CASES = [
    (1, 2, 64, 16, None, None, [1, 17, 40], None),
    (4, 2, 128, 32, None, None, [33, 7, 64], 3),
    (8, 1, 64, 16, 20, None, [50, 3, 70], 5),
    (4, 2, 64, 32, 16, 30.0, [45, 1], 7),  # more splits than tiles: empty splits must merge cleanly
    (2, 2, 64, 16, 24, 25.0, [33, 5, 90], 1),  # one split: stage 1 writes the output, no reduce
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"g{c[0]}-d{c[2]}-p{c[3]}-w{c[4]}-cap{c[5]}")
def test_decode_attention(env: Env, case, monkeypatch) -> None:
    check_decode_case(env, case, monkeypatch)


def test_decode_padding_rows_read_nothing(env: Env) -> None:
    """A CUDA-graph padding row (seq_len 0, table all -1) yields zeros; real rows are unaffected."""
    meta, k_cache, v_cache = paged_batch(env, [20, 40], [1, 1], 16, 2, 64, seed=16)
    tables = torch.cat([meta.block_tables, torch.full_like(meta.block_tables[:1], -1)])
    lens = torch.cat([meta.seq_lens, torch.zeros_like(meta.seq_lens[:1])])
    q = rand(env, 3, 8, 64, seed=17)
    out = K["triton_decode_attention"].decode_attention(
        q, k_cache, v_cache, tables, lens, 0.125, out=nan_like(q)
    )
    close(out[2], torch.zeros_like(out[2]), env)
    close(out[:2], torch_ops.attention(q[:2], q[:2, :2], None, k_cache, v_cache, meta, 0.125), env)


# (group, kv_heads, head_dim, page or None = cache-free, window, softcap, ctx_lens, q_lens, tiles)
PREFILL_CASES = [
    (4, 2, 64, None, None, None, [0, 0, 0], [1, 7, 33], None),
    (1, 2, 128, None, 8, None, [0, 0], [33, 20], (16, 16)),
    (8, 1, 64, 16, None, None, [0, 5, 40], [7, 1, 33], None),
    (4, 2, 128, 32, 24, 20.0, [10, 70], [33, 7], (16, 16)),
    (1, 2, 64, 16, None, 50.0, [3, 0, 31], [1, 33, 17], (16, 32)),
    # a group that is no power of two: packed rows of padding heads (GP 8 for 5), small and default tiles
    (5, 2, 64, 16, None, None, [0, 37, 6], [45, 20, 1], (16, 16)),
    (3, 2, 64, 16, 20, None, [50, 0], [19, 40], None),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"g{c[0]}-d{c[2]}-p{c[3]}-w{c[4]}-cap{c[5]}")
def test_prefill_attention(env: Env, case) -> None:
    group, kv_heads, head_dim, page, window, softcap, ctx_lens, q_lens, tiles = case
    if env.big:
        ctx_lens, q_lens = ctx_lens + [0 if page is None else 1000, 0], q_lens + [300, 129]
    scale = head_dim**-0.5
    q = rand(env, sum(q_lens), group * kv_heads, head_dim, seed=12)
    bm, bn = tiles or (None, None)
    pre = K["triton_prefill_attention"]
    if page is None:
        meta = AttentionMetadata.for_full_sequences(q_lens, env.device)
        k = rand(env, sum(q_lens), kv_heads, head_dim, seed=13)
        v = rand(env, sum(q_lens), kv_heads, head_dim, seed=14)
        out = pre.prefill_attention(q, k, v, meta.cu_seqlens_q, meta.seq_lens, meta.max_seqlen_q, scale,
                                    None, window, softcap, bm, bn, out=nan_like(q))  # fmt: skip
        ref = torch_ops.attention(q, k, v, None, None, meta, scale, window, softcap)
    else:
        meta, k_cache, v_cache = paged_batch(env, ctx_lens, q_lens, page, kv_heads, head_dim, seed=15)
        out = pre.prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                    meta.max_seqlen_q, scale, meta.block_tables, window, softcap, bm, bn,
                                    out=nan_like(q))  # fmt: skip
        k_new = q[:, :kv_heads]
        ref = torch_ops.attention(q, k_new, k_new, k_cache, v_cache, meta, scale, window, softcap)
    close(out, ref, env)


def test_num_splits_fill_one_wave_from_shapes_only() -> None:
    """The measured best split counts of benchmarks/decode_splits.py on an H100 (132 SMs, 528 program
    slots; benchmarks/reports/gpu/decode_splits_h100.md)."""
    choose = K["triton_decode_attention"].choose_num_splits
    # Llama-3.1-8B, 128k-token block table: 8 KV heads at TP=1, 4 at TP=2, 2 at TP=4
    assert choose(1, 8, 8192, 16, 64, 132) == 64  # capped at MAX_SPLITS (a wave holds 66)
    assert choose(16, 8, 8192, 16, 64, 132) == 4  # 512 programs; 5 would spill into a second wave
    assert choose(64, 8, 8192, 16, 64, 132) == 1  # 512 programs already fill the wave
    assert choose(64, 4, 8192, 16, 64, 132) == 2  # TP=2: 3 splits (768 programs) measured slower
    assert choose(64, 2, 8192, 16, 64, 132) == 4  # TP=4
    assert choose(128, 8, 8192, 16, 64, 132) == 1  # past one wave with a single split
    assert choose(1, 8, 2, 16, 64, 132) == 1  # a 32-token table holds a single tile
    assert choose(1, 8, 8192, 16, 64, 132, sliding_window=256) == 4  # the window bounds the keys


# ----------------------------------------------------------------------------------------- dispatch


def _dispatch_inputs(device: str, dtype: torch.dtype):
    env = Env(device, dtype, 0, 0)
    x, w = rand(env, 5, 96, seed=20), rand(env, 96, seed=21)
    q, k = rand(env, 5, 4, 64, seed=22), rand(env, 5, 2, 64, seed=23)
    cos_sin = rand(env, 16, 64, seed=24).float()
    positions = torch.tensor([0, 3, 15, 2, 9], device=device)
    return env, x, w, q, k, cos_sin, positions


def _naive_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps) * (offset + w)


def _naive_rotary(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Neox RoPE as a complex product: the pair (i, i + D/2) is the number x_i + j x_{i+D/2}, turned by
    cos + j sin read from cos_sin[position] (cos in the first half of the row, sin in the second)."""
    half = x.shape[-1] // 2
    turn = torch.complex(cos_sin[positions, :half], cos_sin[positions, half:])[:, None, :]
    z = torch.complex(x[..., :half], x[..., half:]) * turn
    return torch.cat((z.real, z.imag), -1)


def test_cpu_dispatch_runs_no_kernel_and_matches_a_naive_recompute(monkeypatch) -> None:
    """On CPU tensors ops must not reach a Triton launcher (each is replaced by one that raises), and what
    it returns (the torch twins, the reference of every kernel test) must match the definitions written
    out independently in float64: RMS as sqrt(sum x^2 / n + eps), RoPE as a complex rotation, silu as
    g / (1 + e^-g), GeLU-tanh from its formula."""

    def no_kernel(*args, **kwargs):
        raise AssertionError("a Triton launcher was called on CPU tensors")

    launchers = {"triton_norm": ("rms_norm", "add_rms_norm"), "triton_rope": ("apply_rotary",),
                 "triton_act": ("silu_and_mul", "gelu_tanh_and_mul")}  # fmt: skip
    for mod, fns in launchers.items():
        for fn in fns:
            monkeypatch.setattr(K[mod], fn, no_kernel)
    _, x, w, q, k, cos_sin, positions = _dispatch_inputs("cpu", torch.float32)
    assert not ops.use_triton(x)
    xd, wd, csd = x.double(), w.double(), cos_sin.double()

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    check(ops.rms_norm(x, w, 1e-5, 1.0), _naive_rms_norm(xd, wd, 1e-5, 1.0))
    normed, summed = ops.add_rms_norm(x, 2 * x, w, 1e-5)
    check(summed, 3 * xd)
    check(normed, _naive_rms_norm(3 * xd, wd, 1e-5, 0.0))
    q_out, k_out = ops.apply_rotary(q, k, positions, cos_sin)
    check(q_out, _naive_rotary(q.double(), csd, positions))
    check(k_out, _naive_rotary(k.double(), csd, positions))
    gate, up = xd[:, :48], xd[:, 48:]
    check(ops.silu_and_mul(x), gate / (1 + torch.exp(-gate)) * up)
    inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    check(ops.gelu_tanh_and_mul(x), 0.5 * gate * (1 + torch.tanh(inner)) * up)


def _route(env: Env, monkeypatch) -> list[str]:
    """Force the Triton branch on CPU tensors (interpreter) and record which launcher each op used."""
    if env.device == "cpu":
        monkeypatch.setattr(ops, "use_triton", lambda x: True)
    calls: list[str] = []
    launchers = [
        ("triton_decode_attention", "decode_attention"),
        ("triton_kv", "store_kv"),
        ("triton_prefill_attention", "prefill_attention"),
        ("triton_norm", "add_rms_norm"),
        ("triton_rope", "rope_store_kv"),
    ]
    for mod, fn in launchers:
        real = getattr(K[mod], fn)
        monkeypatch.setattr(K[mod], fn, lambda *a, _r=real, _n=fn, **kw: (calls.append(_n), _r(*a, **kw))[1])
    return calls


def test_dispatch_attention_routes_decode_and_prefill(env: Env, monkeypatch) -> None:
    calls = _route(env, monkeypatch)
    scale = 0.125
    for q_lens, ctx in [([1, 1, 1], [0, 16, 40]), ([1, 9, 3], [4, 0, 20])]:
        meta, k_cache, v_cache = paged_batch(env, ctx, q_lens, 16, 2, 64, seed=30)
        q = rand(env, sum(q_lens), 8, 64, seed=31)
        k_new = q[:, :2]
        got = ops.attention(q, k_new, k_new, k_cache, v_cache, meta, scale)
        close(got, torch_ops.attention(q, k_new, k_new, k_cache, v_cache, meta, scale), env)
    meta = AttentionMetadata.for_full_sequences([1], env.device)  # one token, but no cache: prefill kernel
    q, k = rand(env, 1, 8, 64, seed=32), rand(env, 1, 2, 64, seed=33)
    want = torch_ops.attention(q, k, k, None, None, meta, scale)
    close(ops.attention(q, k, k, None, None, meta, scale), want, env)
    assert calls == ["decode_attention", "prefill_attention", "prefill_attention"]


def test_dispatch_store_kv_and_norm_use_triton(env: Env, monkeypatch) -> None:
    calls = _route(env, monkeypatch)
    meta, k_cache, v_cache = paged_batch(env, [3, 0], [2, 5], 16, 2, 64, seed=40)
    k, v = rand(env, 7, 2, 64, seed=41), rand(env, 7, 2, 64, seed=42)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    torch_ops.store_kv(k, v, ref_k, ref_v, meta.slot_mapping)
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    x, r, w = rand(env, 3, 64, seed=43), rand(env, 3, 64, seed=44), rand(env, 64, seed=45)
    for got, want in zip(ops.add_rms_norm(x, r, w, 1e-6, 1.0), torch_ops.add_rms_norm(x, r, w, 1e-6, 1.0)):
        close(got, want, env, 4)
    assert calls == ["store_kv", "add_rms_norm"]


def _rope_store_kv_inputs(env: Env, norm: bool):
    meta, k_cache, v_cache = paged_batch(env, [3, 0], [2, 5], 16, 2, 64, seed=46)
    q, k, v = fused_qkv(env, 7, 6, 2, 64, seed=47)
    positions = torch.tensor([3, 4, 0, 1, 2, 3, 4], device=env.device)
    kwargs = {}
    if norm:
        w = rand(env, 2, 64, seed=48, scale=0.5)
        kwargs = dict(q_norm_weight=w[0], k_norm_weight=w[1], norm_eps=1e-6, norm_offset=1.0)
    cos_sin = rand(env, 16, 64, seed=49).float()
    return (q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping), kwargs


def test_dispatch_rope_store_kv_on_cpu_gives_twin_results() -> None:
    env = Env("cpu", torch.float32, 0, 0)
    (q, k, v, pos, cs, k_cache, v_cache, slots), norm = _rope_store_kv_inputs(env, norm=True)
    assert not ops.use_triton(q)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    got = ops.rope_store_kv(q, k, v, pos, cs, k_cache, v_cache, slots, **norm)
    want = torch_ops.rope_store_kv(q, k, v, pos, cs, ref_k, ref_v, slots, **norm)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("norm", [False, True], ids=["no-norm", "norm"])
def test_dispatch_rope_store_kv_uses_triton(env: Env, monkeypatch, norm: bool) -> None:
    calls = _route(env, monkeypatch)
    (q, k, v, pos, cs, k_cache, v_cache, slots), kwargs = _rope_store_kv_inputs(env, norm)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    got = ops.rope_store_kv(q, k, v, pos, cs, k_cache, v_cache, slots, **kwargs)
    close(got, torch_ops.rope_store_kv(q, k, v, pos, cs, ref_k, ref_v, slots, **kwargs), env, 4)
    torch.testing.assert_close(k_cache, ref_k, atol=4 * env.atol, rtol=env.rtol, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)
    assert calls == ["rope_store_kv"]


def test_attention_layer_fused_prologue_matches_cache_free(env: Env, monkeypatch) -> None:
    """Attention.forward with a paged cache (one rope_store_kv launch, then prefill / decode kernels reading
    the cache) gives the rows of the cache-free path over the whole sequences (QK-norm, Gemma offset 1)."""
    from engine.models.layers import Attention, RotaryEmbedding

    hidden, q_heads, kv_heads, head_dim, lens = 64, 6, 2, 64, [6, 4]
    attn = Attention(hidden, q_heads, kv_heads, head_dim, RotaryEmbedding(head_dim, 64, 10000.0), 0.125,
                     qk_norm_eps=1e-6, norm_offset=1.0)  # fmt: skip
    for i, param in enumerate(attn.parameters()):  # parameters are allocated empty: fill them
        param.copy_(rand(Env("cpu", torch.float32, 0, 0), *param.shape, seed=70 + i, scale=0.3))
    attn = attn.to(env.device, env.dtype)
    attn.rotary.cos_sin = attn.rotary.cos_sin.float()
    x = rand(env, sum(lens), hidden, seed=75)
    positions = torch.tensor([p for n in lens for p in range(n)], device=env.device)
    with attention_context(AttentionMetadata.for_full_sequences(lens, env.device)):
        ref = attn(positions, x)
    calls = _route(env, monkeypatch)
    meta, attn.k_cache, attn.v_cache = paged_batch(env, [0, 0], lens, 16, kv_heads, head_dim, seed=76)
    i32 = dict(dtype=torch.int32, device=env.device)
    prefill, decode = [0, 1, 2, 3, 4, 6, 7, 8], [5, 9]  # rows of x: all but the last token, then the last
    steps = [
        (prefill, AttentionMetadata(torch.tensor([0, 5, 8], **i32), torch.tensor([5, 3], **i32),
                                    meta.slot_mapping[prefill], meta.block_tables, [5, 3], [5, 3], 5, 5, 16)),
        (decode, AttentionMetadata(torch.tensor([0, 1, 2], **i32), torch.tensor(lens, **i32),
                                   meta.slot_mapping[decode], meta.block_tables, [1, 1], lens, 1, 6, 16)),
    ]  # fmt: skip
    for rows, step_meta in steps:
        with attention_context(step_meta):
            close(attn(positions[rows], x[rows]), ref[rows], env, 4)
    assert calls == ["rope_store_kv", "prefill_attention", "rope_store_kv", "decode_attention"]


# ----------------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
def test_decode_attention_replays_in_a_cuda_graph() -> None:
    """Capture once, then change lengths and tables in place: the replay must follow the new data."""
    env = Env("cuda", torch.bfloat16, 2e-2, 2e-2)
    meta, k_cache, v_cache = paged_batch(env, [99, 500, 7], [1, 1, 1], 16, 8, 128, seed=50)
    q = rand(env, 3, 32, 128, seed=51)
    dec = K["triton_decode_attention"]
    call = lambda: dec.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.088)
    call()  # warm-up compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    # Swap the first two tables and shorten the lengths: every position read stays an owned slot.
    meta.block_tables.copy_(meta.block_tables[[1, 0, 2]].clone())
    meta.seq_lens.copy_(torch.tensor([400, 60, 8], dtype=torch.int32))
    q.copy_(rand(env, 3, 32, 128, seed=52))
    new_meta = AttentionMetadata(meta.cu_seqlens_q, meta.seq_lens, None, meta.block_tables, [1, 1, 1],
                                 [400, 60, 8], 1, 400, 16)  # fmt: skip
    graph.replay()
    k_new = q[:, :8]
    close(out, torch_ops.attention(q, k_new, k_new, k_cache, v_cache, new_meta, 0.088), env)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
def test_decode_split_merge_is_race_free() -> None:
    """The last split to arrive merges the others' partials (atomic counter, acquire/release). Many
    splits of many sequences, replayed 50 times in a graph: every replay must match the twin and be
    bit-identical to the first (the merge order is fixed, whichever split arrives last)."""
    env = Env("cuda", torch.bfloat16, 2e-2, 2e-2)
    lens = [int(x) for x in torch.randint(1, 3000, (24,), generator=torch.Generator().manual_seed(3))]
    meta, k_cache, v_cache = paged_batch(env, lens, [1] * 24, 16, 8, 128, seed=53)
    q = rand(env, 24, 32, 128, seed=54)
    dec = K["triton_decode_attention"]
    call = lambda: dec.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.088,
                                        num_splits=48)  # fmt: skip
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    first = out.clone()
    k_new = q[:, :8]
    close(first, torch_ops.attention(q, k_new, k_new, k_cache, v_cache, meta, 0.088), env)
    for _ in range(50):
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, first)
    assert not arrivals._BUFFERS[q.device][-1].any()


# ----------------------------------------------------------------------------------------- Hopper build


@pytest.mark.skipif(not INTERPRET or INTERP_OK, reason="the interpreter tests ran in this process")
def test_interpreter_subprocess() -> None:
    """triton was imported before TRITON_INTERPRET=1 was set: run the CPU checks (this module's and the fp8
    KV cache's) in a fresh process."""
    root = Path(__file__).resolve().parents[1]
    envvars = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "interp and not subprocess",
        __file__,
        str(Path(__file__).with_name("test_kernels_fp8_kv.py")),
        str(Path(__file__).with_name("test_kernels_mixed.py")),
    ]
    proc = subprocess.run(cmd, cwd=root, env=envvars, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_hopper_compile() -> None:
    """Every kernel, launched through its real launcher, compiles for sm_90, fits H100 shared memory and
    moves global memory in 16-byte vectors (tests/hopper_compile.py; own process, since the interpreter
    flag is fixed when the kernels are defined)."""
    root = Path(__file__).resolve().parents[1]
    envvars = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "tests.hopper_compile", "kernels"], cwd=root,
                          env=envvars, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
