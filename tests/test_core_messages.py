"""The step message's records (engine/core/messages.py): columns on the wire, named records back."""

from __future__ import annotations

import pickle

from engine.core.messages import FinalMetrics, Record, Records, Sample, Step

RECORDS = [
    Record("a", (Sample(0, [1, 2], [1, 0]), Sample(2, [3], [1], None, "stop", None, True)), False, 3),
    Record("b", (), True, 0, FinalMetrics(1.5, 2.5, 4, 3), [None, "lp"]),
    Record("c", (Sample(0, [], [], finish_reason="error", error="boom"),), True, 0, FinalMetrics(None, None)),
    Record("d", (Sample(1, [7], [1], ["x"]),)),
]
DECODE = [Record(f"r{i}", (Sample(0, [i], [1]),)) for i in range(5)]  # one sample each


def test_records_survive_the_wire_in_order_with_their_fields():
    step = pickle.loads(pickle.dumps(Step(Records.of(RECORDS), None), protocol=5))
    back = list(step.records.rows())
    assert back == RECORDS and step.records.num_requests == 4
    assert all(type(r) is Record and all(type(s) is Sample for s in r.samples) for r in back)
    assert back[0].samples[1].finish_reason == "stop" and back[0].samples[1].stop_token
    assert back[1].final_metrics.spec_accepted_tokens == 3 and back[1].prompt_logprobs == [None, "lp"]
    # the replica's plain form holds the same values in the fields' order
    plain = [
        (r.request_id, tuple(tuple(s) for s in r.samples), r.finished, r.cached_tokens, r.final_metrics,
         r.prompt_logprobs)
        for r in RECORDS
    ]  # fmt: skip
    assert list(step.records.unpacked()) == plain


def test_records_of_one_sample_each_come_back_the_same():
    records = pickle.loads(pickle.dumps(Records.of(DECODE)))
    assert list(records.rows()) == DECODE
    assert [(r.request_id, [s.token_ids for s in r.samples]) for r in records.rows()] == [
        (f"r{i}", [[i]]) for i in range(5)
    ]


def test_concat_keeps_the_first_records_first_and_empty_is_neutral():
    empty = Records.of([])
    assert empty.num_requests == 0 and list(empty.rows()) == []
    joined = Records.of(RECORDS[2:]).concat(Records.of(RECORDS[:2]))
    assert list(joined.rows()) == RECORDS[2:] + RECORDS[:2]
    assert list(empty.concat(Records.of(RECORDS)).rows()) == RECORDS
    assert list(Records.of(RECORDS).concat(empty).rows()) == RECORDS


def test_a_sample_defaults_to_no_end():
    s = Sample(0, [5], [1])
    assert (s.logprobs, s.finish_reason, s.error, s.stop_token) == (None, None, None, False)
    f = FinalMetrics(None, None)
    assert (f.spec_draft_tokens, f.spec_accepted_tokens) == (0, 0)
