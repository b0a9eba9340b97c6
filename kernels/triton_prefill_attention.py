"""Prefill / chunked-prefill attention for a packed varlen batch (twin: kernels.torch_ops.attention).

Grid (query tile, sequence, head slot); no padding of the batch: a program whose tile starts past
its sequence's query_len exits at once. A head slot is one KV head with all GROUP query heads that
share it (PACK_GQA): the tile's BLOCK_M rows are BQ = BLOCK_M / GP queries times GP heads (GP: GROUP
rounded up to a power of two, rows of the extra heads masked), so each K/V tile is loaded once for the
group. Without packing (GROUP 1, or tiles too small) a slot is one query head. Sequence b owns rows
cu_seqlens_q[b] : cu_seqlens_q[b + 1] of q; its query i sits at absolute position p = ctx + i with
ctx = seq_len - query_len (tokens already cached) and sees key j iff j <= p and (no window or
p - j < window). Plain causal tiles without a window (SPLIT) run the keys before their first query,
which every row sees, through a loop without the mask, and only the rest through the masked one.

Keys come from the paged cache (PAGED: position j lives in block block_table[b, j // PAGE] at offset
j % PAGE; this step's keys are already stored there) or, when there is no cache, from this step's
k/v packed exactly like q (then seq_len == query_len). Online softmax in base 2, fp32 accumulators.

VIS (per-row visibility, engine.models.attention_context.TokenVisibility; paged only) replaces the causal
rule: row t sees cache positions j < ctx_lens[t] (and positions[t] - j < window), then the packed rows
local_start[t] ... local_start[t] + local_len[t] - 1, whose keys are read from the cache at their
slot_mapping slots in a second loop over the union of the tile's local ranges (_attend_local). seq_lens
is not read then. One-query sequences of a FLAT grid are the decode kernel's, which knows no visibility:
they must be ordinary causal (ctx_lens = seq_len, no local rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import torch_ops
from kernels.triton_attn_common import dot_dtype_for, load_paged_rows, online_softmax_step, scores_log2
from kernels.triton_gemv import _sm_count


@triton.jit
def _load_kv_tile(base_ptr, bt_row, seq_start, kpos, kvalid, kh, stride_b, stride_s, stride_h, d, dmask,
                  PAGED: tl.constexpr, PAGE: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_D] keys or values at positions kpos of one sequence and KV head."""
    if PAGED:
        return load_paged_rows(
            base_ptr, bt_row, kpos, kvalid, kh, stride_b, stride_s, stride_h, d, dmask, PAGE
        )
    rows = (seq_start + kpos).to(tl.int64)  # packed like q: stride_b is the token stride
    ptrs = base_ptr + rows[:, None] * stride_b + kh * stride_h + d[None, :]
    return tl.load(ptrs, mask=kvalid[:, None] & dmask[None, :], other=0.0)


@triton.jit
def _flat_tile_seq(cu_q_ptr, t, num_seqs, search_steps, BLOCK_M: tl.constexpr):
    """The sequence owning flat tile t: the last b with first_tile(b) = cu_q[b] // BLOCK_M + b <= t.
    first_tile rises by at least 1 per sequence and sequence b has cdiv(q_len, BLOCK_M) tiles, so the
    sequences' tile ranges never overlap; a binary search of search_steps >= log2(num_seqs) halvings."""
    lo = 0
    hi = num_seqs - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        go = tl.load(cu_q_ptr + mid) // BLOCK_M + mid <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo


@triton.jit
def _load_slot_rows(base_ptr, slot, valid, kh, stride_b, stride_s, stride_h, d, dmask, PAGE: tl.constexpr):
    """Rows [len(slot), BLOCK_D] of one KV head at flat cache slots (block * PAGE + offset). Invalid rows
    read 0."""
    offs = (slot // PAGE)[:, None] * stride_b + (slot % PAGE)[:, None] * stride_s + kh * stride_h + d[None, :]
    return tl.load(base_ptr + offs, mask=valid[:, None] & dmask[None, :], other=0.0)


@triton.jit
def _attend_local(q, m_i, l_i, acc, k_ptr, v_ptr, slot_ptr, first_ptr, len_ptr, rows, mvalid, kh,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, d, dmask, scale, softcap,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  DOT_PREC: tl.constexpr):  # fmt: skip
    """Fold in the tile's local keys: row t sees packed rows first[t] ... first[t] + len[t] - 1, whose
    keys and values sit in the cache at slot_mapping[row] (slot -1: none). One pass over the union of
    the rows' ranges; a tile without local keys runs none (lo = hi = 0: no sentinel near the int32 limit,
    whose overflow a pipelined loop's look-ahead could turn into a read)."""
    first = tl.load(first_ptr + rows, mask=mvalid, other=0)
    end = first + tl.load(len_ptr + rows, mask=mvalid, other=0)
    has = mvalid & (end > first)
    hi = tl.max(tl.where(has, end, 0), axis=0)
    lo = tl.min(tl.where(has, first, hi), axis=0)
    for n in range(lo, hi, BLOCK_N):
        r = n + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_ptr + r, mask=r < hi, other=-1)
        valid = slot >= 0
        k = _load_slot_rows(k_ptr, slot, valid, kh, stride_kb, stride_ks, stride_kh, d, dmask,
                            PAGE).to(q.dtype)  # fmt: skip
        allowed = valid[None, :] & (r[None, :] >= first[:, None]) & (r[None, :] < end[:, None])
        s = scores_log2(q, k, allowed, scale, softcap, HAS_SOFTCAP, DOT_PREC)
        v = _load_slot_rows(v_ptr, slot, valid, kh, stride_vb, stride_vs, stride_vh, d, dmask,
                            PAGE).to(q.dtype)  # fmt: skip
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)
    return m_i, l_i, acc


