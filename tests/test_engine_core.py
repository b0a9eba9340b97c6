"""The engine core process and its client (no Ray): outputs equal the offline engine's, aborts and stop
strings free KV blocks across the process boundary, the core's death fails every open request, and the
core never outlives the process that started it.

Two harnesses: `CoreClient` starts the real core process (`python -m engine.core.process`); `InProcessCore`
runs the same `EngineCore` loop on a thread over a Pipe, so a test can hold the loop at a step boundary or
swap the engine's sampler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import Pipe

import pytest

from engine import LLM
from engine.config import EngineConfig
from engine.core.messages import Abort, Add, Dead, Record, Shutdown, Step
from engine.core.process import EngineCore
from engine.core_client import CoreClient
from engine.errors import EngineDeadError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.serving_fixtures import ROOT, process_alive

pytestmark = pytest.mark.engine
GREEDY = dict(temperature=0.0, ignore_eos=True)


class Collector:
    """on_step target: per request, the concatenated tokens/text and the final output."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.text: dict[str, str] = {}
        self.finish: dict[str, list] = {}
        self.finals: dict[str, threading.Event] = {}
        self.steps = 0
        self._lock = threading.Lock()

    def __call__(self, outputs) -> None:
        with self._lock:
            self.steps += 1
            for out in outputs:
                key = (out.request_id,)
                for d in out.outputs:
                    k = f"{out.request_id}/{d.index}"
                    self.tokens.setdefault(k, []).extend(d.token_ids)
                    self.text[k] = self.text.get(k, "") + d.text
                    if d.finish_reason:
                        self.finish.setdefault(out.request_id, []).append((d.index, d.finish_reason, d.error))
                if out.finished:
                    self.event(key[0]).set()

    def event(self, rid: str) -> threading.Event:
        return self.finals.setdefault(rid, threading.Event())

    def wait(self, rid: str, timeout: float = 60) -> None:
        assert self.event(rid).wait(timeout), f"no final output for {rid}"


def wait_for(predicate, timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    sink = Collector()
    c = CoreClient(EngineConfig.from_kwargs(str(tiny_model_dir)), sink)
    c.sink = sink
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir))


def test_core_runs_in_a_process_of_its_own(client):
    assert client.proc.pid != os.getpid() and client.is_alive()
    cmdline = open(f"/proc/{client.proc.pid}/cmdline", "rb").read().split(b"\0")
    assert b"engine.core.process" in cmdline


def test_outputs_equal_the_offline_engine(client, llm):
    """Greedy, seeded, n=2 and stop-string requests at once: text, ids and reasons as LLM.generate."""
    outputs_equal_the_offline_engine(client, llm, max_tokens=24)


