"""The real server (Ray Serve, serve_config.yaml, tiny model) through the official openai client and raw HTTP.

The server is the one shared with tests/test_clients.py and tests/test_serving_tools.py (conftest).
Greedy outputs are checked against the offline engine (`engine.LLM`) run in this process; streaming
against non-streaming; SSE framing and error bodies byte by byte; disconnects against the engine's KV
block count.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from engine.sampling_params import SamplingParams
from tests.serving_fixtures import ROOT, Server, wait_idle

# Ray Serve's own pydantic models warn on import; not ours to fix.
pytestmark = [pytest.mark.serving, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
PROMPT = "The quick brown fox jumps over the lazy dog"


# `server` and `client` come from tests/conftest.py: the shared server, whose stop checks that
# serve.shutdown() leaves no engine core behind, and the openai client on it.


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Greedy generations of the offline engine, the reference for the server's output."""
    from engine import LLM

    llm = LLM(str(tiny_model_dir))

    def generate(prompt, max_tokens: int) -> str:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return llm.generate(prompt, params)[0].outputs[0].text

    return generate


def _events(raw: bytes) -> list[str]:
    """Split an SSE body into its events; each must be a single `data: ...` line."""
    text = raw.decode()
    assert text.endswith("\n\n"), f"stream does not end with a blank line: {text[-40:]!r}"
    events = text[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, f"bad SSE event {event!r}"
    return [e[len("data: ") :] for e in events]


def _post(server: Server, path: str, body: dict | bytes) -> httpx.Response:
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    return httpx.post(f"{server.url}{path}", timeout=60, **kwargs)


def _assert_error(
    resp: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# ---------------------------------------------------------------- happy paths


def test_health_and_models(server: Server, client: openai.OpenAI, tiny_model_dir):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [server.model] == [tiny_model_dir.name]


def test_completions_match_offline_engine(server, client, reference):
    expected = reference(PROMPT, 12)
    full = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].text == expected
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0

    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == expected
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_matches_offline_engine(server, client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    expected = reference(messages, 10)
    full = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == expected
    assert full.usage.completion_tokens == 10

    stream = list(
        client.chat.completions.create(
            model=server.model,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    assert stream[-1].choices[0].finish_reason == "length"


def test_greedy_and_seeded_outputs_equal_the_offline_engine(server, tiny_model_dir):
    """Concurrent requests, greedy and seeded (n=2), through HTTP: the same text as LLM.generate."""
    from engine import LLM

    prompts = ["Seven stones by the river", "The garden in winter", [5, 6, 7, 8, 9, 10]]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.0, seed=21, n=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=4, ignore_eos=True),
    ]
    expected = [[o.text for o in r.outputs] for r in LLM(str(tiny_model_dir)).generate(prompts, params)]
    bodies = [
        {"model": server.model, "prompt": p, "max_tokens": sp.max_tokens, "temperature": sp.temperature,
         "top_p": sp.top_p, "seed": sp.seed, "n": sp.n, "ignore_eos": True, "stream": stream}
        for p, sp in zip(prompts, params) for stream in (False, True)
    ]  # fmt: skip

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))

    for i, resp in enumerate(asyncio.run(together())):
        want = expected[i // 2]
        if bodies[i]["stream"]:
            texts = [""] * len(want)
            for event in _events(resp.content)[:-1]:
                for choice in json.loads(event)["choices"]:
                    texts[choice["index"]] += choice["text"]
        else:
            texts = [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]
        assert texts == want, (bodies[i], texts, want)


def test_the_engine_runs_in_a_process_of_its_own(server):
    stats = httpx.get(f"{server.url}/v1/engine/stats").json()
    replica, core = stats["pid"], stats["core_pid"]
    assert core != replica
    cmdline = open(f"/proc/{core}/cmdline", "rb").read().split(b"\0")
    assert b"engine.core.process" in cmdline
    parent = int(open(f"/proc/{core}/stat").read().rsplit(") ", 1)[1].split()[1])
    assert parent == replica  # started and owned by the replica


def test_one_log_line_per_request_shows_within_seconds(server, client):
    """Serve's throughput mode buffers replica logs by 1000 records; the replica writes them out every
    stats interval, so a finished request's one INFO line, with its timings, is in the log at once."""
    done = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0.0)
    pattern = re.compile(
        rf"request {re.escape(done.id)}\S* length: prompt \d+, completion 3, cached \d+ tokens; "
        r"in ingress [\d.]+ ms, to replica [\d.]+ ms, to core [\d.]+ ms, queue [\d.]+ ms, "
        r"engine ttft [\d.]+ ms, ttft [\d.]+ ms, e2e [\d.]+ ms"
    )
    logs = f"{server.session_dir}/logs/serve"
    deadline = time.monotonic() + 5
    while True:
        text = "".join(open(f"{logs}/{n}").read() for n in os.listdir(logs) if "EngineDeployment" in n)
        if len(pattern.findall(text)) == 1:
            break
        assert time.monotonic() < deadline, f"no log line for {done.id} in {logs} after 5 s"
        time.sleep(0.2)


