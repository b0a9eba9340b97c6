"""Batched multi-LoRA ops: the mapping against a stable sort, the torch twins against a per-row loop,
the Triton kernels (interpreter here, compiled on a GPU) against the twins, and a CUDA-graph replay with
new slots and weights. Shapes are tiny but cross every tile edge: T past BLOCK_M, K past BLOCK_K and
split over programs, a slice wider than BLOCK_N, unequal slices (QKV with GQA), padded ranks."""

from __future__ import annotations

from tests.kernel_env import CUDA_OK, interpreter_usable  # first: it chooses TRITON_INTERPRET

# isort: split
from dataclasses import dataclass

import pytest
import torch

from kernels import ops, torch_lora

pytestmark = pytest.mark.kernels
INTERP_OK = interpreter_usable()
NEEDS_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")]
INTERP = pytest.mark.skipif(not INTERP_OK, reason="needs TRITON_INTERPRET=1 before triton is imported")


@dataclass(frozen=True)
class Case:
    """T rows over S slots; lora_a [S, n*r, K]; slices of widths `widths`; `used_rank` < r pads."""

    tokens: int
    slots: int
    k: int
    rank: int
    widths: tuple[int, ...]
    wdtype: torch.dtype = torch.float32
    ydtype: torch.dtype = torch.float32
    used_rank: int | None = None


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CASES = {
    "decode-1row-fp16w": Case(1, 2, 40, 8, (24,), wdtype=F16),  # fp32 y: checks s -> fp16 rounding
    "split-k": Case(3, 2, 520, 8, (40, 8, 8), ydtype=BF16),  # K split over programs (atomics)
    "qkv-gqa-bf16y": Case(60, 2, 300, 8, (136, 24, 24), ydtype=BF16),  # > BLOCK_M rows a slot, q > BLOCK_N
    "gate-up-fp16": Case(20, 4, 64, 16, (40, 40), wdtype=F16, ydtype=F16, used_rank=5),
    "prefill-tiles": Case(150, 1, 96, 4, (20,), ydtype=F16),  # T > SMALL_T: prefill tiles, 2 per slot
    "empty-slice": Case(5, 2, 32, 4, (16, 0, 8)),
}
# The interpreter's tl.dot mishandles bf16 operands, so bf16 weights are checked on a GPU only.
GPU_CASES = {"qkv-bf16": Case(70, 8, 4096, 16, (4096, 1024, 1024), wdtype=BF16, ydtype=BF16)}


@pytest.fixture(autouse=True)
def _no_tf32(monkeypatch) -> None:
    """On a GPU the fp32 twin must not drop to TF32 matmuls (the kernels' fp32 dots are IEEE)."""
    if CUDA_OK:
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _inputs(case: Case, device: str = "cpu", seed: int = 0):
    """Unsorted slots with -1 and an out-of-range slot, weights with rank padding, and x / y as
    strided views (a column window of a wider tensor), as a fused layer's outputs are."""
    g = torch.Generator().manual_seed(seed)
    n_slices, r = len(case.widths), case.rank
    slots = torch.randint(-1, case.slots, (case.tokens,), generator=g, dtype=torch.int32)
    if case.tokens > 2:
        slots[1] = case.slots  # out of range: treated as no adapter
        slots[2] = -1
    a = torch.randn(case.slots, n_slices * r, case.k, generator=g) * case.k**-0.5
    b = torch.randn(case.slots, sum(case.widths), r, generator=g)
    if case.used_rank is not None:  # an adapter of lower rank, zero-padded to r
        a.view(case.slots, n_slices, r, case.k)[:, :, case.used_rank :] = 0
        b[..., case.used_rank :] = 0
    x = torch.randn(case.tokens, case.k + 3, generator=g)[:, 3:]
    y = torch.randn(case.tokens, sum(case.widths) + 5, generator=g)[:, 2 : 2 + sum(case.widths)]
    offsets = [0]
    for w in case.widths:
        offsets.append(offsets[-1] + w)
    move = dict(device=device)
    return (slots.to(**move), x.to(case.wdtype).to(**move), a.to(case.wdtype).to(**move),
            b.to(case.wdtype).to(**move), y.to(case.ydtype).to(**move), offsets)  # fmt: skip


def _naive(slots, x, a, b, y, offsets):
    """Row by row in float64, from the contract: s = A[slot] x, then y_i += B_i[slot] s_i with s rounded
    to B's dtype first; rows without an adapter keep y."""
    s = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    out = y.double().clone()
    r = b.shape[2]
    for t, slot in enumerate(slots.tolist()):
        if not 0 <= slot < a.shape[0]:
            continue
        s[t] = a[slot].double() @ x[t].double()
        sr = s[t].float().to(b.dtype).double()
        for i in range(len(offsets) - 1):
            lo, hi = offsets[i], offsets[i + 1]
            out[t, lo:hi] += b[slot, lo:hi].double() @ sr[i * r : (i + 1) * r]
    return s, out


