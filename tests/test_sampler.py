"""The sampler draws from exactly the filtered, tempered distribution, and its processors do what the
OpenAI / vLLM definitions say. References are computed independently with numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sampling.sampler import Sampler, SamplingRow, stream_key
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.engine
V = 8


def reference_probs(logits: np.ndarray, t: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Temperature, then top-k, then top-p (smallest prefix of the sorted tokens reaching p), then
    min-p relative to the most likely token, renormalised at each stage."""
    z = logits / t
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(V, bool)
    keep[order[: top_k or V]] = True
    p = np.where(keep, p, 0)
    p /= p.sum()
    cum = np.cumsum(p[order])
    nucleus = order[: int(np.searchsorted(cum, top_p - 1e-9)) + 1]
    keep = np.zeros(V, bool)
    keep[nucleus] = True
    p = np.where(keep, p, 0)
    p /= p.sum()
    p = np.where(p >= min_p * p.max(), p, 0)
    return p / p.sum()


@pytest.mark.parametrize("t,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0),
                                                 (1.0, 0, 1.0, 0.2), (0.9, 6, 0.9, 0.05)])  # fmt: skip
def test_draws_follow_the_filtered_distribution(t, top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, 0.9])
    n = 40000
    params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    rows = [SamplingRow(params, [0], 1, key=stream_key(99, i), counter=1) for i in range(n)]
    ids = Sampler(V, torch.device("cpu"))(logits.expand(n, V).clone(), rows).resolve().token_ids
    freq = np.bincount(ids, minlength=V) / n
    expected = reference_probs(logits.numpy().astype(np.float64), t, top_k, top_p, min_p)
    assert np.abs(freq - expected).max() < 0.01, (freq.round(3), expected.round(3))
    assert freq[expected == 0].sum() == 0


def test_penalties_match_their_definitions():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5, 0.0, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3)
    prompt, output = [1, 3], [2, 2, 5]
    got = Sampler(V, torch.device("cpu"))._apply_penalties(
        logits.clone(), [SamplingRow(params, prompt + output, 2, key=0, counter=5)]
    )
    want = logits[0].numpy().astype(np.float64).copy()
    for tok in set(prompt + output):  # repetition: divide positive logits, multiply negative ones
        want[tok] = want[tok] / 1.5 if want[tok] > 0 else want[tok] * 1.5
    for tok in set(output):  # presence once, frequency per occurrence (output tokens only)
        want[tok] -= 0.4 + 0.3 * output.count(tok)
    np.testing.assert_allclose(got[0].numpy(), want, rtol=1e-6)


def test_seeded_rows_ignore_their_neighbours_and_logprobs_are_exact():
    """A seeded row draws the same 64 tokens (counters 1..64) at position 0 and at position 4 of a batch
    of other, randomly keyed rows with random logits. One token matches by chance with probability
    sum(p^2) (about 0.16 here); all 64, below 1e-50."""
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    seeded = SamplingParams(temperature=1.0, seed=11, logprobs=3)
    other = SamplingParams(temperature=1.0)
    sampler = Sampler(V, torch.device("cpu"))

    def draw(position: int, counter: int) -> tuple[int, tuple]:
        rows = [
            SamplingRow(other, [0], 1, key=stream_key(5, position * 6 + i), counter=counter) for i in range(6)
        ]
        rows[position] = SamplingRow(seeded, [0], 1, key=stream_key(11, 0), counter=counter)
        batch = torch.randn(6, V)
        batch[position] = logits[0]
        result = sampler(batch, rows).resolve()
        return result.token_ids[position], result.logprobs[position]

    at_0 = [draw(0, c) for c in range(1, 65)]
    at_4 = [draw(4, c) for c in range(1, 65)]
    tokens = [t for t, _ in at_0]
    assert tokens == [t for t, _ in at_4]
    assert len(set(tokens)) >= 3  # real draws, not one token
    ref = torch.log_softmax(logits[0].double(), -1)
    for a, (chosen, top) in at_0:
        assert abs(chosen - ref[a].item()) < 1e-5
        assert [t for t, _ in top] == ref.topk(3).indices.tolist()