def test_raw_sse_framing(server):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 6, "stream": True, "ignore_eos": True}
    resp = _post(server, "/v1/completions", body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = _events(resp.content)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_samples_and_prompt_lists(server, client):
    out = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 16
    assert out.choices[0].text != out.choices[1].text  # two samples, not one copied

    ids = [[5, 6, 7, 8], [9, 10, 11]]  # a list of token-id prompts: one choice per prompt and sample
    out = client.completions.create(
        model=server.model, prompt=ids, n=2, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 12

    stream = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    finished = {ch.index: ch.finish_reason for c in stream for ch in c.choices if ch.finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_stop_string(server, client):
    text = (
        client.completions.create(
            model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_seed_reproducibility(server, client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=server.model,
                prompt=PROMPT,
                max_tokens=16,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_logprobs_shapes(server, client):
    out = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy: chosen is best

    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)


def _forced_suppress(llm, prompt: str, max_tokens: int) -> tuple[int, str]:
    """(index, text) of the first token of the greedy output whose text encodes back to that token
    first: budget forcing can suppress it (it compares the sampled id with its suppress string's first)."""
    tok = llm.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, t in enumerate(llm.generate(prompt, params)[0].outputs[0].token_ids):
        text = tok.decode([t])
        if tok.encode(text, add_special_tokens=False)[:1] == [t]:
            return i, text
    raise AssertionError(f"no suppressible token in the first {max_tokens} greedy tokens")


def test_extension_fields_reach_the_engine(server, tiny_model_dir):
    """The extensions are mapped onto SamplingParams: budget forcing changes the server's text exactly
    as it changes the offline engine's (the effects' details are tested in the engine tests)."""
    from engine import LLM
    from engine.sampling_params import BudgetForcing

    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    plain = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    calc = _post(server, "/v1/completions", {**body, "tools_calculator": True})
    assert calc.status_code == 200 and calc.json()["choices"][0]["text"] == plain  # no tool call: same text
    llm = LLM(str(tiny_model_dir))
    at, suppress = _forced_suppress(llm, PROMPT, 16)  # greedy samples `suppress` as output token `at`
    forcing = {"suppress": suppress, "replacements": [" Wait"], "min_tokens": at + 2}
    greedy = dict(max_tokens=at + 6, temperature=0.0, ignore_eos=True)
    unforced = llm.generate(PROMPT, SamplingParams(**greedy))[0].outputs[0].text
    (want,) = llm.generate(PROMPT, SamplingParams(**greedy, budget_forcing=BudgetForcing(**forcing)))
    assert " Wait" in want.outputs[0].text and want.outputs[0].text != unforced  # the forcing bites
    forced = _post(server, "/v1/completions", {**body, "max_tokens": at + 6, "budget_forcing": forcing})
    assert forced.status_code == 200 and forced.json()["choices"][0]["text"] == want.outputs[0].text
    bad = {**body, "budget_forcing": {"suppress": "x", "replacements": [], "min_tokens": 1}}
    _assert_error(_post(server, "/v1/completions", bad), 422, param="budget_forcing.replacements")
    bad = {**body, "budget_forcing": {"suppress": "x", "replacement": ["y"]}}  # misspelt nested field
    _assert_error(_post(server, "/v1/completions", bad), 422, param="budget_forcing")


# ---------------------------------------------------------------- errors


def test_error_malformed_json_and_unknown_fields(server):
    _assert_error(
        _post(server, "/v1/completions", b'{"model": "any", "prompt": "Hel'), 400, code="invalid_json"
    )
    body = {"model": server.model, "prompt": "x", "max_tokens": 2, "temprature": 0.5}
    assert (
        "temprature"
        in _assert_error(_post(server, "/v1/completions", body), 422, param="temprature")["message"]
    )
    body = {"model": server.model, "prompt": "x", "max_tokens": "many"}
    _assert_error(_post(server, "/v1/completions", body), 422, param="max_tokens")
    body = {"model": server.model, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    _assert_error(_post(server, "/v1/chat/completions", body), 422, param="top_logprobs")
    _assert_error(httpx.get(f"{server.url}/v1/nope"), 404)


def test_error_invalid_value_unknown_model_and_long_prompt(server, client):
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.completions.create(model=server.model, prompt="x", temperature=-1)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-nope", prompt="x")
    assert err.value.body["code"] == "model_not_found"

    max_len = client.models.list().data[0].model_extra["max_model_len"]
    for stream in (False, True):  # also a streaming request is refused before any stream byte
        body = {"model": server.model, "prompt": [7] * max_len, "max_tokens": 4, "stream": stream}
        _assert_error(_post(server, "/v1/completions", body), 400, code="context_length_exceeded")


def test_failure_during_generation_ends_with_one_error_event(server):
    body = {"model": server.model, "prompt": "__fault:sample__ go", "max_tokens": 8, "stream": True}
    resp = _post(server, "/v1/completions", body)
    assert resp.status_code == 200  # accepted: the failure happens inside the engine, after the headers
    events = _events(resp.content)
    assert "[DONE]" not in events
    errors = [json.loads(e) for e in events if "error" in json.loads(e)]
    assert len(errors) == 1 and events[-1] == json.dumps(errors[0], separators=(",", ":"))
    assert errors[0]["error"]["type"] == "server_error"

    resp = _post(server, "/v1/completions", {**body, "stream": False})
    _assert_error(resp, 500, code="generation_error")
    assert wait_idle(server.url)["kv_blocks_used"] == 0


def test_overload_is_503_before_any_stream_byte(server):
    limit = httpx.get(f"{server.url}/v1/engine/stats").json()["max_ongoing_requests"]
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(limit)]
            opened = await asyncio.gather(*(s.__aenter__() for s in streams))
            try:
                assert [r.status_code for r in opened] == [200] * limit
                extra = await http.post("/v1/completions", json=body)
                await extra.aread()
                return extra
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)

    extra = asyncio.run(scenario())
    error = _assert_error(extra, 503, code="queue_full")
    assert extra.headers["retry-after"] == "1" and "max_ongoing_requests" in error["message"]
    stats = wait_idle(server.url)
    assert stats["kv_blocks_used"] == 0 and stats["ongoing_requests"] == 0


def _read_then_disconnect(server: Server, events: int) -> None:
    body = {
        "model": server.model,
        "prompt": PROMPT * 20,
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        data = (line for line in r.iter_lines() if line)
        assert all(next(data).startswith("data: {") for _ in range(events))
        # tokens arrived: the request holds KV blocks until the engine sees the abort
        assert httpx.get(f"{server.url}/v1/engine/stats").json()["kv_blocks_used"] > 0


def test_client_disconnect_frees_kv_blocks(server):
    aborts_before = httpx.get(f"{server.url}/v1/engine/stats").json()["num_aborts"]
    _read_then_disconnect(server, events=3)
    stats = wait_idle(server.url)
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    assert stats["num_aborts"] == aborts_before + 1
    assert httpx.get(f"{server.url}/v1/engine/audit").json() == {"problems": []}


# ---------------------------------------------------------------- observability and load


def test_metrics_at_ray_metrics_port(server):
    # make every required series non-empty: a finished request, an engine error and an abort
    _post(server, "/v1/completions", {"model": server.model, "prompt": "__fault:sample__", "max_tokens": 2})
    _read_then_disconnect(server, events=1)
    required = [
        "ray_minserve_time_to_first_token_seconds_bucket",
        "ray_minserve_inter_token_latency_seconds_bucket",
        "ray_minserve_e2e_request_latency_seconds_bucket",
        "ray_minserve_queue_time_seconds_bucket",
        "ray_minserve_prompt_tokens_total",
        "ray_minserve_generation_tokens_total",
        "ray_minserve_aborts_total",
        "ray_minserve_errors_total",
        "ray_minserve_num_running",
        "ray_minserve_num_waiting",
        "ray_minserve_kv_blocks_used",
        "ray_minserve_kv_blocks_total",
        "ray_minserve_prefix_cache_hit_rate",
    ]  # preemptions_total appears once a preemption happened (Ray exports no zero-valued counters)
    deadline, missing = time.monotonic() + 30, required
    while missing and time.monotonic() < deadline:
        text = httpx.get(server.metrics_url, timeout=10).text
        names = set(re.findall(r"^(ray_minserve_\w+)\{", text, re.M))
        missing = [m for m in required if m not in names]
        time.sleep(1)
    assert not missing, f"not exported: {missing}"
    tokens = re.search(
        rf'^ray_minserve_generation_tokens_total\{{[^}}]*model="{server.model}"[^}}]*\}} (\S+)', text, re.M
    )
    assert tokens and float(tokens.group(1)) > 0
    # TTFT ends where a client's does, so the ingress observes it; the engine's own TTFT is the replica's
    deployments = {
        name: set(re.findall(rf'^ray_{name}_count\{{[^}}]*deployment="(\w+)"', text, re.M))
        for name in ("minserve_time_to_first_token_seconds", "minserve_engine_time_to_first_token_seconds")
    }
    assert deployments == {
        "minserve_time_to_first_token_seconds": {"Ingress"},
        "minserve_engine_time_to_first_token_seconds": {"EngineDeployment"},
    }, deployments


@pytest.mark.slow
def test_locust_headless_w2_and_w4(server, tmp_path):
    """Locust headless against the real server: W2 with some W4 conversations (which resend each answer
    as the ids the server returned) and a short think time; every timing row, no failure."""
    prefix = tmp_path / "w2"
    env = {**os.environ, "MINSERVE_WORKLOAD": "W2:3,W4:1", "MINSERVE_GEN_SCALE": "0.125",
           "MINSERVE_THINK_TIME": "0.05"}  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        "loadtests/",
        "--host",
        server.url,
        "--headless",
        "-u",
        "16",
        "-r",
        "16",
        "-t",
        "30s",
        "--csv",
        str(prefix),
        "--only-summary",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(f"{prefix}_stats.csv")))
    by_type = {r["Type"]: r for r in rows if r["Name"] == "W2 /v1/completions"}
    assert {"POST", "TTFT", "ITL", "E2E"} <= set(by_type)
    assert int(by_type["TTFT"]["Request Count"]) > 16 and int(by_type["ITL"]["Request Count"]) > 100
    later = {r["Type"]: r for r in rows if r["Name"] == "W4 /v1/completions turn 2+"}
    assert {"POST", "TTFT", "E2E"} <= set(later) and int(later["POST"]["Request Count"]) > 0
    assert all(r["Failure Count"] == "0" for r in rows)


def test_killed_core_fails_health_ends_streams_and_replica_is_replaced(server):
    """Runs last: kill -9 of the engine core process. Open streams end with one error event, health
    fails, Serve replaces the replica (with a new core), and the server serves again."""
    stats = httpx.get(f"{server.url}/v1/engine/stats").json()
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}

    async def scenario() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:

            async def in_flight(started: asyncio.Event) -> list[str]:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    first = await lines.__anext__()
                    started.set()
                    return [first] + [line async for line in lines]

            flags = [asyncio.Event() for _ in range(2)]
            tasks = [asyncio.create_task(in_flight(f)) for f in flags]
            await asyncio.gather(*(f.wait() for f in flags))
            os.kill(stats["core_pid"], signal.SIGKILL)
            return [[line[6:] for line in t if line] for t in await asyncio.gather(*tasks)]

    for events in asyncio.run(scenario()):
        assert "[DONE]" not in events and sum(e.startswith('{"error"') for e in events) == 1, events[-3:]
        assert "engine core process exited" in json.loads(events[-1])["error"]["message"]
    _assert_error(httpx.get(f"{server.url}/health", timeout=60), 503, code="engine_dead")
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.url}/health", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the replica with the dead core was not replaced"
        time.sleep(1)
    new = httpx.get(f"{server.url}/v1/engine/stats").json()
    assert new["pid"] != stats["pid"] and new["core_pid"] != stats["core_pid"]
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3}
    assert _post(server, "/v1/completions", body).json()["usage"]["completion_tokens"] == 3
