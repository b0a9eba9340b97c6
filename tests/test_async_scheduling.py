"""Async scheduling: a decode step launched before the previous step's tokens reach the host must
change nothing that a request sees, and must never leak a KV block."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.reference import NaiveGenerator

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return NaiveGenerator(tiny_model_dir)


def make_engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="float64", device="cpu", **kw))


def count_ahead(engine: LLMEngine) -> list[int]:
    """Wrap schedule_ahead; the returned list collects the batch size of every step scheduled ahead."""
    sizes: list[int] = []
    original = engine.scheduler.schedule_ahead

    def wrapped(prev, **kw):
        out = original(prev, **kw)
        if out is not None:
            sizes.append(len(out.chunks))
        return out

    engine.scheduler.schedule_ahead = wrapped
    return sizes


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    """Every sample's (token ids, text, finish reason, logprobs), keyed by request index."""
    ids = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(requests)]
    got: dict[str, list[list]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            for d in out.outputs:
                got[out.request_id].append((d.index, d.token_ids, d.text, d.finish_reason, d.logprobs))
    result = {}
    for rid, deltas in got.items():
        per_sample: dict[int, list] = {}
        for index, toks, text, reason, lps in deltas:
            s = per_sample.setdefault(index, [[], "", None, []])
            s[0] += toks
            s[1] += text
            s[2] = reason or s[2]
            s[3] += lps or []
        result[rid] = {i: tuple(s) for i, s in per_sample.items()}
    assert engine.audit() == [] and engine.block_manager.num_used == 0
    return result


def mixed_requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Requests that end at every kind of point: by length (1..30), on a stop id, on a stop string,
    on EOS; seeded sampling, logprobs, n > 1 and penalties (which never run ahead) among them."""
    rng = random.Random(7)
    reqs = []
    for i in range(14):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 60))]
        kind = i % 7
        params = dict(max_tokens=rng.randint(1, 30), temperature=0.0, ignore_eos=True)
        if kind == 1:
            params.update(temperature=0.9, top_p=0.9, seed=100 + i)
        elif kind == 2:
            params.update(logprobs=3)
        elif kind == 3:
            params.update(n=3, temperature=1.0, seed=5 + i)
        elif kind == 4:
            params.update(repetition_penalty=1.3, frequency_penalty=0.5)
        elif kind == 5:
            params.update(stop_token_ids=[rng.randrange(vocab) for _ in range(60)])
        elif kind == 6:
            params.update(stop=["e", "a"], ignore_eos=False)
        reqs.append((prompt, SamplingParams(**params)))
    return reqs


def test_async_scheduling_changes_no_output(tiny_model_dir):
    sync = make_engine(tiny_model_dir, async_scheduling=False)
    eng = make_engine(tiny_model_dir)
    vocab = eng.runner.model_config.vocab_size
    reqs = mixed_requests(vocab)
    ahead = count_ahead(eng)
    assert count_ahead(sync) == [] and run(sync, reqs) == run(eng, reqs)
    assert len(ahead) > 20 and max(ahead) >= 8, "the workload must exercise steps scheduled ahead"


def staggered(engine: LLMEngine, requests, every: int = 3) -> dict[str, list[int]]:
    """Add one request every `every` steps (so prompts arrive while others decode); each request's
    sample-0 token ids."""
    got: dict[str, list[int]] = {}
    pending, steps = list(enumerate(requests)), 0
    while pending or engine.has_unfinished():
        if pending and steps % every == 0:
            i, (prompt, params) = pending.pop(0)
            got[engine.add_request(prompt, params, request_id=f"r{i}")] = []
        steps += 1
        for out in engine.step():
            got[out.request_id] += [t for d in out.outputs if d.index == 0 for t in d.token_ids]
    assert engine.audit() == [] and engine.block_manager.num_used == 0
    return got


def test_mixed_steps_run_ahead_and_change_no_output(tiny_model_dir, reference):
    """Prompt chunks (a shared prefix among them, so prefix hits) and admissions ride in steps scheduled
    ahead beside fed-back decodes: greedy output equals a naive recompute, seeded output equals the
    synchronous engine's."""
    rng = random.Random(5)
    prefix = [rng.randrange(1000) for _ in range(40)]
    requests = []
    for i in range(12):
        prompt = (prefix if i % 2 else []) + [rng.randrange(1000) for _ in range(rng.randint(5, 90))]
        seeded = dict(temperature=0.8, top_p=0.95, seed=i) if i % 3 == 0 else dict(temperature=0.0)
        requests.append((prompt, SamplingParams(max_tokens=rng.randint(4, 20), ignore_eos=True, **seeded)))
    kw = dict(block_size=8, max_num_batched_tokens=48)
    eng, sync = make_engine(tiny_model_dir, **kw), make_engine(tiny_model_dir, async_scheduling=False, **kw)
    seen: list = []
    original = eng.scheduler.schedule_ahead
    eng.scheduler.schedule_ahead = lambda prev, **k: seen.append(original(prev, **k)) or seen[-1]
    got = staggered(eng, requests)
    assert got == staggered(sync, requests)
    for i, (prompt, params) in enumerate(requests):
        if params.greedy:
            assert got[f"r{i}"] == reference.greedy(prompt, params.max_tokens), i
    mixed = [o for o in seen if o is not None and o.prev_rows and any(c.num_tokens > 1 for c in o.chunks)]
    admitted = [o for o in seen if o is not None and any(c.start == 0 for c in o.chunks)]
    assert len(mixed) >= 10 and admitted, "prompt chunks and admissions must run ahead beside decodes"
    assert eng.block_manager.prefix_hits > 0


def test_async_scheduling_matches_a_naive_recompute_at_length_limits(tiny_model_dir, reference):
    """Sequences that run into max_tokens or max_model_len on the very step after a step launched ahead."""
    eng = make_engine(tiny_model_dir, max_model_len=48, block_size=4)
    ahead = count_ahead(eng)
    rng = random.Random(11)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(10, 40))] for _ in range(8)]
    reqs = [
        (p, SamplingParams(max_tokens=min(48 - len(p), 6 + i), temperature=0.0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    got = run(eng, reqs)
    for i, (p, sp) in enumerate(reqs):
        assert got[f"r{i}"][0][0] == reference.greedy(p, sp.max_tokens)
    assert ahead, "no step was scheduled ahead"


def test_abort_while_a_step_is_scheduled_ahead_frees_everything(tiny_model_dir, reference):
    eng = make_engine(tiny_model_dir, block_size=4)
    ahead = count_ahead(eng)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    keep, gone = eng.add_request(list(range(1, 30)), greedy), eng.add_request(list(range(5, 40)), greedy)
    tokens = []
    for _ in range(6):
        tokens += [
            t for out in eng.step() if out.request_id == keep for d in out.outputs for t in d.token_ids
        ]
    assert eng._ahead is not None and ahead, "a step should be in flight ahead"
    final = eng.abort(gone)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    while eng.has_unfinished():
        tokens += [t for out in eng.step() for d in out.outputs for t in d.token_ids]
    assert tokens == reference.greedy(list(range(1, 30)), 40)
    assert eng.block_manager.num_used == 0 and eng.audit() == []


def test_a_short_pool_falls_back_to_a_normal_schedule_that_preempts(tiny_model_dir, reference):
    """With too few free blocks the engine falls back to a normal schedule (which may preempt)."""
    eng = make_engine(tiny_model_dir, block_size=4, num_blocks=24)
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(10, 30))] for _ in range(6)]
    reqs = [(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for p in prompts]
    got = run(eng, reqs)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"][0][0] == reference.greedy(p, 12)
    assert eng.scheduler.num_preemptions > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_scheduling_on_the_gpu_with_cuda_graphs(tiny_model_dir, reference):
    """Ids fed back inside the graph's input buffer, and the pinned copy of sampled ids, on a real GPU:
    sequences of uneven lengths (rows die while a step is in flight) against a naive recompute."""
    eng = LLMEngine(
        EngineConfig.from_kwargs(str(tiny_model_dir), dtype="float32", device="cuda", num_blocks=400)
    )
    assert eng.runner.graphs is not None
    ahead = count_ahead(eng)
    rng = random.Random(4)
    prompts = [[rng.randrange(1500) for _ in range(rng.randint(1, 200))] for _ in range(24)]
    reqs = [
        (p, SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True)) for p in prompts
    ]
    got = run(eng, reqs)
    mismatches = sum(
        got[f"r{i}"][0][0] != reference.greedy(p, sp.max_tokens) for i, (p, sp) in enumerate(reqs)
    )
    assert mismatches <= 1, f"{mismatches} of {len(reqs)} sequences differ from the fp64 reference"
    assert len(ahead) > 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_steps_ahead_on_the_gpu_with_mixed_graphs(tiny_model_dir, reference):
    """Prompt chunks and admissions launched ahead beside fed-back decodes, through the mixed graphs'
    static buffers, against a naive recompute."""
    kw = dict(dtype="float32", device="cuda", num_blocks=400, block_size=16, max_num_batched_tokens=64)
    eng = LLMEngine(EngineConfig.from_kwargs(str(tiny_model_dir), **kw))
    assert eng.runner.mixed_graphs is not None
    seen: list = []
    original = eng.scheduler.schedule_ahead
    eng.scheduler.schedule_ahead = lambda prev, **k: seen.append(original(prev, **k)) or seen[-1]
    rng = random.Random(8)
    requests = [
        ([rng.randrange(1500) for _ in range(rng.randint(5, 150))],
         SamplingParams(max_tokens=rng.randint(4, 24), temperature=0.0, ignore_eos=True))
        for _ in range(16)
    ]  # fmt: skip
    got = staggered(eng, requests, every=2)
    mismatches = sum(got[f"r{i}"] != reference.greedy(p, sp.max_tokens) for i, (p, sp) in enumerate(requests))
    assert mismatches <= 1, f"{mismatches} of {len(requests)} sequences differ from the fp64 reference"
    mixed = [o for o in seen if o is not None and o.prev_rows and any(c.num_tokens > 1 for c in o.chunks)]
    assert len(mixed) >= 5 and eng.runner.mixed_graphs.replays >= len(mixed)


