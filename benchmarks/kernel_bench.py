"""Triton kernels vs their torch twins on a CUDA machine; a Hopper compile check without one.

    python benchmarks/kernel_bench.py               # GPU: gpu-marked kernel tests, then timings (~2 min)
    python benchmarks/kernel_bench.py --no-tests    # GPU: timings only
    python benchmarks/kernel_bench.py --compile-only  # any machine: build every kernel for sm_90
    python benchmarks/kernel_bench.py --sweep-decode [--kv-dtype fp8]  # GPU: decode-attention configs

Timings are medians of triton.testing.do_bench. Decode attention uses Llama-3.1-8B shapes (32 q heads,
8 KV heads, head_dim 128, page 16; a bf16 and an fp8 KV cache) and reports the KV bytes it must read /
time against the device's measured copy bandwidth (bytes read + written by a large device-to-device
copy / time).
The short table comes last.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# ------------------------------------------------------------------------------- compile-only (no GPU)

H100_SMEM = 232448  # bytes of shared memory one H100 block may use (227 KiB)


def _fake_hopper_driver():
    """A stand-in Triton driver: targets sm_90, "loads" binaries and launches nothing."""
    from triton.backends.compiler import GPUTarget

    class _Utils:
        def get_device_properties(self, device):
            return {"max_shared_mem": H100_SMEM, "multiprocessor_count": 132, "max_num_regs": 65536,
                    "warpSize": 32, "sm_clock_rate": 0, "mem_clock_rate": 0, "mem_bus_width": 0}  # fmt: skip

        def load_binary(self, name, kernel, shared, device):
            return 0, 0, 0, 0, 1024  # module, function, n_regs, n_spills, max threads

    class _Driver:
        utils = _Utils()

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def launcher_cls(self, src, metadata):
            return lambda *args, **kwargs: None

    return _Driver()


def _launch_all_on_cpu() -> list:
    """Call every launcher once per served configuration; returns the JIT functions involved."""
    from kernels import triton_act, triton_argmax, triton_kv, triton_norm, triton_rope
    from kernels import triton_decode_attention as dec
    from kernels import triton_prefill_attention as pre

    bf = dict(dtype=torch.bfloat16)
    for hidden, offset in [(4096, 0.0), (3584, 1.0)]:
        x = torch.randn(4, hidden, **bf)
        triton_norm.rms_norm(x, torch.randn(hidden, **bf), 1e-6, offset)
        triton_norm.add_rms_norm(x, x.clone(), torch.randn(hidden, **bf), 1e-6, offset)
        triton_act.silu_and_mul(torch.randn(4, 2 * 14336, **bf))
        triton_act.gelu_tanh_and_mul(torch.randn(4, 2 * 14336, **bf))
    triton_argmax.argmax(torch.randn(2, 128256, **bf))
    # (q heads, kv heads, head_dim, window, softcap): Llama-3.1-8B, Gemma-2-9B local layer, a D=64 model
    models = [(32, 8, 128, None, None), (16, 8, 256, 4096, 50.0), (8, 8, 64, None, None)]
    for hq, hk, d, window, cap in models:
        qkv = torch.randn(6, (hq + 2 * hk) * d, **bf)
        q, k = qkv[:, : hq * d].view(6, hq, d), qkv[:, hq * d : (hq + hk) * d].view(6, hk, d)
        triton_rope.apply_rotary(q, k, torch.arange(6), torch.randn(64, d))
        cache = torch.randn(8, 16, hk, d, **bf)
        triton_kv.store_kv(k, k, cache, cache, torch.arange(6))
        slots = torch.tensor([0, 5, -1, 17, 100, -1])  # -1: CUDA-graph padding
        triton_rope.rope_store_kv(q, k, k, torch.arange(6), torch.randn(64, d), cache, cache, slots)
        norm = dict(q_norm_weight=torch.randn(d, **bf), k_norm_weight=torch.randn(d, **bf), norm_offset=1.0)
        triton_rope.rope_store_kv(q, k, k, torch.arange(6), torch.randn(64, d), cache, cache, slots, **norm)
        tables = torch.arange(8, dtype=torch.int32).view(2, 4)
        lens, cu = torch.tensor([40, 64], dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32)
        for kv in (cache, cache.to(torch.float8_e4m3fn)):  # the model-dtype and the fp8 KV cache
            triton_kv.store_kv(k, k, kv, kv, torch.arange(6))
            triton_rope.rope_store_kv(q, k, k, torch.arange(6), torch.randn(64, d), kv, kv, slots, **norm)
            dec.decode_attention(q[:2], kv, kv, tables, lens, 0.1, window, cap)  # 1 split: direct
            dec.decode_attention(q[:2], kv, kv, tables, lens, 0.1, window, cap, num_splits=2)  # + merge
            pre.prefill_attention(q, kv, kv, cu, lens, 3, 0.1, tables, window, cap)
        pre.prefill_attention(q, k, k, cu, torch.tensor([3, 3]), 3, 0.1, None, window, cap)
    return [triton_norm._rms_norm_kernel, triton_act._gated_kernel, triton_rope._rope_kernel,
            triton_rope._rope_store_kv_kernel, triton_kv._store_kv_kernel, dec._decode_split_kernel,
            triton_argmax._argmax_kernel, pre._prefill_kernel]  # fmt: skip


def compile_only() -> int:
    os.environ["TRITON_INTERPRET"] = "0"
    from triton.runtime.driver import driver

    driver.set_active(_fake_hopper_driver())
    failures = 0
    print(f"{'kernel':<24}{'variants':>9}{'max smem':>10}  16-byte global loads")
    for fn in _launch_all_on_cpu():
        compiled = list(fn.device_caches[0][0].values())
        smem = max(k.metadata.shared for k in compiled)
        wide = all("v4.b32" in k.asm["ptx"] or "cp.async.cg" in k.asm["ptx"] for k in compiled)
        ok = compiled and smem <= H100_SMEM and wide
        failures += not ok
        verdict = ("yes" if wide else "NO") + ("" if ok else "  FAIL")
        print(f"{fn.__name__:<24}{len(compiled):>9}{smem:>10}  {verdict}")
    print("ALL OK" if not failures else f"{failures} kernel(s) failed")
    return 1 if failures else 0


# ------------------------------------------------------------------------------- GPU timings


def _ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def _decode_case(
    batch: int, ctx: int, page: int = 16, hq: int = 32, hk: int = 8, d: int = 128, kv_dtype=torch.bfloat16
):
    from engine.attention_context import AttentionMetadata

    blocks = math.ceil(ctx / page)
    k_cache = torch.randn(batch * blocks + 1, page, hk, d, device="cuda").to(kv_dtype)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(kv_dtype)
    tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(torch.arange(batch + 1, dtype=torch.int32, device="cuda"), lens, None, tables,
                             [1] * batch, [ctx] * batch, 1, ctx, page)  # fmt: skip
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
    kv_bytes = 2 * batch * ctx * hk * d * k_cache.element_size()
    return q, k_cache, v_cache, meta, kv_bytes


def bench_decode_case(batch: int, ctx: int, copy_gbs: float, kv_dtype=torch.bfloat16) -> tuple:
    from kernels import torch_ops
    from kernels.triton_decode_attention import decode_attention

    q, kc, vc, meta, kv_bytes = _decode_case(batch, ctx, kv_dtype=kv_dtype)
    k_new = q[:, :8]  # the twin takes the KV head count from k
    run = lambda s=None: decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.088, num_splits=s)
    twin = lambda: torch_ops.attention(q, k_new, k_new, kc, vc, meta, 0.088)
    torch.testing.assert_close(run(), twin(), atol=2e-2, rtol=2e-2)
    t_tri, t_one, t_twin = _ms(run), _ms(lambda: run(1)), _ms(twin)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    t_graph = _ms(graph.replay)
    gbs = kv_bytes / (t_tri * 1e-3) / 1e9
    note = f"{gbs:.0f} GB/s = {gbs / copy_gbs:.0%} of copy; 1 split {t_one:.3f} ms; graph {t_graph:.3f} ms"
    fp8 = " fp8" if kv_dtype == torch.float8_e4m3fn else ""
    return f"decode B={batch} ctx={ctx}{fp8}", t_tri, t_twin, note


DECODE_SWEEP = [  # (BLOCK_N, num_warps, num_stages, PROGRAMS_PER_SM, MIN_SPLITS); the first is the default
    (64, 4, 3, 4, 3), (64, 4, 2, 4, 3), (128, 4, 2, 4, 3), (128, 8, 3, 4, 3), (32, 4, 4, 4, 3),
    (64, 4, 3, 4, 2), (64, 8, 3, 4, 2), (128, 4, 2, 4, 2), (32, 4, 3, 4, 2), (64, 4, 3, 8, 2),
    (32, 2, 4, 8, 2), (64, 4, 3, 2, 2),
]  # fmt: skip
DECODE_SWEEP_CASES = [  # (batch, ctx, Hq, Hk): (a) 8B, (b) 8B, (c)-like Qwen3-0.6B, long context
    (1, 1100, 32, 8), (64, 1064, 32, 8), (256, 600, 16, 8), (256, 1200, 16, 8), (64, 4096, 32, 8),
]  # fmt: skip


def sweep_decode(copy_gbs: float, kv_dtype: torch.dtype) -> None:
    """us per decode-attention call for each DECODE_SWEEP config (module globals patched), over a KV
    cache of kv_dtype. Block tables are as wide as the context here; the engine's graphs use
    max_model_len wide ones, which can only raise the split count where the context caps it (batch 1)."""
    from kernels import triton_decode_attention as tda

    saved = tda.decode_config, tda.PROGRAMS_PER_SM, tda.MIN_SPLITS
    print(f"decode configs over a {kv_dtype} cache (BLOCK_N, warps, stages, programs/SM, min splits):",
          DECODE_SWEEP)  # fmt: skip
    for batch, ctx, hq, hk in DECODE_SWEEP_CASES:
        q, kc, vc, meta, kv_bytes = _decode_case(batch, ctx, hq=hq, hk=hk, kv_dtype=kv_dtype)
        args = (q, kc, vc, meta.block_tables, meta.seq_lens, 0.088)
        times = []
        for block_n, warps, stages, pps, min_splits in DECODE_SWEEP:
            tda.decode_config = lambda *_, c=(block_n, warps, stages): c
            tda.PROGRAMS_PER_SM, tda.MIN_SPLITS = pps, min_splits
            times.append(_ms(lambda a=args: tda.decode_attention(*a)))
        best = min(times)
        print(f"B={batch:<4}ctx={ctx:<5}Hq/Hk={hq}/{hk}: " + " ".join(f"{t * 1e3:6.1f}" for t in times)
              + f"  us; best {kv_bytes / (best * 1e-3) / 1e9 / copy_gbs:.0%} of copy")  # fmt: skip
    tda.decode_config, tda.PROGRAMS_PER_SM, tda.MIN_SPLITS = saved


def bench_elementwise() -> list[tuple]:
    from engine.attention_context import AttentionMetadata
    from kernels import ops, torch_ops

    bf = dict(dtype=torch.bfloat16, device="cuda")
    t, hidden, inter, hq, hk, d = 4096, 4096, 14336, 32, 8, 128
    x, w, gu = torch.randn(t, hidden, **bf), torch.randn(hidden, **bf), torch.randn(t, 2 * inter, **bf)
    q, k = torch.randn(t, hq, d, **bf), torch.randn(t, hk, d, **bf)
    pos, cs = torch.arange(t, device="cuda"), torch.randn(8192, d, device="cuda")
    cache = torch.empty(t // 16 + 1, 16, hk, d, **bf)
    slots = torch.randperm(t, device="cuda")
    meta = AttentionMetadata.for_full_sequences([t], "cuda")
    cases = [
        ("rms_norm T=4096 H=4096", lambda m: m.rms_norm(x, w, 1e-6)),
        ("add_rms_norm", lambda m: m.add_rms_norm(x, x, w, 1e-6)),
        ("rope T=4096 32/8 heads", lambda m: m.apply_rotary(q, k, pos, cs)),
        ("silu_and_mul I=14336", lambda m: m.silu_and_mul(gu)),
        ("store_kv T=4096", lambda m: m.store_kv(k, k, cache, cache, slots)),
        ("prefill 1 x 4096 tokens", lambda m: m.attention(q, k, k, None, None, meta, 0.088)),
    ]
    return [(name, _ms(lambda f=f: f(ops)), _ms(lambda f=f: f(torch_ops)), "") for name, f in cases]


def run_gpu_tests(test_file: str) -> int:
    """The gpu-marked tests of one file, in a subprocess; its exit code (timings still run after a
    failed check: one GPU session should report both)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-m", "gpu", test_file]
    return subprocess.run(cmd, cwd=ROOT).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="build for sm_90 on CPU, no GPU needed")
    parser.add_argument("--no-tests", action="store_true", help="skip the gpu-marked kernel tests")
    parser.add_argument("--sweep-decode", action="store_true", help="time decode-attention configs (GPU)")
    parser.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16", help="cache of --sweep-decode")
    args = parser.parse_args()
    if args.compile_only:
        return compile_only()
    if not torch.cuda.is_available():
        print("no CUDA device: run with --compile-only, or on a GPU machine")
        return 1
    if args.sweep_decode:
        sweep_decode(copy_bandwidth(), torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16)
        return 0
    tests_rc = 0 if args.no_tests else run_gpu_tests("tests/test_kernels.py")
    copy_gbs = copy_bandwidth()
    rows = [bench_decode_case(b, ctx, copy_gbs) for b in (1, 64) for ctx in (1024, 4096)]
    rows += [
        bench_decode_case(b, ctx, copy_gbs, torch.float8_e4m3fn) for b in (1, 64) for ctx in (1024, 4096)
    ]
    rows += bench_elementwise()
    print(f"\n{torch.cuda.get_device_name()}: device copy {copy_gbs:.0f} GB/s (read + write)")
    print(f"{'kernel':<26}{'triton ms':>10}{'twin ms':>10}{'speedup':>9}  notes")
    for name, t_tri, t_twin, note in rows:
        print(f"{name:<26}{t_tri:>10.3f}{t_twin:>10.3f}{t_twin / t_tri:>8.1f}x  {note}")
    if tests_rc:
        print("GPU KERNEL TESTS FAILED (see the pytest output above)")
    return 1 if tests_rc else 0


if __name__ == "__main__":
    sys.exit(main())
