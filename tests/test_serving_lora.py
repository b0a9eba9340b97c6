"""LoRA adapters served (issue 48), all in one server: serve_config.yaml's application with two engine
replicas, 8 adapters in `lora_modules`, `enable_lora` with max_loras 4 and max_cpu_loras 4,
`allow_runtime_lora_updating` and an API key, on the tiny model with random PEFT adapters written by peft
(tests/lora_fixtures.py).

First the routing acceptance: requests spread uniformly over the 8 adapters (each round of 8 a shuffle
of them), 4 at a time; at least 90% of those after the first 8 must land on a replica that already
holds their adapter. Measured from the replicas' own records: each counts its adapter requests and the
loads they caused (Serve's multiplexer, app/lora_replica.py); a request that caused no load found its
adapter there. Every adapter reaches each replica only as the name and path its requests carry, which
is also how a runtime-loaded adapter reaches them.

Then the API, against the offline engine with the same adapter (`LLM(..., enable_lora=True).generate(
..., lora_request=LoRARequest(...))`, whose own agreement with peft's merged model is the engine tests').
Both replicas are full after the routing test, so the runtime load evicts, and adapters are loaded
again where they were evicted; the answers must not change. Without `allow_runtime_lora_updating` the
load/unload routes do not exist: tests/test_serving_lora_units.py checks that on the shared server.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.lora_fixtures import break_tensor, write_adapters
from tests.serving_fixtures import Server, start_server, stop_server

pytestmark = [pytest.mark.serving, pytest.mark.filterwarnings("ignore::FutureWarning")]
KEY = "lora-test-key"
SERVED = ["sql", "chat", "a2", "a3", "a4", "a5", "a6", "a7"]  # lora_modules
PROMPTS = ["The quick brown fox", "Adapters change the answer"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    return write_adapters(tiny_model_dir, tmp_path_factory.mktemp("adapters"), [*SERVED, "extra"])


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters) -> Server:
    overrides = {
        "num_replicas": 2,
        "engine_num_cpus": 0.5,
        "ingress_num_cpus": 0.5,
        "api_key": KEY,
        "allow_runtime_lora_updating": True,
        "lora_modules": {name: adapters[name] for name in SERVED},
        "engine": {"enable_lora": True, "max_loras": 4, "max_cpu_loras": 4},
    }
    try:
        yield start_server(tiny_model_dir, overrides)
    finally:
        stop_server()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapters):
    """(model name, prompt) -> the offline engine's greedy text with that adapter (the base model's for
    any other name)."""
    llm = LLM(str(tiny_model_dir), enable_lora=True, max_loras=2)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)

    ids = {name: i for i, name in enumerate(adapters, 1)}

    def generate(model: str, prompt) -> str:
        lora = LoRARequest(model, ids[model], adapters[model]) if model in adapters else None
        return llm.generate(prompt, params, lora_request=lora)[0].outputs[0].text

    return generate


# ---------------------------------------------------------------- routing


def _replica_records(server: Server) -> dict[int, tuple[int, int]]:
    """pid -> (adapter requests, loads) of each engine replica; stats calls go by power of two choices,
    so enough of them reach both replicas."""
    records: dict[int, tuple[int, int]] = {}
    deadline = time.monotonic() + 30
    while len(records) < 2 and time.monotonic() < deadline:
        stats = httpx.get(f"{server.url}/v1/engine/stats", headers=server.headers, timeout=10).json()
        records[stats["pid"]] = (stats["lora_requests"], stats["lora_loads"])
    assert len(records) == 2, f"stats reached {len(records)} replica(s)"
    return records


async def _send(server: Server, models: list[str], concurrency: int) -> None:
    queue: asyncio.Queue = asyncio.Queue()
    for i, model in enumerate(models):
        queue.put_nowait((i, model))

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            i, model = queue.get_nowait()
            body = {"model": model, "prompt": f"request {i} for {model}", "max_tokens": 4}
            resp = await http.post(f"{server.url}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text

    async with httpx.AsyncClient(timeout=120, headers=server.headers) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))


def test_two_replicas_keep_each_adapter_where_it_is_held(server):
    rng = random.Random(0)
    order = [name for _ in range(8) for name in rng.sample(SERVED, len(SERVED))]
    asyncio.run(_send(server, order[:8], 1))  # the first 8: every adapter loaded once somewhere
    first = _replica_records(server)
    asyncio.run(_send(server, order[8:], 4))
    last = _replica_records(server)
    stats = httpx.get(f"{server.url}/v1/engine/stats", headers=server.headers, timeout=10).json()
    requests = sum(last[p][0] - first[p][0] for p in last)
    loads = sum(last[p][1] - first[p][1] for p in last)
    assert requests == len(order) - 8, (first, last)
    assert (requests - loads) / requests >= 0.9, (first, last, stats["ingress_adapter_routing"])
    # the router knew: it sent them to a holder (app/adapter_affinity.py), counted per routing attempt
    assert stats["ingress_adapter_routing"].get("adapter_hit", 0) >= 0.9 * requests, stats
    assert len(stats["lora_adapters"]) <= 4  # a replica holds at most max_cpu_loras


# ---------------------------------------------------------------- the API


def _post(server: Server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


def _error(resp: httpx.Response, status: int, code: str | None) -> str:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == code, error
    return error["message"]


def _answers(client: openai.OpenAI, model: str) -> dict[str, list[str]]:
    """The model's greedy texts for PROMPTS (completions) and CHAT, each streamed and not."""
    kw = {"model": model, "max_tokens": TOKENS, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    out: dict[str, list[str]] = {"completions": [], "chat": []}
    for prompt in PROMPTS:
        full = client.completions.create(prompt=prompt, **kw)
        assert full.model == model and full.usage.completion_tokens == TOKENS
        chunks = client.completions.create(prompt=prompt, stream=True, **kw)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        out["completions"].append((full.choices[0].text, streamed))
    full = client.chat.completions.create(messages=CHAT, **kw)
    assert full.model == model
    chunks = client.chat.completions.create(messages=CHAT, stream=True, **kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    out["chat"].append((full.choices[0].message.content, streamed))
    return out


def _expected(reference, model: str) -> dict[str, list]:
    completions = [(reference(model, p),) * 2 for p in PROMPTS]
    return {"completions": completions, "chat": [(reference(model, CHAT),) * 2]}


def test_models_lists_the_base_model_and_each_adapter(server, client, adapters, tiny_model_dir):
    cards = httpx.get(f"{server.url}/v1/models", headers=server.headers, timeout=30).json()["data"]
    assert [c["id"] for c in cards] == [server.model, *SERVED]
    assert (cards[0]["root"], cards[0]["parent"]) == (str(tiny_model_dir), None)
    for card in cards[1:]:
        assert (card["root"], card["parent"]) == (adapters[card["id"]], server.model)
        assert card["object"] == "model" and card["max_model_len"] == cards[0]["max_model_len"]
    assert [m.id for m in client.models.list().data] == [server.model, *SERVED]  # the SDK reads it


def test_adapters_through_the_openai_sdk_equal_the_offline_engine(server, client, reference):
    answers = {}
    for model in (server.model, "sql", "chat", "sql"):
        answers[model] = _answers(client, model)
        assert answers[model] == _expected(reference, model), model
    # each adapter changes the answer: the adapter was applied, and not another one
    texts = {m: a["completions"][0][0] for m, a in answers.items()}
    assert len(set(texts.values())) == 3, texts
    # the Responses API is answered as the chat request it translates to, with the adapter
    kw = {"model": "chat", "temperature": 0}
    resp = client.responses.create(
        **kw, max_output_tokens=TOKENS, instructions="Be brief.", input=CHAT[1]["content"]
    )
    chat = client.chat.completions.create(**kw, max_tokens=TOKENS, messages=CHAT)
    assert resp.model == "chat" and resp.output_text == chat.choices[0].message.content


def test_an_unknown_model_is_a_404_naming_it(server, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "no-such-adapter" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-adapter", messages=CHAT, max_tokens=2)
    body = {"model": "no-such-adapter", "input": "Hi", "max_output_tokens": 4}
    assert "no-such-adapter" in _error(_post(server, "/v1/responses", body), 404, "model_not_found")


def test_runtime_load_and_unload(server, client, reference, adapters, tmp_path):
    load = {"lora_name": "extra", "lora_path": adapters["extra"]}
    assert _error(_post(server, "/v1/load_lora_adapter", load, key=None), 401, "invalid_api_key")
    resp = _post(server, "/v1/load_lora_adapter", load)
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'extra' added successfully."
    assert [m.id for m in client.models.list().data] == [server.model, *SERVED, "extra"]
    assert _answers(client, "extra") == _expected(reference, "extra")  # evicts an adapter of a full replica
    for model in SERVED:  # each answers as before, loaded again where it was evicted
        got = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0.0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert got.choices[0].text == reference(model, PROMPTS[0]), model
    message = _error(_post(server, "/v1/load_lora_adapter", load), 400, "invalid_value")
    assert "already been loaded" in message
    assert _error(_post(server, "/v1/load_lora_adapter", {"lora_name": "x"}), 422, "missing")
    # an adapter that does not fit the base model: 400 naming the file and the tensor; not in the table
    broken, tensor = break_tensor(adapters["extra"], tmp_path / "broken")
    resp = _post(server, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": broken})
    message = _error(resp, 400, "invalid_lora_adapter")
    assert "adapter_model.safetensors" in message and tensor in message, message
    missing = {"lora_name": "gone", "lora_path": str(tmp_path / "nothing")}
    assert "adapter_config.json" in _error(
        _post(server, "/v1/load_lora_adapter", missing), 400, "invalid_lora_adapter"
    )
    assert "broken" not in [m.id for m in client.models.list().data]
    # unload: the name is gone at once
    unload = {"lora_name": "extra"}
    assert _error(_post(server, "/v1/unload_lora_adapter", unload, key=None), 401, "invalid_api_key")
    resp = _post(server, "/v1/unload_lora_adapter", unload)
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'extra' removed successfully."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra", prompt="Hi", max_tokens=2)
    assert "'extra'" in _error(_post(server, "/v1/unload_lora_adapter", unload), 404, "model_not_found")
    # loaded again under the same name from another adapter's files: the new weights answer
    resp = _post(server, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": adapters["sql"]})
    assert resp.status_code == 200
    got = client.completions.create(model="extra", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0.0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].text == reference("sql", PROMPTS[0])
