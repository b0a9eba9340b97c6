"""Batch-1 GEMV (kernels.triton_gemv) vs cuBLAS (F.linear) on real projection shapes; sm_90 build check.

    python benchmarks/linear_bench.py                 # GPU: gpu-marked linear tests, then timings
    python benchmarks/linear_bench.py --no-tests      # GPU: timings only
    python benchmarks/linear_bench.py --compile-only  # any machine: build for sm_90, print smem / regs
    python benchmarks/linear_bench.py --sweep-gemv    # GPU: graph timings of a few tile configs
    python benchmarks/linear_bench.py --rows 64       # GPU: cuBLAS vs cuBLASLt at 64 rows (batch 64)

Shapes: Llama-3.1-8B and Llama-3.2-1B projections, bf16, one row of x (batch-1 decode). Each timing runs
the op once on each of enough copies of W that they total > 200 MB (no copy is still in L2 when it comes
round again) inside one CUDA graph, as decode runs it: back-to-back kernels, no launch overhead. GB/s
counts W's bytes over the time, against the device's copy bandwidth (bytes read + written by a 1 GiB
device-to-device copy). A failing check is reported, timings go on. The short table comes last.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.kernel_bench import _ms, copy_bandwidth, run_gpu_tests  # noqa: E402

SHAPES = [  # (name, K, N)
    ("8b qkv", 4096, 6144), ("8b o", 4096, 4096), ("8b gate_up", 4096, 28672), ("8b down", 14336, 4096),
    ("8b lm_head", 4096, 128256), ("1b qkv", 2048, 3072), ("1b o", 2048, 2048),
    ("1b gate_up", 2048, 16384), ("1b down", 8192, 2048),
]  # fmt: skip
ROTATE_BYTES = 256 << 20  # > 200 MB of distinct weights per measurement


def _ptxas_registers(ptx: str) -> str:
    """Registers / spills from the ptxas that ships with triton (the newest one that reads this PTX)."""
    bin_dir = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"
    src = Path(os.environ.get("TMPDIR", "/tmp")) / "gemv_check.ptx"
    src.write_text(ptx)
    for name in ("ptxas-blackwell", "ptxas"):
        exe = bin_dir / name
        if not exe.exists():
            continue
        proc = subprocess.run([str(exe), "-arch=sm_90a", "-v", str(src), "-o", os.devnull],
                              capture_output=True, text=True)  # fmt: skip
        regs = re.search(r"Used (\d+) registers", proc.stderr)
        spills = re.search(r"(\d+) bytes spill stores", proc.stderr)
        if proc.returncode == 0 and regs:
            return f"{regs.group(1)} regs, {spills.group(1) if spills else '?'} B spilled"
    return "ptxas unavailable"


def compile_only() -> int:
    """Build both GEMV configs (and a bias / masked-K variant) for sm_90 with a stand-in driver."""
    os.environ["TRITON_INTERPRET"] = "0"
    from triton.runtime.driver import driver

    from benchmarks.kernel_bench import H100_SMEM, _fake_hopper_driver
    from kernels import triton_gemv as tg

    driver.set_active(_fake_hopper_driver())
    bf = dict(dtype=torch.bfloat16)
    for k, n, bias in [(4096, 6144, False), (14336, 4096, False), (4160, 1040, True)]:
        tg.gemv(torch.randn(1, k, **bf), torch.randn(n, k, **bf), torch.randn(n, **bf) if bias else None)
    failures = 0
    print(f"{'variant':<10}{'smem':>8}  {'registers':<22}checks")
    compiled = list(tg._gemv_kernel.device_caches[0][0].values())
    failures += len(compiled) < 3
    for i, kern in enumerate(compiled):
        ptx = kern.asm["ptx"]
        regs = _ptxas_registers(ptx)
        spilled = re.search(r"(\d+) B spilled", regs)
        wide = "v4.b32" in ptx or "cp.async.cg" in ptx  # W moves in 16-byte vectors
        ok = wide and kern.metadata.shared <= H100_SMEM and not (spilled and int(spilled[1]))
        failures += not ok
        print(f"gemv #{i:<4}{kern.metadata.shared:>8}  {regs:<22}{'ok' if ok else 'FAIL'}")
    print("ALL OK" if not failures else f"{failures} problem(s)")
    return 1 if failures else 0


def _graph_us(op, x: torch.Tensor, ws: list) -> float:
    """Per-call time of `op` inside one CUDA graph that runs it once on every weight copy."""
    for w in ws:  # compiles outside the capture
        op(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            op(x, w)
    return _ms(graph.replay) * 1e3 / len(ws)


def _weights(k: int, n: int) -> list[torch.Tensor]:
    copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
    return [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k**-0.5 for _ in range(copies)]


def _cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


GEMV_SWEEP = [  # (BLOCK_K, num_stages, MAX_BLOCK_N); warps and programs/SM as shipped
    (1024, 2, 4), (512, 4, 16), (512, 4, 8), (1024, 3, 4), (256, 6, 16), (1024, 2, 8), (512, 6, 8),
]  # fmt: skip


def sweep_gemv() -> None:
    """Graph-mode us per call for each GEMV_SWEEP config next to cuBLAS, with the best config's GB/s."""
    from kernels import triton_gemv as tg

    shipped = tg.SHORT_ROWS, tg.LONG_ROWS
    print("gemv configs (BLOCK_K, stages, MAX_BLOCK_N):", GEMV_SWEEP)
    for name, k, n in SHAPES:
        ws = _weights(k, n)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        times = [_graph_us(_cublas, x, ws)]
        for cfg in GEMV_SWEEP:
            tg.SHORT_ROWS = tg.LONG_ROWS = cfg
            times.append(_graph_us(tg.gemv, x, ws))
        tg.SHORT_ROWS, tg.LONG_ROWS = shipped
        best = n * k * 2 / (min(times[1:]) * 1e-6) / 1e9
        print(f"{name:<11} cuBLAS {times[0]:7.2f} | " + " ".join(f"{t:7.2f}" for t in times[1:])
              + f" | best {best:.0f} GB/s")  # fmt: skip
        del ws
        torch.cuda.empty_cache()


