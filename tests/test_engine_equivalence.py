"""The engine under random workloads must give every request exactly what a naive recompute gives."""

from __future__ import annotations

import os
import random

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.reference import NaiveGenerator

pytestmark = pytest.mark.engine
NUM_WORKLOADS = int(os.environ.get("EQUIV_WORKLOADS", "200"))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return NaiveGenerator(tiny_model_dir)


def make_engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="float64", device="cpu", **kw))


def random_workload(rng: random.Random, vocab: int):
    """A few requests with shared prefixes, random lengths, n up to 4 and random arrival steps."""
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(1, 200))] for _ in range(2)]
    requests = []
    for _ in range(rng.randint(1, 6)):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 100))]
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + prompt
        prompt = prompt[: rng.randint(1, 300)]
        params = SamplingParams(
            n=rng.randint(1, 4), max_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True
        )
        requests.append((rng.randint(0, 8), prompt, params))
    return requests


def run_workload(engine: LLMEngine, requests) -> dict[str, list[list[int]]]:
    """Add each request at its arrival step; every sample's token ids, keyed "r<index in requests>"."""
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    outputs: dict[str, list[list[int]]] = {
        f"r{i}": [[] for _ in range(r[2].n)] for i, r in enumerate(requests)
    }
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(prompt, params, request_id=f"r{i}")
        for out in engine.step():
            for d in out.outputs:
                outputs[out.request_id][d.index] += d.token_ids
        step += 1
        assert step < 5000, "engine made no progress"
    return outputs


def test_random_workloads_match_naive_recompute(tiny_model_dir, reference):
    rng = random.Random(1234)
    vocab = reference.config.vocab_size
    preempted = 0
    for w in range(NUM_WORKLOADS):
        block_size = rng.choice([4, 16])
        requests = random_workload(rng, vocab)
        # the largest single request must fit; the sum usually does not, which forces preemption
        need = max(-(-(len(p) + sp.max_tokens) // block_size) for _, p, sp in requests)
        engine = make_engine(
            tiny_model_dir,
            block_size=block_size,
            num_blocks=need + rng.randint(0, need),
            max_num_batched_tokens=rng.choice([16, 64, 512]),
            max_num_seqs=rng.choice([4, 8, 64]),
        )
        outputs = run_workload(engine, requests)
        for (_, prompt, params), (rid, samples) in zip(requests, outputs.items()):
            expected = reference.greedy(prompt, params.max_tokens)
            for i, got in enumerate(samples):
                assert got == expected, f"workload {w} request {rid} sample {i}"
        assert engine.audit() == [], f"workload {w}: {engine.audit()}"
        assert engine.block_manager.num_used == 0, f"workload {w}: blocks still held"
        preempted += engine.scheduler.num_preemptions
    assert preempted > 0, "no workload exercised preemption: shrink the pools"


def test_seeded_sampling_is_batch_independent(tiny_model_dir):
    params = SamplingParams(
        n=2,
        max_tokens=24,
        temperature=0.9,
        top_p=0.95,
        top_k=50,
        seed=7,
        ignore_eos=True,
        repetition_penalty=1.1,
        presence_penalty=0.2,
    )
    prompt = list(range(5, 40))
    alone = run_workload(make_engine(tiny_model_dir), [(0, prompt, params)])
    rng = random.Random(0)
    crowd = [
        (
            rng.randint(0, 5),
            [rng.randrange(500) for _ in range(rng.randint(5, 80))],
            SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True),
        )
        for _ in range(10)
    ]
    crowded = run_workload(
        make_engine(tiny_model_dir, num_blocks=40, block_size=4),
        crowd[:5] + [(2, prompt, params)] + crowd[5:],
    )
    (alone_samples,) = alone.values()
    assert list(crowded.values())[5] == alone_samples
    assert alone_samples[0] != alone_samples[1], "the n samples of a seeded request must differ"
