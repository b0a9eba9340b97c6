"""Hardening of the real server (Ray Serve, tiny model): access control, bad input, overload, KV
exhaustion, per-request faults, a disconnect storm, a short soak, and the engine loop dying.

One server for the module, configured for all of it at once (HARDENED): an API key, a small KV pool
(80 blocks of 16 tokens: the longest W2 request fits, eight long requests do not), 8 running + 8
waiting sequences, and fault injection. The last test kills the engine loop and waits for Serve to
replace the replica. Greedy outputs are checked against the offline engine (`engine.LLM`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings

from app.engine_client import RETRY_BUDGET_S
from engine.sampling_params import SamplingParams
from scripts import disconnect_storm, soak
from tests.hardening_support import OpenWatch, bad_cases, body_strategy
from tests.serving_fixtures import Server, start_server, stop_server, wait_idle

pytestmark = [pytest.mark.serving, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
API_KEY = "hardening-test-key"
HARDENED = {
    "api_key": API_KEY,
    "max_ongoing_requests": 64,  # above the engine's 8 + 8: the overload test meets the engine queue
    "default_max_tokens": 16,  # fuzzed chat requests without max_tokens stay short
    "engine": {"fault_injection": True, "num_blocks": 80, "max_num_seqs": 8, "max_waiting": 8},
}


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Server:
    srv = start_server(tiny_model_dir, HARDENED)
    yield srv
    stop_server()


@pytest.fixture(scope="module")
def http(server: Server) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Greedy texts of the offline engine (uncontended: the default KV pool holds all of them)."""
    from engine import LLM

    llm = LLM(str(tiny_model_dir))

    def generate(prompts: list, max_tokens: int) -> list[str]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [r.outputs[0].text for r in llm.generate(prompts, params)]

    return generate


def _error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text[:500]
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert param is None or error["param"] == param, error
    assert code is None or error["code"] == code, error
    return error


def _sse(raw: str) -> list[str]:
    return [line[len("data: ") :] for line in raw.split("\n\n") if line.startswith("data: ")]


# ---------------------------------------------------------------- access


