"""The one dispatch point between model layers and kernels.

Each op runs its Triton kernel when the tensors live on a CUDA device and Triton is usable, and its
torch twin (kernels.torch_ops) otherwise. Model files call only these functions, so faster kernels
plug in here without touching any model.

Triton modules are imported lazily, inside the Triton branch: importing this module never imports
triton, so a test process can still set TRITON_INTERPRET before the first kernel is defined.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels import torch_lora, torch_ops
from kernels.lora_mapping import LoraMapping

_FORCE_TORCH = os.environ.get("MINSERVE_TORCH_KERNELS", "0") == "1"


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    """Triton is used only on CUDA tensors (the interpreter is for tests, not serving)."""
    if _FORCE_TORCH or not x.is_cuda:
        return False
    return _triton_importable()


def _use_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A single row of bf16/fp16 (batch-1 decode: a pure weight stream) goes to the Triton GEMV."""
    return (
        x.numel() == x.shape[-1]
        and use_triton(x)
        and weight.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == weight.dtype
        and weight.stride(1) == 1
        and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()))
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias): the Triton GEMV for a single bf16/fp16 row,
    torch.nn.functional.linear (cuBLAS) for everything else. out_dtype=torch.float32 (no bias): the
    fp32 sums before any rounding to x's dtype (a row-parallel partial sum, engine/models/parallel.py)."""
    if out_dtype is not None and out_dtype != x.dtype:
        return _linear_wide(x, weight, bias, out_dtype)
    if _use_gemv(x, weight, bias):
        from kernels import triton_gemv

        return triton_gemv.gemv(x.contiguous(), weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def _linear_wide(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype) -> torch.Tensor:
    if out_dtype != torch.float32 or bias is not None:
        raise ValueError(f"linear: out_dtype {out_dtype}, bias {bias is not None}; only float32, no bias")
    if _use_gemv(x, weight, None):
        from kernels import triton_gemv

        out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype, device=x.device)
        return triton_gemv.gemv(x.contiguous(), weight, None, out=out)
    if x.is_cuda:  # cuBLAS writes its fp32 accumulators out unrounded
        flat = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=out_dtype)
        return flat.view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x.float(), weight.float())


def gated_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu_tanh: bool
) -> torch.Tensor:
    """act(gate) * up [..., I] of x's [gate | up] projection weight [2I, K] (silu, or gelu_tanh). A single
    bf16/fp16 row takes the GEMV with the activation as its epilogue (triton_gemv.gemv_gated)."""
    if _use_gemv(x, weight, bias):
        from kernels import triton_gemv

        if triton_gemv.GATED_EPILOGUE and weight.shape[0] % 2 == 0:
            y = triton_gemv.gemv_gated(x.reshape(1, -1).contiguous(), weight, bias, gelu_tanh)
            return y.reshape(*x.shape[:-1], y.shape[-1])
    h = linear(x, weight, bias)
    return gelu_tanh_and_mul(h) if gelu_tanh else silu_and_mul(h)


def quant_gemv_reads_act_amax(qweight: torch.Tensor, scheme: str, act_quant: str | None) -> bool:
    """Whether quant_linear of one row reads `act_amax` (the integer-dot GEMV), so x's producer should
    write it (kernels.triton_qgemv.reads_act_amax)."""
    from kernels import triton_qgemv

    return triton_qgemv.reads_act_amax(qweight, scheme, act_quant)


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    row_block: torch.Tensor | None,
    bias: torch.Tensor | None,
    scheme: str,
    act_quant: str | None,
    act_amax: torch.Tensor | None = None,
    silu: bool = False,
) -> torch.Tensor:
    """x [..., K] (model dtype) @ dequantised W^T (+ bias) -> [..., N] in x.dtype; the storage is
    documented in engine/models/quant_linear.py, the arithmetic in torch_ops.quant_linear. act_amax:
    partial maxima of |x| from x's producer (gated_and_mul_amax), which the single-row DP4A kernel reads
    instead of a pass over x; the other paths find amax themselves (the same value). silu: F.silu of
    the result, which the single-row kernel applies in its store (one launch fewer).

    On CUDA a single row (batch-1 decode) goes to triton_qgemv. With int8 per-channel weights and
    "int8_token" it quantises the row and sums in integers (DP4A), which is cheaper than turning every
    weight into a float; otherwise it dequantises W in registers and leaves the activations exact
    whatever act_quant says (one row is a pure weight stream, so skipping their rounding costs
    nothing). Several rows go to triton_qgemm, which quantises activations as act_quant says.
    Elsewhere: the torch twin."""
    rows = x.numel() // x.shape[-1]
    if not use_triton(x) or rows == 0:
        y = torch_ops.quant_linear(x, qweight, scale, row_block, bias, scheme, act_quant)
        return F.silu(y) if silu else y
    x2d = x.reshape(rows, x.shape[-1]).contiguous()
    if rows == 1:
        from kernels import triton_qgemv

        y = triton_qgemv.qgemv(
            x2d, qweight, scale, row_block, bias, scheme, act_quant=act_quant, act_amax=act_amax, silu=silu
        )
    else:
        from kernels import triton_qgemm

        y = triton_qgemm.qgemm(x2d, qweight, scale, row_block, bias, scheme, act_quant)
        y = F.silu(y) if silu else y
    return y.reshape(*x.shape[:-1], y.shape[-1])


