"""Skinny GEMM (kernels.triton_linear) vs cuBLAS (F.linear) at decode batch sizes; sm_90 build check.

    python benchmarks/linear_bench.py                 # GPU: gpu-marked linear tests, then timings
    python benchmarks/linear_bench.py --no-tests      # GPU: timings only
    python benchmarks/linear_bench.py --compile-only  # any machine: build for sm_90, print smem / regs
    python benchmarks/linear_bench.py --sweep         # GPU: graph timings of a few tile configs at M=1, 8

Shapes: Llama-3.1-8B and Llama-3.2-1B projections, bf16, M in {1, 2, 4, 8, 16}. Each measurement
cycles through enough copies of W that they total > 200 MB (no copy is still in L2 when it comes
round again), timed with triton.testing.do_bench (median; it also flushes L2 between calls). GB/s
counts the bytes the layer must move (W + x + y) over the time, against the device's copy bandwidth
(bytes read + written by a 1 GiB device-to-device copy). A failing check is reported, timings go on.
The short table comes last.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.kernel_bench import _ms, copy_bandwidth  # noqa: E402

SHAPES = [  # (name, K, N)
    ("8b qkv", 4096, 6144), ("8b o", 4096, 4096), ("8b gate_up", 4096, 28672), ("8b down", 14336, 4096),
    ("8b lm_head", 4096, 128256), ("1b qkv", 2048, 3072), ("1b o", 2048, 2048),
    ("1b gate_up", 2048, 16384), ("1b down", 8192, 2048),
]  # fmt: skip
BATCHES = (1, 2, 4, 8, 16)
ROTATE_BYTES = 256 << 20  # > 200 MB of distinct weights per measurement


# ------------------------------------------------------------------------------- compile-only (no GPU)


def _ptxas_registers(ptx: str) -> str:
    """Registers / spills from the ptxas that ships with triton (the newest one that reads this PTX)."""
    bin_dir = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"
    src = Path(os.environ.get("TMPDIR", "/tmp")) / "skinny_linear_check.ptx"
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
    os.environ["TRITON_INTERPRET"] = "0"
    from triton.runtime.driver import driver

    from benchmarks.kernel_bench import H100_SMEM, _fake_hopper_driver
    from kernels import triton_linear as tlin

    driver.set_active(_fake_hopper_driver())
    bf = dict(dtype=torch.bfloat16)
    # (K, N, splits, bias): the split path, the direct path with bias, a masked tail (K = 32.5 k-blocks)
    for k, n, splits, bias in [(2048, 2048, 8, False), (4096, 6144, 1, True), (4160, 1040, 3, True)]:
        tlin.skinny_linear(torch.randn(3, k, **bf), torch.randn(n, k, **bf), num_splits=splits,
                           bias=torch.randn(n, **bf) if bias else None)  # fmt: skip
    failures = 0
    print(f"{'kernel':<24}{'smem':>8}  {'registers':<22}checks")
    checks = [(tlin._skinny_kernel, ("cp.async.cg", "wgmma")), (tlin._splitk_reduce_kernel, ("v4.b32",))]
    for fn, needs in checks:
        compiled = list(fn.device_caches[0][0].values())
        failures += not compiled
        for kern in compiled:
            ptx = kern.asm["ptx"]
            missing = [s for s in needs if s not in ptx]
            ok = kern.metadata.shared <= H100_SMEM and not missing
            failures += not ok
            verdict = "ok" if ok else f"FAIL (missing {missing})"
            print(f"{fn.__name__:<24}{kern.metadata.shared:>8}  {_ptxas_registers(ptx):<22}{verdict}")
    print("ALL OK" if not failures else f"{failures} problem(s)")
    return 1 if failures else 0


# ------------------------------------------------------------------------------- GPU timings


def _graph_us(op, x: torch.Tensor, ws: list) -> float:
    """Per-call time of `op` inside one CUDA graph that runs it once on every weight copy (as decode
    does: no launch overhead, back-to-back kernels, each W cold in L2)."""
    for w in ws:  # compiles outside the capture
        op(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            op(x, w)
    return _ms(graph.replay) * 1e3 / len(ws)


def _eager_us(op, x: torch.Tensor, ws: list) -> float:
    """Median of single eager calls (do_bench flushes L2 before each), cycling through the copies."""
    cycle = itertools.cycle(ws)
    return _ms(lambda: op(x, next(cycle))) * 1e3


def bench_shape(k: int, n: int, batches, copy_gbs: float) -> list[tuple]:
    """Rows (M, cuBLAS graph us, Triton graph us, cuBLAS eager us, Triton eager us, Triton graph GB/s,
    fraction of copy bandwidth) for one weight shape."""
    from kernels import triton_linear as tlin

    cublas = lambda x, w: torch.nn.functional.linear(x, w)  # noqa: E731 - both allocate their output
    bytes_w = n * k * 2
    copies = max(2, -(-ROTATE_BYTES // bytes_w))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k**-0.5 for _ in range(copies)]
    rows = []
    for m in batches:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        err = (tlin.skinny_linear(x, ws[0]).float() - cublas(x, ws[0]).float()).abs().max()
        if not err <= 3e-2:  # NaN fails too
            print(f"MISMATCH K={k} N={n} M={m}: max |triton - cuBLAS| = {err.item():.3g}")
        t_cub, t_tri = _graph_us(cublas, x, ws), _graph_us(tlin.skinny_linear, x, ws)
        e_cub, e_tri = _eager_us(cublas, x, ws), _eager_us(tlin.skinny_linear, x, ws)
        gbs = (bytes_w + 2 * m * (k + n)) / (t_tri * 1e-6) / 1e9
        rows.append((m, t_cub, t_tri, e_cub, e_tri, gbs, gbs / copy_gbs))
    del ws
    torch.cuda.empty_cache()
    return rows


SWEEP = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages, PROGRAMS_PER_SM); the first is the shipped default
    (64, 128, 4, 4, 4), (64, 128, 4, 3, 8), (64, 256, 4, 3, 4), (64, 256, 4, 2, 4), (32, 256, 4, 3, 4),
    (32, 128, 4, 4, 8), (128, 128, 8, 3, 4), (64, 512, 4, 2, 2), (16, 256, 2, 4, 8), (64, 128, 4, 6, 4),
]  # fmt: skip


def sweep() -> None:
    """Graph-mode us per call for each SWEEP config (module constants patched), next to cuBLAS."""
    from kernels import triton_linear as tlin

    print("configs (BLOCK_N, BLOCK_K, warps, stages, programs/SM):", SWEEP)
    for name, k, n in SHAPES:
        copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        for m in (1, 8):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            times = [_graph_us(lambda x, w: torch.nn.functional.linear(x, w), x, ws)]
            for cfg in SWEEP:
                tlin.BLOCK_N, tlin.BLOCK_K, tlin.NUM_WARPS, tlin.NUM_STAGES, tlin.PROGRAMS_PER_SM = cfg
                times.append(_graph_us(tlin.skinny_linear, x, ws))
            print(f"{name:<11} M={m:<2} cuBLAS {times[0]:7.2f} | " + " ".join(f"{t:7.2f}" for t in times[1:]))
        del ws
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="build for sm_90 on CPU, no GPU needed")
    parser.add_argument("--no-tests", action="store_true", help="skip the gpu-marked linear tests")
    parser.add_argument("--sweep", action="store_true", help="time a few tile configs (GPU)")
    args = parser.parse_args()
    if args.compile_only:
        return compile_only()
    if not torch.cuda.is_available():
        print("no CUDA device: run with --compile-only, or on a GPU machine")
        return 1
    if args.sweep:
        sweep()
        return 0
    tests_rc = 0  # timings still run after a failed check: one GPU session should report both
    if not args.no_tests:
        test_file = "tests/test_kernels_linear.py"
        cmd = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-m", "gpu", test_file]
        tests_rc = subprocess.run(cmd, cwd=ROOT).returncode
    copy_gbs = copy_bandwidth()
    table, failed = [], []
    for name, k, n in SHAPES:
        try:
            table += [(name, *row) for row in bench_shape(k, n, BATCHES, copy_gbs)]
        except Exception:  # noqa: BLE001 - report and go on to the next shape
            traceback.print_exc()
            failed.append(name)
    print(f"\n{torch.cuda.get_device_name()}: device copy {copy_gbs:.0f} GB/s (read + write); times in us;")
    print("graph = per call inside a CUDA graph (as decode runs); eager = single do_bench calls")
    head = ["shape", "M", "cuBLAS", "triton", "speedup", "GB/s", "of copy", "eager cuBLAS", "eager triton"]
    print("{:<12}{:>3}{:>9}{:>9}{:>9}{:>7}{:>9}{:>14}{:>14}".format(*head))
    for name, m, t_cub, t_tri, e_cub, e_tri, gbs, frac in table:
        print(f"{name:<12}{m:>3}{t_cub:>9.2f}{t_tri:>9.2f}{t_cub / t_tri:>8.2f}x{gbs:>7.0f}{frac:>9.0%}"
              f"{e_cub:>14.2f}{e_tri:>14.2f}")  # fmt: skip
    if failed:
        print(f"SHAPES THAT FAILED: {', '.join(failed)} (tracebacks above)")
    if tests_rc:
        print("GPU LINEAR TESTS FAILED (see the pytest output above)")
    return 1 if tests_rc or failed else 0


if __name__ == "__main__":
    sys.exit(main())
