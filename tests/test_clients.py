"""What real OpenAI clients send, replayed against the real server (issue 27).

Each body below is what the client builds, read from its source at the version named, field for field;
the assertions check the response fields that client reads. The replays need only httpx, so they run
in every `make test`. The real clients (LangChain's ChatOpenAI, lm-eval's LocalCompletionsAPI, the
guidellm CLI) run too where they can be imported: in this test's Python, or in the Python named by
MINSERVE_CLIENTS_PYTHON. `make test-clients` installs lm-eval and guidellm (the `clients` extra) into
a venv of their own, .venv/clients (their pins differ from the server's), and runs the real-client tests
with MINSERVE_CLIENTS_REQUIRED set, so that a client that cannot be imported fails instead of skipping.

Clients and where their bodies come from:
  lm-eval 0.4.13, `local-completions` (lm_eval/models/openai_completions.py LocalCompletionsAPI
    ._create_payload, generate=False; parse_logprobs): loglikelihood sends the context and continuation
    together with echo, 1 logprob and 1 generated token, then sums token_logprobs[ctxlen:-1] and calls
    the continuation greedy if each of its tokens' logprob equals the max of that position's
    top_logprobs. The prompt is a list of token-id lists (tokenized_requests=True, the default), or
    the decoded string (tokenized_requests=False, batch size 1). Older versions sent max_tokens 0.
  guidellm 0.8.1, OpenAI HTTP backend (guidellm/backends/openai/request_handlers.py): streaming chat
    (its default request type) and text completions with stream_options.continuous_usage_stats and,
    for a fixed output length, ignore_eos and stop: null; it keeps the last `usage` it saw and counts
    a chunk with text as a token iteration. Before a run it GETs /health and /v1/models.
  langchain-openai 1.7.4, ChatOpenAI (langchain_openai/chat_models/base.py _default_params,
    _get_request_payload, _stream): model, stream, the options set on the model (temperature,
    max_tokens sent as max_completion_tokens), messages with string content; stream adds
    stream_options.include_usage when stream_usage=True (the default only for api.openai.com).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import httpx
import pytest

from engine.sampling_params import SamplingParams
from tests.serving_fixtures import ROOT, Server

pytestmark = [
    pytest.mark.clients,
    pytest.mark.serving,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]
CLIENTS_PYTHON_ENV = "MINSERVE_CLIENTS_PYTHON"
CLIENTS_REQUIRED_ENV = "MINSERVE_CLIENTS_REQUIRED"  # set (`make test-clients`): a missing client fails
TOL = 1e-3  # server vs offline engine log-probabilities (same code and weights, other batches)


# `server`: the shared server (tests/conftest.py), the one tests/test_serving.py uses.


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    """The offline engine in this process: prompt log-probabilities, the reference for the server's."""
    from engine import LLM

    return LLM(str(tiny_model_dir))


def prompt_logprobs(llm, ids: list[int], k: int = 1) -> list:
    """The engine's prompt logprobs for `ids`: entry 0 None, entry i a TokenLogprob (token_id, logprob,
    top [(token_id, logprob), ...] best first)."""
    rid = llm.engine.add_request(list(ids), SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k))
    entries: list = []
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.request_id == rid and getattr(out, "prompt_logprobs", None):
                entries += out.prompt_logprobs
    assert len(entries) == len(ids), f"engine gave {len(entries)} prompt logprobs for {len(ids)} tokens"
    return entries


def _post(server: Server, path: str, body: dict) -> dict:
    resp = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert resp.status_code == 200, f"{path} {json.dumps(body)[:300]} -> {resp.status_code} {resp.text}"
    return resp.json()


def _stream(server: Server, path: str, body: dict) -> list[dict]:
    """The chunks of an SSE stream, up to its `data: [DONE]`, as a client reading lines sees them."""
    chunks, done = [], False
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as resp:
        assert resp.status_code == 200, f"{path} -> {resp.status_code} {resp.read().decode()}"
        for line in resp.iter_lines():
            if not line.strip():
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            chunks.append(json.loads(data))
    assert done, "stream ended without data: [DONE]"
    return chunks


# ---------------------------------------------------------------- lm-eval local-completions


def lm_eval_loglikelihood_body(model: str, prompt) -> dict:
    """LocalCompletionsAPI._create_payload(generate=False), lm-eval 0.4.13 (seed: TemplateAPI default)."""
    return {
        "model": model,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }


def lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """LocalCompletionsAPI.parse_logprobs, lm-eval 0.4.13, as written there."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        assert ctxlen > 0
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = True
        for tok, top in zip(tokens_logprobs, top_logprobs):
            if tok != max(top.values()):
                is_greedy = False
                break
        res.append((logprobs, is_greedy))
    return res


# (context, continuation) pairs as a multiple-choice task poses them: one context, several endings
PAIRS = [
    ("Question: what colour is the sky? Answer:", " blue"),
    ("Question: what colour is the sky? Answer:", " the colour of the sea at noon"),
    ("The quick brown fox jumps over the", " lazy dog"),
]


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """TemplateLM._encode_pair for a causal model: encode the whole, split at the context's length."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def _reference(llm, ctx: list[int], cont: list[int]) -> tuple[float, bool, list]:
    entries = prompt_logprobs(llm, ctx + cont, k=1)
    cont_entries = entries[len(ctx) :]
    total = sum(e.logprob for e in cont_entries)
    greedy = all(e.top and e.top[0][0] == e.token_id for e in cont_entries)
    return total, greedy, entries


def _check_echo_logprobs(choice: dict, n_prompt: int, n_generated: int) -> dict:
    lp = choice["logprobs"]
    assert lp is not None, choice
    n = n_prompt + n_generated
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert len(lp[key]) == n, f"{key}: {len(lp[key])} entries for {n_prompt} prompt + {n_generated}"
    assert lp["token_logprobs"][0] is None, "the first prompt token has no logprob (OpenAI: null)"
    assert lp["top_logprobs"][0] in (None, {}), lp["top_logprobs"][0]
    assert all(isinstance(x, float) and x <= 0.0 for x in lp["token_logprobs"][1:])
    assert all(isinstance(t, dict) and t for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    return lp


def test_lm_eval_loglikelihood_token_ids(server, offline):
    """tokenized_requests=True (default), batch_size=2: prompt is a list of token-id lists."""
    tok = offline.tokenizer
    encoded = [_encode_pair(tok, c, x) for c, x in PAIRS[:2]]
    prompts = [ctx + cont for ctx, cont in encoded]
    out = _post(server, "/v1/completions", lm_eval_loglikelihood_body(server.model, prompts))
    assert sorted(c["index"] for c in out["choices"]) == [0, 1]
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert out["usage"]["completion_tokens"] == 2
    parsed = lm_eval_parse_logprobs(out, [len(ctx) for ctx, _ in encoded])
    for choice in sorted(out["choices"], key=lambda c: c["index"]):
        i = choice["index"]
        (ctx, cont), prompt = encoded[i], prompts[i]
        lp = _check_echo_logprobs(choice, len(prompt), 1)
        assert choice["text"].startswith(tok.decode(prompt)), "echo: the prompt's text comes first"
        total, greedy, entries = _reference(offline, ctx, cont)
        for pos in range(1, len(prompt)):
            assert math.isclose(lp["token_logprobs"][pos], entries[pos].logprob, abs_tol=TOL), pos
        assert math.isclose(parsed[i][0], total, abs_tol=TOL * len(cont)), (parsed[i], total)
        assert parsed[i][1] == greedy


def test_lm_eval_loglikelihood_string_prompt(server, offline):
    """tokenized_requests=False, batch_size=1: prompt is one string; the server adds BOS as for any
    string prompt (as vLLM does), so the echo has one token more than lm-eval's own count."""
    context, continuation = PAIRS[2]
    out = _post(server, "/v1/completions", lm_eval_loglikelihood_body(server.model, context + continuation))
    (choice,) = out["choices"]
    n_prompt = out["usage"]["prompt_tokens"]
    ids = offline.tokenizer.encode(context + continuation)
    assert n_prompt == len(ids)
    lp = _check_echo_logprobs(choice, n_prompt, 1)
    # the echo is the prompt as the model saw it, BOS included (lm-eval reads no text when scoring)
    assert context + continuation in choice["text"]
    entries = prompt_logprobs(offline, ids)
    for pos in range(1, n_prompt):
        assert math.isclose(lp["token_logprobs"][pos], entries[pos].logprob, abs_tol=TOL), pos


def test_echo_score_only_max_tokens_0(server, offline):
    """Older lm-eval (and the OpenAI legacy docs) score with max_tokens 0: the echo alone."""
    ctx, cont = _encode_pair(offline.tokenizer, *PAIRS[0])
    body = {**lm_eval_loglikelihood_body(server.model, [ctx + cont]), "max_tokens": 0}
    out = _post(server, "/v1/completions", body)
    (choice,) = out["choices"]
    lp = _check_echo_logprobs(choice, len(ctx + cont), 0)
    assert out["usage"]["completion_tokens"] == 0
    assert choice["text"] == offline.tokenizer.decode(ctx + cont)
    total, _, _ = _reference(offline, ctx, cont)
    assert math.isclose(sum(lp["token_logprobs"][len(ctx) :]), total, abs_tol=TOL * len(cont))


# ---------------------------------------------------------------- guidellm streaming


def guidellm_chat_body(model: str, text: str, output_tokens: int) -> dict:
    """ChatCompletionsRequestHandler.format, guidellm 0.8.1, stream=True, fixed output length."""
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": output_tokens,
        "stop": None,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
    }