@pytest.mark.parametrize("kind", ["penalty", "budget_forcing"])
def test_host_token_requests_do_not_starve_next_to_requests_run_ahead(tiny_model_dir, kind):
    """A penalty row runs ahead with a late draw; a budget-forcing one never runs ahead (its next input
    may be forced). Either must progress every step, not wait until the sequences that run ahead end."""
    from engine.sampling_params import BudgetForcing

    eng = make_engine(tiny_model_dir)
    plain = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    extra = dict(repetition_penalty=1.3) if kind == "penalty" else dict(budget_forcing=BudgetForcing())
    slow = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **extra)
    for i in range(3):
        eng.add_request(list(range(5 + i, 20 + i)), plain, request_id=f"plain{i}")
    eng.add_request(list(range(30, 45)), slow, request_id="slow")
    ahead = count_ahead(eng)
    steps, finished_at = 0, {}
    while eng.has_unfinished():
        steps += 1
        finished_at.update({o.request_id: steps for o in eng.step() if o.finished})
    assert finished_at["slow"] <= 13, finished_at  # 1 prefill + 10 tokens (+ outputs trail a step)
    assert all(finished_at[f"plain{i}"] <= 63 for i in range(3)), finished_at
    assert len(ahead) > 30, "the plain requests (with the penalty one) run ahead"
