"""Mixed steps through CUDA graphs on a GPU: prefill chunks beside decodes replay the token-count graphs
(engine/runner/cuda_graph.MixedGraphs), and give what the eager engine gives.

Each workload runs twice, eagerly and with graphs, with requests arriving in waves so that new prompts'
chunks share steps with running decodes. Graph and eager pad differently (the graph's decode kernel
splits its keys for the bucket's sequence count, eager's for the step's), so they agree within the
tolerance of test_gpu_engine.test_graph_and_eager_agree_in_bf16: all but two samples identical.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.structured_helpers import so

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def waves(engine: LLMEngine, requests, per_wave: int = 6, steps_between: int = 3) -> list[dict]:
    """Add `per_wave` requests, step `steps_between` times, repeat; then run to the end. Per request,
    per sample index, its token ids. Checks that nothing leaked."""
    ids, got = [], {}
    for start in range(0, len(requests), per_wave):
        for prompt, params in requests[start : start + per_wave]:
            ids.append(engine.add_request(prompt, params))
            got[ids[-1]] = {}
        for _ in range(steps_between):
            _collect(engine.step(), got)
    while engine.has_unfinished():
        _collect(engine.step(), got)
    assert engine.audit() == [] and engine.block_manager.num_used == 0
    return [got[i] for i in ids]


def _collect(outputs, got: dict) -> None:
    for out in outputs:
        for d in out.outputs:
            got[out.request_id].setdefault(d.index, []).extend(d.token_ids)


def both(model_dir, requests, **kw) -> tuple[list, list, LLMEngine]:
    """The workload eagerly and with graphs; returns both results and the graph engine."""
    results, engine = [], None
    kw.setdefault("num_blocks", 400)  # both engines fit beside each other, whatever the card
    for eager in (True, False):
        del engine
        engine = LLMEngine(EngineConfig.from_kwargs(
            str(model_dir), dtype="bfloat16", device="cuda", enforce_eager=eager, **kw
        ))  # fmt: skip
        results.append(waves(engine, requests))
    assert engine.runner.mixed_graphs.replays > 0, "no step replayed a mixed graph"
    return results[0], results[1], engine


def agree(eager: list, graph: list, slack: int = 2) -> None:
    samples = [(a.get(i), b.get(i)) for a, b in zip(eager, graph) for i in sorted(a)]
    differ = sum(x != y for x, y in samples)
    assert differ <= slack, f"graph and eager disagree on {differ} of {len(samples)} samples"


def test_chunked_prefill_prefix_hits_preemption_and_n(tiny_model_dir):
    rng = random.Random(5)
    shared = [rng.randrange(1500) for _ in range(48)]  # three full blocks every prompt starts with
    prompts = [shared + [rng.randrange(1500) for _ in range(rng.randint(1, 150))] for _ in range(30)]
    params = SamplingParams(n=2, max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    eager, graph, engine = both(
        tiny_model_dir, [(p, params) for p in prompts],
        max_num_batched_tokens=64, block_size=16, num_blocks=90, max_num_seqs=32,
    )  # fmt: skip
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    agree(eager, graph)


def test_speculative_steps(tiny_model_dir):
    rng = random.Random(6)
    base = [rng.randrange(100, 1500) for _ in range(40)]  # repeated: n-gram lookups match
    prompts = [base * 2 + [rng.randrange(100, 1500) for _ in range(rng.randint(1, 90))] for _ in range(18)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    eager, graph, engine = both(
        tiny_model_dir, [(p, params) for p in prompts], max_num_batched_tokens=128, speculative_config=spec
    )
    assert engine.get_stats()["spec_accepted_tokens"] > 0
    agree(eager, graph)


def test_structured_output_steps(tiny_model_dir):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rng = random.Random(8)
    requests = []
    for i in range(18):
        prompt = [rng.randrange(1500) for _ in range(rng.randint(5, 120))]
        structured = so("json", schema) if i % 2 else None
        requests.append((prompt, SamplingParams(max_tokens=24, temperature=0.0, structured=structured)))
    eager, graph, _ = both(tiny_model_dir, requests, max_num_batched_tokens=96)
    agree(eager, graph)
