"""Token-bitmask application (kernels.triton_bitmask) against its torch twin, and the twin against a
plain per-token reference: -inf exactly where the token's bit is 0, every other logit untouched.

CPU: TRITON_INTERPRET=1 on small vocabularies (inside one block, an exact multiple of 32, a partial
last word and block), with and without a row index; GPU (marker `gpu`): 128k and 256k vocabularies.
"""

from __future__ import annotations

from tests.kernel_env import CUDA_OK, interpreter_usable  # first: it chooses TRITON_INTERPRET

# isort: split
import pytest
import torch

pytest.importorskip("triton")

from kernels import torch_ops  # noqa: E402
from kernels import triton_bitmask as tb  # noqa: E402

pytestmark = pytest.mark.kernels
interp = pytest.mark.skipif(not interpreter_usable(), reason="needs TRITON_INTERPRET=1 before triton loads")


def _case(rows: int, masked_rows: int, vocab: int, dtype, device: str):
    g = torch.Generator().manual_seed(rows * 131 + vocab)
    logits = torch.randn(rows, vocab, generator=g).to(dtype).to(device)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (masked_rows, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = -1  # every token allowed
    if masked_rows > 1:
        bitmask[1] = 0  # none allowed
    index = torch.randperm(rows, generator=g)[:masked_rows].to(device) if masked_rows < rows else None
    return logits, bitmask.to(device), index


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, index) -> torch.Tensor:
    out = logits.clone().cpu()
    rows = range(bitmask.shape[0]) if index is None else index.tolist()
    for i, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [37, 64, 1000])
@pytest.mark.parametrize("masked", ["all", "some"])
def test_twin_matches_a_per_token_reference(vocab, masked):
    logits, bitmask, index = _case(5, 5 if masked == "all" else 3, vocab, torch.float32, "cpu")
    want = _reference(logits, bitmask, index)
    torch_ops.apply_token_bitmask(logits, bitmask, index)
    assert torch.equal(logits, want)


@interp
@pytest.mark.parametrize("vocab", [37, 64, 4096 + 70])
@pytest.mark.parametrize("masked", ["all", "some"])
def test_kernel_matches_twin_interpreted(vocab, masked):
    logits, bitmask, index = _case(4, 4 if masked == "all" else 2, vocab, torch.float32, "cpu")
    want = logits.clone()
    torch_ops.apply_token_bitmask(want, bitmask, index)
    tb.apply_token_bitmask(logits, bitmask, index)
    assert torch.equal(logits, want)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
@pytest.mark.parametrize("vocab", [128256, 151936, 262144])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_twin_on_gpu(vocab, dtype):
    for rows, masked in ((1, 1), (64, 64), (256, 100)):
        logits, bitmask, index = _case(rows, masked, vocab, dtype, "cuda")
        want = logits.clone()
        torch_ops.apply_token_bitmask(want, bitmask, index)
        tb.apply_token_bitmask(logits, bitmask, index)
        assert torch.equal(logits, want)
