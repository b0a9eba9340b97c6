"""Plain torch twins of every kernel: the CPU serving path and the reference the Triton kernels are
tested against. Clarity over speed; shapes are documented on each function.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """y = x / rms(x) * (weight_offset + weight), computed in fp32. Gemma uses weight_offset = 1."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (weight_offset + weight.float())).to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; returns (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps, weight_offset), residual


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) RoPE. q: [T, Hq, D], k: [T, Hk, D], positions: [T],
    cos_sin: [max_pos, D] holding cos in the first D/2 columns and sin in the last D/2."""
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions)
    cos = cs[:, None, :half].float()
    sin = cs[:, None, half:].float()

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_silu(a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
    """silu(a + b[idx]) (idx None: b's rows in order), the sum rounded to a's dtype first."""
    return F.silu(a + (b if idx is None else b.index_select(0, idx)))


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> gelu_tanh(gate) * up (Gemma's GeGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


FP8_DTYPE = torch.float8_e4m3fn  # the fp8 KV-cache element (engine.config.CacheConfig.kv_cache_dtype)
FP8_MAX = 448.0  # torch.finfo(FP8_DTYPE).max: values beyond are clamped, never turned into NaN


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a KV cache of `dtype` stores it: an fp8 cache holds x clamped to +-FP8_MAX and rounded to
    nearest (even) with a unit scale; any other cache dtype is a plain cast."""
    if dtype == FP8_DTYPE:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k/v [T, Hk, D] into caches [num_blocks, block_size, Hk, D] at flat slots; slot -1 is skipped.
    The values are converted with to_cache_dtype (fp8 caches: clamped and rounded)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = to_cache_dtype(k[keep], k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = to_cache_dtype(v[keep], v_cache.dtype)


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    norm_offset: float = 0.0,
) -> torch.Tensor:
    """The attention prologue: optional per-head RMSNorm of q and k (QK-norm), RoPE, then k (rotated) and
    v into the caches at slot_mapping (-1 = skip). q: [T, Hq, D], k, v: [T, Hk, D]; returns rotated q."""
    if q_norm_weight is not None:
        q = rms_norm(q, q_norm_weight, norm_eps, norm_offset)
        k = rms_norm(k, k_norm_weight, norm_eps, norm_offset)
    q, k = apply_rotary(q, k, positions, cos_sin)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def _gather_paged(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence, gathered from its blocks: [length, Hk, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_row[:num_blocks].long()].reshape(-1, *cache.shape[2:])[:length]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    meta,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention for a packed batch (see engine.models.attention_context for the layout).

    q: [T, Hq, D]; k, v: [T, Hk, D] (this step's keys, already stored in the cache when there is one;
    attention then reads them back from the cache, so an fp8 cache's rounding applies to them too).
    Query i of a sequence sits at absolute position p = seq_len - query_len + i and sees key j iff
    j <= p and (sliding_window is None or p - j < sliding_window). Returns [T, Hq, D].
    With meta.visibility set, each row sees the keys it names instead (_visible_keys).
    """
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    vis = getattr(meta, "visibility", None)
    if vis is not None and meta.block_tables is None:
        raise ValueError("attention: visibility needs a KV cache (block_tables)")
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        qb = q[start : start + q_len]
        if vis is not None and q_len > 0:
            kb, vb, allowed = _visible_keys(k_cache, v_cache, meta, b, start, q_len, sliding_window)
        else:
            if meta.block_tables is None:
                kb, vb = k[start : start + q_len], v[start : start + q_len]
            else:
                kb = _gather_paged(k_cache, meta.block_tables[b], kv_len)
                vb = _gather_paged(v_cache, meta.block_tables[b], kv_len)
            allowed = _causal_mask(q_len, kv_len, sliding_window, q.device)
        out[start : start + q_len] = _attend_one(qb, kb, vb, allowed, group, scale, softcap)
        start += q_len
    return out


def _causal_mask(q_len: int, kv_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """[q_len, kv_len]: the last q_len of kv_len positions, each seeing itself and what precedes it."""
    pos_q = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    pos_k = torch.arange(kv_len, device=device)[None, :]
    allowed = pos_k <= pos_q
    if sliding_window is not None:
        allowed &= (pos_q - pos_k) < sliding_window
    return allowed


def _visible_keys(k_cache, v_cache, meta, b: int, start: int, q_len: int, sliding_window: int | None):
    """(keys, values, allowed [q_len, n]) of sequence b's rows start ... start + q_len - 1 under
    meta.visibility: its cache positions below the rows' largest ctx_len, then the union of the rows'
    local rows (ascending) read through slot_mapping. Ordinary causal values give exactly the keys and
    mask of the causal rule, so the result is bit-identical to attention without visibility."""
    vis, rows = meta.visibility, slice(start, start + q_len)
    ctx, pos = vis.ctx_lens[rows].long(), vis.positions[rows].long()
    first = vis.local_start[rows].long()
    last = first + vis.local_len[rows].long()  # exclusive
    if q_len == 1 and (int(ctx) != meta.seq_lens_cpu[b] or int(last - first) or int(pos) + 1 != int(ctx)):
        raise ValueError("attention: a one-query sequence must be ordinary causal (the decode kernel's)")
    n_ctx = int(ctx.max())
    pos_k = torch.arange(n_ctx, device=ctx.device)[None, :]
    allowed = pos_k < ctx[:, None]
    if sliding_window is not None:
        allowed &= (pos[:, None] - pos_k) < sliding_window
    local = torch.cat([torch.arange(f, e, device=ctx.device) for f, e in zip(first.tolist(), last.tolist())])
    local = torch.unique(local)  # sorted
    allowed = torch.cat([allowed, (local[None, :] >= first[:, None]) & (local[None, :] < last[:, None])], 1)
    slots = meta.slot_mapping[local]
    kb = torch.cat([_gather_paged(k_cache, meta.block_tables[b], n_ctx), k_cache.flatten(0, 1)[slots]])
    vb = torch.cat([_gather_paged(v_cache, meta.block_tables[b], n_ctx), v_cache.flatten(0, 1)[slots]])
    return kb, vb, allowed


def _attend_one(qb, kb, vb, allowed, group, scale, softcap) -> torch.Tensor:
    """Softmax attention of qb [q_len, Hq, D] over kb, vb [n, Hk, D] where allowed [q_len, n]."""
    compute = torch.float64 if qb.dtype == torch.float64 else torch.float32
    qh = qb.to(compute).transpose(0, 1)  # [Hq, q_len, D]
    kh = kb.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
    vh = vb.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vh).transpose(0, 1).to(qb.dtype)


# Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"), the generator behind
# triton.language.philox: a keyed bijection of a 128-bit counter, so draw (key, counter) is the same
# number on every device and in any batch. uint32 arithmetic is emulated in int64 tensors.
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_PHILOX_BUMP = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * b for a 32-bit constant a and b in [0, 2**32), in int64 without
    overflow: with 16-bit limbs a*b = ah*bh*2**32 + mid*2**16 + al*bl, every partial product < 2**33."""
    ah, al = a >> 16, a & 0xFFFF
    bh, bl = b >> 16, b & 0xFFFF
    mid = ah * bl + al * bh
    low = al * bl + ((mid & 0xFFFF) << 16)
    return (ah * bh + (mid >> 16) + (low >> 32)) & _U32, low & _U32


def philox_uint32(keys: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor) -> torch.Tensor:
    """First output word of Philox4x32-10 for key `keys` (int64: low word k0, high word k1) and counter
    (c0, c1, 0, 0), as tl.philox computes it; the arguments broadcast. Values in [0, 2**32) as int64."""
    k0, k1 = keys & _U32, (keys >> 32) & _U32
    c0, c1 = c0.long() & _U32, c1.long() & _U32
    c2 = c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUND[1], c2)
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_BUMP[0]) & _U32, (k1 + _PHILOX_BUMP[1]) & _U32
    return c0


def gumbel_noise(keys: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] fp32 Gumbel(0, 1) noise: -log(-log(u)), u from Philox(key, (column, counter)).
    u = (top 23 bits + 0.5) / 2**23 lies strictly inside (0, 1) and is exact in fp32 (a full 32-bit
    integer is not: rounding would give u = 1 and an infinite draw about once per 2**25 logits)."""
    cols = torch.arange(vocab, device=keys.device)[None, :]
    bits = philox_uint32(keys[:, None], cols, counters[:, None])
    u = ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor
) -> torch.Tensor:
    """One draw per row from softmax(logits / T) by the Gumbel-max trick: argmax(logits / T + G). Rows
    with T = 0 take the plain argmax. logits [rows, V] (any float dtype), temperature [rows] fp32,
    keys / counters [rows] int64 (kernels.triton_argmax.sample documents their meaning). int64 [rows]."""
    x = logits.float()
    hot = temperature > 0
    noisy = x / torch.where(hot, temperature, 1.0)[:, None] + gumbel_noise(keys, counters, x.shape[1])
    return torch.where(hot[:, None], noisy, x).argmax(dim=-1)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [R, ceil(vocab / 32)] int32 (bit b of word w allows token 32 * w + b) -> bool [R, vocab]."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # arithmetic shift of a negative word: bit 31 still right
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (rows None: row i itself).
    logits [N, V] (any float dtype), bitmask [R, ceil(V / 32)] int32, rows [R] int64. Tokens past
    32 * words (none, when the mask was made for V) are masked too."""
    vocab = logits.shape[-1]
    allowed = unpack_bitmask(bitmask, vocab)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def masked_by_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, mask_row: torch.Tensor | None = None
) -> torch.Tensor:
    """A copy of logits with apply_token_bitmask applied, the mask rows given per logits row: row r takes
    bitmask row mask_row[r] (-1: none), or row r when mask_row is None."""
    out = logits.clone()
    if mask_row is None:
        apply_token_bitmask(out, bitmask)
        return out
    rows = torch.nonzero(mask_row >= 0).flatten()
    apply_token_bitmask(out, bitmask[mask_row[rows].long()], rows)
    return out


