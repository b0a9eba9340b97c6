"""The batch-1 quantised GEMVs' fixed tile configs, chosen from the shape (no autotune): shared by the
float GEMV (kernels/triton_qgemv.py) and the integer-dot one (kernels/triton_qgemv_w8a8.py), which falls
back to the float GEMV's tiles. Benchmarks patch these module constants one variant at a time
(benchmarks/quant_sweep.py).
"""

from __future__ import annotations

import triton

from kernels.triton_gemv import LONG_K, MIN_PROGRAMS_PER_SM

# (BLOCK_K, num_stages, MAX_BLOCK_N, num_warps): 2 KiB of up to 8 rows per tile; long rows (K >= LONG_K,
# down_proj of an 8B model) over 8 warps, 3 tiles deep. Chosen by benchmarks/quant_sweep.py on an H200
# (its report: benchmarks/reports/gpu/quant_sweep_8b_h200.md).
SHORT_ROWS = (2048, 2, 8, 4)
LONG_ROWS = (2048, 3, 8, 8)
SCALE_BLOCK = 128  # the block scheme's square block edge


def qgemv_config(n: int, k: int, sm_count: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_stages, num_warps) from the shape: BLOCK_K shrinks to K's power of two
    (at least 128, so a tile holds whole scale blocks); BLOCK_N is the largest power of two <= the
    config's MAX_BLOCK_N that still gives MIN_PROGRAMS_PER_SM programs per SM (or 1)."""
    block_k, stages, block_n, warps = LONG_ROWS if k >= LONG_K else SHORT_ROWS
    block_k = min(block_k, max(SCALE_BLOCK, triton.next_power_of_2(k)))
    while block_n > 1 and triton.cdiv(n, block_n) < MIN_PROGRAMS_PER_SM * sm_count:
        block_n //= 2
    return block_n, block_k, stages, warps