def test_mapping_groups_rows_like_a_stable_sort() -> None:
    slots = torch.tensor([2, -1, 0, 2, 5, 1, -1, 0, 2], dtype=torch.int32)
    m = ops.lora_mapping(slots, 3)
    key = [s if 0 <= s < 3 else 3 for s in slots.tolist()]
    assert m.token_order.tolist() == sorted(range(len(key)), key=lambda t: key[t])
    assert m.slot_starts.tolist() == [0, 2, 3, 6]
    assert m.token_order.dtype == m.slot_starts.dtype == torch.int32
    empty = ops.lora_mapping(torch.full((4,), -1, dtype=torch.int32), 2)
    assert empty.slot_starts.tolist() == [0, 0, 0] and sorted(empty.token_order.tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("name", list(CASES))
def test_twin_matches_naive_loop(name: str) -> None:
    case = CASES[name]
    slots, x, a, b, y, offsets = _inputs(case)
    ref_s, ref_y = _naive(slots, x, a, b, y, offsets)
    m = ops.lora_mapping(slots, case.slots)
    s = torch_lora.lora_shrink(x, a, m)
    torch.testing.assert_close(s, ref_s.float(), atol=1e-5, rtol=1e-5)
    before = y.clone()
    torch_lora.lora_expand(y, s, b, m, offsets)
    tol = 1e-5 if case.ydtype == F32 else 1e-2
    torch.testing.assert_close(y.double(), ref_y, atol=tol, rtol=tol)
    off = ~((slots >= 0) & (slots < case.slots))
    assert torch.equal(y[off], before[off])  # rows without an adapter: bit for bit


def _triton_vs_twin(case: Case, device: str) -> None:
    from kernels import triton_lora

    slots, x, a, b, y, offsets = _inputs(case, device)
    m = ops.lora_mapping(slots, case.slots)
    s = triton_lora.lora_shrink(x, a, m)
    ref_s = torch_lora.lora_shrink(x, a, m)
    exact_f32 = case.wdtype == F32 and device == "cpu"
    torch.testing.assert_close(s, ref_s, atol=1e-5 if exact_f32 else 2e-3, rtol=1e-4 if exact_f32 else 1e-2)
    ref_y = y.clone()
    torch_lora.lora_expand(ref_y, s, b, m, offsets)
    before = y.clone()
    triton_lora.lora_expand(y, s, b, m, offsets)
    tol = 1e-5 if case.ydtype == F32 else 1e-2
    torch.testing.assert_close(y, ref_y, atol=tol, rtol=tol)
    off = ~((slots >= 0) & (slots < case.slots))
    assert torch.equal(y[off], before[off])
    # s already in B's dtype, a column window of a wider output (a folded layer's GEMM): the same bits,
    # as the kernel rounds an fp32 s to B's dtype before its dot anyway
    wide = torch.zeros(s.shape[0], s.shape[1] + 7, dtype=b.dtype, device=device)
    folded_s = wide[:, 3 : 3 + s.shape[1]]
    folded_s.copy_(s)
    again = before.clone()
    triton_lora.lora_expand(again, folded_s, b, m, offsets)
    assert torch.equal(again, y)


@INTERP
@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_twin_interp(name: str) -> None:
    _triton_vs_twin(CASES[name], "cpu")


@pytest.mark.parametrize("name", list(CASES) + list(GPU_CASES))
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
def test_triton_matches_twin_gpu(name: str) -> None:
    _triton_vs_twin({**CASES, **GPU_CASES}[name], "cuda")


def test_bad_shapes_name_the_tensor() -> None:
    slots, x, a, b, y, offsets = _inputs(CASES["gate-up-fp16"])
    m = ops.lora_mapping(slots, 4)
    with pytest.raises(ValueError, match="lora_a"):
        ops.lora_shrink(x[:, 1:], a, m)
    s = ops.lora_shrink(x, a, m)
    with pytest.raises(ValueError, match="slice_offsets"):
        ops.lora_expand(y, s, b, m, [0, 40])
    with pytest.raises(ValueError, match="float32"):  # neither fp32 nor lora_b's fp16
        ops.lora_expand(y, s.bfloat16(), b, m, offsets)
    with pytest.raises(ValueError, match="mapping"):
        ops.lora_shrink(x, a, ops.lora_mapping(slots, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
def test_cuda_graph_replay_with_new_slots_and_weights() -> None:
    """mapping + shrink + expand captured once (through kernels.ops); a replay after token_slots and the
    slot weights changed in place equals the twin on the new values."""
    case = Case(64, 4, 512, 16, (256, 64, 64), wdtype=BF16, ydtype=BF16)
    slots, x, a, b, y0, offsets = _inputs(case, "cuda")
    y = torch.empty_like(y0)

    def step() -> None:
        m = ops.lora_mapping(slots, case.slots)
        y.copy_(y0)
        ops.lora_expand(y, ops.lora_shrink(x, a, m), b, m, offsets)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_slots, _, new_a, new_b, _, _ = _inputs(case, "cuda", seed=1)
    slots.copy_(torch.flip(new_slots, (0,)))
    a[1].copy_(new_a[1])
    b[2].copy_(new_b[2])
    graph.replay()
    torch.cuda.synchronize()
    m = torch_lora.lora_mapping(slots, case.slots)
    ref = y0.clone()
    torch_lora.lora_expand(ref, torch_lora.lora_shrink(x, a, m), b, m, offsets)
    torch.testing.assert_close(y, ref, atol=2e-2, rtol=2e-2)
