"""The engine on a GPU: Triton kernels and CUDA-graph decode give what the naive recompute gives."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.reference import NaiveGenerator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def run(engine: LLMEngine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            for d in out.outputs:
                got[out.request_id] += d.token_ids
    assert engine.audit() == [] and engine.block_manager.num_used == 0
    return [got[i] for i in ids]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gpu_greedy_matches_naive_recompute(tiny_model_dir, enforce_eager, kv_cache_dtype):
    """fp32 on the GPU: the paged Triton path (graphs or eager) against a cache-free recompute on CPU;
    with an fp8 cache, against a recompute that rounds K and V to fp8 the same way."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1500) for _ in range(rng.randint(1, 300))] for _ in range(24)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            str(tiny_model_dir),
            dtype="float32",
            device="cuda",
            enforce_eager=enforce_eager,
            max_num_batched_tokens=256,
            block_size=16,
            num_blocks=200,
            kv_cache_dtype=kv_cache_dtype,
        )
    )
    assert (engine.runner.graphs is None) == enforce_eager
    got = run(engine, prompts, params)
    if not enforce_eager:  # chunked prefill beside decodes: those steps replay the mixed graphs
        assert engine.runner.mixed_graphs.replays > 0
    fp8 = kv_cache_dtype == "fp8"
    ref = NaiveGenerator(tiny_model_dir, dtype=torch.float64, kv_dtype=torch.float8_e4m3fn if fp8 else None)
    mismatches = sum(g != ref.greedy(p, 16) for g, p in zip(got, prompts))
    assert mismatches <= 1, f"{mismatches} of {len(prompts)} sequences differ from the fp64 reference"


def test_graph_and_eager_agree_in_bf16(tiny_model_dir):
    rng = random.Random(1)
    prompts = [[rng.randrange(1500) for _ in range(rng.randint(5, 100))] for _ in range(40)]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    outs = []
    for eager in (True, False):
        engine = LLMEngine(
            EngineConfig.from_kwargs(
                str(tiny_model_dir), dtype="bfloat16", device="cuda", enforce_eager=eager, num_blocks=512
            )
        )
        outs.append(run(engine, prompts, params))
        del engine
    same = sum(a == b for a, b in zip(*outs))
    assert same >= len(prompts) - 2, f"graph and eager decode disagree on {len(prompts) - same} sequences"
