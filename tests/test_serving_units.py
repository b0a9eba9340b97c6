"""Pieces of the serving path without a server: ITL buckets against a naive histogram, the pacer's
interval, a request's output as one stream item, and /health when no engine replica answers."""

from __future__ import annotations

import random

import pytest

from app.metrics import _ITL_BUCKETS, ItlBuckets
from app.streaming import Pacer, to_wire
from engine.outputs import CompletionDelta, RequestOutput, TokenLogprob

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


def test_to_wire_gives_one_item_per_output():
    """An output's deltas (one per sample, any order) become the item's samples by index, with token
    strings for logprobs, the finish reason and error only where a sample ended, and the output's usage."""
    d1 = CompletionDelta(1, [3], "c", [TokenLogprob(3, -0.5, [(3, -0.5), (9, -1.5)])])
    d0 = CompletionDelta(0, [1, 2], "ab", finish_reason="length")
    out = RequestOutput("r", [d1, d0], False, 5, 3, 2)
    item = to_wire(out, lambda t: f"<{t}>")
    assert [s["index"] for s in item["outputs"]] == [0, 1]
    s0, s1 = item["outputs"]
    assert (s0["text"], s0["token_ids"], s0["logprobs"]) == ("ab", [1, 2], None)
    assert (s0["finish_reason"], s0["error"]) == ("length", None)
    assert (s1["finish_reason"], s1["error"]) == (None, None)
    assert s1["logprobs"] == [{"token": "<3>", "logprob": -0.5, "top": [("<3>", -0.5), ("<9>", -1.5)]}]
    assert (item["prompt_tokens"], item["completion_tokens"], item["cached_tokens"]) == (5, 3, 2)
    assert item["finished"] is False and item["prompt_logprobs"] is None


def test_health_answers_503_when_no_engine_replica_answers(monkeypatch):
    """While the only engine replica is being replaced, Serve holds a call to it: /health must still
    answer, 503 with Retry-After, once HEALTH_TIMEOUT_S has passed."""
    import asyncio
    import json

    from app import ingress

    monkeypatch.setattr(ingress, "HEALTH_TIMEOUT_S", 0.2)

    class NoReplica:  # a handle whose calls are never answered
        class is_alive:
            @staticmethod
            def remote():
                return asyncio.get_running_loop().create_future()

    cls = ingress.Ingress.func_or_class
    route = object.__new__(cls)
    route._engine, route._retry_after = NoReplica(), 3
    answer = asyncio.run(cls.health(route))
    assert answer.status_code == 503 and answer.headers["retry-after"] == "3"
    assert json.loads(answer.body)["error"]["code"] == "engine_unavailable"
