"""The matcher process (engine/structured/process.py, engine/structured/remote.py) against matchers advanced
on the host, and the engine's outputs with the matchers in a process against those with them on a
thread of the engine's own process."""

from __future__ import annotations

import os
import time

import pytest
import torch

from benchmarks.structured_cases import REGEXES, SCHEMAS
from engine.device import cpus
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.structured import process as grammar_process
from engine.structured.compiler import compiler_for
from engine.structured.process import GrammarProcessError
from engine.structured.remote import ProcessBitmaskFiller
from engine.structured.state import BitmaskFiller, GrammarError, GrammarState
from tests.structured_helpers import PROMPT, make_engine, run, so

pytest.importorskip("llguidance")
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return make_engine(tiny_model_dir, grammar_process=False)


def fillers(engine: LLMEngine) -> tuple[ProcessBitmaskFiller, BitmaskFiller]:
    vocab = engine.limits.vocab_size
    cpu = torch.device("cpu")
    return ProcessBitmaskFiller(vocab, cpu, max_rows=8), BitmaskFiller(vocab, cpu)


def test_remote_masks_equal_masks_of_matchers_advanced_on_the_host(engine):
    compiler = compiler_for(engine.tokenizer, engine.limits.vocab_size)
    constraint = so("regex", "(ab|cd)[0-9]{3}x")
    texts = ["ab123x", "cd9", "ab", "cd45"]
    tokens = [compiler.ll_tokenizer.tokenize_str(t) for t in texts]
    remote_filler, host_filler = fillers(engine)
    remote = [remote_filler.new_state(constraint, compiler) for _ in texts]
    host = [GrammarState.start(compiler.prototype(constraint)) for _ in texts]
    for step in range(max(map(len, tokens))):
        live = [i for i, t in enumerate(tokens) if step < len(t)]
        for i in live:
            remote[i].push(tokens[i][step])
            host[i].advance(tokens[i][step])
        got = remote_filler.start([remote[i] for i in live])()
        assert torch.equal(got, host_filler.fill([host[i] for i in live])), step
    assert [s.num_consumed for s in remote] == [len(t) for t in tokens] and not any(s.pending for s in remote)
    bad = remote_filler.new_state(constraint, compiler)
    bad.push(compiler.ll_tokenizer.tokenize_str("zz")[0])
    mask = remote_filler.start([bad, remote[1]])()
    allowed = [t for t in range(engine.limits.vocab_size) if mask[0, t // 32] >> (t % 32) & 1]
    assert bad.error and set(allowed) <= set(engine.tokenizer.eos_token_ids)
    assert remote[1].error is None
    with pytest.raises(GrammarError, match="refused"):
        bad.check()


def test_remote_fork_and_rollback_follow_host_matchers(engine):
    compiler = compiler_for(engine.tokenizer, engine.limits.vocab_size)
    constraint = so("regex", "ab(c|d)e[0-9]{2}")
    ids = compiler.ll_tokenizer.tokenize_str("abd")
    remote_filler, host_filler = fillers(engine)
    state = remote_filler.new_state(constraint, compiler)
    for t in ids:
        state.push(t)
        remote_filler.start([state])()
    child = state.fork()
    state.rollback(1)  # consumed in the child: a rollback operation
    state.push(ids[-1])
    state.push(ids[-1])
    state.rollback(1)  # pending: dropped on this side
    twins = [GrammarState.start(compiler.prototype(constraint)) for _ in range(2)]
    for t in ids:
        twins[0].advance(t)
        twins[1].advance(t)
    assert torch.equal(remote_filler.start([state, child])(), host_filler.fill(twins))
    assert state.num_tokens == child.num_tokens == len(ids)
    with pytest.raises(ValueError):
        child.rollback(len(ids) + 1)


def test_released_and_dropped_states_are_freed_in_the_child(engine):
    compiler = compiler_for(engine.tokenizer, engine.limits.vocab_size)
    remote_filler, host_filler = fillers(engine)
    constraint = so("regex", "[a-z]{4}")
    dropped, released, kept = (remote_filler.new_state(constraint, compiler) for _ in range(3))
    slots = dropped.slot, released.slot
    del dropped
    released.release()
    released.release()  # once only
    assert [op for op in remote_filler.service.ops if op[0] == "free"] == [("free", s) for s in slots]
    # a state released after its step was scheduled (an abort) still rides in that step's fill
    got = remote_filler.start([released, kept])()
    expected = host_filler.fill([GrammarState.start(compiler.prototype(constraint))])
    assert torch.equal(got[1], expected[0])


def test_retired_requests_free_their_matchers(tiny_model_dir, monkeypatch):
    """A request and its sequences form a reference cycle, so the engine releases matchers when a
    request retires rather than waiting for the cyclic collector."""
    made = []
    new_state = ProcessBitmaskFiller.new_state
    monkeypatch.setattr(ProcessBitmaskFiller, "new_state", lambda *a: made.append(new_state(*a)) or made[-1])
    eng = make_engine(tiny_model_dir, grammar_process=True)
    run(eng, requests(seed=3))
    assert len(made) == 11 and all(state.slot is None for state in made)


def test_split_cpus_gives_the_child_whole_cores_and_is_stable(monkeypatch):
    """16 CPUs as 8 cores of two hyperthreads (i, i + 8): the child gets whole cores at the end, a
    second engine's child the same ones, and the calling thread is never pinned."""
    monkeypatch.setattr(cpus, "ALLOWED", frozenset(range(16)))
    pinned = []
    monkeypatch.setattr(grammar_process.os, "sched_setaffinity", lambda pid, cpus: pinned.append(set(cpus)))
    topology = "/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"
    siblings = {topology.format(c): f"{c % 8},{c % 8 + 8}" for c in range(16)}
    monkeypatch.setattr(cpus.Path, "read_text", lambda self: siblings[str(self)])
    assert grammar_process.split_cpus(2) == grammar_process.split_cpus(2) == [6, 7, 14, 15]
    assert grammar_process.split_cpus(64) == [4, 5, 6, 7, 12, 13, 14, 15]  # at most half the cores
    assert pinned == []
    assert cpus.last_cores(1, skip=2) == [5, 13]  # a tensor-parallel worker (engine/runner/tp_group.py)
    monkeypatch.setattr(cpus, "ALLOWED", frozenset(range(3)))
    assert grammar_process.split_cpus(2) is None  # under four cores: nothing pinned


def test_a_dead_grammar_process_gives_a_clear_error(engine):
    compiler = compiler_for(engine.tokenizer, engine.limits.vocab_size)
    remote_filler, _ = fillers(engine)
    states = [remote_filler.new_state(so("regex", "[a-z]{8}"), compiler) for _ in range(2)]
    remote_filler.start(states)()
    assert not any(name.startswith("minserve-grammar-") for name in os.listdir("/dev/shm"))
    remote_filler.service._proc.kill()
    remote_filler.service._proc.wait()
    time.sleep(0.05)
    with pytest.raises(GrammarProcessError, match="exited|gone"):
        remote_filler.start(states)()


def requests(seed: int) -> list[tuple[str, SamplingParams]]:
    cases = [so("json", s) for s in SCHEMAS[:6]] + [so("regex", r) for r in REGEXES[:4]]
    reqs = [
        (f"{PROMPT} {i}", SamplingParams(max_tokens=60, temperature=1.0, seed=seed + i, structured=c))
        for i, c in enumerate(cases)
    ]
    forked = SamplingParams(max_tokens=60, temperature=1.0, seed=seed, n=3, structured=so("json", SCHEMAS[2]))
    plain = SamplingParams(max_tokens=40, temperature=1.0, seed=seed + 99)
    return reqs + [(PROMPT, forked), (PROMPT + " free text", plain)]


@pytest.mark.parametrize("kw", [{}, {"block_size": 4, "num_blocks": 48}, {"async_scheduling": False}])
def test_the_process_and_the_thread_give_the_same_run(tiny_model_dir, engine, kw):
    """Seeded sampling at temperature 1: only identical masks give identical tokens. With a small pool
    the requests are preempted and recomputed; n=3 forks the matcher."""
    in_process = make_engine(tiny_model_dir, grammar_process=True, **kw)
    on_thread = engine if not kw else make_engine(tiny_model_dir, grammar_process=False, **kw)
    reqs = requests(seed=7)
    got = run(in_process, reqs)
    assert got == run(on_thread, reqs)
    assert isinstance(in_process.runner.bitmasks, ProcessBitmaskFiller)
    assert sum(r == "stop" for out in got for _, _, r in out.values()) >= len(got) // 2
    if "num_blocks" in kw:
        assert in_process.scheduler.num_preemptions > 0, "the pool must be small enough to preempt"


def test_a_failed_job_raises_at_its_wait_and_the_next_job_works(engine):
    compiler = compiler_for(engine.tokenizer, engine.limits.vocab_size)
    remote_filler, host_filler = fillers(engine)
    constraint = so("regex", "[a-z]{8}")
    state = remote_filler.new_state(constraint, compiler)
    expected = host_filler.fill([GrammarState.start(compiler.prototype(constraint))])
    remote_filler.service.submit(0, [10**9], [], [])  # a slot the child never made
    with pytest.raises(GrammarProcessError, match="KeyError"):
        remote_filler.service.wait()
    assert torch.equal(remote_filler.start([state])(), expected)


def test_the_mask_buffer_leaves_a_small_dev_shm_alone(tmp_path, monkeypatch):
    """A container's /dev/shm (64 MiB by default) may be too small for 1024 rows of a 262k vocabulary;
    a full tmpfs would kill the child with SIGBUS, so the buffer goes to the temporary directory."""
    free = {"bytes": 64 << 20}
    real = grammar_process.os.statvfs

    def statvfs(path):
        if path != str(tmp_path):
            return real(path)
        return type("S", (), {"f_bavail": free["bytes"] // 4096, "f_frsize": 4096})()

    monkeypatch.setattr(grammar_process.os, "statvfs", statvfs)
    assert grammar_process.buffer_dir(16 << 20, shm=str(tmp_path)) == str(tmp_path)
    assert grammar_process.buffer_dir(2 * 1024 * 8192 * 4, shm=str(tmp_path)) is None
    assert grammar_process.buffer_dir(1, shm=str(tmp_path / "missing")) is None