def bench(copy_gbs: float) -> list[tuple]:
    """(shape, cuBLAS us, GEMV us, GEMV GB/s, fraction of copy bandwidth, max |difference|) per shape."""
    from kernels import triton_gemv as tg

    rows = []
    for name, k, n in SHAPES:
        ws = _weights(k, n)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        err = (tg.gemv(x, ws[0]).float() - _cublas(x, ws[0]).float()).abs().max().item()
        t_cub, t_gemv = _graph_us(_cublas, x, ws), _graph_us(tg.gemv, x, ws)
        gbs = n * k * 2 / (t_gemv * 1e-6) / 1e9
        rows.append((name, t_cub, t_gemv, gbs, gbs / copy_gbs, err))
        del ws
        torch.cuda.empty_cache()
    return rows


def bench_rows(rows: int, copy_gbs: float) -> None:
    """Graph-mode us per call at `rows` rows (decode at that batch) of F.linear through cuBLAS and through
    cuBLASLt (torch.backends.cuda.preferred_blas_library), with W's GB/s and the share of copy bandwidth."""
    print(f"\n{rows} rows: us per call (GB/s of W, share of copy {copy_gbs:.0f} GB/s)")
    for name, k, n in SHAPES:
        ws = _weights(k, n)
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        cells = []
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            t = _graph_us(_cublas, x, ws)
            gbs = n * k * 2 / (t * 1e-6) / 1e9
            cells.append(f"{lib} {t:8.2f} ({gbs:5.0f}, {gbs / copy_gbs:4.0%})")
        torch.backends.cuda.preferred_blas_library("cublas")
        print(f"{name:<12}" + "  ".join(cells))
        del ws
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="build for sm_90 on CPU, no GPU needed")
    parser.add_argument("--no-tests", action="store_true", help="skip the gpu-marked linear tests")
    parser.add_argument("--sweep-gemv", action="store_true", help="time a few tile configs (GPU)")
    parser.add_argument("--rows", default="", help="GPU: cuBLAS vs cuBLASLt at these rows (16,64)")
    args = parser.parse_args()
    if args.compile_only:
        return compile_only()
    if not torch.cuda.is_available():
        print("no CUDA device: run with --compile-only, or on a GPU machine")
        return 1
    if args.sweep_gemv:
        sweep_gemv()
        return 0
    if args.rows:
        copy_gbs = copy_bandwidth()
        for rows in args.rows.split(","):
            bench_rows(int(rows), copy_gbs)
        return 0
    tests_rc = 0 if args.no_tests else run_gpu_tests("tests/test_kernels_linear.py")
    copy_gbs = copy_bandwidth()
    rows = bench(copy_gbs)
    print(f"\n{torch.cuda.get_device_name()}: device copy {copy_gbs:.0f} GB/s (read + write); us per call")
    print(f"{'shape':<12}{'cuBLAS':>9}{'gemv':>9}{'speedup':>9}{'GB/s':>7}{'of copy':>9}{'max diff':>10}")
    for name, t_cub, t_gemv, gbs, frac, err in rows:
        print(
            f"{name:<12}{t_cub:>9.2f}{t_gemv:>9.2f}{t_cub / t_gemv:>8.2f}x{gbs:>7.0f}{frac:>9.0%}{err:>10.1e}"
        )
    if tests_rc:
        print("GPU LINEAR TESTS FAILED (see the pytest output above)")
    return 1 if tests_rc else 0


if __name__ == "__main__":
    sys.exit(main())
