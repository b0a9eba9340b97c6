"""The quantised-weight kernels (kernels.triton_qgemv, kernels.triton_qgemm) against an fp64 reference.

The reference is written here, independent of both kernels and of the torch twin: dequantise W
(q * scale[n] or q * scale[row_block[n], k // 128]) in fp64, quantise x with torch ops in fp32 exactly as
the contract says (sx = max(amax / QMAX, 1e-12), x / sx clamped, then torch.round or the e4m3 cast), and
multiply in fp64. The kernels quantise x identically (test_act_quant_is_exact checks every code and
scale bit for bit, ties and e4m3 subnormals included), so the ~2^-4 relative error of fp8 activations is
in the reference too and the tolerance only covers summation order: fp32 sums of K terms are off by
~sqrt(K) * 2^-24 of sum|x_k w_nk| typically, far below the ATOL_INTERP = 2e-5 of that sum used here; on
a GPU the bf16 output rounding (2^-9) and fp8 tensor-core accumulation dominate, so 2e-2 as for bf16.

CPU (TRITON_INTERPRET=1): small shapes with a merged q|k|v layout whose shard boundaries and scale-row
changes fall inside row tiles, K not a multiple of the K tile, M in {1, 3, 17, 64}, both schemes, fp8 and
int8 weights, every act_quant, bias and none, NaN-poisoned outputs and scratch buffers; agreement with the
torch twin (kernels.torch_ops.quant_linear). Without a GPU,
test_hopper_build compiles every variant for sm_90 through a stand-in driver (tests/hopper_compile.py):
shared memory fits, no spills, the GEMV's weights move in 16-byte loads and M >= 64 tiles use wgmma on
e4m3 / s8 operands. GPU (marker `gpu`): Llama shapes in bf16 and CUDA-graph replay.
"""

from __future__ import annotations

from tests.kernel_env import CUDA_OK, interpreter_usable  # first: it chooses TRITON_INTERPRET

# isort: split
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernels import ops, torch_ops  # noqa: E402
from kernels import triton_qgemm as tq  # noqa: E402
from kernels import triton_qgemv as tv  # noqa: E402
from kernels import triton_qgemv_tiles as tt  # noqa: E402
from kernels import triton_qgemv_w8a8 as w8  # noqa: E402
from tests.kernel_helpers import poisoned_empty  # noqa: E402

pytestmark = pytest.mark.kernels
ROOT = Path(__file__).resolve().parents[1]
interp = pytest.mark.skipif(not interpreter_usable(), reason="needs TRITON_INTERPRET=1 before triton loads")
needs_cuda = pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
FP8, INT8 = torch.float8_e4m3fn, torch.int8
QMAX = {"int8_token": 127.0, "fp8_token": 448.0, "fp8_group128": 448.0}
PAIRS = [(FP8, None), (FP8, "fp8_token"), (FP8, "fp8_group128"), (INT8, None), (INT8, "int8_token")]
MERGED = (150, 37, 29)  # q|k|v shards: scale rows change at 128, 150 and 187, none a multiple of 4
ATOL_INTERP = 2e-5