# Quantised linears (engine/models/quant_linear.py documents the storage). Activation scales are clamped
# to at least ACT_SCALE_MIN so an all-zero row (or group) quantises to zeros instead of 0/0.
QUANT_BLOCK = 128  # weight scale tiles are 128 x 128; fp8_group128 activations share a scale per 128 columns
INT8_MAX = 127.0
ACT_SCALE_MIN = 1e-12


def dequantize_weight(
    qweight: torch.Tensor, scale: torch.Tensor, row_block: torch.Tensor | None, scheme: str
) -> torch.Tensor:
    """float32 W [N, K] = qweight * its scale: scale[n] ("channel"), or scale[row_block[n], k // 128]
    ("block")."""
    w = qweight.float()
    if scheme == "channel":
        return w * scale[:, None]
    if scheme == "block":
        tiles = scale.index_select(0, row_block.long())  # [N, ceil(K / 128)]
        return w * tiles.repeat_interleave(QUANT_BLOCK, dim=1)[:, : w.shape[1]]
    raise ValueError(f"scheme {scheme!r} is not channel or block")


def quantize_per_token(x: torch.Tensor, act_quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] fp32 -> (xq [T, K] fp32 holding int8 or e4m3 values, sx [T, 1]), x ~ xq * sx.
    int8_token: sx = amax|x| / 127, xq = round-half-even(x / sx) in [-128, 127];
    fp8_token: sx = amax|x| / 448, xq = x / sx rounded to e4m3."""
    qmax = {"int8_token": INT8_MAX, "fp8_token": FP8_MAX}[act_quant]
    sx = (x.abs().amax(dim=1, keepdim=True) / qmax).clamp(min=ACT_SCALE_MIN)
    if act_quant == "int8_token":
        return torch.round(x / sx).clamp(-128, 127), sx
    return (x / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float(), sx


def fp8_group_round(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] fp32 as fp8_group128 activations see it: each (token, 128-column group) rounded to e4m3
    with its own scale amax / 448, then multiplied back (the last group may be narrower)."""
    t, k = x.shape
    groups = -(-k // QUANT_BLOCK)
    xg = torch.nn.functional.pad(x, (0, groups * QUANT_BLOCK - k)).view(t, groups, QUANT_BLOCK)
    sx = (xg.abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp(min=ACT_SCALE_MIN)
    xq = (xg / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    return (xq * sx).view(t, groups * QUANT_BLOCK)[:, :k]


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    row_block: torch.Tensor | None,
    bias: torch.Tensor | None,
    scheme: str,
    act_quant: str | None,
) -> torch.Tensor:
    """y = x W^T (+ bias) for a quantised W (dequantize_weight), in fp32, returned in x.dtype.
    x [..., K] -> [..., N]. act_quant None: x as it is (weight-only); "int8_token" / "fp8_token":
    y = (xq @ W^T) * sx with xq, sx from quantize_per_token; "fp8_group128": x rounded per
    (token, 128 columns) by fp8_group_round."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    w = dequantize_weight(qweight, scale, row_block, scheme)
    if act_quant is None:
        y = x2 @ w.T
    elif act_quant == "fp8_group128":
        y = fp8_group_round(x2) @ w.T
    else:
        xq, sx = quantize_per_token(x2, act_quant)
        y = (xq @ w.T) * sx
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
