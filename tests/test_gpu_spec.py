"""Speculative decoding on a GPU: the CUDA-graph verify step (k + 1 queries per row through the varlen
attention kernel) and the draft model's graphs give, in float32, exactly the greedy text of plain
decoding (CUDA-graph decode through the decode kernel), and leak no KV block."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    base = [rng.randrange(100, 1500) for _ in range(64)]  # repeated: n-gram lookups match
    return [base * 2 + [rng.randrange(100, 1500) for _ in range(rng.randint(1, 64))] for _ in range(12)]


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> list[list[int]]:
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda", max_num_seqs=16, num_blocks=400)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    out = [r.outputs[0].token_ids for r in llm.generate(_prompts(), params)]
    assert llm.engine.runner.graphs is not None
    return out


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_matches_plain_decoding_on_gpu(tiny_model_dir, plain, method):
    spec = {"method": method, "num_speculative_tokens": 4 if method == "ngram" else 3}
    if method == "draft_model":
        spec["model"] = str(tiny_model_dir)
    llm = LLM(
        str(tiny_model_dir), dtype="float32", device="cuda", max_num_seqs=16, num_blocks=400,
        speculative_config=spec,
    )  # fmt: skip
    assert sorted(llm.engine.runner.graphs_by_q) == [1, spec["num_speculative_tokens"] + 1]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    got = [r.outputs[0].token_ids for r in llm.generate(_prompts(), params)]
    assert got == plain
    stats = llm.engine.get_stats()
    assert stats["spec_accepted_tokens"] > 0 and llm.engine.audit() == []
    if method == "draft_model":  # draft = target: every greedy proposal is accepted
        assert stats["spec_acceptance_rate"] == 1.0