def _gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def make_weights(shards, k: int, wdtype, scheme: str, seed: int = 0, device: str = "cpu"):
    """(qweight, scale, row_block) of a merged projection: each shard's rows start a new scale row."""
    g, n = _gen(seed, device), sum(shards)
    q = (torch.randn(n, k, generator=g, device=device) * 48).clamp(-127, 127)
    q = q.round().to(INT8) if wdtype == INT8 else q.to(FP8)
    if scheme == "channel":
        return q, torch.rand(n, generator=g, device=device) * 0.02 + 0.005, None
    rows, base = [], 0
    for size in shards:
        rows += [base + i // 128 for i in range(size)]
        base = rows[-1] + 1
    scale = torch.rand(base, -(-k // 128), generator=g, device=device) * 0.02 + 0.005
    return q, scale, torch.tensor(rows, dtype=torch.int32, device=device)


def ref_weight(q, scale, row_block) -> torch.Tensor:
    w = q.double()
    if row_block is None:
        return w * scale.double()[:, None]
    cols = torch.arange(q.shape[1], device=q.device) // 128
    return w * scale.double()[row_block.long()][:, cols]


def ref_act_quant(x: torch.Tensor, act: str):
    """(codes [M, K], scales [M, groups], codes * scales in fp64) per the contract; one group per row
    unless grouped."""
    x = x.float()
    m, k = x.shape
    width = 128 if act == "fp8_group128" else k
    groups = -(-k // width)
    xg = torch.nn.functional.pad(x, (0, groups * width - k)).view(m, groups, width)
    s = (xg.abs().amax(-1) / QMAX[act]).clamp(min=tq.SCALE_MIN)
    v = (xg / s[..., None]).clamp(-QMAX[act], QMAX[act])
    codes = v.round().to(INT8) if act == "int8_token" else v.to(FP8)
    return codes.view(m, -1)[:, :k], s, (codes.double() * s.double()[..., None]).view(m, -1)[:, :k]


def reference(x, q, scale, row_block, bias, act) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 y = deq(x) @ deq(W)^T (+ bias) on x's device, and sum_k |x_k w_nk| (the error's scale)."""
    xd = x.double() if act is None else ref_act_quant(x, act)[2]
    w = ref_weight(q, scale, row_block)
    y = xd @ w.T
    return (y if bias is None else y + bias.double()), xd.abs() @ w.abs().T


def check(out, x, q, scale, row_block, bias, act, tol: float) -> None:
    ref, mag = reference(x.reshape(-1, x.shape[-1]), q, scale, row_block, bias, act)
    got = out.reshape(ref.shape).double()
    assert not got.isnan().any(), "an output was never written"
    torch.testing.assert_close(got, ref, atol=tol * float(mag.max()), rtol=tol)


# ----------------------------------------------------------------------------------------- interpreter


@interp
@pytest.mark.parametrize("wdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("shards,k", [(MERGED, 192), ((37,), 300), ((24,), 4224), ((9,), 12288 + 200)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_qgemv_interpreted(wdtype, scheme, shards, k: int, with_bias: bool) -> None:
    """One row: single masked K tile, two prefetched tiles + a masked loop tile, the long-row config."""
    q, scale, row_block = make_weights(shards, k, wdtype, scheme, seed=k)
    x = torch.randn(1, k, generator=_gen(1))
    bias = torch.randn(q.shape[0], generator=_gen(2)) if with_bias else None
    out = torch.full((1, q.shape[0]), float("nan"))
    assert tv.qgemv(x, q, scale, row_block, bias, scheme, out=out) is out
    check(out, x, q, scale, row_block, bias, None, ATOL_INTERP)
    if wdtype == FP8 and not with_bias:  # silu in the store: F.silu of the same stored output
        torch.testing.assert_close(tv.qgemv(x, q, scale, row_block, None, scheme, silu=True), F.silu(out))


def gated_reference(x, q, scale, row_block, bias, gelu_tanh: bool) -> tuple[torch.Tensor, float]:
    """fp64 act(gate) * up of x's [gate | up] projection, and the error scale: the projection's
    magnitude (sum_k |x_k w_nk|) times the largest |d output / d projection|."""
    h, mag = reference(x.reshape(1, -1), q, scale, row_block, bias, None)
    g, u = h.chunk(2, dim=-1)
    act = torch.nn.functional.gelu(g, approximate="tanh") if gelu_tanh else torch.nn.functional.silu(g)
    slope = float(u.abs().max()) * 1.2 + float(act.abs().max())
    return act * u, float(mag.max()) * max(slope, 1.0)


@interp
@pytest.mark.parametrize("wdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("inter,k", [(150, 192), (37, 4224), (9, 12288 + 200)])
@pytest.mark.parametrize("gelu_tanh,with_bias", [(False, False), (True, True)])
def test_qgemv_gated_interpreted(wdtype, scheme, inter: int, k: int, gelu_tanh: bool, with_bias) -> None:
    """gate|up with the activation as the GEMV's epilogue: gate and up shards whose 128-row scale
    blocks end mid-tile (150), a grid whose last tile pairs rows past I (37, 9), prefetched and long K."""
    q, scale, row_block = make_weights((inter, inter), k, wdtype, scheme, seed=inter + k)
    x = torch.randn(1, k, generator=_gen(3)) * 0.05
    bias = torch.randn(2 * inter, generator=_gen(4)) if with_bias else None
    out = torch.full((1, inter), float("nan"))
    assert tv.qgemv_gated(x, q, scale, row_block, bias, scheme, gelu_tanh, out=out) is out
    ref, err_scale = gated_reference(x, q, scale, row_block, bias, gelu_tanh)
    assert not out.isnan().any(), "an output was never written"
    torch.testing.assert_close(out.double(), ref, atol=ATOL_INTERP * err_scale, rtol=ATOL_INTERP)
    plain = tv.qgemv(x, q, scale, row_block, bias, scheme)  # the unfused path within fp32 rounding
    unfused = (torch_ops.gelu_tanh_and_mul if gelu_tanh else torch_ops.silu_and_mul)(plain)
    torch.testing.assert_close(out, unfused, atol=1e-5 * err_scale, rtol=1e-5)


@interp
@pytest.mark.parametrize("shards,k", [(MERGED, 192), ((37,), 4224), ((9,), 12288 + 256), ((21,), 300)])
@pytest.mark.parametrize("wide", [False, True])
def test_w8a8_gemv_interpreted(shards, k: int, wide: bool, monkeypatch) -> None:
    """One row, int8 weights, "int8_token": the DP4A kernel (spelled out in shifts under the interpreter)
    against the reference that quantises x per token; the 16-row config and the float GEMV's; K = 300 is
    no multiple of 16, so the float GEMV takes it and the reference keeps x exact."""
    monkeypatch.setattr(w8, "MAX_WIDE_PROGRAMS_PER_SM", 64 if wide else 0)
    q, scale, _ = make_weights(shards, k, INT8, "channel", seed=k)
    x = torch.randn(1, k, generator=_gen(1)) * 3
    bias = torch.randn(q.shape[0], generator=_gen(2))
    out = torch.full((1, q.shape[0]), float("nan"))
    assert tv.qgemv(x, q, scale, None, bias, "channel", out=out, act_quant="int8_token") is out
    check(out, x, q, scale, None, bias, "int8_token" if w8.supported(q, "channel") else None, ATOL_INTERP)
    assert w8.supported(q, "channel") == (k % 16 == 0)
    assert not w8.supported(q.view(torch.uint8).view(FP8), "channel") and not w8.supported(q, "block")


@interp
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("inter", [1500, 4096])
def test_gated_activation_writes_partial_maxima_interpreted(gelu: bool, inter: int) -> None:
    """gated_and_mul_amax: the same activation as the plain kernel, and per row partial maxima whose
    maximum is exactly amax |output| (as rounded to the output dtype), masked tail block included."""
    from kernels import triton_act

    x = (torch.randn(3, 2 * inter, generator=_gen(3)) * 2).to(torch.bfloat16)
    act, partials = triton_act.gated_and_mul_amax(x, gelu)
    plain = triton_act.gelu_tanh_and_mul(x) if gelu else triton_act.silu_and_mul(x)
    assert torch.equal(act, plain)
    assert partials.shape == (3, triton_act.amax_blocks(inter)) and partials.dtype == torch.float32
    assert torch.equal(partials.amax(dim=1), act.float().abs().amax(dim=1))


@interp
def test_w8a8_gemv_reads_the_producers_amax_interpreted() -> None:
    """With act_amax the DP4A kernel takes amax from the partial maxima: the producer's true maxima
    give the very output of its own pass over x; doubled ones give another (so they are read)."""
    from kernels import triton_act

    k = 4224
    q, scale, _ = make_weights((37,), k, INT8, "channel", seed=5)
    h = (torch.randn(1, 2 * k, generator=_gen(4)) * 3).to(torch.bfloat16)
    x, partials = triton_act.gated_and_mul_amax(h, False)
    own = tv.qgemv(x, q, scale, None, None, "channel", act_quant="int8_token")
    given = tv.qgemv(x, q, scale, None, None, "channel", act_quant="int8_token", act_amax=partials)
    doubled = tv.qgemv(x, q, scale, None, None, "channel", act_quant="int8_token", act_amax=partials * 2)
    assert torch.equal(given, own)
    assert not torch.equal(doubled, own)
    check(given.float(), x.float(), q, scale, None, None, "int8_token", 2e-2)


@interp
@pytest.mark.parametrize("wdtype,act", PAIRS, ids=lambda p: str(p).replace("torch.", ""))
@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("m,with_bias", [(1, False), (3, True), (17, False), (64, True)])
def test_qgemm_interpreted(wdtype, act, scheme: str, m: int, with_bias: bool, monkeypatch) -> None:
    """Merged shards, K = 300 (a masked last K tile); small tiles so M and N span several of them."""
    poisoned_empty(monkeypatch)  # xq, sx and out start as NaN
    monkeypatch.setattr(tq, "CONFIGS", ((1 << 62, 16, 64, 4, 2),))
    monkeypatch.setattr(tq, "GROUP_M", 3)  # 4 row tiles at M = 64: a full group and a partial one
    q, scale, row_block = make_weights(MERGED, 300, wdtype, scheme, seed=m)
    x = torch.randn(m, 300, generator=_gen(m + 1))
    bias = torch.randn(q.shape[0], generator=_gen(3)) if with_bias else None
    out = tq.qgemm(x, q, scale, row_block, bias, scheme, act)
    check(out, x, q, scale, row_block, bias, act, ATOL_INTERP)


@interp
@pytest.mark.parametrize("wdtype,act", PAIRS, ids=lambda p: str(p).replace("torch.", ""))
@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_qgemm_split_k_interpreted(wdtype, act, scheme: str, monkeypatch) -> None:
    """K split over 4 programs per tile (the last split short and masked), partials summed with bias."""
    poisoned_empty(monkeypatch)  # the workspace starts as NaN: every split must write its slice
    monkeypatch.setattr(tq, "CONFIGS", ((1 << 62, 16, 64, 4, 2),))
    monkeypatch.setattr(tq, "MIN_SPLIT_K_TILES", 2)
    monkeypatch.setattr(tq, "SPLIT_PROGRAMS_PER_SM", 64)
    monkeypatch.setattr(tq, "MAX_PARTIAL_SHARE", 1)
    k = 7 * 128 + 44
    assert tq.qgemm_config(5, sum(MERGED), k, 2)[4] == 4
    q, scale, row_block = make_weights(MERGED, k, wdtype, scheme, seed=11)
    x = torch.randn(5, k, generator=_gen(12))
    bias = torch.randn(q.shape[0], generator=_gen(13))
    out = tq.qgemm(x, q, scale, row_block, bias, scheme, act)
    check(out, x, q, scale, row_block, bias, act, ATOL_INTERP)


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_qgemm_half_inputs_and_leading_dims(dtype) -> None:
    """fp16 activations (the weight-only dot runs in fp16), [B, T, K] input, default tiles."""
    q, scale, row_block = make_weights(MERGED, 256, FP8, "block", seed=5)
    x = torch.randn(2, 5, 256, generator=_gen(6)).to(dtype)
    for act in (None, "fp8_group128"):
        out = tq.qgemm(x, q, scale, row_block, None, "block", act)
        assert out.shape == (2, 5, sum(MERGED)) and out.dtype == dtype
        check(out, x.float(), q, scale, row_block, None, act, 2e-3 if dtype == torch.float16 else ATOL_INTERP)


@interp
@pytest.mark.parametrize("act", ["int8_token", "fp8_token", "fp8_group128"])
@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "chunked"])
def test_act_quant_is_exact(act: str, one_pass: bool, monkeypatch) -> None:
    """Codes and scales equal torch's bit for bit: ties to even, e4m3 carries, subnormals, zero rows;
    the row held in registers, and read twice in 128-wide chunks."""
    poisoned_empty(monkeypatch)
    if not one_pass:
        monkeypatch.setattr(tq, "MAX_ONE_PASS", 0)
        monkeypatch.setattr(tq, "QUANT_BLOCK", 128)
    qmax = QMAX[act]
    x = torch.randn(6, 300, generator=_gen(7)) * 3
    x[1] = 0.0  # CUDA-graph padding: codes 0, scale SCALE_MIN
    x[2, :8] = torch.tensor([qmax, 2.5, -3.5, 0.5, 8.5, 9.5, 127.0, 0.0146])  # scale 1: ties, carries
    x[2, 8:] = torch.linspace(-0.02, 0.02, 292)  # e4m3 subnormals (below 2^-6) and their rounding
    codes, scales = tq.quantise_activations(x, act)
    want_codes, want_scales, _ = ref_act_quant(x, act)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales.view(x.shape[0], -1), want_scales)


@interp
@pytest.mark.parametrize("wdtype,act", PAIRS, ids=lambda p: str(p).replace("torch.", ""))
def test_agrees_with_the_twin(wdtype, act) -> None:
    """The kernels and kernels.torch_ops.quant_linear (the other implementation of this contract) agree."""
    from kernels import torch_ops

    if not hasattr(torch_ops, "quant_linear"):
        pytest.skip("no torch twin in this tree")
    for scheme in ("channel", "block"):
        w = make_weights(MERGED, 300, wdtype, scheme, seed=9)
        x, bias = torch.randn(5, 300, generator=_gen(10)), torch.randn(sum(MERGED), generator=_gen(11))
        twin = torch_ops.quant_linear(x, *w, bias, scheme, act)
        torch.testing.assert_close(tq.qgemm(x, *w, bias, scheme, act), twin, atol=1e-4, rtol=1e-4)
        twin = torch_ops.quant_linear(x[:1], *w, bias, scheme, None)
        torch.testing.assert_close(tv.qgemv(x[:1], *w, bias, scheme), twin, atol=1e-4, rtol=1e-4)


def test_configs_from_shapes() -> None:
    """GEMV: tiles hold whole 128-column scale blocks and fill the GPU; GEMM: BLOCK_N shrinks to fill it."""
    for n, k in [(6144, 4096), (4096, 14336), (28672, 4096), (2048, 8192), (160, 192), (8, 64)]:
        block_n, block_k, _, _ = tv.qgemv_config(n, k, 132)
        assert block_k % 128 == 0 and (block_n == 1 or -(-n // block_n) >= tt.MIN_PROGRAMS_PER_SM * 132)
    assert tv.qgemv_config(4096, 14336, 132)[1] == tt.LONG_ROWS[0]
    assert w8.w8a8_config(6144, 4096, 132)[0] == w8.WIDE[0]  # 384 programs of 16 rows
    assert w8.w8a8_config(28672, 4096, 132) == tv.qgemv_config(28672, 4096, 132)  # 1,792: too many
    assert w8.w8a8_config(4096, 14336, 132) == tv.qgemv_config(4096, 14336, 132)  # long rows
    assert tq.qgemm_config(64, 4096, 14336, 132) == (64, 32, 4, 4, 4)  # down_proj: 128 tiles, K in four
    assert tq.qgemm_config(64, 28672, 4096, 132)[4] == 1  # 224 tiles: partials would be 1/8 of W
    assert tq.qgemm_config(4096, 28672, 4096, 132)[:2] + (tq.qgemm_config(4096, 28672, 4096, 132)[4],) == (
        128,
        128,
        1,
    )  # prefill: enough tiles, no split


def test_rejects_bad_inputs() -> None:
    q, scale, row_block = make_weights((64,), 256, FP8, "block")
    x = torch.zeros(2, 256)
    cases = [
        (lambda: tv.qgemv(x, q, scale, row_block, None, "block"), "one contiguous row"),
        (lambda: tv.qgemv(x[:1], q, scale, None, None, "block"), "row_block"),
        (lambda: tv.qgemv(x[:1], q, scale, row_block, None, "channel"), "channel"),
        (lambda: tv.qgemv(x[:1], q.float(), scale, row_block, None, "block"), "fp8"),
        (lambda: tq.qgemm(x, q, scale, row_block, None, "block", "int8_token"), "needs torch.int8"),
        (lambda: tq.qgemm(x, q, scale, row_block, None, "block", "fp4"), "unknown act_quant"),
        (lambda: tq.qgemm(x, q, scale, row_block, torch.zeros(3), "block", None), "bias"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


# ----------------------------------------------------------------------------------------- GPU
SHAPES = {"8b qkv": ((4096, 1024, 1024), 4096), "8b gate_up": ((14336, 14336), 4096),
          "8b down": ((4096,), 14336), "odd shards": ((2000, 520, 520), 2048 + 64)}  # fmt: skip


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("wdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_gpu_shapes_bf16(name: str, wdtype, scheme: str) -> None:
    """Llama-3.1-8B projections in bf16: the GEMV at M = 1, the GEMM for every act_quant at M > 1."""
    shards, k = SHAPES[name]
    q, scale, row_block = make_weights(shards, k, wdtype, scheme, seed=k, device="cuda")
    bias = torch.randn(q.shape[0], generator=_gen(1, "cuda"), device="cuda").bfloat16()
    x = torch.randn(300, k, generator=_gen(2, "cuda"), device="cuda").bfloat16()
    out = tv.qgemv(x[:1], q, scale, row_block, bias, scheme)
    check(out, x[:1], q, scale, row_block, bias, None, 2e-2)
    torch.testing.assert_close(tv.qgemv(x[:1], q, scale, row_block, bias, scheme, silu=True), F.silu(out))
    if wdtype == INT8:  # "int8_token" at M = 1: the DP4A kernel for "channel", else the float GEMV
        out = tv.qgemv(x[:1], q, scale, row_block, bias, scheme, act_quant="int8_token")
        check(out, x[:1], q, scale, row_block, bias, "int8_token" if scheme == "channel" else None, 2e-2)
    if name == "8b gate_up":  # the same weights with the activation as the GEMV's epilogue
        ref, err_scale = gated_reference(x[:1], q, scale, row_block, bias, False)
        got = tv.qgemv_gated(x[:1], q, scale, row_block, bias, scheme, False)
        torch.testing.assert_close(got.double(), ref, atol=2e-2 * err_scale, rtol=2e-2)
    for act in [a for w, a in PAIRS if w == wdtype]:
        for m in (3, 64, 300):
            out = tq.qgemm(x[:m], q, scale, row_block, bias, scheme, act)
            check(out, x[:m], q, scale, row_block, bias, act, 2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("act", [None, "fp8_token", "fp8_group128"])
def test_gpu_graph_replay(act) -> None:
    """Captured in a CUDA graph (after a warm-up compile), replays follow x rewritten in place."""
    q, scale, row_block = make_weights((2048, 512, 512), 2048, FP8, "block", device="cuda")
    x = torch.randn(64, 2048, device="cuda").bfloat16()
    run = (lambda: tv.qgemv(x[:1], q, scale, row_block, None, "block")) if act is None else (
        lambda: tq.qgemm(x, q, scale, row_block, None, "block", act))  # fmt: skip
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn(64, 2048, device="cuda"))
    graph.replay()
    check(out, x[: out.shape[0]], q, scale, row_block, None, act, 2e-2)


def _hopper_build() -> int:
    """Compile every serving variant for sm_90 (stand-in driver); print one line each, return failures."""
    import re

    from triton.runtime.driver import driver

    from tests.hopper_compile import H100_SMEM, HopperStandIn, _compiled, _wide, ptxas_registers

    driver.set_active(HopperStandIn())
    for mod in (tv, tq, w8):
        mod._sm_count, mod.pdl_enabled = (lambda _: 132), (lambda _: True)
    for (wdtype, act), scheme in [(p, s) for p in PAIRS for s in ("channel", "block")]:
        for m, n, k in [(1, 6144, 4096), (1, 4096, 14336), *[(m, 6144, 4096) for m in (8, 64, 256)]]:
            blocks = scheme == "block"  # the stand-in launches nothing: values never matter
            scale = torch.ones(n // 128, k // 128) if blocks else torch.ones(n)
            row_block = torch.zeros(n, dtype=torch.int32) if blocks else None
            w = (torch.zeros(n, k, dtype=wdtype), scale, row_block)
            x = torch.randn(m, k, dtype=torch.bfloat16)
            if m == 1 and act in (None, "int8_token"):
                tv.qgemv(x, *w, None, scheme, act_quant=act)
            if m == 1 and act is None:
                tv.qgemv_gated(x, *w, None, scheme, False)
            elif m > 1:
                tq.qgemm(x, *w, None, scheme, act)
    failures = 0
    gemvs = (tv._qgemv_kernel, w8._w8a8_gemv_kernel)
    for fn in (*gemvs, tq._qgemm_kernel, tq._act_quant_kernel):
        for kern in _compiled(fn):
            ptx, meta = kern.asm["ptx"], kern.metadata
            regs = ptxas_registers(ptx) or (0, 0)
            mma = re.search(r"wgmma\.mma_async\S*|mma\.sync\S*|dp4a\S*", ptx)
            ok = meta.shared <= H100_SMEM and not regs[1] and (fn not in gemvs or _wide(ptx))
            failures += not ok
            print(f"{fn.__name__:<18} warps {meta.num_warps} smem {meta.shared:>6} regs {regs} "
                  f"{mma[0] if mma else '-'} {'ok' if ok else 'FAIL'}")  # fmt: skip
    return failures


def test_hopper_build() -> None:
    """Every variant builds for sm_90 without a GPU; fp8 / int8 activations reach wgmma at M >= 64."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    code = "import sys; from tests.test_kernels_quant import _hopper_build; sys.exit(_hopper_build())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for operands in ("f32.e4m3.e4m3", "s32.s8.s8", "f32.bf16.bf16"):
        assert "wgmma.mma_async.sync.aligned.m64n32k" in proc.stdout and operands in proc.stdout, operands
    assert "_w8a8_gemv_kernel  warps 8 smem" in proc.stdout and "dp4a.s32.s32" in proc.stdout


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gpu_gated_mlp_hands_amax_to_an_int8_down_proj(act: str, monkeypatch) -> None:
    """Batch 1, an int8 W8A8 down_proj: GatedMLP has the activation kernel write partial maxima and the
    DP4A GEMV read them (checked by spying on qgemv), with bitwise the output of the unfused path."""
    from engine.models.layers import GatedMLP
    from engine.models.quant_linear import LinearQuant, QuantLinear

    hidden, inter = 1024, 4096
    mlp = GatedMLP(hidden, inter, act).cuda().bfloat16()
    torch.nn.init.normal_(mlp.gate_up_proj.weight, std=0.05)
    down = QuantLinear(inter, hidden, False, LinearQuant(INT8, "channel", "int8_token")).cuda()
    q, scale, _ = make_weights((hidden,), inter, INT8, "channel", seed=9, device="cuda")
    down.qweight.data, down.scale.data = q, scale
    mlp.down_proj = down
    assert down.takes_act_amax
    seen = []
    qgemv = tv.qgemv
    monkeypatch.setattr(tv, "qgemv", lambda *a, **k: seen.append(k.get("act_amax")) or qgemv(*a, **k))
    x = torch.randn(1, hidden, device="cuda").bfloat16()
    fused = mlp(x)
    unfused = down(getattr(ops, mlp.act_name)(mlp.gate_up_proj(x)))
    assert seen[0] is not None and seen[1] is None
    assert torch.equal(fused, unfused)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gpu_gated_mlp_fuses_the_activation_into_gate_up(scheme: str, act: str, monkeypatch) -> None:
    """Batch 1 with fp8 gate|up: GatedMLP runs no activation kernel (gate|up's GEMV applies it), and
    matches the unfused path (gate|up rounded to bf16, then the activation kernel) within bf16 rounding;
    two rows still take the GEMM and the activation kernel."""
    from engine.models.layers import GatedMLP
    from engine.models.quant_linear import LinearQuant, QuantMergedLinear
    from kernels import triton_act

    hidden, inter = 2048, 8192
    mlp = GatedMLP(hidden, inter, act).cuda().bfloat16()
    torch.nn.init.normal_(mlp.down_proj.weight, std=0.02)
    quant = LinearQuant(FP8, scheme, "fp8_group128" if scheme == "block" else "fp8_token")
    gate_up = QuantMergedLinear(hidden, [inter, inter], False, quant).cuda()
    q, scale, row_block = make_weights((inter, inter), hidden, FP8, scheme, 5, "cuda")
    gate_up.qweight.data, gate_up.scale.data = q, scale
    if row_block is not None:
        gate_up.row_block = row_block
    mlp.gate_up_proj = gate_up
    launches = []
    launch = triton_act._launch
    monkeypatch.setattr(triton_act, "_launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    x = torch.randn(2, hidden, generator=_gen(6, "cuda"), device="cuda").bfloat16() * 0.1
    fused = mlp(x[:1])
    assert not launches
    gelu = act != "silu"
    unfused = mlp.down_proj((ops.gelu_tanh_and_mul if gelu else ops.silu_and_mul)(gate_up(x[:1])))
    assert launches == [1]
    tol = 2e-2 * float(unfused.abs().max())
    torch.testing.assert_close(fused.float(), unfused.float(), atol=tol, rtol=2e-2)
    both = mlp(x)
    assert launches == [1, 1]
    torch.testing.assert_close(both[:1].float(), fused.float(), atol=5 * tol, rtol=0.1)  # fp8 activations
