"""The one-launch argmax (kernels.triton_argmax) against torch.argmax, ties included; its sampling form
against the torch twin (kernels.torch_ops.sample), whose Philox matches the Random123 known answers.

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

from kernels import arrivals, ops, torch_ops  # noqa: E402
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


def _check_ids(x: torch.Tensor) -> None:
    """With an id map (a draft vocabulary: distinct ascending ids), the mapped id of torch's argmax."""
    g = torch.Generator().manual_seed(x.shape[1])
    ids = torch.randperm(4 * x.shape[1], generator=g)[: x.shape[1]].sort().values.to(x.device)
    assert torch.equal(ta.argmax(x, ids=ids), ids[x.argmax(dim=-1)])
    assert not arrivals._BUFFERS[x.device][-1].any()


@interp
@pytest.mark.parametrize("rows,vocab", [(1, 100), (3, 2 * ta.BLOCK + 1)])
def test_maps_ids_interpreted(rows: int, vocab: int, monkeypatch) -> None:
    x = _logits_with_ties(rows, vocab, torch.bfloat16, "cpu")
    _check_ids(x)
    monkeypatch.setattr(ops, "use_triton", lambda x: False)  # the twin's mapping
    ids = torch.arange(vocab) * 3 + 1
    assert torch.equal(ops.argmax(x, ids=ids), ids[x.argmax(dim=-1)])
    with pytest.raises(ValueError, match="ids must be"):
        ta.argmax(x, ids=ids[:-1])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
@pytest.mark.parametrize("vocab", [128256, 151936, 262144])
@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_gpu(rows: int, vocab: int, dtype) -> None:
    x = _logits_with_ties(rows, vocab, dtype, "cuda")
    _check(x)
    if vocab == 128256 and dtype == torch.bfloat16:
        _check_ids(x[:, :32768].contiguous())


# ------------------------------------------------------------------------------------------- sampling


def test_twin_philox_gives_the_random123_known_answer():
    """Philox4x32-10, key 0, counter 0: first word 0x6627e8d5 (Random123's kat_vectors)."""
    zero = torch.zeros(1, dtype=torch.int64)
    assert torch_ops.philox_uint32(zero, zero, zero).item() == 0x6627E8D5


def _sample_case(rows: int, vocab: int, dtype, device: str):
    g = torch.Generator().manual_seed(rows * 31 + vocab)
    x = (3 * torch.randn(rows, vocab, generator=g)).to(dtype).to(device)
    temperature = torch.tensor([(0.0, 0.6, 1.0, 1.7)[i % 4] for i in range(rows)], device=device)
    keys = torch.randint(0, 2**63 - 1, (rows,), generator=g).to(device)
    keys[0] = 2**63 - 1  # every key bit, and counters beyond 32 bits (only the low word counts)
    counters = torch.randint(0, 2**40, (rows,), generator=g).to(device)
    return x, temperature, keys, counters


def _check_sample(x, temperature, keys, counters) -> None:
    """Same ids as the twin, except where the twin's two best noisy scores are within float noise."""
    got = ta.sample(x, temperature, keys, counters)
    want = torch_ops.sample(x.cpu(), temperature.cpu(), keys.cpu(), counters.cpu())
    hot = (temperature > 0).cpu()
    noisy = x.cpu().float() / torch.where(hot, temperature.cpu(), 1.0)[:, None]
    noisy += torch_ops.gumbel_noise(keys.cpu(), counters.cpu(), x.shape[1])
    scores = torch.where(hot[:, None], noisy, x.cpu().float())
    rows = torch.arange(len(got))
    gap = (scores[rows, want] - scores[rows, got.cpu()]).abs()
    assert ((got.cpu() == want) | (gap < 1e-4 * scores[rows, want].abs().clamp(min=1))).all()
    assert (got.cpu() == want).float().mean() > 0.95
    assert torch.equal(got.cpu()[~hot], x.cpu()[~hot].argmax(dim=-1))  # T = 0: the plain argmax
    assert not arrivals._BUFFERS[x.device][-1].any()


