"""RequestOutputKind.FINAL_ONLY (what `LLM.generate` asks for): one output per request, at its end,
holding every token and the whole text, equal to what the per-step (DELTA) outputs of the same request
add up to; stop strings still cut the text where they appear."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.engine
KINDS = (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)


def _run(model_dir, kind: RequestOutputKind, params: list[dict]) -> tuple[dict, dict]:
    """Per request: (token ids, text, finish reasons) per sample, and how many outputs it got."""
    engine = LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="float64", device="cpu", seed=3))
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24]]
    for i, (prompt, kw) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, SamplingParams(output_kind=kind, **kw), request_id=f"r{i}")
    got: dict[str, dict] = {}
    counts: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + 1
            samples = got.setdefault(out.request_id, {})
            for d in out.outputs:
                ids, text, _ = samples.get(d.index, ([], "", None))
                samples[d.index] = (ids + d.token_ids, text + d.text, d.finish_reason)
    return got, counts


def test_one_final_output_equals_the_deltas_summed(tiny_model_dir):
    params = [
        dict(max_tokens=40, temperature=0.0, ignore_eos=True),
        dict(max_tokens=30, temperature=0.8, seed=5, n=3, ignore_eos=True),
        dict(max_tokens=25, temperature=0.0),
    ]
    (delta, delta_counts), (final, final_counts) = (_run(tiny_model_dir, k, params) for k in KINDS)
    assert final == delta
    assert final_counts == {rid: 1 for rid in delta}
    assert delta_counts["r0"] > 1  # the DELTA run really handed out per-step outputs
    assert len(final["r1"]) == 3 and all(len(s[0]) == 30 for s in final["r1"].values())


def test_a_stop_string_cuts_a_final_only_request_where_it_cuts_a_delta_one(tiny_model_dir):
    """The stop string is taken from the greedy text itself, so it does occur."""
    free = [dict(max_tokens=40, temperature=0.0, ignore_eos=True)] * 3
    text = _run(tiny_model_dir, RequestOutputKind.DELTA, free)[0]["r0"][0][1]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"a printable stop string from {text!r}"
    params = [dict(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])] + free[1:]
    (delta, _), (final, final_counts) = (_run(tiny_model_dir, k, params) for k in KINDS)
    assert final == delta
    assert final["r0"][0][2] == "stop" and final_counts["r0"] == 1
    assert len(final["r0"][0][0]) < 40


def test_output_kind_must_be_the_enum():
    with pytest.raises(InvalidRequestError, match="output_kind"):
        SamplingParams(output_kind="final")
