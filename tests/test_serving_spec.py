"""Speculative decoding through `serve run`'s path (issue 30): `speculative_config` under `args.engine`
of serve_config.yaml reaches the engine core, greedy completions through the official `openai` SDK
(streamed or not) equal the offline engine's without speculation, and the acceptance counters and
gauges reach Ray's Prometheus endpoint. The draft is the target itself, so greedy proposals are
always accepted and the counters must move."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.serving_fixtures import Server, start_server, stop_server

pytestmark = [pytest.mark.serving, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
PROMPTS = ["The quick brown fox", "Speculative decoding verifies", "one two one two one two"]


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Server:
    spec = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3}
    srv = start_server(tiny_model_dir, {"engine": {"speculative_config": spec}})
    yield srv
    stop_server()


@pytest.fixture(scope="module")
def plain_texts(tiny_model_dir) -> list[str]:
    llm = LLM(str(tiny_model_dir))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [r.outputs[0].text for r in llm.generate(PROMPTS, params)]


def test_greedy_completions_equal_plain_decoding(server, plain_texts):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    for prompt, want in zip(PROMPTS, plain_texts, strict=True):
        kw = {"model": server.model, "prompt": prompt, "max_tokens": 24, "temperature": 0.0}
        got = client.completions.create(**kw, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        assert got.usage.completion_tokens == 24
        chunks = client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want


def test_acceptance_reaches_prometheus(server, plain_texts):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=16, temperature=0.0)
    want = ("ray_minserve_spec_draft_tokens_total", "ray_minserve_spec_accepted_tokens_total",
            "ray_minserve_spec_acceptance_rate")  # fmt: skip
    deadline, values = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        text = httpx.get(server.metrics_url, timeout=10).text
        found = {n: re.search(rf"^{n}\{{[^}}]*\}} (\S+)", text, re.M) for n in want}
        values = {n: float(m.group(1)) for n, m in found.items() if m}
        if len(values) == len(want) and values[want[0]] > 0:
            break
        time.sleep(1)
    assert len(values) == len(want), f"not exported: {set(want) - set(values)}"
    assert values[want[0]] > 0 and values[want[1]] == values[want[0]]  # draft = target: all accepted
    assert values["ray_minserve_spec_acceptance_rate"] == 1.0
