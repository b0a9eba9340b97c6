"""Locust load test for minserve's OpenAI endpoints, streaming.

    locust -f loadtests/ --host http://localhost:8000                     # web UI on :8089
    locust -f loadtests/ --host http://localhost:8000 --headless -u 16 -r 4 -t 60s --workload W2 \\
           --csv benchmarks/runs/locust_w2                                    # summary + CSV files

Besides the HTTP row (time to response headers), every request records custom Locust request types:
  TTFT  request sent -> first streamed token (ms)
  ITL   gap between consecutive streamed chunks that carry text (ms), one event per gap
  E2E   request sent -> final [DONE] (ms); response_length = completion tokens
They appear in the web UI, in the --csv files (Type column) and in the headless summary, each in its
own row, but not in the "Aggregated" row: that counts HTTP requests only (`TimingStats`), so its
request count and req/s are the real ones, not inflated by one ITL event per token. With the
server's stream_interval_ms > 0 a chunk may hold several tokens: ITL is then per chunk.

Options (flag or environment variable):
  --workload       MINSERVE_WORKLOAD       W1, W2, W3, W4 or a weighted mix "W1:1,W2:3" (default W2)
  --model          MINSERVE_MODEL          default: the first model of GET /v1/models
  --prompt-format  MINSERVE_PROMPT_FORMAT  ids (exact lengths, default) or text
  --endpoint       MINSERVE_ENDPOINT       auto (W3 text -> chat, else completions), completions, chat
  --gen-scale      MINSERVE_GEN_SCALE      multiply generation lengths (e.g. 0.125 on a small CPU box)
  --prompt-scale   MINSERVE_PROMPT_SCALE   multiply prompt lengths
  --no-ignore-eos  MINSERVE_NO_IGNORE_EOS  let the model stop early (default: ignore_eos=true, exact lengths)
  --think-time     MINSERVE_THINK_TIME     mean seconds a user pauses after each answer (exponential;
                                           default 0: each user sends its next request at once)

W4 (multi-turn) keeps one conversation per user (_workloads.Conversation): each request resends the
history plus a new message; the answer joins the history as its text (text prompts) or as its token
ids (ids: vLLM's return_token_ids; stand-in ids of its length from a server that returns none). Its
rows are named by turn group ("W4 /v1/completions turn 1" and "turn 2+").

HttpUser (requests) with stream=True is used on purpose: FastHttpUser buffers the SSE body, which
would turn every token time into the end-of-stream time.
"""

from __future__ import annotations

import json
import random
import time

import requests
from _workloads import SHAPES, WORDS, Conversation, PromptMaker, Request, parse_mix, sample, think_seconds
from locust import HttpUser, events, task
from locust.stats import RequestStats

TIMING_TYPES = frozenset({"TTFT", "ITL", "E2E"})  # custom request types: timings, not requests


class TimingStats(RequestStats):
    """Locust's statistics, except that the custom timing types stay out of the "Aggregated" row.

    Locust adds every `events.request.fire` to its total; these timing events are several per HTTP
    request (one ITL per token), so the total's count and req/s would be timings, not requests. Their
    own rows (entries) and errors are kept as Locust keeps them. In a distributed run each worker
    sends its total and entries, so the master's total excludes them too."""

    def log_request(self, method: str, name: str, response_time: int, content_length: int) -> None:
        if method in TIMING_TYPES:
            self.entries[(name, method)].log(response_time, content_length)
        else:
            super().log_request(method, name, response_time, content_length)

    def log_error(self, method: str, name: str, error) -> None:
        if method in TIMING_TYPES:
            self.entries[(name, method)].log_error(error)
        else:
            super().log_error(method, name, error)


@events.init.add_listener
def _separate_timings(environment, **_kwargs) -> None:
    """The runner logs into the environment's RequestStats object, created before this event: its
    class is swapped, so every reference to it (runner, web UI, CSV writer) sees the same object."""
    environment.stats.__class__ = TimingStats


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    group = parser.add_argument_group("minserve workload")
    group.add_argument(
        "--workload", default="W2", env_var="MINSERVE_WORKLOAD", help="W1, W2, W3, W4 or W1:1,W2:3"
    )
    group.add_argument(
        "--model", default="", env_var="MINSERVE_MODEL", help="model name (default: ask the server)"
    )
    group.add_argument(
        "--prompt-format", default="ids", choices=["ids", "text"], env_var="MINSERVE_PROMPT_FORMAT"
    )
    group.add_argument(
        "--endpoint", default="auto", choices=["auto", "completions", "chat"], env_var="MINSERVE_ENDPOINT"
    )
    group.add_argument("--gen-scale", type=float, default=1.0, env_var="MINSERVE_GEN_SCALE")
    group.add_argument("--prompt-scale", type=float, default=1.0, env_var="MINSERVE_PROMPT_SCALE")
    group.add_argument("--no-ignore-eos", action="store_true", env_var="MINSERVE_NO_IGNORE_EOS")
    group.add_argument("--think-time", type=float, default=0.0, env_var="MINSERVE_THINK_TIME")


_FACTS: dict = {}  # per process: model, max_model_len, vocab_size, tokens_per_word