def outputs_equal_the_offline_engine(client, llm, max_tokens: int) -> list[str]:
    """Submit greedy, seeded n=2, sampled and stop-string requests to `client` (its `sink` a Collector),
    check them against LLM.generate and that their blocks are freed; their request ids."""
    prompts = ["The quick brown fox", [5, 6, 7, 8, 9], "Seven stones by the river"]
    params = [
        SamplingParams(max_tokens=max_tokens, **GREEDY),
        SamplingParams(max_tokens=max_tokens * 5 // 6, temperature=1.0, seed=11, n=2, ignore_eos=True),
        SamplingParams(max_tokens=max_tokens * 2 // 3, temperature=0.8, seed=5, ignore_eos=True),
    ]
    greedy = llm.generate(prompts[0], params[0])[0].outputs[0].text
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 3]
    prompts.append(prompts[0])
    params.append(SamplingParams(max_tokens=max_tokens, stop=[stop], **GREEDY))
    expected = llm.generate(prompts, params)
    rids = [client.submit(p, sp) for p, sp in zip(prompts, params)]
    for rid in rids:
        client.sink.wait(rid)
    for rid, ref in zip(rids, expected):
        for o in ref.outputs:
            key = f"{rid}/{o.index}"
            assert client.sink.text[key] == o.text
            assert client.sink.tokens[key] == o.token_ids
        assert sorted(client.sink.finish[rid]) == [(o.index, o.finish_reason, None) for o in ref.outputs]
    assert expected[3].outputs[0].finish_reason == "stop" and stop not in expected[3].outputs[0].text
    wait_for(lambda: client.stats()["kv_blocks_used"] == 0, what="blocks freed")
    wait_for(lambda: client.stats()["num_running"] == 0, what="the stopped request to end in the core")
    return rids


def test_abort_frees_kv_blocks_across_the_process_boundary(client):
    wait_for(lambda: "num_aborts" in client.stats(), what="the core's first stats")  # none before then
    aborts = client.stats()["num_aborts"]
    rid = client.submit([7] * 40, SamplingParams(max_tokens=3000, **GREEDY))
    wait_for(lambda: len(client.sink.tokens.get(f"{rid}/0", [])) >= 3, what="tokens")
    # While it runs, the core's stats show it holding at least the blocks of its 40 prompt tokens and
    # the token being decoded (block_size 16: 3 blocks); the stats ride on the core's step messages.
    wait_for(
        lambda: client.stats()["num_running"] == 1 and client.stats()["kv_blocks_used"] >= 3,
        what="the running request's blocks in the core's stats",
    )
    assert rid not in client.sink.finish
    client.abort(rid)
    wait_for(lambda: client.stats()["kv_blocks_used"] == 0, what="blocks freed")
    wait_for(lambda: client.stats()["num_aborts"] == aborts + 1, what="the abort counted")
    wait_for(lambda: client.stats()["num_running"] == 0, what="idle")
    assert client.audit() == []


def test_a_client_that_fails_to_start_ends_the_core_it_started(tiny_model_dir, monkeypatch):
    """The client loads its tokenizer while the core starts: when that load fails, the error propagates
    and the already running core is ended, not left waiting for a client that never came."""
    import engine.core_client as core_client

    started = []
    start = CoreClient._start

    def recording_start(self, *args):
        started.append(start(self, *args))
        return started[-1]

    def broken_tokenizer(path):
        raise ValueError(f"could not load the tokenizer in {path}: test")

    monkeypatch.setattr(CoreClient, "_start", recording_start)
    monkeypatch.setattr(core_client.Tokenizer, "from_dir", staticmethod(broken_tokenizer))
    with pytest.raises(ValueError, match="could not load the tokenizer"):
        CoreClient(EngineConfig.from_kwargs(str(tiny_model_dir)), Collector())
    (proc, conn) = started[0]
    assert proc.poll() is not None and conn.closed


def test_killing_the_core_fails_open_requests(tiny_model_dir):
    sink = Collector()
    c = CoreClient(EngineConfig.from_kwargs(str(tiny_model_dir)), sink)
    try:
        rids = [c.submit([9] * 8, SamplingParams(max_tokens=3000, **GREEDY)) for _ in range(3)]
        wait_for(lambda: all(sink.tokens.get(f"{r}/0") for r in rids), what="tokens")
        os.kill(c.proc.pid, signal.SIGKILL)
        for rid in rids:
            sink.wait(rid, 30)
            ((index, reason, error),) = sink.finish[rid]
            assert reason == "error" and "engine core process exited" in error
        assert not c.is_alive()
        with pytest.raises(EngineDeadError):
            c.submit("hi", SamplingParams(max_tokens=2))
    finally:
        c.shutdown()


def test_a_request_submitted_as_the_core_dies_is_refused(tiny_model_dir, monkeypatch):
    """The core dies while `submit` checks a request (after its first look at the core): the request
    must be refused, not added behind the failure of the open ones, where no final output would come."""
    from engine import core_client

    c = CoreClient(EngineConfig.from_kwargs(str(tiny_model_dir)), Collector())
    check = core_client.admission.check

    def check_while_the_core_dies(*args, **kwargs) -> None:
        check(*args, **kwargs)
        os.kill(c.proc.pid, signal.SIGKILL)
        wait_for(lambda: c.death is not None, what="the client to see the core's death")

    monkeypatch.setattr(core_client.admission, "check", check_while_the_core_dies)
    try:
        with pytest.raises(EngineDeadError):
            c.submit([9] * 8, SamplingParams(max_tokens=4))
    finally:
        c.shutdown()


def test_the_core_dies_with_the_process_that_started_it(tiny_model_dir, tmp_path):
    """kill -9 of the starting process (a replica in the server) leaves no orphan core."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from engine.config import EngineConfig
        from engine.core_client import CoreClient
        c = CoreClient(EngineConfig.from_kwargs({str(tiny_model_dir)!r}), lambda outs: None)
        print(c.proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(parent.stdout.readline())
        assert process_alive(core_pid)
        parent.kill()
        parent.wait()
        wait_for(lambda: not process_alive(core_pid), timeout=10, what="the core to exit")
    finally:
        parent.kill()


# ---------------------------------------------------------------- the loop itself, in-process


class InProcessCore:
    """EngineCore on a thread over a Pipe; `gate` holds it before reading its first commands."""

    def __init__(self, model_dir, **options):
        self.engine = LLMEngine(EngineConfig.from_kwargs(str(model_dir), **options), detokenize=False)
        self.conn, core_end = Pipe()
        self.core = EngineCore(self.engine, core_end)
        self.gate = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.gate.wait(30)
        self.core.run()

    def finals(self, want: set[str], timeout: float = 60, on_record=None) -> dict[str, Record]:
        """Read step messages until every request in `want` had its final record."""
        got: dict[str, Record] = {}
        deadline = time.monotonic() + timeout
        while not want <= set(got):
            assert self.conn.poll(max(0.0, deadline - time.monotonic())), f"missing finals {want - set(got)}"
            message = self.conn.recv()
            for rec in message.records.rows() if isinstance(message, Step) else []:
                if on_record is not None:
                    on_record(rec)
                if rec.finished:
                    got[rec.request_id] = rec
        return got

    def close(self) -> None:
        self.gate.set()
        self.conn.send([Shutdown()])
        self.thread.join(10)


def test_adds_over_the_queue_wait_in_the_core_instead_of_failing(tiny_model_dir):
    """Two adds arrive in one batch while the scheduler's queue has room for one (max_waiting=1): the
    replica admitted both (capacity 2 running + 1 waiting), so both must run, none may fail."""
    core = InProcessCore(tiny_model_dir, max_num_seqs=2, max_waiting=1)
    try:
        params = SamplingParams(max_tokens=6, **GREEDY)
        core.conn.send(
            [
                Add("a", [11, 12, 13, 14], params, time.time()),
                Add("b", [21, 22, 23], params, time.time()),
            ]
        )
        core.gate.set()
        finals = core.finals({"a", "b"})
        assert {rid: rec.samples[-1].finish_reason for rid, rec in finals.items()} == {
            "a": "length",
            "b": "length",
        }
    finally:
        core.close()


def test_abort_of_a_request_still_queued_in_the_core(tiny_model_dir):
    core = InProcessCore(tiny_model_dir, max_num_seqs=1, max_waiting=1)
    try:
        params = SamplingParams(max_tokens=200, **GREEDY)
        adds = [Add(rid, [5, 6, 7], params, time.time()) for rid in "abc"]
        core.conn.send(adds + [Abort("c")])  # c never reached the engine's queue
        core.gate.set()
        assert core.finals({"c"})["c"].samples[0].finish_reason == "abort"
        core.conn.send([Abort("a"), Abort("b")])
        assert {r.samples[0].finish_reason for r in core.finals({"a", "b"}).values()} == {"abort"}
        wait_for(lambda: not core.engine.has_unfinished(), what="idle")
        assert core.engine.block_manager.num_used == 0 and core.core.stats()["num_aborts"] == 3
    finally:
        core.close()


def test_a_dying_loop_tells_the_replica_why(tiny_model_dir):
    core = InProcessCore(tiny_model_dir, fault_injection=True)
    core.gate.set()
    prompt = core.engine.tokenizer.encode("__fault:loop__ go")
    core.conn.send([Add("x", prompt, SamplingParams(max_tokens=4), time.time())])
    core.thread.join(30)
    messages = []
    while core.conn.poll(0.5):
        messages.append(core.conn.recv())
    assert isinstance(messages[-1], Dead) and "injected fault at loop" in messages[-1].error


def test_pace_log_shows_waiting_requests_and_why(tiny_model_dir, monkeypatch, caplog):
    """MINSERVE_PACE_LOG_S: the core logs its scheduler's pace. Three requests and one seat: while one
    runs the other two wait, admission stops on seats, and the line says so."""
    monkeypatch.setenv("MINSERVE_PACE_LOG_S", "0.02")
    caplog.set_level("INFO", logger="engine.core.pace")
    core = InProcessCore(tiny_model_dir, max_num_seqs=1)
    try:
        params = SamplingParams(max_tokens=40, **GREEDY)
        core.conn.send([Add(rid, [5, 6, 7], params, time.time()) for rid in "abc"])
        core.gate.set()
        core.finals({"a", "b", "c"})
    finally:
        core.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.core.pace"]
    assert lines, "no pace line in a run of about 120 steps"
    assert any("running 1 (min 1, max 1)" in s and "seats" in s and "waiting 0.0" not in s for s in lines)


def test_pace_log_arithmetic_and_setting():
    """The line's figures from a fake clock and scheduler; the setting's parsing and its error."""
    from types import SimpleNamespace

    from engine.core.pace_log import PaceLog

    now = [0.0]
    pace = PaceLog(1.0, clock=lambda: now[0])
    sched = SimpleNamespace(running=[0] * 4, waiting=[0] * 2, admit_stop="budget")
    for i in range(1, 5):  # steps at 0.25 s intervals: the fourth closes the interval
        now[0] = 0.25 * i
        sched.admit_stop = "budget" if i < 3 else None
        line = pace.step(sched)
    assert line == (
        "pace: 4 steps/s; running 4 (min 4, max 4); waiting 2.0 (max 2); steps leaving some waiting: budget 2"
    )
    sched.running = [0]
    now[0] = 1.5
    assert pace.step(sched) is None  # half of the next interval
    now[0] = 2.0
    line = pace.step(sched)
    assert line == (
        "pace: 2 steps/s; running 1 (min 1, max 1); waiting 2.0 (max 2); steps leaving some waiting: none"
    )
    os.environ.pop("MINSERVE_PACE_LOG_S", None)
    assert PaceLog.from_env() is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINSERVE_PACE_LOG_S", "half")
        with pytest.raises(ValueError, match="MINSERVE_PACE_LOG_S='half'"):
            PaceLog.from_env()
        mp.setenv("MINSERVE_PACE_LOG_S", "0")
        assert PaceLog.from_env() is None
