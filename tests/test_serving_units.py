"""Pieces of the serving path without a server: ITL buckets against a naive histogram, the pacer's
interval, and merging a request's outputs into one stream item."""

from __future__ import annotations

import random

import pytest

from app.metrics import _ITL_BUCKETS, ItlBuckets
from app.streaming import Pacer, to_wire
from engine.outputs import CompletionDelta, RequestOutput

pytestmark = pytest.mark.serving


def test_itl_buckets_keep_counts_and_sums_exact():
    rng = random.Random(0)
    values = [rng.lognormvariate(-4, 1.5) for _ in range(5000)] + list(_ITL_BUCKETS)  # edges included
    buckets = ItlBuckets(_ITL_BUCKETS)
    for v in values:
        buckets.add(v)
    replay = buckets.take()
    # naive: Prometheus's cumulative "le" buckets over the raw values
    for bound in _ITL_BUCKETS:
        naive = sum(v <= bound for v in values)
        replayed = sum(count for mean, count in replay if mean <= bound)
        assert replayed == naive, bound
    assert sum(mean * count for mean, count in replay) == pytest.approx(sum(values))
    assert buckets.take() == []  # taken once


def test_pacer_bounds_items_per_second_by_open_streams():
    pacer = Pacer(min_interval_s=0.005, items_per_s=2000)
    assert pacer.interval(1) == 0.005  # the floor
    assert pacer.interval(64) == pytest.approx(0.032)
    assert pacer.interval(256) == pytest.approx(0.128)


def test_to_wire_merges_deltas_in_order():
    a = RequestOutput("r", [CompletionDelta(0, [1, 2], "ab"), CompletionDelta(1, [3], "c")], False, 5, 3)
    b = RequestOutput("r", [CompletionDelta(0, [4], "d", finish_reason="length")], False, 5, 4, 2)
    item = to_wire([a, b], str)
    assert item["outputs"][0]["text"] == "abd" and item["outputs"][0]["token_ids"] == [1, 2, 4]
    assert item["outputs"][0]["finish_reason"] == "length" and item["outputs"][1]["text"] == "c"
    assert (item["completion_tokens"], item["cached_tokens"], item["finished"]) == (4, 2, False)
