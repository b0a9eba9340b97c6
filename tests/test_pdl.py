"""Programmatic dependent launch (kernels.pdl): a decode-layer chain of PDL-launched kernels replayed in
a CUDA graph must give exactly what the same kernels give launched one after another without PDL.

A kernel that touched a predecessor's output before waiting for it would read a half-written tensor
and show up here as a difference. The shapes keep every GEMM unsplit (no atomics), so both runs do
the same arithmetic in the same order and must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import ops, pdl  # noqa: E402

pytestmark = pytest.mark.kernels
CUDA_OK = torch.cuda.is_available()
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 512, 1024, 4, 2, 128, 16, 6


def test_off_without_cuda() -> None:
    assert not pdl.enabled(torch.device("cpu"))


def test_enabled_asks_the_device_once(monkeypatch) -> None:
    """Every kernel launch asks `enabled`: the device's capability is queried once, then cached."""
    calls = []
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.setattr(pdl, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: calls.append(d) or (9, 0))
    pdl.enabled.cache_clear()
    try:
        assert pdl.enabled(torch.device("cuda", 0)) and pdl.enabled(torch.device("cuda", 0))
        assert len(calls) == 1
    finally:
        pdl.enabled.cache_clear()


def _layer_weights(gen: torch.Generator) -> list[dict]:
    def w(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16).cuda()

    def fp8(weight):  # per-channel fp8: the quantised GEMV's path
        scale = (weight.float().abs().amax(1) / 448).clamp(min=1e-12)
        return (weight.float() / scale[:, None]).to(torch.float8_e4m3fn), scale

    qkv_n = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return [
        dict(norm=w(HIDDEN) + 1, qkv=w(qkv_n, HIDDEN), o=fp8(w(HIDDEN, HEADS * HEAD_DIM)),
             norm2=w(HIDDEN) + 1, up=w(2 * INTER, HIDDEN), down=w(HIDDEN, INTER))
        for _ in range(LAYERS)
    ]  # fmt: skip


def _decoder(x, res, layers, caches, positions, slots, block_tables, seq_lens, cos_sin):
    """Llama-shaped decode layers through ops: norm, qkv, RoPE + KV write, paged attention, o (fp8
    weights), MLP (at one row gate|up's GEMV applies the activation). Every kernel that precedes a GEMV
    releases it before its own wait (RELEASE_FIRST), so weight loads overlap two kernels back."""
    rows = x.shape[0]
    for p, (kc, vc) in zip(layers, caches):
        h, res = ops.add_rms_norm(x, res, p["norm"], 1e-5)
        q, k, v = ops.linear(h, p["qkv"]).split(
            [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1
        )
        q = ops.rope_store_kv(
            q.view(rows, HEADS, HEAD_DIM), k.view(rows, KV_HEADS, HEAD_DIM), v.view(rows, KV_HEADS, HEAD_DIM),
            positions, cos_sin, kc, vc, slots,
        )  # fmt: skip
        fields = dict(block_tables=block_tables, seq_lens=seq_lens, is_decode=True, mixed=False)
        meta = type("Meta", (), fields)()  # what ops.attention reads of a decode step's metadata
        a = ops.attention(q, None, None, kc, vc, meta, HEAD_DIM**-0.5)
        x = ops.quant_linear(a.reshape(rows, -1), *p["o"], None, None, "channel", None)
        h, res = ops.add_rms_norm(x, res, p["norm2"], 1e-5)
        x = ops.linear(ops.gated_linear(h, p["up"], None, False), p["down"])  # one row: the gated GEMV
    return x, res


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8])
def test_pdl_graph_chain_matches_plain_launches(rows: int, monkeypatch) -> None:
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs sm_90 or newer")
    gen = torch.Generator().manual_seed(0)
    layers = _layer_weights(gen)
    ctx = 200  # cached tokens per sequence before this step
    blocks = -(-(ctx + 1) // PAGE)
    caches = [
        tuple(torch.randn(rows * blocks, PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).cuda()
              for _ in range(2))
        for _ in range(LAYERS)
    ]  # fmt: skip
    block_tables = torch.arange(rows * blocks, dtype=torch.int32, device="cuda").view(rows, blocks)
    positions = torch.full((rows,), ctx, dtype=torch.int64, device="cuda")
    slots = (block_tables[:, ctx // PAGE].long() * PAGE + ctx % PAGE).contiguous()
    seq_lens = torch.full((rows,), ctx + 1, dtype=torch.int32, device="cuda")
    freqs = torch.outer(torch.arange(4096.0), 1e4 ** (-torch.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1).cuda()
    x = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
    res = torch.zeros_like(x)
    args = (layers, caches, positions, slots, block_tables, seq_lens, cos_sin)

    _decoder(x, res, *args)  # compile the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_res = _decoder(x, res, *args)
    results = []
    for seed in (1, 2):
        x.copy_(torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        res.copy_(x * 0.5)
        graph.replay()
        results.append((out.clone(), out_res.clone(), caches[-1][0].clone()))

    monkeypatch.setenv(pdl.ENV, "0")
    pdl.enabled.cache_clear()
    try:
        for seed, (got, got_res, got_cache) in zip((1, 2), results):
            x.copy_(
                torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
            )
            res.copy_(x * 0.5)
            want, want_res = _decoder(x, res, *args)
            assert torch.equal(got, want) and torch.equal(got_res, want_res)
            assert torch.equal(got_cache, caches[-1][0])
    finally:
        pdl.enabled.cache_clear()
