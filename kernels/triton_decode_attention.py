"""Paged decode attention: split-KV flash-decoding (twin: kernels.torch_ops.attention, one query per seq).

One launch, grid (batch, kv_head, split): a program takes all GROUP = Hq / Hk query heads of one KV
group (so each K/V row is read once per group, not once per query head) and one contiguous chunk of
the sequence's visible keys, and writes a partial softmax result: o_s (normalised) and its base-2
log-sum-exp lse_s. It then counts itself in at an arrival counter of (sequence, KV head); the split
that arrives last merges all of them, so no second kernel sits on the decode step's critical path:
    out = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m),   m = max_s lse_s.
kernels.arrivals.arrive_last orders the partial stores before the merge's loads. The merge order is
fixed (split 0 upward), so the output does not depend on which split arrives last.

CUDA-graph safety: the grid depends only on shapes (batch, heads, and a split count derived from the
block-table width, the window and the SM count); sequence lengths are read from the device tensor
inside the kernel; configs are fixed (no autotune), so a warm-up call compiles everything.

The visible keys of sequence b are [lo, seq_len) with lo = max(0, seq_len - window) (0 without a
window); each split takes ceil(visible / num_splits) keys rounded up to whole BLOCK_N tiles, so late
splits of short sequences are empty and store lse = -inf, o = 0. A row with seq_len 0 (graph padding)
reads no memory and returns zeros.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import torch_ops
from kernels.arrivals import arrival_counters, arrive_last
from kernels.pdl import enabled as pdl_enabled
from kernels.pdl import wait_for_inputs
from kernels.triton_attn_common import dot_dtype_for, load_paged_rows, online_softmax_step, scores_log2

MAX_SPLITS = 64  # more splits than tiles of a 1k-token context never pay for their merge
PROGRAMS_PER_SM = 4  # enough resident CTAs to keep HBM busy while each waits on its loads
MERGE_TILE = 8192  # fp32 partial-output values the merging program loads at once ([G, S, D] tile)
INTERPRETER_SMS = 2  # stand-in SM count under TRITON_INTERPRET (CPU tensors): still yields splits
RELEASE_FIRST = True  # o_proj launches before the wait: its weight loads overlap the kernel before (pdl)


# Runtime ints that vary per layer or per shape are not specialised, so no value triggers a recompile.
@triton.jit(do_not_specialize=["window", "num_splits"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr, out_ptr,
    arrivals_ptr, cu_q_ptr, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
    stride_vh, stride_bt, stride_ob, stride_oh, scale, softcap, window, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
    DIRECT: tl.constexpr, MERGE_G: tl.constexpr, MERGE_S: tl.constexpr, USE_PDL: tl.constexpr,
    RELEASE_FIRST: tl.constexpr, ROWS_FROM_CU: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL, RELEASE_FIRST)
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    qrow = b
    if ROWS_FROM_CU:  # a mixed batch: sequence b's row is cu_q[b]; only one-query sequences are ours
        qrow = tl.load(cu_q_ptr + b).to(tl.int64)
        if tl.load(cu_q_ptr + b + 1) - qrow != 1:
            return
    seq_len = tl.load(seq_lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    heads = kh * GROUP + g  # query heads of this KV group; rows g >= GROUP are padding for tl.dot
    q_mask = (g < GROUP)[:, None] & dmask[None, :]
    q = tl.load(q_ptr + qrow * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = dot_dtype_for(q, k_cache_ptr)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    # Every tile starts below `end`, so each holds >= 1 valid key (the decode query sees all of them).
    for n in range(start, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        valid = pos < end
        # .to(q.dtype): an fp8 cache is upcast as it loads (exact; see dot_dtype_for).
        k = load_paged_rows(
            k_cache_ptr, bt_row, pos, valid, kh, stride_kb, stride_ks, stride_kh, d, dmask, PAGE
        ).to(q.dtype)
        s = scores_log2(q, k, valid[None, :], scale, softcap, HAS_SOFTCAP, DOT_PREC)
        v = load_paged_rows(
            v_cache_ptr, bt_row, pos, valid, kh, stride_vb, stride_vs, stride_vh, d, dmask, PAGE
        ).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)

    has = l_i > 0.0  # false only for an empty split
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:  # a single split is the whole answer: no partial buffers, no merge
        out_offs = qrow * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=q_mask)
        return
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    # Partial buffers: part_lse [B, Hq, S], part_o [B, Hq, S, HEAD_DIM], both contiguous fp32.
    row = (b * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
    tl.store(part_lse_ptr + row, lse, mask=g < GROUP)
    tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=q_mask)
    # The last split of (b, kh) to arrive merges them all (kernels.arrivals orders the partials).
    counter = arrivals_ptr + b * tl.num_programs(1) + kh
    if arrive_last(counter, num_splits):
        used = tl.where(chunk > 0, tl.cdiv(seq_len - lo, tl.maximum(chunk, 1)), 0)
        first = (b * (tl.num_programs(1) * GROUP) + kh * GROUP) * num_splits
        _merge_splits(part_o_ptr, part_lse_ptr, out_ptr + qrow * stride_ob + kh * GROUP * stride_oh, first,
                      num_splits, used, stride_oh, GROUP, HEAD_DIM, BLOCK_D, MERGE_G, MERGE_S)  # fmt: skip
        tl.store(counter, 0)  # ready for the next launch (the next layer, or the next graph replay)


@triton.jit
def _merge_splits(part_o_ptr, part_lse_ptr, out_ptr, first, num_splits, used, stride_oh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  MERGE_G: tl.constexpr, MERGE_S: tl.constexpr):  # fmt: skip
    """out[g] = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m) over the `used` non-empty splits of the
    group's heads (the rest hold lse = -inf, o = 0), MERGE_S splits per [MERGE_G, MERGE_S, D] tile with a
    running max. Rows start at part_*[first + g * num_splits]. Loads bypass L1 (.cg): the partials were
    written by other SMs, and this SM's L1 may hold an earlier layer's lines at the same addresses."""
    g = tl.arange(0, MERGE_G)
    sp = tl.arange(0, MERGE_S)
    d = tl.arange(0, BLOCK_D)
    m = tl.full([MERGE_G], float("-inf"), tl.float32)
    den = tl.zeros([MERGE_G], tl.float32)
    acc = tl.zeros([MERGE_G, BLOCK_D], tl.float32)
    for s0 in range(0, used, MERGE_S):
        row = first + g[:, None] * num_splits + s0 + sp[None, :]  # [G, S]
        rmask = (g < GROUP)[:, None] & (s0 + sp < used)[None, :]
        lse = tl.load(part_lse_ptr + row, mask=rmask, other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - m_safe[:, None])
        omask = rmask[:, :, None] & (d < HEAD_DIM)[None, None, :]
        o = tl.load(part_o_ptr + row[:, :, None] * HEAD_DIM + d[None, None, :], mask=omask, other=0.0,
                    cache_modifier=".cg")  # fmt: skip
        alpha = tl.exp2(m - m_safe)
        den = den * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        m = m_new
    out = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    omask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(out_ptr + g[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=omask)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    batch: int, num_kv_heads: int, max_blocks: int, block_size: int, block_n: int, sm_count: int,
    sliding_window: int | None = None,
) -> int:  # fmt: skip
    """Splits per (seq, kv head): the most for which batch * Hk * splits stays within one wave of
    PROGRAMS_PER_SM * SMs programs; shapes only.

    Rounding down, not up: a grid just past one wave runs a second, mostly idle one, which costs more
    than the splits save (at batch 64 over 4 KV heads, 2 splits beat 3, and 1 split beats 2 over 8;
    benchmarks/decode_splits.py). Capped by the most BLOCK_N tiles a sequence can have (block-table
    width or window) and MAX_SPLITS.
    """
    span = max_blocks * block_size
    if sliding_window:
        span = min(span, sliding_window)
    want = (PROGRAMS_PER_SM * sm_count) // max(1, batch * num_kv_heads)
    return max(1, min(want, triton.cdiv(span, block_n), MAX_SPLITS))


def decode_config(head_dim: int, fp8_cache: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): fixed per head_dim and cache type, so CUDA-graph capture never
    compiles.

    An fp8 cache takes 2-warp programs with 5 stages. Its tiles reach the MMA through 8-bit shared
    loads and conversions, a long chain per tile, so the kernel is bound by latency: a wave of 4-warp
    programs keeps few of the SM's warps active, and smaller programs with a deeper pipeline hide more
    of each tile's latency (the configs tried: docs/performance.md, ideas tried)."""
    if head_dim > 128:
        return 32, 4, 2
    return (64, 2, 5) if fp8_cache else (64, 4, 3)


