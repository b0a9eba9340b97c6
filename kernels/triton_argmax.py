"""Row-wise argmax of logits in one launch, plain (greedy decoding; twin: torch.argmax(dim=-1), lowest
index on ties) or of Gumbel-perturbed logits (sampling; twin: kernels.torch_ops.sample).

Greedy decoding takes one argmax per step over a vocabulary of 128k-256k. torch.argmax gives each row
to one thread block, and a two-stage torch version costs five small launches; either is a visible
share of a small model's batch-1 step. Here grid (row, chunk) spreads each row over the chip: a program finds
the first maximum of its BLOCK logits and stores (value, index) as a partial, then counts itself in at
the row's arrival counter (kernels.arrivals); the row's last program picks the first chunk holding the
largest partial, so ties resolve to the lowest index whichever program arrives last.
NaN logits give an unspecified id (torch would return the NaN's index).

A grammar's token bitmask (engine/structured/state.py) can be applied as the logits load: a refused token
reads as -inf, so a constrained draw needs no separate masking pass over the logits (nor its launch).

Sampling is the same pass with noise added as the logits load: argmax(x / T + G) with G ~ Gumbel(0, 1)
i.i.d. is an exact draw from softmax(x / T) (the Gumbel-max trick), so a sampled row costs one read of
its logits, like a greedy one; no fp32 copy, softmax or noise tensor is ever written. The noise of
logit v comes from Philox4x32-10 keyed by the row's 64-bit key at counter (v, counter): a row's draw
depends on (key, counter) only, never on its neighbours, its batch or the device.
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
def _gumbel(key, counter, idx):
    """Gumbel(0, 1) noise of logits idx: Philox(key, (idx, counter, 0, 0)), the top 23 bits of its first
    word as u = (bits + 0.5) / 2**23 (strictly inside (0, 1), exact in fp32), then -log(-log(u))."""
    zero = tl.zeros_like(idx).to(tl.uint32)
    bits, _, _, _ = tl.philox(key, idx.to(tl.uint32), zero + counter.to(tl.uint32), zero, zero)
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _argmax_kernel(
    x_ptr, temp_ptr, key_ptr, counter_ptr, part_val_ptr, part_idx_ptr, out_ptr, arrivals_ptr, V, stride_x,
    mask_ptr, mask_row_ptr, W, ids_ptr,
    BLOCK: tl.constexpr, CHUNKS_P2: tl.constexpr, NOISE: tl.constexpr, MASK: tl.constexpr,
    MASK_ROWS: tl.constexpr, USE_PDL: tl.constexpr, IDS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    wait_for_inputs(USE_PDL)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    if NOISE:
        t = tl.load(temp_ptr + row)
        if t > 0.0:  # T = 0 rows (greedy) keep their logits; padding columns stay -inf (-inf + G)
            v = v / t + _gumbel(tl.load(key_ptr + row), tl.load(counter_ptr + row), idx)
    if MASK:  # a grammar's bitmask: row m = mask_row[row] (-1: unconstrained), bit t of word t // 32
        m = tl.load(mask_row_ptr + row).to(tl.int64) if MASK_ROWS else row
        if m >= 0:
            words = tl.load(mask_ptr + m * W + idx // 32, mask=idx < 32 * W, other=0)
            v = tl.where(((words >> (idx % 32)) & 1) != 0, v, float("-inf"))
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
        winner = tl.min(tl.where(vals == top, idxs, V), axis=0)
        if IDS:  # the id the winning column stands for
            winner = tl.load(ids_ptr + winner)
        tl.store(out_ptr + row, winner.to(tl.int64))
        tl.store(counter, 0)  # ready for the next launch


def argmax(
    logits: torch.Tensor, bitmask: torch.Tensor | None = None, mask_row=None, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [rows, V] (any float dtype, rows contiguous) -> int64 ids [rows]. With `bitmask`
    [R, ceil(V / 32)] int32, only the tokens whose bit is set compete (a grammar's mask, as
    kernels.torch_ops.apply_token_bitmask applies it): for row r, mask row mask_row[r] ([rows] int,
    -1: no mask), or mask row r when mask_row is None. With `ids` [V] int64 (contiguous), column c
    stands for token ids[c]: the result is ids[argmax], in the same launch."""
    if ids is not None and (
        ids.shape != logits.shape[-1:] or ids.dtype != torch.int64 or not ids.is_contiguous()
    ):
        raise ValueError(f"argmax: ids must be contiguous int64 [{logits.shape[-1]}], got {tuple(ids.shape)}")
    return _launch(logits, None, bitmask, mask_row, ids)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    counters: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    mask_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """One draw per row from softmax(logits / temperature): int64 ids [rows]. temperature [rows] fp32
    (0: the plain argmax); keys [rows] int64, one Philox stream per sequence; counters [rows] int64, the
    position of the token being drawn (only its low 32 bits are used), so each draw of a stream is
    fresh and a recomputed position draws the same token again. bitmask / mask_row: as in `argmax`."""
    rows = logits.shape[0]
    for name, t, dtype in (("temperature", temperature, torch.float32), ("keys", keys, torch.int64),
                           ("counters", counters, torch.int64)):  # fmt: skip
        if t.shape != (rows,) or t.dtype != dtype or t.device != logits.device:
            raise ValueError(
                f"sample: {name} must be [{rows}] {dtype} on {logits.device}, got {tuple(t.shape)} {t.dtype}"
            )
    return _launch(logits, (temperature, keys, counters), bitmask, mask_row)


def _launch(logits: torch.Tensor, noise: tuple | None, bitmask=None, mask_row=None, ids=None):
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
    temp, keys, counters = noise or (logits, logits, logits)  # unread without NOISE
    if bitmask is not None and (bitmask.dtype != torch.int32 or not bitmask.is_contiguous()):
        raise ValueError(f"argmax: bitmask must be contiguous int32, got {bitmask.dtype}")
    _argmax_kernel[(rows, chunks)](
        logits, temp, keys, counters, part_val, part_idx, out, arrival_counters(rows, logits.device), vocab,
        logits.stride(0), logits if bitmask is None else bitmask, logits if mask_row is None else mask_row,
        0 if bitmask is None else bitmask.shape[1], out if ids is None else ids, BLOCK=BLOCK,
        CHUNKS_P2=triton.next_power_of_2(chunks), NOISE=noise is not None, MASK=bitmask is not None,
        MASK_ROWS=mask_row is not None, USE_PDL=pdl, IDS=ids is not None,
        num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out
