"""Multi-LoRA through CUDA graphs on a GPU: decode graphs, mixed graphs (prefill chunks beside decodes)
and speculative verification graphs read each row's adapter slot from their static buffers, and give
what the eager engine gives (within test_gpu_mixed_graphs' bf16 slack), while the adapters still
change the output (a graph that ignored them would match the base model instead).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LoRARequest, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from scripts.make_lora import make_lora

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def loras(tiny_model_dir, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("gpu-loras")
    targets = ["all", "attn", "mlp"]
    paths = [
        make_lora(tiny_model_dir, root / f"g{i}", rank=8, targets=t, seed=i) for i, t in enumerate(targets)
    ]
    return [LoRARequest(f"g{i}", i + 1, str(path)) for i, path in enumerate(paths)]


def run(model_dir, requests, eager: bool, **kw) -> tuple[list, LLMEngine]:
    """Requests (prompt, params, lora) added in waves of 6, 3 steps apart; per request its tokens."""
    engine = LLMEngine(EngineConfig.from_kwargs(
        str(model_dir), dtype="bfloat16", device="cuda", enforce_eager=eager, num_blocks=400,
        enable_lora=True, max_loras=2, max_cpu_loras=3, **kw,
    ))  # fmt: skip
    ids, got = [], {}
    for start in range(0, len(requests), 6):
        for prompt, params, lora in requests[start : start + 6]:
            ids.append(engine.add_request(prompt, params, lora_request=lora))
            got[ids[-1]] = []
        for _ in range(3):
            _collect(engine.step(), got)
    while engine.has_unfinished():
        _collect(engine.step(), got)
    assert engine.audit() == [] and engine.block_manager.num_used == 0
    return [got[i] for i in ids], engine


def _collect(outputs, got: dict) -> None:
    for out in outputs:
        for d in out.outputs:
            got[out.request_id].extend(d.token_ids)


def workload(loras, seed: int, repeat: bool = False) -> list:
    rng = random.Random(seed)
    base = [rng.randrange(100, 1500) for _ in range(40)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out = []
    for i in range(24):
        tail = [rng.randrange(100, 1500) for _ in range(rng.randint(1, 120))]
        out.append(((base * 2 if repeat else []) + tail, params, [*loras, None][i % 4]))
    return out


def agree(eager: list, graph: list, slack: int = 2) -> None:
    differ = sum(a != b for a, b in zip(eager, graph, strict=True))
    assert differ <= slack, f"graph and eager disagree on {differ} of {len(eager)} requests"


@pytest.mark.parametrize("spec", [False, True])
def test_graphs_with_adapters_match_eager(tiny_model_dir, loras, spec):
    kw = dict(max_num_batched_tokens=128, max_num_seqs=32)
    if spec:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3}
    requests = workload(loras, 11 + spec, repeat=spec)
    eager, _ = run(tiny_model_dir, requests, True, **kw)
    graph, engine = run(tiny_model_dir, requests, False, **kw)
    runner = engine.runner
    assert runner.graphs is not None and runner.mixed_graphs is not None and runner.mixed_graphs.replays > 0
    assert runner.lora.slot_loads >= 3  # 3 adapters through 2 slots
    agree(eager, graph)
    base = [(p, s, None) for p, s, _ in requests]
    plain, _ = run(tiny_model_dir, base, False, **kw)
    with_lora = [i for i, r in enumerate(requests) if r[2] is not None]
    assert sum(graph[i] != plain[i] for i in with_lora) > len(with_lora) // 2  # the adapters act in graphs