def _alloc_partials(batch: int, num_q_heads: int, num_splits: int, head_dim: int, device: torch.device):
    """Split results: o [B, Hq, S, D] and lse [B, Hq, S], fp32. Every entry is written by stage 1."""
    part_o = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=device)
    return part_o, part_lse


def _check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q) -> int:
    """The batch (sequence count) of a decode_attention call, or a ValueError naming what disagrees."""
    batch, num_q_heads, head_dim = q.shape
    if cu_seqlens_q is not None:
        batch = seq_lens.shape[0]
        if cu_seqlens_q.shape[0] != batch + 1:
            raise ValueError(f"decode_attention: cu_seqlens_q needs {batch + 1} entries ({batch} sequences)")
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("decode_attention: the head_dim axis of q and the caches must be contiguous")
    if seq_lens.shape[0] != batch or block_tables.shape[0] != batch:
        raise ValueError(
            f"decode_attention: q has {batch} rows but seq_lens {tuple(seq_lens.shape)} and block_tables "
            f"{tuple(block_tables.shape)} disagree; pad all three to the same batch"
        )
    return batch


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D] (one new token per sequence, already in the cache); caches [N, page, Hk, D];
    block_tables [B, max_blocks] int32; seq_lens [B] int32 on the device. Returns [B, Hq, D]
    (written into `out` when given). num_splits overrides the shape-derived split count, config
    (BLOCK_N, num_warps, num_stages) decode_config's choice (benchmarks/decode_splits.py sweeps both).

    With cu_seqlens_q ([B + 1] int32), q is a mixed packed batch [T, Hq, D]: sequence b's query rows
    are cu_seqlens_q[b] : cu_seqlens_q[b + 1], and only sequences with exactly one are attended (their
    row of `out` written); the others' rows are left for the prefill kernel (kernels.ops.attention)."""
    batch = _check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"decode_attention: out must be {tuple(q.shape)} {q.dtype}, last dim contiguous")
    if batch == 0 or q.shape[0] == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_n, num_warps, num_stages = config or decode_config(head_dim, k_cache.dtype == torch_ops.FP8_DTYPE)
    if num_splits is None:
        num_splits = choose_num_splits(
            batch, num_kv_heads, block_tables.shape[1], page, block_n, _sm_count(q.device), sliding_window
        )
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"decode_attention: num_splits {num_splits} outside [1, {MAX_SPLITS}]")
    part_o, part_lse = _alloc_partials(batch, num_q_heads, num_splits, head_dim, q.device)
    block_d = triton.next_power_of_2(head_dim)
    pdl = pdl_enabled(q.device)
    arrivals = arrival_counters(batch * num_kv_heads, q.device)
    merge_g = triton.next_power_of_2(group)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_lse, out, arrivals,
        seq_lens if cu_seqlens_q is None else cu_seqlens_q, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), scale, softcap or 0.0, sliding_window or 0, num_splits,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=page, BLOCK_N=block_n, HAS_SOFTCAP=softcap is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        DIRECT=num_splits == 1, MERGE_G=merge_g, MERGE_S=max(1, MERGE_TILE // (merge_g * block_d)),
        USE_PDL=pdl, RELEASE_FIRST=RELEASE_FIRST, ROWS_FROM_CU=cu_seqlens_q is not None,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return out