@events.test_start.add_listener
def _discover(environment, **_kwargs) -> None:
    """Model facts from GET /v1/models, plus (text prompts) the tokenizer's tokens-per-word ratio.

    Runs once per process before users start; these set-up calls stay out of the statistics."""
    opts, host = environment.parsed_options, environment.host.rstrip("/")
    card = requests.get(f"{host}/v1/models", timeout=30).json()["data"][0]
    facts = {
        "model": opts.model or card["id"],
        "max_model_len": card.get("max_model_len") or 2048,
        "vocab_size": card.get("vocab_size") or 32000,
        "tokens_per_word": 1.0,
    }
    if opts.prompt_format == "text":
        text = " ".join(random.Random(0).choice(WORDS) for _ in range(200))
        body = {"model": facts["model"], "prompt": text, "max_tokens": 1}
        usage = requests.post(f"{host}/v1/completions", json=body, timeout=60).json()["usage"]
        facts["tokens_per_word"] = max(0.5, usage["prompt_tokens"] / 200)
    _FACTS.update(facts)


class OpenAIStreamUser(HttpUser):
    def wait_time(self) -> float:
        """0 by default (a closed loop: the next request when the last one ends), else a think time."""
        return think_seconds(self.pauses, self.opts.think_time)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        facts = _FACTS
        self.opts, self.facts = opts, facts
        self.rng, self.pauses = random.Random(), random.Random()
        self.mix = parse_mix(opts.workload)
        self.maker = PromptMaker(facts["vocab_size"], facts["tokens_per_word"], opts.prompt_format == "text")
        # multi-turn shapes (W4): one conversation each, carried from request to request
        self.talks = {n: Conversation(SHAPES[n], self.maker) for n, _ in self.mix if SHAPES[n].multi_turn}
        think_seconds(self.pauses, opts.think_time)  # a negative mean fails here, naming the flag
        if opts.endpoint == "chat" and opts.prompt_format == "ids":
            raise ValueError("--endpoint chat needs --prompt-format text (chat messages are text)")

    @task
    def generate(self) -> None:
        names, weights = zip(*self.mix)
        shape = SHAPES[self.rng.choices(names, weights)[0]]
        scales = (self.opts.prompt_scale, self.opts.gen_scale, self.facts["max_model_len"])
        talk = self.talks.get(shape.name)
        if talk is not None:
            req = talk.next(self.rng, *scales)
        else:
            req = sample(self.rng, shape, self.maker, *scales)
        path, body = self._request_body(req)
        if talk is not None and not self.maker.as_text:
            body["return_token_ids"] = True  # the next turn resends the answer's own ids
        turn = "" if talk is None else (" turn 1" if talk.turn == 1 else " turn 2+")
        answer = self._stream(path, body, f"{req.workload} {path}{turn}")
        if talk is not None and answer is not None:
            text, tokens, ids = answer
            talk.answered(text if self.maker.as_text else (ids or self.maker.make(self.rng, tokens)))

    def _request_body(self, req: Request) -> tuple[str, dict]:
        common = {
            "model": self.facts["model"],
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not self.opts.no_ignore_eos:
            common["ignore_eos"] = True
        chat = self.opts.endpoint == "chat" or (
            self.opts.endpoint == "auto" and req.prefix is not None and isinstance(req.prompt, str)
        )
        if chat:
            messages = [{"role": "user", "content": req.prompt}]
            if req.prefix is not None:
                messages.insert(0, {"role": "system", "content": req.prefix})
            return "/v1/chat/completions", {**common, "messages": messages}
        if req.prefix is None:
            prompt = req.prompt
        elif isinstance(req.prompt, str):
            prompt = f"{req.prefix}\n{req.prompt}"
        else:
            prompt = req.prefix + req.prompt
        return "/v1/completions", {**common, "prompt": prompt}

    def _stream(self, path: str, body: dict, name: str) -> tuple[str, int, list[int]] | None:
        """Stream one request and report its timings; (answer text, completion tokens, its token ids if
        the server returned them), None if failed."""
        start = time.perf_counter()
        times: list[float] = []  # arrival of each chunk that carries text
        usage = None
        text: list[str] = []
        ids: list[int] = []
        with self.client.post(path, json=body, stream=True, catch_response=True, name=name) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:300]}")
                return None
            try:
                done = False
                for line in resp.iter_lines():
                    if not line:
                        continue
                    if not line.startswith(b"data: "):
                        raise ValueError(f"not an SSE data line: {line[:80]!r}")
                    if line == b"data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise ValueError(f"error event: {chunk['error']}")
                    usage = chunk.get("usage") or usage
                    ids += [t for c in chunk["choices"] for t in c.get("token_ids") or []]
                    pieces = [_chunk_text(c) for c in chunk["choices"]]
                    if any(pieces):
                        times.append(time.perf_counter())
                        text += pieces
                if not done:
                    raise ValueError("stream ended without data: [DONE]")
            except Exception as exc:
                resp.failure(f"{type(exc).__name__}: {exc}")
                return None
            resp.success()
        end = time.perf_counter()
        tokens = (usage or {}).get("completion_tokens", len(times))
        self._report(name, start, times, end, tokens)
        return "".join(text), tokens, ids

    def _report(self, name: str, start: float, times: list[float], end: float, tokens: int) -> None:
        fire = self.environment.events.request.fire
        if times:
            fire(
                request_type="TTFT",
                name=name,
                response_time=(times[0] - start) * 1000,
                response_length=tokens,
                exception=None,
                context={},
            )
        for a, b in zip(times, times[1:]):
            fire(
                request_type="ITL",
                name=name,
                response_time=(b - a) * 1000,
                response_length=0,
                exception=None,
                context={},
            )
        fire(
            request_type="E2E",
            name=name,
            response_time=(end - start) * 1000,
            response_length=tokens,
            exception=None,
            context={},
        )


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""
