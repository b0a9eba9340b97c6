"""The one-launch argmax (kernels.triton_argmax) against torch.argmax, ties included.

Each row's maximum is copied to a later index, often in another chunk, so the lowest-index rule is
exercised across programs; a row of all -inf must give 0 as torch does. CPU: TRITON_INTERPRET=1 on
small vocabularies (one chunk, an exact chunk, a partial last chunk); GPU (marker `gpu`): the Llama 3,
Qwen 3 and Gemma 3 vocabulary sizes at batch 1 to 256, bf16 and fp32.
"""

from __future__ import annotations

from tests.kernel_env import CUDA_OK, interpreter_usable  # first: it chooses TRITON_INTERPRET

# isort: split
import pytest
import torch

pytest.importorskip("triton")

from kernels import arrivals, ops  # noqa: E402
from kernels import triton_argmax as ta  # noqa: E402

pytestmark = pytest.mark.kernels
interp = pytest.mark.skipif(not interpreter_usable(), reason="needs TRITON_INTERPRET=1 before triton loads")


def _logits_with_ties(rows: int, vocab: int, dtype, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * 7919 + vocab)
    x = torch.randn(rows, vocab, generator=g)
    top = x.argmax(dim=-1)
    later = (top + torch.randint(1, vocab, (rows,), generator=g)).clamp(max=vocab - 1)
    x[torch.arange(rows), later] = x[torch.arange(rows), top]
    if rows > 2:
        x[1] = float("-inf")
    return x.to(dtype).to(device)


def _check(x: torch.Tensor) -> None:
    got = ta.argmax(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    assert not arrivals._BUFFERS[x.device][-1].any()  # the last program of each row reset its counter


@interp
@pytest.mark.parametrize("rows,vocab", [(1, 100), (3, 2048), (5, 5000), (2, 2 * ta.BLOCK + 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_interpreted(rows: int, vocab: int, dtype) -> None:
    _check(_logits_with_ties(rows, vocab, dtype, "cpu"))


@interp
def test_ops_dispatch_and_bad_input(monkeypatch) -> None:
    """ops.argmax takes the kernel where Triton runs; otherwise torch.argmax. A strided row is refused."""
    monkeypatch.setattr(ops, "use_triton", lambda x: True)
    x = _logits_with_ties(4, 3000, torch.float32, "cpu")
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))
    with pytest.raises(ValueError, match="contiguous rows"):
        ta.argmax(x.t())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
@pytest.mark.parametrize("vocab", [128256, 151936, 262144])
@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_gpu(rows: int, vocab: int, dtype) -> None:
    _check(_logits_with_ties(rows, vocab, dtype, "cuda"))
