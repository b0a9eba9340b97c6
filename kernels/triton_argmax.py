"""Row-wise argmax of logits in one launch (twin: torch.argmax(dim=-1), lowest index on ties).

Greedy decoding takes one argmax per step over a vocabulary of 128k-256k. torch.argmax gives each row
to one thread block, and a two-stage torch version costs five small launches; either is a visible
share of a 0.8 ms batch-1 step. Here grid (row, chunk) spreads each row over the chip: a program finds
the first maximum of its BLOCK logits and stores (value, index) as a partial, then counts itself in at
the row's arrival counter (kernels.arrivals); the row's last program picks the first chunk holding the
largest partial, so ties resolve to the lowest index whichever program arrives last.
NaN logits give an unspecified id (torch would return the NaN's index).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arrivals import arrival_counters, arrive_last
from kernels.pdl import enabled as pdl_enabled
from kernels.pdl import wait_for_inputs

BLOCK = 2048  # logits per program: 63 programs for one row of a 128k vocabulary


@triton.jit
def _argmax_kernel(
    x_ptr, part_val_ptr, part_idx_ptr, out_ptr, arrivals_ptr, V, stride_x,
    BLOCK: tl.constexpr, CHUNKS_P2: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    wait_for_inputs(USE_PDL)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    best = tl.max(v, axis=0)
    first = tl.min(tl.where(v == best, idx, V), axis=0)  # a real index: every chunk holds one
    tl.store(part_val_ptr + row * chunks + chunk, best)
    tl.store(part_idx_ptr + row * chunks + chunk, first)
    counter = arrivals_ptr + row
    if arrive_last(counter, chunks):
        c = tl.arange(0, CHUNKS_P2)
        parts = row * chunks + c  # loads bypass L1: other SMs wrote the partials
        vals = tl.load(part_val_ptr + parts, mask=c < chunks, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(part_idx_ptr + parts, mask=c < chunks, other=V, cache_modifier=".cg")
        top = tl.max(vals, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(vals == top, idxs, V), axis=0).to(tl.int64))
        tl.store(counter, 0)  # ready for the next launch


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, V] (any float dtype, rows contiguous) -> int64 ids [rows]."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"argmax: logits {tuple(logits.shape)} must be [rows, vocab] with contiguous rows")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, BLOCK)
    part_val = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    pdl = pdl_enabled(logits.device)
    _argmax_kernel[(rows, chunks)](
        logits, part_val, part_idx, out, arrival_counters(rows, logits.device), vocab, logits.stride(0),
        BLOCK=BLOCK, CHUNKS_P2=triton.next_power_of_2(chunks), USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out
