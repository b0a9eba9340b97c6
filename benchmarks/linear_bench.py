"""Skinny GEMM (kernels.triton_linear) vs cuBLAS (F.linear) at decode batch sizes; sm_90 build check.

    python benchmarks/linear_bench.py                 # GPU: gpu-marked linear tests, then timings
    python benchmarks/linear_bench.py --no-tests      # GPU: timings only
    python benchmarks/linear_bench.py --compile-only  # any machine: build for sm_90, print smem / regs

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
    for k, n, splits, bias in [(2048, 2048, 8, False), (4096, 6144, 1, True), (4160, 1040, 3, True)]:  # K = 32.5 k-blocks
        tlin.skinny_linear(torch.randn(3, k, **bf), torch.randn(n, k, **bf), num_splits=splits,
                           bias=torch.randn(n, **bf) if bias else None)  # fmt: skip
    failures = 0
    print(f"{'kernel':<24}{'smem':>8}  {'registers':<22}checks")
    for fn, needs in [(tlin._skinny_kernel, ("cp.async.cg", "wgmma")), (tlin._splitk_reduce_kernel, ("v4.b32",))]:
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


def _ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    gbs = 2 * src.numel() / (_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9
    del src, dst
    return gbs


def bench_shape(k: int, n: int, batches, copy_gbs: float) -> list[tuple]:
    """Rows (shape, M, cuBLAS us, Triton us, Triton GB/s, % of copy) for one weight shape."""
    from kernels import triton_linear as tlin

    bytes_w = n * k * 2
    copies = max(2, -(-ROTATE_BYTES // bytes_w))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k**-0.5 for _ in range(copies)]
    rows = []
    for m in batches:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        err = (tlin.skinny_linear(x, ws[0]).float() - torch.nn.functional.linear(x, ws[0]).float()).abs().max()
        if not err <= 3e-2:  # NaN fails too
            print(f"MISMATCH K={k} N={n} M={m}: max |triton - cuBLAS| = {err.item():.3g}")
        cyc_a, cyc_b = itertools.cycle(ws), itertools.cycle(ws)  # both allocate their output
        t_cublas = _ms(lambda: torch.nn.functional.linear(x, next(cyc_a)))
        t_triton = _ms(lambda: tlin.skinny_linear(x, next(cyc_b)))
        gbs = (bytes_w + 2 * m * (k + n)) / (t_triton * 1e-3) / 1e9
        rows.append((m, t_cublas * 1e3, t_triton * 1e3, gbs, gbs / copy_gbs))
    del ws
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="build for sm_90 on CPU, no GPU needed")
    parser.add_argument("--no-tests", action="store_true", help="skip the gpu-marked linear tests")
    args = parser.parse_args()
    if args.compile_only:
        return compile_only()
    if not torch.cuda.is_available():
        print("no CUDA device: run with --compile-only, or on a GPU machine")
        return 1
    tests_rc = 0  # timings still run after a failed check: one GPU session should report both
    if not args.no_tests:
        cmd = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-m", "gpu", "tests/test_kernels_linear.py"]
        tests_rc = subprocess.run(cmd, cwd=ROOT).returncode
    copy_gbs = copy_bandwidth()
    table, failed = [], []
    for name, k, n in SHAPES:
        try:
            table += [(name, *row) for row in bench_shape(k, n, BATCHES, copy_gbs)]
        except Exception:  # noqa: BLE001 - report and go on to the next shape
            traceback.print_exc()
            failed.append(name)
    print(f"\n{torch.cuda.get_device_name()}: device copy {copy_gbs:.0f} GB/s (read + write); times in us")
    print(f"{'shape':<12}{'M':>3}{'cuBLAS':>9}{'triton':>9}{'speedup':>9}{'GB/s':>7}{'of copy':>9}")
    for name, m, t_cub, t_tri, gbs, frac in table:
        print(f"{name:<12}{m:>3}{t_cub:>9.2f}{t_tri:>9.2f}{t_cub / t_tri:>8.2f}x{gbs:>7.0f}{frac:>9.0%}")
    if failed:
        print(f"SHAPES THAT FAILED: {', '.join(failed)} (tracebacks above)")
    if tests_rc:
        print("GPU LINEAR TESTS FAILED (see the pytest output above)")
    return 1 if tests_rc or failed else 0


if __name__ == "__main__":
    sys.exit(main())
