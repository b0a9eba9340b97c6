"""Prompt-lookup proposals equal a naive recompute straight from the definition."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec.ngram import propose

pytestmark = pytest.mark.engine


def naive_propose(seq: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Every n from longest to shortest; every start from latest to earliest, excluding the suffix."""
    for n in range(n_max, n_min - 1, -1):
        if n > len(seq):
            continue
        suffix = seq[len(seq) - n :]
        starts = [s for s in range(len(seq) - n) if seq[s : s + n] == suffix]
        if starts:
            s = max(starts)
            return seq[s + n : s + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(
    seq=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(1, 6),
    n_max=st.integers(1, 6),
    n_min=st.integers(1, 6),
)
def test_matches_naive_recompute(seq, k, n_max, n_min):
    assert propose(seq, k, n_max, n_min) == naive_propose(seq, k, n_max, n_min)


@pytest.mark.parametrize(
    "seq,k,n_max,n_min,want",
    [
        ([], 3, 4, 1, []),
        ([7], 3, 4, 1, []),  # the suffix itself is never a match
        ([7, 7], 3, 4, 1, [7]),  # overlap with the suffix is allowed
        ([1, 2, 3, 1, 2], 5, 2, 1, [3, 1, 2]),  # k larger than what follows
        ([1, 2, 3, 9, 2, 3, 4, 2, 3], 2, 2, 1, [4, 2]),  # most recent occurrence, not the first
        ([1, 2, 3, 4], 2, 9, 5, []),  # n_min longer than the sequence
        ([5, 1, 2, 6, 2, 1, 2], 2, 2, 1, [6, 2]),  # the 2-gram wins over a later 1-gram
    ],
)
def test_edge_cases(seq, k, n_max, n_min, want):
    assert propose(seq, k, n_max, n_min) == want == naive_propose(seq, k, n_max, n_min)


def test_long_sequence_matches_naive():
    import random

    rng = random.Random(0)
    seq = [rng.randrange(50) for _ in range(3000)] + [1, 2, 3]
    seq[1000:1003] = [1, 2, 3]
    assert propose(seq, 4, 4, 1) == naive_propose(seq, 4, 4, 1) == seq[1003:1007]


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k >= 1"):
        propose([1, 2], 0, 2, 1)


def test_index_matches_the_scan_as_the_sequence_grows():
    """NgramIndex (incremental) proposes exactly what the reverse scan `propose` does, at every length."""
    import random

    from engine.spec.ngram import NgramIndex

    rng = random.Random(3)
    for n_max, n_min, k in ((4, 1, 3), (3, 2, 5), (1, 1, 2)):
        tokens = [rng.randrange(6) for _ in range(3)]
        index = NgramIndex(n_max, n_min)
        for _ in range(200):
            assert index.propose(tokens, k) == propose(tokens, k, n_max, n_min)
            tokens.append(rng.randrange(6))
