"""Build the Triton kernels for Hopper (sm_90) on a machine without a GPU, for the kernel tests.

    python -m tests.hopper_compile kernels   # every kernel, through its real launcher
    python -m tests.hopper_compile gemv      # the batch-1 GEMV's configs, with ptxas register counts

Run in a process of its own with TRITON_INTERPRET=0 (tests/test_kernels.py and test_kernels_linear.py do):
Triton fixes the interpreter flag when the kernels are defined. A stand-in driver targets sm_90, "loads"
the binaries and launches nothing, so each launcher compiles exactly the variants that serving would. A
kernel fails when a variant's shared memory exceeds what one H100 block may use, or when it does not move
global memory in 16-byte vectors (or, for the GEMV, when ptxas reports register spills). Prints one line per
kernel and exits 1 on any failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

H100_SMEM = 232448  # bytes of shared memory one H100 block may use (227 KiB)
BF16 = dict(dtype=torch.bfloat16)


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": H100_SMEM, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 0, "mem_clock_rate": 0, "mem_bus_width": 0}  # fmt: skip

    def load_binary(self, name, kernel, shared, device):
        return 0, 0, 0, 0, 1024  # module, function, n_regs, n_spills, max threads


class HopperStandIn:
    """A Triton driver that compiles for sm_90 and never touches a device."""

    utils = _Utils()

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def launcher_cls(self, src, metadata):
        return lambda *args, **kwargs: None


def _wide(ptx: str) -> bool:
    """Global memory moves in 16-byte vectors (or asynchronous 16-byte copies)."""
    return "v4.b32" in ptx or "cp.async.cg" in ptx


def _compiled(fn) -> list:
    return list(fn.device_caches[0][0].values())


def _norms_and_activations() -> list:
    from kernels import triton_act, triton_argmax, triton_norm

    for hidden, offset in [(4096, 0.0), (3584, 1.0)]:
        x = torch.randn(4, hidden, **BF16)
        triton_norm.rms_norm(x, torch.randn(hidden, **BF16), 1e-6, offset)
        triton_norm.add_rms_norm(x, x.clone(), torch.randn(hidden, **BF16), 1e-6, offset)
        triton_act.silu_and_mul(torch.randn(4, 2 * 14336, **BF16))
        triton_act.gelu_tanh_and_mul(torch.randn(4, 2 * 14336, **BF16))
    triton_argmax.argmax(torch.randn(2, 128256, **BF16))
    from kernels import triton_bitmask

    for vocab in (128256, 151936):  # the grammar mask: every row, and some rows by index
        mask = torch.zeros(3, (vocab + 31) // 32, dtype=torch.int32)
        triton_bitmask.apply_token_bitmask(torch.randn(4, vocab, **BF16), mask, None)
        triton_bitmask.apply_token_bitmask(torch.randn(4, vocab, **BF16), mask, torch.tensor([0, 2, 3]))
    kernels = [triton_norm._rms_norm_kernel, triton_act._gated_kernel, triton_argmax._argmax_kernel]
    return kernels + [triton_bitmask._bitmask_kernel]


def _attention_and_cache(hq: int, hk: int, d: int, window: int | None, cap: float | None) -> None:
    from kernels import triton_decode_attention as dec
    from kernels import triton_kv, triton_rope
    from kernels import triton_prefill_attention as pre

    qkv = torch.randn(6, (hq + 2 * hk) * d, **BF16)
    q, k = qkv[:, : hq * d].view(6, hq, d), qkv[:, hq * d : (hq + hk) * d].view(6, hk, d)
    pos, cos_sin = torch.arange(6), torch.randn(64, d)
    triton_rope.apply_rotary(q, k, pos, cos_sin)
    cache = torch.randn(8, 16, hk, d, **BF16)
    slots = torch.tensor([0, 5, -1, 17, 100, -1])  # -1: CUDA-graph padding
    triton_rope.rope_store_kv(q, k, k, pos, cos_sin, cache, cache, slots)
    norm = dict(q_norm_weight=torch.randn(d, **BF16), k_norm_weight=torch.randn(d, **BF16), norm_offset=1.0)
    tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    lens, cu = torch.tensor([40, 64], dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32)
    vis = dict(visibility=(*[torch.zeros(6, dtype=torch.int32)] * 3, pos), slot_mapping=slots)  # per-row
    for kv in (cache, cache.to(torch.float8_e4m3fn)):  # the model-dtype and the fp8 KV cache
        triton_kv.store_kv(k, k, kv, kv, pos)
        triton_rope.rope_store_kv(q, k, k, pos, cos_sin, kv, kv, slots, **norm)
        dec.decode_attention(q[:2], kv, kv, tables, lens, 0.1, window, cap)  # 1 split: direct
        dec.decode_attention(q[:2], kv, kv, tables, lens, 0.1, window, cap, num_splits=2)  # + merge
        pre.prefill_attention(q, kv, kv, cu, lens, 3, 0.1, tables, window, cap)
        pre.prefill_attention(q, kv, kv, cu, lens, 3, 0.1, tables, window, cap, mixed=True, **vis)
    pre.prefill_attention(q, k, k, cu, torch.tensor([3, 3]), 3, 0.1, None, window, cap)


def _lora() -> list:
    """Batched LoRA shrink / expand: 8B qkv (3 slices) and down, decode and prefill tiles, rank 16 / 64."""
    from kernels import torch_lora, triton_lora

    for t in (1, 4096):
        mapping = torch_lora.lora_mapping(torch.zeros(t, dtype=torch.int32), 8)
        for r in (16, 64):
            for k, off in [(4096, [0, 4096, 5120, 6144]), (14336, [0, 4096])]:
                x, n_slices = torch.randn(t, k, **BF16), len(off) - 1
                s = triton_lora.lora_shrink(x, torch.randn(8, n_slices * r, k, **BF16), mapping)
                y = torch.randn(t, off[-1], **BF16)
                triton_lora.lora_expand(y, s, torch.randn(8, off[-1], r, **BF16), mapping, off)
    return [triton_lora._shrink_kernel, triton_lora._expand_kernel]


def kernels() -> int:
    """Every served kernel; Llama-3.1-8B, a Gemma-2-9B local layer and a head_dim-64 model."""
    from kernels import triton_decode_attention as dec
    from kernels import triton_kv, triton_rope
    from kernels import triton_prefill_attention as pre

    fns = _norms_and_activations()
    for case in [(32, 8, 128, None, None), (16, 8, 256, 4096, 50.0), (8, 8, 64, None, None)]:
        _attention_and_cache(*case)
    fns += [triton_rope._rope_kernel, triton_rope._rope_store_kv_kernel, triton_kv._store_kv_kernel,
            dec._decode_split_kernel, pre._prefill_kernel]  # fmt: skip
    fns += _lora()
    failures = 0
    print(f"{'kernel':<24}{'variants':>9}{'max smem':>10}  16-byte global loads")
    for fn in fns:
        compiled = _compiled(fn)
        smem = max((k.metadata.shared for k in compiled), default=0)
        wide = all(_wide(k.asm["ptx"]) for k in compiled)
        ok = bool(compiled) and smem <= H100_SMEM and wide
        failures += not ok
        verdict = ("yes" if wide else "NO") + ("" if ok else "  FAIL")
        print(f"{fn.__name__:<24}{len(compiled):>9}{smem:>10}  {verdict}")
    return failures


def ptxas_registers(ptx: str) -> tuple[int, int] | None:
    """(registers, bytes spilled) from the ptxas that ships with triton, or None where none reads this PTX."""
    bin_dir = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        for name in ("ptxas-blackwell", "ptxas"):
            if not (bin_dir / name).exists():
                continue
            cmd = [str(bin_dir / name), "-arch=sm_90a", "-v", str(src), "-o", os.devnull]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            regs = re.search(r"Used (\d+) registers", proc.stderr)
            spills = re.search(r"(\d+) bytes spill stores", proc.stderr)
            if proc.returncode == 0 and regs:
                return int(regs[1]), int(spills[1]) if spills else 0
    return None


def gemv() -> int:
    """Both GEMV tile configs (short and long rows), a bias / masked-K variant and gate|up's gated one."""
    from kernels import triton_gemv as tg

    for k, n, bias in [(4096, 6144, False), (14336, 4096, False), (4160, 1040, True)]:
        b = torch.randn(n, **BF16) if bias else None
        tg.gemv(torch.randn(1, k, **BF16), torch.randn(n, k, **BF16), b)
    tg.gemv_gated(torch.randn(1, 4096, **BF16), torch.randn(28672, 4096, **BF16), None, False)
    compiled = _compiled(tg._gemv_kernel)
    failures = int(len(compiled) < 4)
    print(f"{'variant':<10}{'smem':>8}  {'registers':<22}checks")
    for i, kern in enumerate(compiled):
        regs = ptxas_registers(kern.asm["ptx"])
        ok = _wide(kern.asm["ptx"]) and kern.metadata.shared <= H100_SMEM and not (regs and regs[1])
        failures += not ok
        text = f"{regs[0]} regs, {regs[1]} B spilled" if regs else "ptxas unavailable"
        print(f"gemv #{i:<4}{kern.metadata.shared:>8}  {text:<22}{'ok' if ok else 'FAIL'}")
    return failures


def main(argv: list[str]) -> int:
    from triton.runtime.driver import driver

    checks = {"kernels": kernels, "gemv": gemv}
    if len(argv) != 1 or argv[0] not in checks:
        print(f"usage: python -m tests.hopper_compile {{{','.join(checks)}}}", file=sys.stderr)
        return 2
    driver.set_active(HopperStandIn())
    failures = checks[argv[0]]()
    print("ALL OK" if not failures else f"{failures} kernel(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
