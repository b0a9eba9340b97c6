"""Shared by the structured-output engine tests: engines on the tiny model, constraints, and a run
that collects every sample's tokens, text and finish reason."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, StructuredOutput

PROMPT = "Answer in the requested format:"


def make_engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="float32", device="cpu", **kw))


def so(kind: str, spec=None) -> StructuredOutput:
    return StructuredOutput(kind, spec, field="response_format")


def run(engine: LLMEngine, requests: list[tuple[object, SamplingParams]]) -> list[dict[int, tuple]]:
    """Per request, per sample: (token ids, text, finish reason). Checks that nothing leaked."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    got: dict[str, dict[int, list]] = {rid: {} for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            for d in out.outputs:
                s = got[out.request_id].setdefault(d.index, [[], "", None])
                s[0] += d.token_ids
                s[1] += d.text
                s[2] = d.finish_reason or s[2]
    assert engine.audit() == [] and engine.block_manager.num_used == 0
    return [{i: tuple(s) for i, s in got[rid].items()} for rid in ids]