def quant_gated_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    row_block: torch.Tensor | None,
    bias: torch.Tensor | None,
    scheme: str,
    act_quant: str | None,
    gelu_tanh: bool,
) -> torch.Tensor:
    """act(gate) * up [..., I] of x's quantised [gate | up] projection [2I, K] (silu, or gelu_tanh).
    On CUDA one row whose GEMV dequantises in registers (triton_qgemv.fuses_gated) takes the GEMV with
    the activation as its epilogue, unrounded in between; otherwise quant_linear, then the activation."""
    if use_triton(x) and x.numel() == x.shape[-1]:
        from kernels import triton_qgemv

        if triton_qgemv.fuses_gated(qweight, scheme, act_quant):
            row = x.reshape(1, -1).contiguous()
            y = triton_qgemv.qgemv_gated(row, qweight, scale, row_block, bias, scheme, gelu_tanh)
            return y.reshape(*x.shape[:-1], y.shape[-1])
    h = quant_linear(x, qweight, scale, row_block, bias, scheme, act_quant)
    return gelu_tanh_and_mul(h) if gelu_tanh else silu_and_mul(h)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    if use_triton(x):
        from kernels import triton_norm

        return triton_norm.rms_norm(x, weight, eps, weight_offset)
    return torch_ops.rms_norm(x, weight, eps, weight_offset)


def add_rms_norm(x, residual, weight, eps: float, weight_offset: float = 0.0):
    if use_triton(x):
        from kernels import triton_norm

        return triton_norm.add_rms_norm(x, residual, weight, eps, weight_offset)
    return torch_ops.add_rms_norm(x, residual, weight, eps, weight_offset)


def apply_rotary(q, k, positions, cos_sin):
    if use_triton(q):
        from kernels import triton_rope

        return triton_rope.apply_rotary(q, k, positions, cos_sin)
    return torch_ops.apply_rotary(q, k, positions, cos_sin)


def silu_and_mul(x):
    if use_triton(x):
        from kernels import triton_act

        return triton_act.silu_and_mul(x)
    return torch_ops.silu_and_mul(x)