def guidellm_text_body(model: str, text: str, output_tokens: int) -> dict:
    """TextCompletionsRequestHandler.format, guidellm 0.8.1 (--request-type text_completions)."""
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": output_tokens,
        "stop": None,
        "ignore_eos": True,
        "prompt": text,
    }


GUIDELLM_TEXT = "a synthetic prompt of a few words that guidellm would make from its word list " * 2


def _check_continuous_usage(chunks: list[dict], output_tokens: int, text_of) -> tuple[str, dict]:
    """Usage on every chunk, cumulative, summing up; the last one as guidellm keeps it."""
    assert chunks
    text, prompt_tokens, last_completion, content_chunks = "", None, 0, 0
    for chunk in chunks:
        usage = chunk.get("usage")
        assert usage is not None, f"chunk without usage: {chunk}"
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
        prompt_tokens = prompt_tokens or usage["prompt_tokens"]
        assert usage["prompt_tokens"] == prompt_tokens > 0
        assert usage["completion_tokens"] >= last_completion, "completion_tokens is a running count"
        last_completion = usage["completion_tokens"]
        piece = text_of(chunk["choices"][0]) if chunk["choices"] else None
        if piece:
            text += piece
            content_chunks += 1
            assert usage["completion_tokens"] >= content_chunks, "every text chunk holds >= 1 token"
    assert chunks[-1]["choices"] == [], "include_usage: a final chunk with no choices"
    assert last_completion == output_tokens, "ignore_eos: exactly the requested output length"
    return text, chunks[-1]["usage"]


