"""The OpenAI/vLLM surface of issue 27: echo and prompt logprobs, continuous usage, thinking models,
chat template options, /tokenize and /detokenize, the field policy, error codes and the metrics' origin.

Server tests run one real server (Ray Serve, serve_config.yaml) for the module on a copy of the tiny
model whose chat template opens a `<think>` block unless `enable_thinking` is false, as Qwen 3's
thinking variants do. References: the offline engine (`engine.LLM`, its LLMEngine for prompt logprobs),
the checkpoint's tokenizer, and raw HTTP bodies. Pure shape builders are unit tests without a server.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import httpx
import openai
import pytest

from app.chat import ChatPrompt
from app.engine_client import EngineClient
from app.field_policy import CHAT_UNSUPPORTED, reject_unsupported, unknown_field_message
from app.logprob_shapes import echo_logprobs, vllm_prompt_logprobs
from app.prompts import token_offsets, token_texts
from app.reasoning import ThinkSplitter
from app.sse import ResponseAssembler
from engine.sampling_params import SamplingParams
from tests.serving_fixtures import ROOT, Server, start_server, stop_server
from tests.wire_items import wire_item

pytestmark = [pytest.mark.serving, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
PROMPT = "The quick brown fox jumps over the lazy dog"
THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% if enable_thinking is not defined or enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


# ---------------------------------------------------------------- units: shapes without a server


@pytest.mark.parametrize(
    "pieces, starts_in_think, expected",
    [
        (["<think>abc</think>rest"], False, ("abc", "rest")),
        (["<th", "ink>ab", "c</th", "ink>re", "st"], False, ("abc", "rest")),  # tags split over items
        (["  <think>x</think>y"], False, ("x", "y")),
        (["plain answer"], False, ("", "plain answer")),
        (["<thin"], False, ("", "<thin")),  # a partial tag that never completes is text
        (["still thinking"], True, ("still thinking", "")),  # the template opened <think>: no </think>
        (["a</think>b"], True, ("a", "b")),
        (["<think>never closed </thi"], False, ("never closed </thi", "")),
    ],
)
def test_think_splitter(pieces, starts_in_think, expected):
    split = ThinkSplitter(starts_in_think)
    reasoning, content = "", ""
    for p in pieces:
        r, c = split.feed(p)
        reasoning, content = reasoning + r, content + c
    r, c = split.finish()
    assert (reasoning + r, content + c) == expected


def test_token_texts_concatenate_to_the_decoded_prompt(tiny_model_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    for text in [PROMPT, "naïve 日本 🌊 test", " leading space"]:
        ids = tok.encode(text)
        texts = token_texts(tok.decode, ids)
        assert len(texts) == len(ids) and "".join(texts) == tok.decode(ids)


def _plp(entries):
    """Wire prompt logprobs (app/streaming.to_wire) from (id, text, logprob, [(id, text, lp)])."""
    return [None] + [{"token_id": i, "token": t, "logprob": lp, "top": top} for i, t, lp, top in entries]


def test_echo_logprobs_and_vllm_shape():
    plp = _plp([(5, "b", -1.0, [(5, "b", -1.0), (6, "c", -2.0)]), (7, "cd", -3.0, [(6, "c", -0.5)])])
    lp = echo_logprobs(["a", "b", "cd"], [0, 1, 2], plp)
    assert lp.tokens == ["a", "b", "cd"] and lp.text_offset == [0, 1, 2]
    assert lp.token_logprobs == [None, -1.0, -3.0]
    assert lp.top_logprobs == [None, {"b": -1.0, "c": -2.0}, {"c": -0.5, "cd": -3.0}]
    vllm = vllm_prompt_logprobs(plp)
    assert vllm[0] is None
    assert vllm[1] == {
        "5": {"logprob": -1.0, "rank": 1, "decoded_token": "b"},
        "6": {"logprob": -2.0, "rank": 2, "decoded_token": "c"},
    }
    assert vllm[2]["7"] == {"logprob": -3.0, "rank": None, "decoded_token": "cd"}  # below the top k


@pytest.mark.parametrize(
    "texts, text, special, expected",
    [
        (["<s>", "Hi", " there"], "Hi there", [True, False, False], [0, 0, 2]),  # an added BOS: no width
        (["<s>", "Hi"], "<s>Hi", [True, False], [0, 3]),  # the client wrote the special token itself
        (["Hi", "<eot>", "!"], "Hi<eot>!", [False, True, False], [0, 2, 7]),
        (["ab", "cd"], "abXcd", [False, False], [0, 2]),  # no round trip: offsets still advance
        (["ab", "cdef"], "abc", [False, False], [0, 2]),  # capped at the text's end
    ],
)
def test_token_offsets_in_the_echoed_prompt(texts, text, special, expected):
    assert token_offsets(texts, text, special) == expected


def _item(text, completion, finish=None, prompt_tokens=4):
    return wire_item(text, completion, finish, prompt_tokens)


def _payloads(events: str) -> list[dict]:
    return [json.loads(e[len("data: ") :]) for e in events.split("\n\n") if e]


def test_assembler_streams_reasoning_and_continuous_usage():
    out = ResponseAssembler(True, "id", "m", 1, 1, continuous_usage=True, reasoning="split")
    out.set_prompt(0, {"prompt_tokens": 4, "starts_in_think": False})
    events = out.role_chunk()
    for item in [_item("<think>ab", 2), _item("c</th", 3), _item("ink>Hi", 4), _item("!", 5, "stop")]:
        events += out.chunk(0, item) or ""
    chunks = _payloads(events)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "abc"
    assert "".join(d.get("content") or "" for d in deltas) == "Hi!"
    usages = [c["usage"] for c in chunks]
    assert all(u["prompt_tokens"] == 4 and u["total_tokens"] == 4 + u["completion_tokens"] for u in usages)
    assert [u["completion_tokens"] for u in usages] == [0, 2, 3, 4, 5]  # "</th" waits; "c" goes out

    whole = ResponseAssembler(True, "id", "m", 1, 1, reasoning="split")
    for item in [_item("<think>ab", 2), _item("c</think>Hi", 3, "stop")]:
        whole.add(0, item)
    message = whole.final()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("abc", "Hi")


def test_field_policy_units():
    with pytest.raises(Exception, match="does not support functions"):
        reject_unsupported({"functions": [{"name": "f"}]}, CHAT_UNSUPPORTED)
    kept = reject_unsupported({"function_call": None, "n": 1}, CHAT_UNSUPPORTED)
    assert kept == {"n": 1}  # values that ask for nothing are dropped
    assert "did you mean 'temperature'" in unknown_field_message(
        "temprature", "temprature", ["temperature", "top_p"]
    )


def test_chat_prompt_refuses_reserved_template_kwargs():
    with pytest.raises(Exception, match="chat_template_kwargs"):
        ChatPrompt([{"role": "user", "content": "x"}], template_kwargs={"add_generation_prompt": False})


def test_ttft_is_observed_once_at_the_first_item_with_text(monkeypatch):
    from app import ingress, metrics

    class Recorder:
        def __init__(self):
            self.seen = []

        def observe(self, value):
            self.seen.append(value)

    m = metrics.IngressMetrics.__new__(metrics.IngressMetrics)
    m.ttft = Recorder()
    monkeypatch.setattr(metrics.time, "time", lambda: 10.25)
    first = ingress.FirstText(m, arrival=10.0)
    first.seen({"outputs": [{"text": ""}]})  # a token that ends inside a character: nothing visible yet
    assert m.ttft.seen == []
    first.seen({"outputs": [{"text": ""}, {"text": "a"}]})
    first.seen({"outputs": [{"text": "b"}]})
    assert m.ttft.seen == [0.25]


def test_the_ingress_arrival_time_reaches_the_replica_call():
    """EngineClient.open hands the ingress's arrival time to the replica's generate (which passes it to
    CoreClient.submit: test_replica_submit_passes_arrival_time_to_the_engine)."""
    calls = []

    class Gen:
        def __init__(self, args, kwargs):
            calls.append((args, kwargs))

        async def __anext__(self):
            return {"kind": "accepted", "request_id": "r", "prompt_tokens": 3}

        def cancel(self):
            pass

    class Handle:
        def options(self, **_):
            return self

        @property
        def generate(self):
            return self

        abort = generate

        def remote(self, *args, **kwargs):
            return Gen(args, kwargs)

    client = EngineClient(Handle(), 1)
    before = time.time()
    streams = asyncio.run(client.open(["a"], SamplingParams(), "req", 1234.5, True))
    sent = calls[0][1].pop("sent_time")  # when the ingress made the call, for the replica's log line
    assert before <= sent <= time.time()
    assert calls == [(("a", SamplingParams()), {"request_id": "req-0", "arrival_time": 1234.5, "echo": True})]
    assert streams[0].accepted["prompt_tokens"] == 3


def test_replica_submit_passes_arrival_time_to_the_engine(tiny_model_dir):
    from app.engine_deployment import EngineDeployment
    from engine.tokenizer import Tokenizer

    submitted = {}

    class Core:
        tokenizer = Tokenizer.from_dir(tiny_model_dir)

        def submit(self, prompt, params, request_id=None, arrival_time=None, lora_request=None):
            submitted.update(prompt=prompt, arrival_time=arrival_time)
            return request_id

        def flush(self):
            pass

        def shutdown(self):
            pass

    cls = EngineDeployment.func_or_class
    replica = object.__new__(cls)
    replica._streams, replica._limit, replica.engine = {}, 10, Core()
    replica._loop, replica._flush_scheduled, replica._retry_after = None, False, 1

    async def submit():
        return replica._submit("hi", SamplingParams(), "r1", 99.0, False)

    assert asyncio.run(submit()) == ("r1", {})
    assert submitted == {"prompt": "hi", "arrival_time": 99.0}


def test_locust_timing_events_stay_out_of_the_aggregate():
    """In a subprocess: importing locust monkey-patches this process (gevent), which Ray must not see."""
    script = textwrap.dedent(
        """
        import json
        from locust.env import Environment
        import locustfile
        env = Environment(user_classes=[locustfile.OpenAIStreamUser], events=locustfile.events)
        runner = env.create_local_runner()  # logs requests into env.stats; then init, as locust's main
        env.events.init.fire(environment=env, runner=runner, web_ui=None)
        for rt in ("POST", "TTFT", "E2E", "ITL", "ITL", "ITL"):
            env.events.request.fire(request_type=rt, name="W2", response_time=5, response_length=0,
                                    exception=None, context={})
        print(json.dumps([env.stats.total.num_requests, env.stats.get("W2", "ITL").num_requests]))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "loadtests")}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [1, 3]  # Aggregated: the one HTTP request


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a thinking chat template (chat_template.jinja wins over tokenizer_config)."""
    path = tmp_path_factory.mktemp("think") / "think-llama"
    shutil.copytree(tiny_model_dir, path)
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(model_dir) -> Server:
    srv = start_server(model_dir)
    yield srv
    stop_server()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(model_dir):
    from engine import LLM

    return LLM(str(model_dir))


def _post(server: Server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def _error(resp: httpx.Response, status: int, param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert param is None or error["param"] == param, error
    assert code is None or error["code"] == code, error
    return error


def _offline_prompt_logprobs(llm, prompt, k: int):
    """RequestOutput.prompt_logprobs of the offline engine for the same prompt (greedy, 1 token)."""
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k))
    found = None
    while engine.has_unfinished():
        for out in engine.step():
            found = out.prompt_logprobs if out.prompt_logprobs is not None else found
    return found


def test_echo_logprobs_shape_and_values(server, client, llm):
    out = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    lp = choice.logprobs
    ids = llm.tokenizer.encode(PROMPT)
    n = len(ids)
    assert ids[0] == llm.tokenizer.bos_token_id  # the tokenizer adds BOS to a string prompt
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 3
    # echo returns the prompt as sent (OpenAI, vLLM); tokens list every prompt token, BOS included
    assert choice.text.startswith(PROMPT) and not choice.text.startswith(lp.tokens[0])
    assert "".join(lp.tokens[1:n]) == PROMPT and "".join(lp.tokens[1:]) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0  # BOS: no width in the text
    for token, offset in zip(lp.tokens[1:], lp.text_offset[1:]):
        assert choice.text[offset : offset + len(token)] == token
    reference = _offline_prompt_logprobs(llm, PROMPT, 2)
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(reference[i].logprob, abs=1e-4)
        tops = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert tops[0] == pytest.approx(reference[i].top[0][1], abs=1e-4)

    stream = list(
        client.completions.create(
            model=server.model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
            stream=True, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in stream) == choice.text
    assert sum((c.choices[0].logprobs.tokens for c in stream if c.choices[0].logprobs), []) == lp.tokens


def test_prompt_logprobs_equal_the_offline_engine(server, llm):
    for path, body in [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a river."}]}),
    ]:
        body = {**body, "model": server.model, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3}
        got = _post(server, path, body).json()["choices"][0]["prompt_logprobs"]
        prompt = body.get("prompt") or llm.tokenizer.encode_chat(body["messages"])
        reference = _offline_prompt_logprobs(llm, prompt, 3)
        assert got[0] is None and len(got) == len(reference)
        for position, ref in zip(got[1:], reference[1:]):
            assert position[str(ref.token_id)]["logprob"] == pytest.approx(ref.logprob, abs=1e-4)
            for rank, (tid, value) in enumerate(ref.top, 1):
                assert position[str(tid)]["rank"] == rank
                assert position[str(tid)]["logprob"] == pytest.approx(value, abs=1e-4)


def test_max_tokens_zero_with_echo_scores_the_prompt(server, llm):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    resp = _post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    ids = llm.tokenizer.encode(PROMPT)
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids) and resp.json()["usage"]["completion_tokens"] == 0
    plain = _post(server, "/v1/completions", {"model": server.model, "prompt": PROMPT, "max_tokens": 0})
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == ""


def test_continuous_usage_stats_in_every_chunk(server):
    for path, extra in [
        ("/v1/completions", {"prompt": [PROMPT, "Hello there"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        body = {
            "model": server.model, "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **extra,
        }  # fmt: skip
        resp = _post(server, path, body)
        events = [e[6:] for e in resp.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        final = chunks.pop()
        assert final["choices"] == [] and all(c.get("usage") for c in chunks), chunks
        by_prompt: dict[int, list[dict]] = {}
        for c in chunks:
            by_prompt.setdefault(c["choices"][0]["index"], []).append(c["usage"])
        for usages in by_prompt.values():
            assert len({u["prompt_tokens"] for u in usages}) == 1
            completions = [u["completion_tokens"] for u in usages]
            assert completions == sorted(completions) and completions[-1] == 6
            assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
        assert final["usage"]["completion_tokens"] == 6 * len(by_prompt)
        assert final["usage"]["prompt_tokens"] == sum(u[-1]["prompt_tokens"] for u in by_prompt.values())


def test_reasoning_split_when_the_template_opens_think(server, llm):
    messages = [{"role": "user", "content": "Think, then answer."}]
    base = {
        "model": server.model,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    raw = (
        llm.generate(messages, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    assert "</think>" not in raw  # the tiny model never closes it: all of it is reasoning
    message = _post(server, "/v1/chat/completions", {**base, "include_reasoning": True}).json()["choices"][0][
        "message"
    ]
    assert (message["reasoning_content"], message["content"]) == (raw, "")
    stream = _post(server, "/v1/chat/completions", {**base, "include_reasoning": True, "stream": True})
    deltas = [
        json.loads(e[6:])["choices"][0]["delta"]
        for e in stream.text.split("\n\n")
        if e and e != "data: [DONE]"
    ]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == raw
    assert "".join(d.get("content") or "" for d in deltas) == ""
    off = _post(server, "/v1/chat/completions", base).json()["choices"][0]["message"]  # server default: off
    assert off["content"] == raw and off["reasoning_content"] is None

    # chat_template_kwargs reach the template: without thinking, no <think> in the prompt
    no_think = {**base, "include_reasoning": True, "chat_template_kwargs": {"enable_thinking": False}}
    resp = _post(server, "/v1/chat/completions", no_think).json()
    expected_ids = llm.tokenizer.encode(
        llm.tokenizer.render_chat(messages, enable_thinking=False), add_special_tokens=False
    )
    assert resp["usage"]["prompt_tokens"] == len(expected_ids)
    raw_plain = llm.generate(expected_ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert resp["choices"][0]["message"] == {
        "role": "assistant", "content": raw_plain.outputs[0].text, "reasoning_content": None,
    }  # fmt: skip


def test_continue_final_message(server, llm):
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    body = {
        "model": server.model,
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    resp = _post(server, "/v1/chat/completions", {**body, "continue_final_message": True})
    text = llm.tokenizer.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("One, two,")
    assert resp.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(text, add_special_tokens=False))
    both = {**body, "continue_final_message": True, "add_generation_prompt": True}
    _error(_post(server, "/v1/chat/completions", both), 422, param="continue_final_message")


def test_tokenize_and_detokenize_round_trip(server, llm):
    tok = llm.tokenizer
    resp = _post(server, "/tokenize", {"model": server.model, "prompt": PROMPT}).json()
    max_len = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    assert resp == {"count": len(tok.encode(PROMPT)), "max_model_len": max_len, "tokens": tok.encode(PROMPT)}
    back = _post(server, "/detokenize", {"tokens": resp["tokens"]}).json()
    assert back == {"prompt": tok.decode(resp["tokens"])}
    messages = [{"role": "user", "content": "hi"}]
    chat = _post(server, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == tok.encode_chat(messages)
    _error(_post(server, "/detokenize", {"tokens": [10**9]}), 422, param="tokens")
    _error(_post(server, "/tokenize", {"prompt": "x", "model": "nope"}), 404, code="model_not_found")


def test_tokenizer_info_matches_the_checkpoint(server, model_dir):
    """vLLM's /tokenizer_info (lm-eval's remote tokenizer reads it), against transformers' own loading of
    the served checkpoint and the chat template file this module wrote into it."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] == type(hf).__name__
    assert (info["bos_token"], info["eos_token"]) == (hf.bos_token, hf.eos_token)
    assert info["chat_template"] == THINKING_TEMPLATE
    assert info["add_bos_token"] == (hf("a")["input_ids"][0] == hf.bos_token_id)
    assert info["vocab_size"] == len(hf) and hf.eos_token_id in info["eos_token_ids"]
    assert info["model_max_length"] == httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]