def add_silu(a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
    """silu(a + b[idx]) [R, H] of a [R, H] and b [M, H] (idx int64 [R]; None: b's rows in order), the
    sum rounded to a's dtype before the silu."""
    if use_triton(a):
        from kernels import triton_act

        return triton_act.add_silu(a, b, idx)
    return torch_ops.add_silu(a, b, idx)


def gated_and_mul_amax(x: torch.Tensor, gelu_tanh: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated activation (silu, or gelu_tanh) and, on the Triton path, partial maxima of its |output|
    per row for a consumer that quantises per token (quant_linear's act_amax); elsewhere None."""
    if use_triton(x):
        from kernels import triton_act

        return triton_act.gated_and_mul_amax(x, gelu_tanh)
    return (torch_ops.gelu_tanh_and_mul(x) if gelu_tanh else torch_ops.silu_and_mul(x)), None


def gelu_tanh_and_mul(x):
    if use_triton(x):
        from kernels import triton_act

        return triton_act.gelu_tanh_and_mul(x)
    return torch_ops.gelu_tanh_and_mul(x)


def argmax(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    mask_row: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-wise argmax of [rows, vocab] logits as int64 ids, lowest index on ties (greedy sampling).
    With a token bitmask, over the allowed tokens only (kernels.triton_argmax.argmax: the mask is read
    as the logits load, no masking pass). With `ids` [vocab] int64, column c stands for token ids[c]
    and the result is ids[argmax] (a draft vocabulary's rows), mapped in the same launch."""
    if use_triton(logits) and logits.stride(-1) == 1:
        from kernels import triton_argmax

        return triton_argmax.argmax(logits, bitmask, mask_row, ids)
    if bitmask is not None:
        logits = torch_ops.masked_by_bitmask(logits, bitmask, mask_row)
    best = logits.argmax(dim=-1)
    return best if ids is None else ids.index_select(0, best)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    if use_triton(k):
        from kernels import triton_kv

        triton_kv.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    torch_ops.store_kv(k, v, k_cache, v_cache, slot_mapping)


def rope_store_kv(
    q,
    k,
    v,
    positions,
    cos_sin,
    k_cache,
    v_cache,
    slot_mapping,
    q_norm_weight=None,
    k_norm_weight=None,
    norm_eps: float = 1e-6,
    norm_offset: float = 0.0,
):
    """(QK-norm +) RoPE + KV-cache write in one launch; returns rotated q (see torch_ops.rope_store_kv)."""
    args = (q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight)
    if use_triton(q):
        from kernels import triton_rope

        return triton_rope.rope_store_kv(*args, norm_eps, norm_offset)
    return torch_ops.rope_store_kv(*args, norm_eps, norm_offset)


def attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window=None, softcap=None):
    """Paged decode kernel when every sequence has one new token and a cache exists (the CUDA-graph
    path: it reads only device tensors and shapes from `meta`); for a mixed batch (meta.mixed) the
    decode kernel on its one-query sequences and the flat-grid prefill kernel on the rest, both from
    shapes alone; the varlen prefill kernel otherwise. meta.visibility goes to the prefill kernel; the
    decode kernel's one-query sequences must be ordinary causal (TokenVisibility says why)."""
    if not use_triton(q):
        return torch_ops.attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, softcap)
    from kernels import triton_decode_attention, triton_prefill_attention

    paged = meta.block_tables is not None
    vis, vis_kw = getattr(meta, "visibility", None), {}
    if vis is not None:
        vis_kw = dict(visibility=(vis.ctx_lens, vis.local_start, vis.local_len, vis.positions),
                      slot_mapping=meta.slot_mapping)  # fmt: skip
    if paged and (meta.is_decode or meta.mixed):
        out = triton_decode_attention.decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window, softcap,
            cu_seqlens_q=meta.cu_seqlens_q if meta.mixed else None,
        )  # fmt: skip
        if not meta.mixed:
            return out
        return triton_prefill_attention.prefill_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.max_seqlen_q, scale,
            block_tables=meta.block_tables, sliding_window=sliding_window, softcap=softcap, out=out,
            mixed=True, **vis_kw,
        )  # fmt: skip
    return triton_prefill_attention.prefill_attention(
        q,
        k_cache if paged else k,
        v_cache if paged else v,
        meta.cu_seqlens_q,
        meta.seq_lens,
        meta.max_seqlen_q,
        scale,
        block_tables=meta.block_tables,
        sliding_window=sliding_window,
        softcap=softcap,
        **vis_kw,
    )


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    counters: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    mask_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Gumbel-max draw per row from softmax(logits / temperature) (T = 0: argmax), its noise from
    Philox keyed per row (kernels.triton_argmax.sample): the kernel and the twin draw the same ids.
    bitmask / mask_row: as in `argmax`."""
    if use_triton(logits) and logits.stride(-1) == 1:
        from kernels import triton_argmax

        return triton_argmax.sample(logits, temperature, keys, counters, bitmask, mask_row)
    if bitmask is not None:
        logits = torch_ops.masked_by_bitmask(logits, bitmask, mask_row)
    return torch_ops.sample(logits, temperature, keys, counters)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """In place: -inf at the tokens whose bit is 0 in bitmask[i], for logits row rows[i] (rows None:
    row i). Grammar-constrained decoding (engine/structured/state.py fills the bitmask)."""
    if use_triton(logits) and logits.stride(-1) == 1:
        from kernels import triton_bitmask

        return triton_bitmask.apply_token_bitmask(logits, bitmask, rows)
    return torch_ops.apply_token_bitmask(logits, bitmask, rows)


def lora_mapping(token_slots: torch.Tensor, num_slots: int) -> LoraMapping:
    """Rows grouped by LoRA adapter slot (token_slots [T] int32, -1 = no adapter), built on
    token_slots' device with capturable torch ops on every path (kernels.lora_mapping)."""
    return torch_lora.lora_mapping(token_slots, num_slots)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoraMapping) -> torch.Tensor:
    """x [T, K] @ each row's slot of lora_a [S, R, K] -> [T, R] float32 (0 for rows without an adapter):
    kernels.triton_lora.lora_shrink on CUDA, torch_lora.lora_shrink elsewhere."""
    if use_triton(x):
        from kernels import triton_lora

        return triton_lora.lora_shrink(x, lora_a, mapping)
    return torch_lora.lora_shrink(x, lora_a, mapping)


def lora_expand(
    y: torch.Tensor,
    s: torch.Tensor,
    lora_b: torch.Tensor,
    mapping: LoraMapping,
    slice_offsets: Sequence[int],
) -> None:
    """In place y[t, off[i]:off[i+1]] += lora_b[slot[t], off[i]:off[i+1]] @ s[t, i*r:(i+1)*r] for every
    slice i in one launch on CUDA (kernels.triton_lora.lora_expand); torch_lora.lora_expand elsewhere."""
    if use_triton(y):
        from kernels import triton_lora

        triton_lora.lora_expand(y, s, lora_b, mapping, slice_offsets)
        return
    torch_lora.lora_expand(y, s, lora_b, mapping, slice_offsets)
