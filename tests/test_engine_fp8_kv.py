"""The engine with kv_cache_dtype="fp8": what a naive recompute gives when it rounds K and V the same way.

The reference (tests/reference.py) recomputes every sequence from scratch with no cache at all, and
rounds each key and value through float8 e4m3 before attention reads them. The engine must match it
token for token and in log-probabilities, through prefix caching, chunked prefill and preemption, and
must differ measurably from the unrounded reference (so the fp8 cache is really in use).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.reference import NaiveGenerator

pytestmark = pytest.mark.engine
FP8 = torch.float8_e4m3fn


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="float64", device="cpu", **kw))


def _run(engine: LLMEngine, prompts, params) -> list[tuple[list[int], list[float]]]:
    ids = [engine.add_request(p, params) for p in prompts]
    got = {i: ([], []) for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            for d in out.outputs:
                got[out.request_id][0].extend(d.token_ids)
                got[out.request_id][1].extend(lp.logprob for lp in d.logprobs or [])
    assert engine.audit() == [] and engine.block_manager.num_used == 0
    return [got[i] for i in ids]


def _reference_logprobs(ref: NaiveGenerator, prompt: list[int], tokens: list[int]) -> list[float]:
    ids, out = list(prompt), []
    for t in tokens:
        out.append(float(torch.log_softmax(ref.next_logits(ids).double(), dim=-1)[t]))
        ids.append(t)
    return out


def test_fp8_cache_matches_recompute_with_rounded_kv(tiny_model_dir):
    rng = random.Random(7)
    shared = [rng.randrange(1500) for _ in range(40)]  # a common prefix: later prompts hit the cache
    prompts = [shared + [rng.randrange(1500) for _ in range(rng.randint(1, 60))] for _ in range(5)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    # 8-token chunks and a pool too small for all five at once: chunked prefill and preemption
    engine = _engine(tiny_model_dir, kv_cache_dtype="fp8", block_size=4, num_blocks=32,
                     max_num_batched_tokens=8, max_num_seqs=4)  # fmt: skip
    assert all(k.dtype == v.dtype == FP8 for k, v in engine.runner.kv_caches)
    got = _run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.prefix_hits > 0
    rounded = NaiveGenerator(tiny_model_dir, kv_dtype=FP8)
    exact = NaiveGenerator(tiny_model_dir)
    worst_exact = 0.0
    for prompt, (tokens, logprobs) in zip(prompts, got):
        assert tokens == rounded.greedy(prompt, 10)
        want = _reference_logprobs(rounded, prompt, tokens)
        torch.testing.assert_close(logprobs, want, atol=1e-6, rtol=0)
        exact_lp = _reference_logprobs(exact, prompt, tokens)
        worst_exact = max(worst_exact, max(abs(a - b) for a, b in zip(logprobs, exact_lp)))
    assert worst_exact > 1e-4, "the fp8 cache changed nothing: is kv_cache_dtype applied?"


def test_fp8_cache_holds_more_blocks_in_the_same_bytes(tiny_model_dir):
    sizes = {}
    for kv in ("auto", "fp8"):
        spec = _engine(tiny_model_dir, kv_cache_dtype=kv, cpu_kv_cache_bytes=2**22).runner.kv_spec
        sizes[kv] = spec.num_blocks
        assert spec.num_blocks * spec.bytes_per_block <= 2**22
    assert sizes["fp8"] == 8 * sizes["auto"]  # 1 byte per value against float64's 8


def test_bad_kv_cache_dtype_names_the_field(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype: must be auto or fp8"):
        EngineConfig.from_kwargs(str(tiny_model_dir), kv_cache_dtype="int4")