def test_field_policy(server):
    body = {"model": server.model, "prompt": "x", "max_tokens": 2}
    ignored = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    assert _post(server, "/v1/completions", {**body, **ignored}).status_code == 200
    chat = {"model": server.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert _post(server, "/v1/chat/completions", {**chat, "parallel_tool_calls": False}).status_code == 200
    functions = [{"name": "f", "parameters": {}}]
    err = _error(
        _post(server, "/v1/chat/completions", {**chat, "functions": functions}),
        400,
        "functions",
        "unsupported_parameter",
    )
    assert "does not support functions" in err["message"] and "send tools" in err["message"]
    err = _error(
        _post(server, "/v1/completions", {**body, "suffix": "y"}), 400, "suffix", "unsupported_parameter"
    )
    assert "fill-in-the-middle" in err["message"]
    err = _error(
        _post(server, "/v1/completions", {**body, "temprature": 0}), 422, "temprature", "extra_forbidden"
    )
    assert "did you mean 'temperature'" in err["message"]


def test_error_codes_and_params(server, client):
    resp = httpx.post(
        f"{server.url}/v1/completions", content=b'{"model": "x", "prompt": "y"}',
        headers={"content-type": "application/x-www-form-urlencoded"}, timeout=30,
    )  # fmt: skip
    assert "Content-Type: application/json" in _error(resp, 415, code="unsupported_media_type")["message"]
    _error(httpx.get(f"{server.url}/v1/nope"), 404, code="not_found")
    max_len = client.models.list().data[0].model_extra["max_model_len"]
    too_long = {"model": server.model, "prompt": [7] * max_len, "max_tokens": 4}
    _error(_post(server, "/v1/completions", too_long), 400, "prompt", "context_length_exceeded")
    fits = {"model": server.model, "prompt": [7] * 8, "max_tokens": max_len}
    _error(_post(server, "/v1/completions", fits), 400, "max_tokens", "context_length_exceeded")
    chat = {
        "model": server.model,
        "messages": [{"role": "user", "content": "word " * max_len}],
        "max_tokens": 4,
    }
    _error(_post(server, "/v1/chat/completions", chat), 400, "messages", "context_length_exceeded")
    _error(
        _post(server, "/v1/completions", {**fits, "max_tokens": 2, "logit_bias": {"x": 1}}), 422, "logit_bias"
    )


def test_return_token_ids_equal_the_offline_engine(server, client, llm):
    """vLLM's return_token_ids through the official client: the prompt's ids (once) and each choice's
    ids, non-streaming and streamed (the chunks' ids concatenate), equal the offline engine's for the
    same greedy requests; requests that do not ask get neither key."""
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    extra = {"return_token_ids": True, "ignore_eos": True}
    want = llm.generate(PROMPT, greedy)[0]
    prompt_ids = llm.tokenizer.encode(PROMPT)
    ask = dict(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0, n=2, extra_body=extra)
    out = client.completions.create(**ask)
    for choice in out.choices:
        assert choice.prompt_token_ids == prompt_ids and choice.token_ids == want.outputs[0].token_ids
    chunks = list(client.completions.create(**ask, stream=True))
    for index in (0, 1):
        mine = [c for chunk in chunks for c in chunk.choices if c.index == index]
        assert sum((c.token_ids for c in mine), []) == want.outputs[0].token_ids
        assert [c.prompt_token_ids for c in mine if c.prompt_token_ids] == [prompt_ids]  # the first only

    messages = [{"role": "user", "content": "Name a river."}]
    want = llm.generate(messages, greedy)[0]
    chat = dict(model=server.model, messages=messages, max_tokens=6, temperature=0, extra_body=extra)
    out = client.chat.completions.create(**chat)
    assert out.prompt_token_ids == want.prompt_token_ids
    assert out.choices[0].token_ids == want.outputs[0].token_ids
    chunks = list(client.chat.completions.create(**chat, stream=True))
    assert chunks[0].prompt_token_ids == want.prompt_token_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    streamed = sum((c.token_ids or [] for chunk in chunks for c in chunk.choices), [])
    assert streamed == want.outputs[0].token_ids

    base = {"model": server.model, "max_tokens": 2}
    plain = _post(server, "/v1/completions", {**base, "prompt": PROMPT}).json()
    assert not {"token_ids", "prompt_token_ids"} & set(plain["choices"][0])
    plain = _post(server, "/v1/chat/completions", {**base, "messages": messages}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_the_w4_client_resends_the_answers_own_ids(server, llm):
    """benchmarks.serve_client's stream reads the answer's ids (return_token_ids) from the real server:
    they equal the offline engine's greedy ids, and the next turn's prompt is history + them + a message."""
    from types import SimpleNamespace

    import aiohttp

    from benchmarks.serve_client import UserRequests, stream_once, user_rng

    args = SimpleNamespace(workload="W4", prompt_scale=0.05, gen_scale=0.1)
    user = UserRequests(user_rng(0, 1), args, {"vocab_size": llm.tokenizer.vocab_size, "max_model_len": 2048})
    prompt, max_tokens, turn = user.next()
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}  # fmt: skip

    async def send() -> dict:
        async with aiohttp.ClientSession() as session:
            return await stream_once(session, f"{server.url}/v1/completions", body)

    res = asyncio.run(send())
    want = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
    assert turn == 1 and res["ok"] and res["ids"] == want.outputs[0].token_ids
    user.answered(res["tokens"], res["ids"])
    following, _, turn = user.next()
    assert turn == 2 and following[: len(prompt) + max_tokens] == prompt + res["ids"]