def test_api_key_is_required_on_every_route(server, http):
    schema = http.get("/openapi.json").json()
    routes = [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops]
    routes += [("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/no/such/route")]
    assert ("POST", "/v1/completions") in routes and ("GET", "/health") in routes
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in routes:
            resp = httpx.request(method, f"{server.url}{path}", headers=headers, json={}, timeout=30)
            _error(resp, 401, code="invalid_api_key")
            assert resp.headers["www-authenticate"] == "Bearer"
    ok = httpx.get(f"{server.url}/health", headers={"authorization": f"bearer {API_KEY}"}, timeout=30)
    assert ok.json() == {"status": "ok"}

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    out = client.completions.create(
        model=server.model, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 3


def test_body_size_limit(server, http):
    big = b'{"model": "x", "prompt": "' + b"a" * 10_000_000 + b'"}'
    error = _error(
        http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413
    )
    assert error["code"] == "request_too_large" and "1048576" in error["message"]

    def chunked():  # no Content-Length: the limit applies while the body is read
        yield b'{"model": "x", "prompt": "'
        for _ in range(40):
            yield b"b" * 65536
        yield b'"}'

    resp = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    _error(resp, 413, code="request_too_large")
    # just below the limit the body is read and judged on its content (here: far too long a prompt)
    near = json.dumps({"model": server.model, "prompt": [7] * 320_000, "max_tokens": 1}).encode()
    assert 900_000 < len(near) < 1 << 20
    resp = http.post("/v1/completions", content=near, headers={"content-type": "application/json"})
    _error(resp, 400, code="context_length_exceeded")


def test_model_name_is_never_used_as_a_path(server, http, tmp_path):
    canary = tmp_path / "canary-model"
    canary.mkdir()
    (canary / "config.json").write_text("{}")
    watch = OpenWatch(canary)
    try:
        names = [
            "../../etc/passwd",
            str(canary),
            str(canary / "config.json"),
            "../" * 16 + str(canary).lstrip("/"),
            f"file://{canary}",
        ]
        for name in names:
            for stream in (False, True):
                body = {"model": name, "prompt": "hi", "max_tokens": 2, "stream": stream}
                _error(http.post("/v1/completions", json=body), 404, "model", "model_not_found")
                chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
                _error(http.post("/v1/chat/completions", json=chat), 404, "model", "model_not_found")
        assert watch.events() == []
        (canary / "config.json").read_text()  # the watch does see an open: this test can fail
        assert watch.events()
    finally:
        watch.close()


# ---------------------------------------------------------------- bad input


def test_bad_input_gets_a_clear_4xx_and_the_server_keeps_serving(server, http):
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    for path, body, status, param in bad_cases(server.model, max_len):
        for stream in (False, True):  # refused before any stream byte, too
            if stream and not (isinstance(body, dict) and "stream" not in body):
                continue  # raw bodies and the case about `stream` itself are sent once
            if isinstance(body, dict):
                resp = http.post(path, json={**body, "stream": True} if stream else body)
            else:
                resp = http.post(path, content=body, headers={"content-type": "application/json"})
            error = _error(resp, status, param)
            assert param is None or param.split(".")[0] in error["message"], error
    body = {"model": server.model, "prompt": "still here", "max_tokens": 4, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 4


def _fuzz(http: httpx.Client, path: str, bodies) -> None:
    @settings(
        max_examples=120,
        deadline=None,
        derandomize=True,  # the same examples every run
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies)
    def check(body):
        resp = http.post(path, json=body)
        assert resp.status_code < 500, (body, resp.text[:300])
        if resp.status_code != 200:
            assert resp.status_code in (400, 404, 422), (body, resp.text[:300])
            _error(resp, resp.status_code)
        elif body.get("stream") is True:
            events = _sse(resp.text)
            assert events[-1] == "[DONE]", (body, events[-3:])
        else:
            assert resp.json()["choices"], body

    check()


def test_fuzzed_requests_from_the_openapi_schema_never_get_a_5xx(server, http):
    schema = http.get("/openapi.json").json()
    _fuzz(http, "/v1/completions", body_strategy(schema, "CompletionRequest", server.model))
    _fuzz(http, "/v1/chat/completions", body_strategy(schema, "ChatCompletionRequest", server.model))
    assert http.get("/health").json() == {"status": "ok"}
    assert wait_idle(server.url, headers=server.headers)["kv_blocks_used"] == 0


# ---------------------------------------------------------------- overload and KV exhaustion


def test_overload_burst_gets_503_with_retry_after_before_any_byte(server):
    n = 24  # > the engine's 8 running + 8 waiting
    body = {"model": server.model, "prompt": [9] * 8, "max_tokens": 1000, "ignore_eos": True, "stream": True}

    async def burst() -> list[tuple[int, dict, bytes]]:
        answered, everyone = [0], asyncio.Event()

        async def one(http: httpx.AsyncClient):
            async with http.stream("POST", "/v1/completions", json=body) as r:
                answered[0] += 1
                if answered[0] == n:
                    everyone.set()
                chunks = r.aiter_bytes()  # held: a dropped iterator would close the stream early
                first = await chunks.__anext__() if r.status_code == 200 else await r.aread()
                await everyone.wait()  # keep accepted streams open until every request was answered
                return r.status_code, dict(r.headers), first

        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as http:
            return await asyncio.gather(*(one(http) for _ in range(n)))

    results = asyncio.run(burst())
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    assert 8 <= len(ok) <= 16 and len(ok) + len(refused) == n, [r[0] for r in results]
    assert all(r[1]["content-type"].startswith("text/event-stream") for r in ok)
    for status, headers, content in refused:
        assert status == 503 and headers["retry-after"] == "1", (status, headers)
        assert headers["content-type"].startswith("application/json")
        assert json.loads(content)["error"]["code"] == "queue_full"
    assert wait_idle(server.url, headers=server.headers)["kv_blocks_used"] == 0


def test_kv_exhaustion_preempts_and_outputs_match_uncontended(server, http, reference):
    rng = random.Random(6)
    prompts = [[rng.randrange(8, 2048) for _ in range(rng.randint(60, 100))] for _ in range(8)]
    max_tokens = 150  # 8 x (~80 + 150) tokens ~ 120 blocks of 16 > the pool of 80: preemption
    expected = reference(prompts, max_tokens)
    before = http.get("/v1/engine/stats").json()["num_preemptions"]

    async def contended() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as c:
            bodies = [
                {
                    "model": server.model,
                    "prompt": p,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                for p in prompts
            ]
            return [
                r.json() for r in await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
            ]

    outs = asyncio.run(contended())
    assert [o["choices"][0]["finish_reason"] for o in outs] == ["length"] * 8
    assert [o["choices"][0]["text"] for o in outs] == expected
    stats = wait_idle(server.url, headers=server.headers)
    assert stats["num_preemptions"] > before and stats["kv_blocks_used"] == 0


# ---------------------------------------------------------------- faults


def test_a_fault_fails_only_its_own_request(server, reference):
    normal = ["The garden in winter", "Seven stones by the river", "Music and paper"]
    expected = reference(normal, 24)
    faulty = {
        "detokenize": {"prompt": "__fault:detokenize__ one"},
        "tool": {"prompt": "__fault:tool__ two", "tools_calculator": True},
        "sample": {"prompt": "__fault:sample__ three"},
    }
    common = {"model": server.model, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    bodies = [{**common, "prompt": p} for p in normal] + [{**common, **f} for f in faulty.values()]
    bodies.append({**common, "prompt": "__fault:tool__ without the tool"})  # the point is never reached

    async def together() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:
            return [
                (r.status_code, r.text)
                for r in await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
            ]

    results = asyncio.run(together())
    assert all(status == 200 for status, _ in results)
    events = [_sse(text) for _, text in results]
    for i, text in enumerate(expected):
        assert events[i][-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[i][:-1]) == text
    for point, evs in zip(faulty, events[3:6]):
        errors = [json.loads(e) for e in evs if e.startswith('{"error"')]
        assert len(errors) == 1 and evs[-1] == json.dumps(errors[0], separators=(",", ":")), evs
        assert f"injected fault at {point}" in errors[0]["error"]["message"]
    assert events[6][-1] == "[DONE]"
    assert wait_idle(server.url, headers=server.headers)["kv_blocks_used"] == 0


# ---------------------------------------------------------------- disconnect storm and soak


def test_disconnect_storm_frees_every_block_within_a_second(server, http):
    aborts = http.get("/v1/engine/stats").json()["num_aborts"]
    args = disconnect_storm.parse_args(
        # max_tokens well above what a cut stream can have read: the stream is still generating when its
        # abort reaches the engine core, also when the core runs ahead of the replica by a few steps
        [
            "--url",
            server.url,
            "--api-key",
            API_KEY,
            "--requests",
            "500",
            "--concurrency",
            "8",
            "--max-tokens",
            "400",
        ]
        + ["--log-dir", f"{server.session_dir}/logs/serve", "--seed", "0"]
    )
    report = disconnect_storm.run(args)
    assert report["ok"], json.dumps(report, indent=1, default=str)
    cuts = report["cuts"]
    assert cuts["before_headers"] >= 100 and cuts["first_token"] >= 50 and cuts["mid_stream"] >= 20, cuts
    assert report["settle_s"] <= 1.0 and report["stats_after"]["kv_blocks_used"] == 0
    # every request cut after its headers was still generating: the engine must have aborted it
    assert report["stats_after"]["num_aborts"] - aborts >= cuts["first_token"] + cuts["mid_stream"]


def test_ingress_abort_ends_a_stream_whose_serve_cancellation_was_lost(server, http):
    """Serve now and then drops the cancellation of an engine call that races its start (app/aborts.py).
    Here the call is never cancelled at all, as when that happens, and only the explicit abort is sent:
    the replica must end the stream and free its blocks, and refuse a call whose abort came first."""
    from ray import serve

    handle = serve.get_deployment_handle("EngineDeployment", app_name="minserve")
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    before = http.get("/v1/engine/stats").json()
    gen = handle.options(stream=True).generate.remote(list(range(10, 40)), params, "lost-cancel-1")
    assert next(gen)["kind"] == "accepted"
    assert next(gen)["kind"] == "output"  # generating
    handle.abort.remote(["lost-cancel-1"]).result()
    t0 = time.monotonic()
    rest = list(gen)  # ends without a finished item: nobody was meant to read it
    assert not any(item["finished"] for item in rest) and time.monotonic() - t0 < 1.0, rest[-1:]
    stats = wait_idle(server.url, timeout_s=1.0, headers=server.headers)
    assert stats["kv_blocks_used"] == 0 and stats["ongoing_requests"] == 0, stats
    assert stats["num_aborts"] == before["num_aborts"] + 1

    handle.abort.remote(["lost-cancel-2"]).result()  # the abort overtakes its call
    late = handle.options(stream=True).generate.remote(list(range(50, 70)), params, "lost-cancel-2")
    assert list(late) == []
    after = http.get("/v1/engine/stats").json()
    assert after["prompt_tokens_total"] == stats["prompt_tokens_total"]  # the engine never saw it
    assert http.get("/v1/engine/audit").json()["problems"] == []


@pytest.mark.slow
def test_soak_2min_w2(server, tmp_path):
    args = soak.parse_args(
        # two minutes, warm-up 20% (24 s). The server runs with scripts.soak.STEADY_MALLOC_ENV: with glibc's
        # default (dynamic mmap threshold, per-thread arenas) the RSS climbed in steps with no leak, and
        # this check failed now and then on a fresh clone (+7.9%); the engine's own heap is flat.
        ["--url", server.url, "--api-key", API_KEY, "--minutes", "2", "--users", "8"]
        + ["--gen-scale", "0.125", "--sample-s", "0.5", "--out", str(tmp_path / "soak")]
    )
    report = soak.soak(args)
    summary = json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=1)
    assert report["ok"], summary
    assert report["requests"] > 50 and report["failures"] == 0 and report["rss"]["growth"] < 0.05


# ---------------------------------------------------------------- the engine loop dies (runs last)


def test_engine_loop_death_ends_streams_and_the_replica_is_replaced(server, http):
    pid = http.get("/v1/engine/stats").json()["pid"]
    body = {"model": server.model, "prompt": "long", "max_tokens": 1000, "ignore_eos": True, "stream": True}

    async def scenario() -> tuple[list[list[str]], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:

            async def in_flight(started: asyncio.Event) -> list[str]:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    first = await lines.__anext__()
                    started.set()
                    return [first] + [line async for line in lines]

            flags = [asyncio.Event() for _ in range(3)]
            tasks = [asyncio.create_task(in_flight(f)) for f in flags]
            await asyncio.gather(*(f.wait() for f in flags))
            killer = await c.post(
                "/v1/completions", json={**body, "prompt": "__fault:loop__", "stream": False}
            )
            return [[line[6:] for line in t if line] for t in await asyncio.gather(*tasks)], killer

    streams, killer = asyncio.run(scenario())
    _error(killer, 500, code="generation_error")
    for events in streams:
        assert "[DONE]" not in events and len(events) >= 2, events[-3:]
        error = json.loads(events[-1])["error"]
        assert "injected fault at loop" in error["message"], error
        assert sum(e.startswith('{"error"') for e in events) == 1
    _error(http.get("/health"), 503, code="engine_dead")
    # the dead replica refuses at once (engine_dead) and the ingress calls again (app/engine_client.py): the
    # replacement serves the request if it is up within the retries' budget, else the answer is 503 with
    # Retry-After; it never hangs
    start = time.monotonic()
    retried = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 3})
    assert time.monotonic() - start < RETRY_BUDGET_S + 10, "a request to the dead replica hung"
    if retried.status_code != 200:
        _error(retried, 503)
        assert retried.headers["retry-after"] == "1"
    deadline = time.monotonic() + 120
    while http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the dead replica was not replaced"
        time.sleep(1)
    assert http.get("/v1/engine/stats").json()["pid"] != pid
    ok = {"model": server.model, "prompt": "back again", "max_tokens": 3, "ignore_eos": True}
    assert http.post("/v1/completions", json=ok).json()["usage"]["completion_tokens"] == 3