def test_guidellm_backend_validation(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"] == server.model


def test_guidellm_streaming_chat(server):
    chunks = _stream(server, "/v1/chat/completions", guidellm_chat_body(server.model, GUIDELLM_TEXT, 16))
    text, usage = _check_continuous_usage(chunks, 16, lambda c: c["delta"].get("content"))
    assert text and usage["completion_tokens"] == 16


def test_guidellm_streaming_text_completions(server):
    chunks = _stream(server, "/v1/completions", guidellm_text_body(server.model, GUIDELLM_TEXT, 16))
    text, usage = _check_continuous_usage(chunks, 16, lambda c: c.get("text"))
    full = _post(server, "/v1/completions", {"model": server.model, "prompt": GUIDELLM_TEXT, "max_tokens": 1})
    assert usage["prompt_tokens"] == full["usage"]["prompt_tokens"]
    assert text and usage["completion_tokens"] == 16


# ---------------------------------------------------------------- LangChain ChatOpenAI

LC_MESSAGES = [
    {"content": "You answer in one short sentence.", "role": "system"},
    {"content": "What is a paged KV cache?", "role": "user"},
]


def langchain_body(model: str, stream: bool, stream_usage: bool = False) -> dict:
    """ChatOpenAI(model=..., temperature=0, max_tokens=12).invoke / .stream, langchain-openai 1.7.4."""
    body = {
        "model": model,
        "stream": stream,
        "temperature": 0.0,
        "max_completion_tokens": 12,
        "messages": LC_MESSAGES,
    }
    if stream_usage:
        body["stream_options"] = {"include_usage": True}
    return body


@pytest.mark.parametrize("stream_usage", [False, True])
def test_langchain_invoke_and_stream(server, stream_usage):
    full = _post(server, "/v1/chat/completions", langchain_body(server.model, stream=False))
    (choice,) = full["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    assert full["usage"]["completion_tokens"] > 0
    chunks = _stream(server, "/v1/chat/completions", langchain_body(server.model, True, stream_usage))
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == choice["message"]["content"], "greedy: streamed text equals invoke's"
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == choice["finish_reason"]
    if stream_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    else:
        assert all(c.get("usage") is None for c in chunks)


# ---------------------------------------------------------------- the real clients, where installed


def _client_python(module: str) -> str:
    """A Python that can import `module`: this one, else $MINSERVE_CLIENTS_PYTHON; or skip (fail when
    $MINSERVE_CLIENTS_REQUIRED is set)."""
    if importlib.util.find_spec(module) is not None:
        return sys.executable
    other = os.environ.get(CLIENTS_PYTHON_ENV)
    if other and subprocess.run([other, "-c", f"import {module}"], capture_output=True).returncode == 0:
        return other
    missing = f"{module} is not importable here nor in ${CLIENTS_PYTHON_ENV} (see `make test-clients`)"
    if os.environ.get(CLIENTS_REQUIRED_ENV):
        pytest.fail(missing)
    pytest.skip(missing)


def _run_client(module: str, code: str, *args: str, timeout: float = 300) -> dict:
    """Run `code` with the client's Python; its last stdout line is a JSON result."""
    python = _client_python(module)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "NO_PROXY": "127.0.0.1"}
    proc = subprocess.run(
        [python, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


LANGCHAIN_CODE = """
import json, sys
from langchain_openai import ChatOpenAI
url, model = sys.argv[1:3]
llm = ChatOpenAI(base_url=url + "/v1", api_key="x", model=model, temperature=0, max_tokens=12, max_retries=0)
messages = [("system", "You answer in one short sentence."), ("human", "What is a paged KV cache?")]
inv = llm.invoke(messages)
chunks = list(llm.stream(messages, stream_usage=True))
usage = [c.usage_metadata for c in chunks if c.usage_metadata]
print(json.dumps({"invoke": inv.content, "invoke_usage": inv.usage_metadata,
                  "stream": "".join(c.content for c in chunks), "stream_usage": usage}))
"""


def test_real_langchain_chat_openai(server):
    out = _run_client("langchain_openai", LANGCHAIN_CODE, server.url, server.model)
    assert out["invoke"] and out["stream"] == out["invoke"]
    usage = out["stream_usage"]
    assert usage and usage[-1]["output_tokens"] == out["invoke_usage"]["output_tokens"]


LM_EVAL_CODE = """
import json, sys
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
url, model, tokenizer, pairs, backend = sys.argv[1:6]
pairs = json.loads(pairs)
# remote: lm-eval tokenizes through the server (GET /tokenizer_info, POST /tokenize, /detokenize)
extra = {"tokenizer": tokenizer} if backend == "huggingface" else {}
lm = LocalCompletionsAPI(model=model, base_url=url + "/v1/completions", tokenizer_backend=backend,
                         max_retries=1, batch_size=2, **extra)
reqs = [Instance(request_type="loglikelihood", doc={}, arguments=tuple(p), idx=i)
        for i, p in enumerate(pairs)]
res = lm.loglikelihood(reqs, disable_tqdm=True)
print(json.dumps({"results": res, "encoded": [lm._encode_pair(*p) for p in pairs],
                  "tokenizer": type(lm.tokenizer).__name__}))
"""


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_real_lm_eval_loglikelihood(server, offline, tiny_model_dir, backend):
    out = _run_client(
        "lm_eval", LM_EVAL_CODE, server.url, server.model, str(tiny_model_dir), json.dumps(PAIRS), backend
    )
    assert (out["tokenizer"] == "RemoteTokenizer") == (backend == "remote"), out["tokenizer"]
    for (logprob, greedy), (ctx, cont) in zip(out["results"], out["encoded"], strict=True):
        total, ref_greedy, _ = _reference(offline, ctx, cont)
        assert math.isclose(logprob, total, abs_tol=TOL * len(cont)), (logprob, total)
        assert greedy == ref_greedy


GUIDELLM_CODE = """
import json, sys
from guidellm.__main__ import cli
url, tokenizer, out, fmt = sys.argv[1:5]
args = ["run", "--backend", f"kind=openai_http,target={url},request_format={fmt}",
        "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=3",
        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--output", f"kind=json,path={out}", "--disable-console"]
try:
    cli.main(args=args, standalone_mode=False)
except SystemExit as e:
    assert not e.code, e.code
metrics = json.load(open(out))["benchmarks"][0]["metrics"]
print(json.dumps({"totals": metrics["request_totals"],
                  "output_tokens": metrics["output_token_count"]["successful"]["total_sum"]}))
"""


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_real_guidellm_run(server, tiny_model_dir, tmp_path, request_format):
    out = _run_client(
        "guidellm",
        GUIDELLM_CODE,
        server.url,
        str(tiny_model_dir),
        str(tmp_path / "guidellm.json"),
        request_format,
    )
    assert out["totals"] == {"successful": 3, "errored": 0, "incomplete": 0, "total": 3}
    assert out["output_tokens"] == 3 * 8