def test_a_draw_depends_on_its_key_and_counter_only():
    """Same (key, counter): the same token whatever the temperature-free neighbours; a new counter is a
    fresh draw from the same distribution (first-token frequencies over 4,000 positions)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 0.3])
    params = SamplingParams(temperature=1.0)
    sampler = Sampler(V, torch.device("cpu"))
    rows = [SamplingRow(params, [0], 1, key=stream_key(3, 0), counter=c) for c in range(4000)]
    ids = sampler(logits.expand(4000, V).clone(), rows).resolve().token_ids
    again = sampler(logits.expand(4000, V).clone(), rows[::-1]).resolve().token_ids
    assert ids == again[::-1]
    freq = np.bincount(ids, minlength=V) / len(ids)
    expected = torch.softmax(logits.double(), -1).numpy()
    assert np.abs(freq - expected).max() < 0.025, (freq.round(3), expected.round(3))


def test_stream_keys_are_distinct_63_bit_ints():
    keys = {stream_key(seed, index) for seed in range(200) for index in range(8)}
    assert len(keys) == 1600 and all(0 <= k < 2**63 for k in keys)
    assert stream_key(7, 1) != stream_key(8, 0)


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_stream_keys_and_counters_start_16_byte_aligned(n: int):
    """Triton specialises the sampling kernel on each pointer's 16-byte alignment: with counters right
    after an odd number of keys, a batch's parity would pick the variant and compile one mid-run."""
    from engine.device.uploader import Uploader
    from engine.sampling.rows import RowTensors

    params = SamplingParams(temperature=1.0)
    rows = [SamplingRow(params, [0], 1, key=100 + i, counter=10 + i) for i in range(n)]
    keys, counters = RowTensors(Uploader(torch.device("cpu")), V).streams(rows, salt=5)
    assert keys.tolist() == [(100 + i) ^ 5 for i in range(n)]
    assert counters.tolist() == [10 + i for i in range(n)]
    for t in (keys, counters):
        assert (t.data_ptr() - t.untyped_storage().data_ptr()) % 16 == 0


@pytest.mark.parametrize("constrained", [[0], [1, 3], [0, 2, 4]])
def test_mask_row_maps_start_16_byte_aligned(constrained: list[int]):
    """The same for a partly constrained batch's two row maps (one upload): rows, then row_of."""
    from engine.device.uploader import Uploader
    from engine.runner.plain_draw import PlainDraw

    draw = PlainDraw(Sampler(V, torch.device("cpu")), None, Uploader(torch.device("cpu")), 0)
    rows, row_of = draw._mask_row_maps(6, constrained)
    assert rows.tolist() == constrained
    assert row_of.tolist() == [constrained.index(i) if i in constrained else -1 for i in range(6)]
    for t in (rows, row_of):
        assert (t.data_ptr() - t.untyped_storage().data_ptr()) % 16 == 0


def _naive_kinds(rows: list[SamplingRow]) -> tuple[bool, bool, bool, bool]:
    """The four batch facts the draw branches on, each from its own definition."""
    ps = [r.params for r in rows]
    penalties = [(p.repetition_penalty, p.presence_penalty, p.frequency_penalty) for p in ps]
    processors = any(p.logit_bias is not None for p in ps) or any(k != (1, 0, 0) for k in penalties)
    greedy = all(p.temperature == 0 for p in ps)
    filters = any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) for p in ps)
    return any(p.logprobs is not None for p in ps), processors, greedy, filters


def test_one_passrow_kinds_equal_their_definitions():
    from engine.sampling.sampler import row_kinds

    rng = np.random.default_rng(0)
    choices = {
        "temperature": [0.0, 0.7, 1.0],
        "top_k": [0, 5],
        "top_p": [1.0, 0.9],
        "min_p": [0.0, 0.1],
        "logprobs": [None, 0, 3],
        "logit_bias": [None, {1: 2.0}],
        "repetition_penalty": [1.0, 1.2],
        "presence_penalty": [0.0, -0.5],
        "frequency_penalty": [0.0, 0.3],
    }
    for _ in range(400):
        n = int(rng.integers(1, 5))
        rows = []
        for i in range(n):
            # mostly plain rows, so that every flag is sometimes off for the whole batch
            knobs = {k: v[int(rng.integers(len(v)))] for k, v in choices.items() if rng.random() < 0.15}
            rows.append(SamplingRow(SamplingParams(**knobs), [0], 1, key=i, counter=1))
        assert row_kinds(rows) == _naive_kinds(rows)


def test_a_shared_temperature_is_kept_and_mixed_ones_are_uploaded():
    """Rows that all share a value get one kept device vector (no upload); it holds that value whatever
    other batches ask for in between, and mixed rows get their own values."""
    sampler = Sampler(V, torch.device("cpu"))
    row = lambda t: SamplingRow(SamplingParams(temperature=t), [0], 1, key=1, counter=1)  # noqa: E731
    same = [row(0.7)] * 5
    kept = sampler.tensors.draw_temperatures(same, divided=False)
    assert kept.tolist() == pytest.approx([0.7] * 5)
    mixed = [row(0.7), row(0.0), row(1.3)]
    assert sampler.tensors.draw_temperatures(mixed, divided=False).tolist() == pytest.approx([0.7, 0.0, 1.3])
    assert sampler.tensors.draw_temperatures(mixed, divided=True).tolist() == [1.0, 0.0, 1.0]
    assert sampler.tensors.divisors(mixed)[:, 0].tolist() == pytest.approx([0.7, 1.0, 1.3])
    again = sampler.tensors.draw_temperatures(same, divided=False)
    assert again is kept and again.tolist() == pytest.approx([0.7] * 5)
    assert sampler.tensors.draw_temperatures(same, divided=True).tolist() == [1.0] * 5
    assert sampler.tensors.divisors(same).shape == (5, 1)
