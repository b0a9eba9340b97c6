"""The skinny GEMM (kernels.triton_linear) and ops.linear against torch.nn.functional.linear.

CPU (`make test`): TRITON_INTERPRET=1 runs the kernel on small fp32 / fp16 shapes (the interpreter's
bf16 tl.dot is wrong, so bf16 is checked on the GPU only), with odd N and K, forced split counts and
NaN-poisoned outputs, so a missed store or a wrong split boundary shows. GPU (marker `gpu`): the real
Llama shapes in bf16, CUDA-graph replay, and the sm_90 build of benchmarks/linear_bench.py runs here
without a GPU (own process: the interpreter flag is fixed when the kernels are defined).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from kernels import ops  # noqa: E402
from kernels import triton_linear as tlin  # noqa: E402

pytestmark = pytest.mark.kernels
ROOT = Path(__file__).resolve().parents[1]
CUDA_OK = torch.cuda.is_available() and not INTERPRET


def _interpreter_usable() -> bool:
    """True when triton's own library was defined under the interpreter (see tests/test_kernels.py)."""
    from triton.runtime.interpreter import InterpretedFunction

    return INTERPRET and isinstance(
        importlib.import_module("triton.language.standard").sum, InterpretedFunction
    )


interp = pytest.mark.skipif(not _interpreter_usable(), reason="needs TRITON_INTERPRET=1 before triton loads")


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
@pytest.mark.parametrize(
    "m,n,k,splits",
    [(1, 64, 256, None), (3, 100, 300, None), (16, 70, 130, 3), (5, 33, 1000, 8), (2, 130, 17, None)],
)
def test_matches_torch_interpreted(dtype, m: int, n: int, k: int, splits: int | None) -> None:
    """Odd N (partial last tile), odd K (masked last k-block), M up to 16, split-K, short last split."""
    x, w, bias = (
        _rand(m, k, seed=1, dtype=dtype),
        _rand(n, k, seed=2, dtype=dtype),
        _rand(n, seed=3, dtype=dtype),
    )
    for b in (None, bias):
        out = torch.full((m, n), float("nan"), dtype=dtype)
        got = tlin.skinny_linear(x, w, out=out, bias=b, num_splits=splits)
        assert got.data_ptr() == out.data_ptr()
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # fp16: one rounding of the fp32 sum
        torch.testing.assert_close(got.double(), _reference(x, w, b), atol=tol * k**0.5, rtol=tol)


@interp
def test_strided_rows_and_out_interpreted() -> None:
    """x and out as column slices of wider buffers: row strides are honoured, neighbours untouched."""
    x_buf = _rand(4, 200, seed=4, dtype=torch.float32)
    w = _rand(48, 160, seed=5, dtype=torch.float32)
    out_buf = torch.full((4, 80), float("nan"))
    tlin.skinny_linear(x_buf[:, :160], w, out=out_buf[:, 16:64], num_splits=2)
    torch.testing.assert_close(
        out_buf[:, 16:64].double(), _reference(x_buf[:, :160], w), atol=1e-4, rtol=1e-4
    )
    assert out_buf[:, :16].isnan().all() and out_buf[:, 64:].isnan().all()