@triton.jit
def _causal_loop(q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, q_start, lo, hi, kend, wpos, window, kh,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, d, dmask, scale, softcap,
                 MASKED: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """Fold in keys [lo, hi). MASKED: row i sees key j iff j < kend[i] (and wpos[i] - j < window);
    unmasked: every row sees every key of the range, which must hold whole BLOCK_N tiles."""
    for n in range(lo, hi, BLOCK_N):
        kpos = n + tl.arange(0, BLOCK_N)
        kvalid = kpos < hi
        # .to(q.dtype): an fp8 cache is upcast as it loads (exact; see dot_dtype_for).
        k = _load_kv_tile(k_ptr, bt_row, q_start, kpos, kvalid, kh, stride_kb, stride_ks, stride_kh, d,
                          dmask, PAGED, PAGE).to(q.dtype)  # fmt: skip
        if MASKED:
            allowed = kvalid[None, :] & (kpos[None, :] < kend[:, None])
            allowed = allowed & ((window <= 0) | (wpos[:, None] - kpos[None, :] < window))
        else:
            allowed = kvalid[None, :]
        s = scores_log2(q, k, allowed, scale, softcap, HAS_SOFTCAP, DOT_PREC)
        v = _load_kv_tile(v_ptr, bt_row, q_start, kpos, kvalid, kh, stride_vb, stride_vs, stride_vh, d,
                          dmask, PAGED, PAGE).to(q.dtype)  # fmt: skip
        # Rows may see nothing in a tile (window edge, rows past q_len): the step keeps them at 0.
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["window", "num_seqs", "search_steps"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, seq_lens_ptr, block_tables_ptr,
    ctx_ptr, first_ptr, len_ptr, pos_ptr, slot_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    scale, softcap, window, num_seqs, search_steps,
    GROUP: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, FLAT: tl.constexpr, VIS: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    BQ: tl.constexpr = BLOCK_M // GP  # queries per tile: a row is (query, head of the program's group)
    if FLAT:  # grid (flat tile, head slot); one-query sequences belong to the decode kernel
        hp = tl.program_id(1)
        t = tl.program_id(0)
        b = _flat_tile_seq(cu_q_ptr, t, num_seqs, search_steps, BQ).to(tl.int64)
        tile = t - (tl.load(cu_q_ptr + b) // BQ + b)
    else:  # grid (tile of a sequence, sequence, head slot)
        tile = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        hp = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if tile * BQ >= q_len or (FLAT and q_len == 1):
        return
    r = tl.arange(0, BLOCK_M)
    if GP == 1:  # head slot = query head
        kh = hp // GROUP
        h = hp + 0 * r
    else:  # head slot = KV head; row r holds head r % GP of its group (>= GROUP: padding)
        kh = hp
        h = hp * GROUP + r % GP
    m = tile * BQ + r // GP
    mvalid = (m < q_len) & (r % GP < GROUP)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    rows = (q_start + m).to(tl.int64)
    q_mask = mvalid[:, None] & dmask[None, :]
    q_ptrs = q_ptr + rows[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    q = dot_dtype_for(q, k_ptr)

    # Row i sees cache positions j < kend[i] with wpos[i] - j < window; the tile's loop bounds [lo, hi)
    # cover its rows' keys (causal: the last row bounds hi, the first row lo).
    if VIS:
        kend = tl.load(ctx_ptr + rows, mask=mvalid, other=0)
        wpos = tl.load(pos_ptr + rows, mask=mvalid, other=2147483647).to(tl.int32)
        hi = tl.max(kend, axis=0)
        lo = tl.min(wpos, axis=0) - window + 1
    else:
        seq_len = tl.load(seq_lens_ptr + b)
        ctx = seq_len - q_len
        wpos = ctx + m
        kend = wpos + 1
        hi = tl.minimum(seq_len, ctx + (tile + 1) * BQ)
        lo = ctx + tile * BQ - window + 1
    lo = tl.where(window > 0, tl.maximum(lo, 0), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    mid = lo
    if SPLIT:  # causal, no window: every row sees the keys before the tile's first query unmasked
        mid = lo + (ctx + tile * BQ - lo) // BLOCK_N * BLOCK_N
        m_i, l_i, acc = _causal_loop(q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, q_start, lo, mid, kend, wpos,
                                     window, kh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                     stride_vh, d, dmask, scale, softcap, False, PAGED, PAGE, BLOCK_N,
                                     HAS_SOFTCAP, DOT_PREC)  # fmt: skip
    m_i, l_i, acc = _causal_loop(q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, q_start, mid, hi, kend, wpos,
                                 window, kh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                 d, dmask, scale, softcap, True, PAGED, PAGE, BLOCK_N, HAS_SOFTCAP,
                                 DOT_PREC)  # fmt: skip
    if VIS:
        m_i, l_i, acc = _attend_local(q, m_i, l_i, acc, k_ptr, v_ptr, slot_ptr, first_ptr, len_ptr, rows,
                                      mvalid, kh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                      stride_vh, d, dmask, scale, softcap, PAGE, BLOCK_N, HAS_SOFTCAP,
                                      DOT_PREC)  # fmt: skip

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)


SHORT_Q = 16  # at most this many queries per sequence: one 16-row tile (tl.dot's smallest M)
MEDIUM_Q = 32  # at most this many (MTP verify+draft, k = 4: 25 rows): one 32-row tile
SHORT_TILES_ONE_WAVE = True  # ...or 16-row tiles where they fit the chip in one wave (prefill_config)
PACK_GQA = True  # a program takes all query heads of one KV head: each K/V tile is loaded once per group
SPLIT_CAUSAL = True  # keys every row of a tile sees run through a loop without the causal mask


def heads_per_program(group: int, block_m: int) -> int:
    """GP: query heads sharing a program's tile rows (a power of two >= GROUP, padding rows masked), or
    1 (a program per query head) when packing is off, GROUP is 1 or the tile has too few rows."""
    gp = triton.next_power_of_2(group)
    return gp if PACK_GQA and 1 < gp <= block_m // 2 else 1


def tile_layout(group: int, block_m: int, num_q_heads: int) -> tuple[int, int, int]:
    """(GP, queries per tile BQ, head slots of the grid) for BLOCK_M-row tiles."""
    gp = heads_per_program(group, block_m)
    return gp, block_m // gp, num_q_heads if gp == 1 else num_q_heads // group


def prefill_config(
    head_dim: int,
    fp8_cache: bool = False,
    max_seqlen_q: int | None = None,
    one_wave: bool = False,
    waves: float | None = None,
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), fixed per head_dim, cache type and, for at most
    MEDIUM_Q queries per sequence, the query length (no autotune).

    An fp8 cache takes 64-row tiles on 4 warps, which run a chunk after a long cached prefix well ahead
    of the bf16 config. A few queries per sequence (speculative verification: k + 1) take one 16-row
    tile on 4 warps: a 128-row tile would be almost all padding, computed for every key. Up to 32
    queries (the gated-LoRA MTP layout, (k + 1)^2 rows) take one 32-row tile on 4 warps with a 3-stage
    pipeline (bf16, the case measured; an fp8 cache keeps its own stages): two 16-row tiles would read
    every key twice, and at 8 sequences their doubled grid queues. `one_wave`: the 16-row tiles of such
    a chunk would still fit the chip in one wave (a sequence or two); then they win, each program
    walking the keys for half the rows. All were measured (docs/performance.md, ideas tried).

    `waves`: programs with work at the default tiles per SM (`busy_waves`). A bf16 chunk whose tiles
    fill at most one wave runs each 128-row tile on 8 warps when head_dim <= 64: with few programs
    each one's latency is the kernel's, and more warps keep more loads in flight. Over four waves, a
    head_dim of 65-128 takes 64-row tiles of 32 keys on 4 warps: the grid is deep enough to hide
    latency, and smaller programs balance the causal triangle's uneven tiles."""
    bm, bn, num_warps, num_stages = _tile_config(head_dim, fp8_cache)
    if max_seqlen_q is not None and max_seqlen_q <= SHORT_Q:
        return 16, bn, 4, num_stages
    if max_seqlen_q is not None and max_seqlen_q <= MEDIUM_Q:
        return 16 if one_wave else MEDIUM_Q, bn, 4, num_stages if fp8_cache else 3
    if waves is not None and not fp8_cache and head_dim <= 64 and waves <= 1:
        return bm, bn, 8, num_stages
    if waves is not None and not fp8_cache and 64 < head_dim <= 128 and waves > 4:
        return 64, 32, 4, 2
    return bm, bn, num_warps, num_stages


def busy_waves(tiles_per_head: int, slots: int, device: torch.device) -> float:
    """Programs with work (tiles_per_head x head slots) per SM."""
    return tiles_per_head * slots / _sm_count(device)


def fits_one_wave(max_seqlen_q: int, batch: int, num_q_heads: int, device: torch.device) -> bool:
    """Whether chunks of SHORT_Q < max_seqlen_q <= MEDIUM_Q queries, in 16-row tiles, make at most one
    program per SM (False for any other length: prefill_config never asks there)."""
    if not (SHORT_TILES_ONE_WAVE and SHORT_Q < max_seqlen_q <= MEDIUM_Q):
        return False
    return triton.cdiv(max_seqlen_q, SHORT_Q) * batch * num_q_heads <= _sm_count(device)


def _tile_config(head_dim: int, fp8_cache: bool) -> tuple[int, int, int, int]:
    if fp8_cache and head_dim <= 128:
        return 64, 64, 4, 2
    if head_dim <= 64:
        return 128, 64, 4, 3
    if head_dim <= 128:
        return 128, 64, 8, 2
    return 64, 32, 4, 2


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    block_tables: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    mixed: bool = False,
    visibility: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]. With block_tables, k/v are the paged caches [N, page, Hk, D]; without, this step's
    k/v [T, Hk, D] packed like q. cu_seqlens_q [B + 1], seq_lens [B] int32. Returns [T, Hq, D].
    block_m / block_n override the tile sizes (tests use small tiles to cross tile edges); `out` is an
    optional destination like q.

    mixed: the batch's one-query sequences are left to the decode kernel (their rows of `out` are not
    written), and the grid is flat, cdiv(T, BLOCK_M) + B tiles per head, from shapes alone: a CUDA graph
    of a token-count bucket replays it for any split of its rows into sequences (max_seqlen_q unused).

    visibility: (ctx_lens, local_start, local_len, positions), [T] tensors (int32; positions int32 or
    int64) as engine.models.attention_context.TokenVisibility describes them, replacing the causal rule
    row by row; it needs block_tables and slot_mapping [T] (the local rows' cache slots). seq_lens is
    then read only by the decode kernel of a mixed batch, for its one-query sequences."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    if num_q_heads % num_kv_heads or k.shape[-1] != head_dim or v.shape != k.shape:
        raise ValueError(f"prefill_attention: q {tuple(q.shape)} does not fit k/v {tuple(k.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("prefill_attention: the head_dim axis of q, k and v must be contiguous")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"prefill_attention: out must be {tuple(q.shape)} {q.dtype}, last dim contiguous")
    batch = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    bm, bn, num_warps, num_stages = _launch_config(q, k, group, batch, max_seqlen_q, mixed)
    bm, bn = block_m or bm, block_n or bn
    paged = block_tables is not None
    vis_args = _visibility_args(visibility, slot_mapping, paged, num_tokens, cu_seqlens_q)
    if paged:
        kv_strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
        page, bt, stride_bt = k.shape[1], block_tables, block_tables.stride(0)
    else:  # packed rows: the "block" stride is the token stride, the in-block stride is unused
        kv_strides = (k.stride(0), 0, k.stride(1), v.stride(0), 0, v.stride(1))
        page, bt, stride_bt = 1, cu_seqlens_q, 0  # bt is never read when not PAGED
    gp, bq, slots = tile_layout(group, bm, num_q_heads)
    if mixed:
        grid = (triton.cdiv(num_tokens, bq) + batch, slots)
    else:
        grid = (triton.cdiv(max_seqlen_q, bq), batch, slots)
    _prefill_kernel[grid](
        q, k, v, out, cu_seqlens_q, seq_lens, bt, *vis_args,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kv_strides, stride_bt,
        scale, softcap or 0.0, sliding_window or 0, batch, batch.bit_length(),
        GROUP=group, GP=gp, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=bm, BLOCK_N=bn, PAGED=paged, PAGE=page, HAS_SOFTCAP=softcap is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", FLAT=mixed, VIS=visibility is not None,
        SPLIT=SPLIT_CAUSAL and visibility is None and not sliding_window,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _launch_config(q, k, group: int, batch: int, max_seqlen_q: int | None, mixed: bool):
    """prefill_config for this call: a mixed graph's tiles from its token count (the bucket) alone, a
    varlen call's from its longest query too; `waves` counts the tiles at the default config."""
    num_tokens, num_q_heads, head_dim = q.shape
    fp8 = k.dtype == torch_ops.FP8_DTYPE
    short = None if mixed else max_seqlen_q  # a mixed graph's tiles cannot depend on the data
    wave = not mixed and fits_one_wave(max_seqlen_q, batch, num_q_heads, q.device)
    _, bq, slots = tile_layout(group, prefill_config(head_dim, fp8, short, wave)[0], num_q_heads)
    tiles = triton.cdiv(num_tokens, bq) if mixed else triton.cdiv(max_seqlen_q, bq) * batch
    return prefill_config(head_dim, fp8, short, wave, busy_waves(tiles, slots, q.device))


def _visibility_args(visibility, slot_mapping, paged: bool, num_tokens: int, placeholder: torch.Tensor):
    """The kernel's (ctx_lens, local_start, local_len, positions, slot_mapping) pointers: the checked
    tensors, or `placeholder` five times when there is no visibility (never read: VIS is off)."""
    if visibility is None:
        return (placeholder,) * 5
    if not paged or slot_mapping is None:
        raise ValueError("prefill_attention: visibility needs block_tables and slot_mapping")
    args = (*visibility, slot_mapping)
    if len(args) != 5 or any(t.shape != (num_tokens,) or not t.is_contiguous() for t in args):
        raise ValueError(
            f"prefill_attention: visibility and slot_mapping must be 4 + 1 contiguous [{num_tokens}]"
        )
    return args
