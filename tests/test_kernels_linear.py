"""The batch-1 GEMV (kernels.triton_gemv) and ops.linear against torch.nn.functional.linear.

CPU (`make test`): TRITON_INTERPRET=1 runs the kernel on small fp32 / fp16 shapes with odd N and K
(partial last row tile, masked last K tile), both tile configs and NaN-poisoned outputs, so a missed
store or a wrong tail shows. GPU (marker `gpu`): the real Llama shapes in bf16 and CUDA-graph replay;
the sm_90 build (tests/hopper_compile.py gemv) runs here without a GPU (own process: the interpreter
flag is fixed when the kernels are defined).
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

pytest.importorskip("triton")

from kernels import ops  # noqa: E402
from kernels import triton_gemv as tg  # noqa: E402

pytestmark = pytest.mark.kernels
ROOT = Path(__file__).resolve().parents[1]
interp = pytest.mark.skipif(not interpreter_usable(), reason="needs TRITON_INTERPRET=1 before triton loads")


def _rand(*shape: int, seed: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 on the CPU: independent of both the kernel and cuBLAS."""
    b = None if bias is None else bias.double().cpu()
    return torch.nn.functional.linear(x.double().cpu(), w.double().cpu(), b)


# ----------------------------------------------------------------------------------------- interpreter


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(64, 256), (100, 300), (37, 1000), (130, 17), (5, 2048), (9, 12288 + 40)])
def test_matches_torch_interpreted(dtype, n: int, k: int) -> None:
    """Odd N (partial last row tile), odd K (masked last tile), both configs (K >= LONG_K: long rows)."""
    x, w, bias = (
        _rand(1, k, seed=1, dtype=dtype),
        _rand(n, k, seed=2, dtype=dtype),
        _rand(n, seed=3, dtype=dtype),
    )
    for b in (None, bias):
        out = torch.full((1, n), float("nan"), dtype=dtype)
        got = tg.gemv(x, w, b, out=out)
        assert got.data_ptr() == out.data_ptr()
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # fp16: one rounding of the fp32 sum
        torch.testing.assert_close(got.double(), _reference(x, w, b), atol=tol * k**0.5, rtol=tol)


def _gated_reference(x, w, bias, gelu_tanh: bool) -> torch.Tensor:
    h = _reference(x, w, bias)
    g, u = h.chunk(2, dim=-1)
    return (torch.nn.functional.gelu(g, approximate="tanh") if gelu_tanh else torch.nn.functional.silu(g)) * u


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter,k", [(50, 300), (37, 1000), (3, 12288 + 40)])
@pytest.mark.parametrize("gelu_tanh", [False, True])
def test_gated_matches_torch_interpreted(dtype, inter: int, k: int, gelu_tanh: bool) -> None:
    """gate|up with the activation as the epilogue: the last tile pairs rows past I (odd I), a masked K
    tile, the long-row config; against fp64 act(gate) * up, and the bias of each half applied."""
    x, w = _rand(1, k, seed=1, dtype=dtype) * 0.1, _rand(2 * inter, k, seed=2, dtype=dtype)
    bias = _rand(2 * inter, seed=3, dtype=dtype)
    for b in (None, bias):
        out = torch.full((1, inter), float("nan"), dtype=dtype)
        assert tg.gemv_gated(x, w, b, gelu_tanh, out=out) is out
        ref = _gated_reference(x, w, b, gelu_tanh)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        scale = float(_reference(x, w, b).abs().max())  # the error grows with |gate| and |up|
        torch.testing.assert_close(out.double(), ref, atol=tol * k**0.5 * scale, rtol=tol)


