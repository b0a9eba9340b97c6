"""Hardening at the engine boundary (no Ray): what AsyncEngine.submit accepted must not fail later.

submit() admits a request against the engine's capacity (max_num_seqs + max_waiting) and the
scheduler's queue as it is at that moment; the loop thread adds it to the LLMEngine at its next step
boundary, when the queue may have grown (other accepted requests, preempted sequences). The server
has already answered 200 by then, so a QueueFullError there would break a stream that was promised.
"""

from __future__ import annotations

import threading
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.engine
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _collect(results: dict, done: dict, rid_key: str):
    def on_output(out) -> None:
        for d in out.outputs:
            results[rid_key]["tokens"] += d.token_ids
            if d.finish_reason:
                results[rid_key]["finish"] = (d.finish_reason, d.error)
        if out.finished:
            done[rid_key].set()

    return on_output


def test_requests_accepted_together_are_all_served(tiny_model_dir):
    """Two submits land in one inbox pass while the scheduler queue has room for one (max_waiting=1):
    both were accepted (capacity 2 running + 1 waiting), so both must run, none may fail."""
    engine = AsyncEngine(EngineConfig.from_kwargs(str(tiny_model_dir), max_num_seqs=2, max_waiting=1))
    gate, original = threading.Event(), engine._apply_inbox

    def gated_apply() -> None:  # hold the loop thread at its step boundary until both are submitted
        gate.wait(30)
        original()

    engine._apply_inbox = gated_apply
    try:
        results = {k: {"tokens": [], "finish": None} for k in ("a", "b")}
        done = {k: threading.Event() for k in results}
        for key, prompt in (("a", [11, 12, 13, 14]), ("b", [21, 22, 23])):
            engine.submit(prompt, SamplingParams(max_tokens=6, **GREEDY), _collect(results, done, key))
        gate.set()
        assert all(e.wait(60) for e in done.values())
        assert {k: r["finish"] for k, r in results.items()} == {"a": ("length", None), "b": ("length", None)}
        assert all(len(r["tokens"]) == 6 for r in results.values())
    finally:
        gate.set()
        engine.shutdown()


def test_abort_of_a_request_still_in_the_inbox(tiny_model_dir):
    """An abort that reaches the loop together with (or before the engine took) its request ends it
    with finish_reason 'abort' and leaves nothing behind."""
    engine = AsyncEngine(EngineConfig.from_kwargs(str(tiny_model_dir), max_num_seqs=2, max_waiting=1))
    gate, original = threading.Event(), engine._apply_inbox
    engine._apply_inbox = lambda: (gate.wait(30), original())
    try:
        results = {k: {"tokens": [], "finish": None} for k in ("a", "b")}
        done = {k: threading.Event() for k in results}
        params = SamplingParams(max_tokens=200, **GREEDY)
        engine.submit([5, 6, 7], params, _collect(results, done, "a"), request_id="a")
        engine.submit([8, 9], params, _collect(results, done, "b"), request_id="b")
        engine.abort("b")
        gate.set()
        assert done["b"].wait(60) and results["b"]["finish"][0] == "abort"
        engine.abort("a")
        assert done["a"].wait(60) and results["a"]["finish"][0] == "abort"
        deadline = time.monotonic() + 10  # the loop drops the request at its next step boundary
        while engine.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.engine.has_unfinished() and engine.engine.block_manager.num_used == 0
    finally:
        gate.set()
        engine.shutdown()