@interp
@pytest.mark.parametrize("rows,vocab", [(4, 100), (5, 5000), (3, 2 * ta.BLOCK + 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_matches_twin_interpreted(rows: int, vocab: int, dtype) -> None:
    _check_sample(*_sample_case(rows, vocab, dtype, "cpu"))


@interp
def test_sample_dispatch_and_bad_input(monkeypatch) -> None:
    monkeypatch.setattr(ops, "use_triton", lambda x: True)
    x, t, k, c = _sample_case(4, 300, torch.float32, "cpu")
    assert torch.equal(ops.sample(x, t, k, c), torch_ops.sample(x, t, k, c))
    with pytest.raises(ValueError, match="keys must be"):
        ta.sample(x, t, k.int(), c)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
@pytest.mark.parametrize("vocab", [128256, 151936, 262144])
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_sample_matches_twin_gpu(rows: int, vocab: int) -> None:
    _check_sample(*_sample_case(rows, vocab, torch.bfloat16, "cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
def test_sample_frequencies_follow_the_softmax_gpu() -> None:
    """200,000 draws of one row of 64 logits at T = 0.8 (a fresh counter each) against softmax(x / T)."""
    n, vocab = 200_000, 64
    x = torch.randn(vocab, generator=torch.Generator().manual_seed(5)).cuda()
    temperature = torch.full((n,), 0.8, device="cuda")
    keys = torch.full((n,), 12345, dtype=torch.int64, device="cuda")
    ids = ta.sample(x.expand(n, vocab).contiguous(), temperature, keys, torch.arange(n, device="cuda"))
    freq = torch.bincount(ids, minlength=vocab).double() / n
    assert (freq - torch.softmax(x.double() / 0.8, -1)).abs().max() < 0.005


def _mask_case(rows: int, vocab: int, device: str, every_row: bool):
    """A bitmask allowing ~5% of tokens per mask row (never none), and for `every_row` False a row map
    where every other row is unconstrained (-1)."""
    g = torch.Generator().manual_seed(rows * 13 + vocab)
    allowed = torch.rand(rows, vocab, generator=g) < 0.05
    allowed[:, vocab - 1] = True  # the last token (in a partial word and chunk) stays possible
    words = (vocab + 31) // 32
    bits = torch.zeros(rows, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    if every_row:
        return bitmask.to(device), None, allowed
    row_of = torch.tensor([i // 2 if i % 2 == 0 else -1 for i in range(rows)])
    mask_rows = bitmask[row_of[row_of >= 0]]
    per_row = torch.ones(rows, vocab, dtype=torch.bool)
    per_row[row_of >= 0] = allowed[row_of[row_of >= 0]]
    return mask_rows.to(device), row_of.to(device), per_row


def _check_masked(rows: int, vocab: int, every_row: bool, device: str) -> None:
    """argmax and sample with a bitmask read as the logits load give the ids of the unmasked kernels
    run on logits masked beforehand with -inf (each row's allowed set unpacked independently here),
    and the torch twins agree."""
    x, temperature, keys, counters = _sample_case(rows, vocab, torch.float32, device)
    bitmask, row_of, allowed = _mask_case(rows, vocab, device, every_row)
    allowed = allowed.to(device)
    masked = x.masked_fill(~allowed, float("-inf"))
    want = masked.argmax(dim=-1)
    assert torch.equal(ta.argmax(x, bitmask, row_of), want)
    assert allowed[torch.arange(rows, device=device), want].all()
    twin = torch_ops.masked_by_bitmask(x, bitmask, row_of)
    assert torch.equal(twin, masked) and torch.equal(twin.argmax(dim=-1), want)
    got = ta.sample(x, temperature, keys, counters, bitmask, row_of)
    assert torch.equal(got, ta.sample(masked, temperature, keys, counters))
    assert allowed[torch.arange(rows, device=device), got].all()


@interp
@pytest.mark.parametrize("rows,vocab", [(3, 100), (4, 2 * ta.BLOCK + 45)])
@pytest.mark.parametrize("every_row", [True, False])
def test_masked_draws_match_masking_first_interpreted(rows: int, vocab: int, every_row: bool) -> None:
    _check_masked(rows, vocab, every_row, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="needs CUDA")
@pytest.mark.parametrize("every_row", [True, False])
def test_masked_draws_match_masking_first_gpu(every_row: bool) -> None:
    _check_masked(64, 128256, every_row, "cuda")