def test_config_fills_the_gpu_from_shapes() -> None:
    """BLOCK_N shrinks until the grid has MIN_PROGRAMS_PER_SM programs per SM; the K tile follows K."""
    sms = 132
    for n, k in [(2048, 2048), (2048, 8192), (4096, 14336), (28672, 4096), (128256, 4096), (8, 64)]:
        block_n, block_k, _ = tg.gemv_config(n, k, sms)
        assert block_n == 1 or -(-n // block_n) >= tg.MIN_PROGRAMS_PER_SM * sms
        assert block_k == (tg.LONG_ROWS if k >= tg.LONG_K else tg.SHORT_ROWS)[0]
    assert tg.gemv_config(8, 64, sms)[0] == 1


def test_rejects_bad_inputs() -> None:
    w = torch.zeros(64, 32)
    with pytest.raises(ValueError, match="one row"):
        tg.gemv(torch.zeros(2, 32), w)
    with pytest.raises(ValueError, match="one dtype"):
        tg.gemv(torch.zeros(1, 32).half(), w)
    with pytest.raises(ValueError, match="bias"):
        tg.gemv(torch.zeros(1, 32), w, bias=torch.zeros(63))
    with pytest.raises(ValueError, match="one row of 32"):
        tg.gemv(torch.zeros(1, 64), w)
    with pytest.raises(ValueError, match="even number"):
        tg.gemv_gated(torch.zeros(1, 32), torch.zeros(63, 32), None, False)


@interp
def test_ops_linear_dispatch(monkeypatch) -> None:
    """ops.linear takes the GEMV only for a single fp16/bf16 row; F.linear (cuBLAS) otherwise."""
    calls = []
    real = tg.gemv
    monkeypatch.setattr(ops, "use_triton", lambda x: True)  # CPU tensors run under the interpreter
    monkeypatch.setattr(tg, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w, bias = _rand(40, 64, seed=6, dtype=torch.float16), _rand(40, seed=7, dtype=torch.float16)
    for rows, expect_triton in [(1, True), (2, False)]:
        x = _rand(1, rows, 64, seed=8, dtype=torch.float16)  # leading dims are kept
        calls.clear()
        got = ops.linear(x, w, bias)
        assert got.shape == (1, rows, 40) and bool(calls) == expect_triton
        torch.testing.assert_close(got.double(), _reference(x[0], w, bias)[None], atol=2e-2, rtol=2e-2)
    calls.clear()
    ops.linear(_rand(1, 64, seed=9, dtype=torch.float32), w.float())  # fp32 weights stay on cuBLAS
    assert not calls


@interp
def test_ops_linear_fp32_out_keeps_the_sums_unrounded(monkeypatch) -> None:
    """out_dtype=float32 (a row-parallel partial sum): one fp16 row through the GEMV and two through the
    fallback give the fp32 sums, not the fp16-rounded ones; a bias or another dtype is refused."""
    monkeypatch.setattr(ops, "use_triton", lambda x: True)
    k, n = 300, 70
    w = _rand(n, k, seed=12, dtype=torch.float16)
    for rows in (1, 2):
        x = _rand(rows, k, seed=13, dtype=torch.float16)
        got = ops.linear(x, w, None, torch.float32)
        ref = _reference(x, w)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-5)
        rounded = ops.linear(x, w).double()  # fp16 output: off by up to half an fp16 ulp
        assert (got.double() - ref).abs().max() < 0.1 * (rounded - ref).abs().max()
    with pytest.raises(ValueError, match="only float32, no bias"):
        ops.linear(x, w, _rand(n, seed=14, dtype=torch.float16), torch.float32)


# ----------------------------------------------------------------------------------------- GPU

SHAPES = {  # (K, N): Llama-3.1-8B and Llama-3.2-1B projections
    "8b qkv": (4096, 6144), "8b o": (4096, 4096), "8b gate_up": (4096, 28672), "8b down": (14336, 4096),
    "8b lm_head": (4096, 128256), "1b qkv": (2048, 3072), "1b o": (2048, 2048),
    "1b gate_up": (2048, 16384), "1b down": (8192, 2048),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
@pytest.mark.parametrize("name", list(SHAPES))
def test_real_shapes_bf16(name: str) -> None:
    k, n = SHAPES[name]
    x = _rand(1, k, seed=10, dtype=torch.bfloat16, device="cuda")
    w = _rand(n, k, seed=11, dtype=torch.bfloat16, device="cuda") * k**-0.5
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = tg.gemv(x, w, out=out)
    ref = torch.nn.functional.linear(x.float(), w.float())  # fp32 on the GPU: fp64 would be slow at 1 GB
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64])
def test_fp32_out_real_shape_bf16(rows: int) -> None:
    """The TP=2 down_proj shard of the 8B shape with fp32 sums out (GEMV at one row, cuBLAS at 64):
    within fp32 error of an fp64 reference, well inside the bf16 output's error."""
    k, n = 7168, 4096
    x = _rand(rows, k, seed=15, dtype=torch.bfloat16, device="cuda")
    w = _rand(n, k, seed=16, dtype=torch.bfloat16, device="cuda") * k**-0.5
    got = ops.linear(x, w, None, torch.float32)
    ref = _reference(x, w)
    assert got.dtype == torch.float32
    err = (got.double().cpu() - ref).abs().max()
    assert err < 1e-4 and err < 0.05 * (ops.linear(x, w).double().cpu() - ref).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
@pytest.mark.parametrize("name", ["8b gate_up", "1b gate_up"])
def test_gated_real_shapes_bf16(name: str) -> None:
    """gate|up's GEMV with the silu epilogue against fp32 silu(gate) * up on the GPU."""
    k, n = SHAPES[name]
    x = _rand(1, k, seed=10, dtype=torch.bfloat16, device="cuda")
    w = _rand(n, k, seed=11, dtype=torch.bfloat16, device="cuda") * k**-0.5
    got = tg.gemv_gated(x, w, None, False)
    g, u = torch.nn.functional.linear(x.float(), w.float()).chunk(2, dim=-1)
    torch.testing.assert_close(got.float(), torch.nn.functional.silu(g) * u, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
def test_bias_and_graph_replay_bf16() -> None:
    """GEMV with bias inside a CUDA graph: replay follows new x values written in place."""
    x = _rand(1, 8192, seed=12, dtype=torch.bfloat16, device="cuda")
    w = _rand(2048, 8192, seed=13, dtype=torch.bfloat16, device="cuda") * 8192**-0.5
    bias = _rand(2048, seed=14, dtype=torch.bfloat16, device="cuda")
    ops.linear(x, w, bias)  # warm-up compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear(x, w, bias)
    x.copy_(_rand(1, 8192, seed=15, dtype=torch.bfloat16, device="cuda"))
    graph.replay()
    ref = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    first = out.clone()
    graph.replay()
    assert torch.equal(out, first)  # no atomics: bit-identical replays


def test_hopper_compile() -> None:
    """The kernel builds for sm_90 through the real launcher (stand-in driver, no GPU): shared memory
    fits, no register spills, W moves in 16-byte loads (tests/hopper_compile.py gemv)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.hopper_compile", "gemv"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