def test_choose_split_fills_the_gpu_from_shapes() -> None:
    """Split only when N tiles cannot fill the SMs; every split non-empty; at most k_blocks / 2 splits."""
    sms = 132
    for n, k in [(2048, 2048), (2048, 8192), (4096, 14336), (28672, 4096), (128256, 4096), (3072, 2048)]:
        splits, per = tlin.choose_split(n, k, sms)
        k_blocks = -(-k // tlin.BLOCK_K)
        assert (splits - 1) * per < k_blocks <= splits * per  # the last split holds >= 1 block
        assert splits == 1 or per >= tlin.MIN_BLOCKS_PER_SPLIT
        assert splits == 1 or -(-n // tlin.BLOCK_N) * (splits - 1) < tlin.PROGRAMS_PER_SM * sms
    assert tlin.choose_split(128256, 4096, sms)[0] == 1
    assert tlin.choose_split(2048, 8192, sms)[0] > 8


def test_rejects_bad_inputs() -> None:
    x, w = torch.zeros(17, 32), torch.zeros(64, 32)
    with pytest.raises(ValueError, match="at most 16"):
        tlin.skinny_linear(x, w)
    with pytest.raises(ValueError, match="one dtype"):
        tlin.skinny_linear(x[:2].half(), w)
    with pytest.raises(ValueError, match="out must be"):
        tlin.skinny_linear(x[:2], w, out=torch.empty(2, 63))


@interp
def test_ops_linear_dispatch(monkeypatch) -> None:
    """ops.linear takes the Triton path only for <= SKINNY_MAX_M rows of fp16/bf16; F.linear otherwise."""
    calls = []
    real = tlin.skinny_linear
    monkeypatch.setattr(ops, "use_triton", lambda x: True)  # CPU tensors run under the interpreter
    monkeypatch.setattr(tlin, "skinny_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w, bias = _rand(40, 64, seed=6, dtype=torch.float16), _rand(40, seed=7, dtype=torch.float16)
    for rows, expect_triton in [(ops.SKINNY_MAX_M, True), (ops.SKINNY_MAX_M + 1, False)]:
        x = _rand(1, rows, 64, seed=8, dtype=torch.float16)  # leading dims are flattened
        calls.clear()
        got = ops.linear(x, w, bias)
        assert got.shape == (1, rows, 40) and bool(calls) == expect_triton
        torch.testing.assert_close(got.double(), _reference(x[0], w, bias)[None], atol=2e-2, rtol=2e-2)
    calls.clear()
    ops.linear(_rand(2, 64, seed=9, dtype=torch.float32), w.float())  # fp32 weights stay on cuBLAS
    assert not calls


# ----------------------------------------------------------------------------------------- GPU

SHAPES = {  # (K, N): Llama-3.1-8B and Llama-3.2-1B projections
    "8b qkv": (4096, 6144), "8b o": (4096, 4096), "8b gate_up": (4096, 28672), "8b down": (14336, 4096),
    "8b lm_head": (4096, 128256), "1b qkv": (2048, 3072), "1b o": (2048, 2048),
    "1b gate_up": (2048, 16384), "1b down": (8192, 2048),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("name", list(SHAPES))
def test_real_shapes_bf16(name: str, m: int) -> None:
    k, n = SHAPES[name]
    x = _rand(m, k, seed=10, dtype=torch.bfloat16, device="cuda")
    w = _rand(n, k, seed=11, dtype=torch.bfloat16, device="cuda") * k**-0.5
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = tlin.skinny_linear(x, w, out=out)
    ref = torch.nn.functional.linear(x.float(), w.float())  # fp32 on the GPU: fp64 would be slow at 1 GB
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
def test_bias_split_and_graph_replay_bf16() -> None:
    """Split-K with bias inside a CUDA graph: replay follows new x values written in place."""
    x = _rand(4, 8192, seed=12, dtype=torch.bfloat16, device="cuda")
    w = _rand(2048, 8192, seed=13, dtype=torch.bfloat16, device="cuda") * 8192**-0.5
    bias = _rand(2048, seed=14, dtype=torch.bfloat16, device="cuda")
    assert tlin.choose_split(2048, 8192, tlin._sm_count(x.device))[0] > 1
    tlin.skinny_linear(x, w, bias=bias)  # warm-up compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear(x, w, bias)
    x.copy_(_rand(4, 8192, seed=15, dtype=torch.bfloat16, device="cuda"))
    graph.replay()
    ref = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    first = out.clone()
    graph.replay()
    assert torch.equal(out, first)  # deterministic two-pass reduce: bit-identical replays


def test_hopper_compile() -> None:
    """The kernels build for sm_90 through the real launcher (stand-in driver, no GPU): shared memory
    fits, W moves in 16-byte async copies, the dot is a wgmma (benchmarks/linear_bench.py --compile-only)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/linear_bench.py", "--compile-only"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
