"""Deferred text (CoreClient(deferred_text=True), the engine replica's mode): the reader thread only
stashes each step's token ids and a consumer takes them as text when it sends, several steps at once.
The text, ids and finish reasons must be those of the offline engine and of the per-step path, stop
strings included, and the core's death must still give every open request one failed final output."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from engine import LLM
from engine.config import EngineConfig
from engine.core.deferred_text import StepNote
from engine.core.live_request import LiveRequest
from engine.core_client import CoreClient
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.test_engine_core import GREEDY, Collector, outputs_equal_the_offline_engine, wait_for

pytestmark = pytest.mark.engine


class Taker:
    """A consumer in deferred mode: notes mark requests as pending; a thread takes every pending one
    each `period_s` (so one take spans several engine steps) and hands the outputs to `sink`."""

    def __init__(self, sink: Collector, period_s: float = 0.03):
        self.sink, self.period_s = sink, period_s
        self.client: CoreClient | None = None
        self.notes: list[StepNote] = []
        self.pending: set[str] = set()
        self.takes: dict[str, int] = {}
        self._lock, self._stop = threading.Lock(), threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def __call__(self, notes: list[StepNote]) -> None:
        with self._lock:
            self.notes += notes
            self.pending |= {n.request_id for n in notes}

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                rids, self.pending = self.pending, set()
            outs = [out for rid in rids if (out := self.client.take(rid)) is not None]
            for out in outs:
                self.takes[out.request_id] = self.takes.get(out.request_id, 0) + 1
            if outs:
                self.sink(outs)

    def close(self) -> None:
        self._stop.set()


def deferred_client(model_dir) -> CoreClient:
    taker = Taker(Collector())
    c = CoreClient(EngineConfig.from_kwargs(str(model_dir)), taker, deferred_text=True)
    taker.client, c.sink, c.taker = c, taker.sink, taker
    return c


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    c = deferred_client(tiny_model_dir)
    yield c
    c.taker.close()
    c.shutdown()


def test_deferred_outputs_equal_the_offline_engine(client, tiny_model_dir):
    """Greedy, seeded n=2 and stop-string requests, taken every 30 ms: text, ids and reasons as
    LLM.generate; each request took fewer outputs than it had engine steps; the blocks are freed."""
    rids = outputs_equal_the_offline_engine(client, LLM(str(tiny_model_dir)), max_tokens=48)
    steps = {rid: sum(n.request_id == rid for n in client.taker.notes) for rid in rids}
    assert client.taker.takes[rids[0]] < steps[rids[0]], (client.taker.takes, steps)


def test_killing_the_core_fails_open_requests_in_deferred_mode(tiny_model_dir):
    c = deferred_client(tiny_model_dir)
    try:
        rids = [c.submit([9] * 8, SamplingParams(max_tokens=3000, **GREEDY)) for _ in range(3)]
        wait_for(lambda: all(c.sink.tokens.get(f"{r}/0") for r in rids), what="tokens")
        os.kill(c.proc.pid, signal.SIGKILL)
        for rid in rids:
            c.sink.wait(rid, 30)
            ((index, reason, error),) = c.sink.finish[rid]
            assert reason == "error" and "engine core process exited" in error
        assert all(c.take(rid) is None for rid in rids)  # one final output each, then nothing
    finally:
        c.taker.close()
        c.shutdown()


def _stream(rng: random.Random, n: int, vocab: int) -> list[list[int]]:
    """n token ids in steps of 1-3 tokens (speculative steps bring several)."""
    ids = [rng.randrange(3, vocab) for _ in range(n)]
    steps, i = [], 0
    while i < n:
        k = rng.randint(1, 3)
        steps.append(ids[i : i + k])
        i += k
    return steps


@pytest.mark.parametrize("seed", range(6))
def test_take_over_several_steps_gives_the_per_step_text(tiny_model_dir, seed):
    """LiveRequest: the same records absorbed one by one (the per-step path) and stashed then taken at
    random points give the same text, ids, finish reason and stop; with no stop string the text is the
    tokenizer's own decode of the ids."""
    tok = Tokenizer.from_dir(tiny_model_dir)
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 500) for _ in range(12)]
    steps = _stream(rng, 60, 500)
    whole = tok.decode([t for s in steps for t in s])
    stop = [whole[20:23]] if seed % 2 and len(whole) > 30 else []
    params = SamplingParams(max_tokens=1000, stop=stop)
    eager = LiveRequest("a", prompt, params, 0.0, tok)
    lazy = LiveRequest("b", prompt, params, 0.0, tok)
    e_text = l_text = ""
    e_ids, l_ids, e_reason, l_reason = [], [], None, None
    for i, ids in enumerate(steps):
        last = i == len(steps) - 1
        sample = [(0, ids, [0] * len(ids), None, "length" if last else None, None, False)]
        out = eager.absorb(sample, last, 0, None, 100.0 + i, None)
        e_text += "".join(d.text for d in out.outputs)
        e_ids += [t for d in out.outputs for t in d.token_ids]
        e_reason = next((d.finish_reason for d in out.outputs if d.finish_reason), e_reason)
        lazy.stash(sample, last, 0, None, 100.0 + i)
        if last or rng.random() < 0.3:
            out = lazy.take(None)
            l_text += "".join(d.text for d in out.outputs)
            l_ids += [t for d in out.outputs for t in d.token_ids]
            l_reason = next((d.finish_reason for d in out.outputs if d.finish_reason), l_reason)
    assert (l_text, l_ids, l_reason) == (e_text, e_ids, e_reason)
    assert lazy.take_stops() == eager.take_stops()
    assert lazy.take(None) is None
    if stop:
        assert e_reason == "stop" and stop[0] not in e_text
    else:
        assert e_text == whole and e_ids == [t for s in steps for t in s]
    assert (lazy.metrics.first_token_time, lazy.metrics.last_token_time) == (100.0, 100.0 + len(steps) - 1)


def test_a_take_during_appends_loses_no_record(tiny_model_dir):
    """The reader thread stashes while another thread takes: every token arrives exactly once."""
    tok = Tokenizer.from_dir(tiny_model_dir)
    live = LiveRequest("r", [5, 6], SamplingParams(max_tokens=10**6), 0.0, tok)
    total, got = 20000, []

    def reader() -> None:
        for i in range(total):
            live.stash([(0, [3 + i % 400], [0], None, None, None, False)], False, 0, None, time.time())

    t = threading.Thread(target=reader)
    t.start()
    while t.is_alive() or live._inbox:
        out = live.take(None)
        if out is not None:
            got += [tid for d in out.outputs for tid in d.token_ids]
    t.join()
    assert got == [3 + i % 400 for i in range(total)]
