"""A multi-prefix, multi-turn workload (W3-like) for routing: what share of prompt tokens the replicas'
prefix caches serve, and the TTFT and throughput that follow.

Each of `prefixes` system prompts (random token ids, `prefix_len` long) is shared by its users; each
user has `turns` turns, and turn t's prompt is the system prompt plus the user's earlier turns (each a
fresh question and a fixed stand-in answer) plus a new question. So a turn shares its system prompt
with every user of that prompt, and its whole history with its own earlier turns. Users run
`concurrency` at a time, each one's turns in order (closed loop); or, with `user_rate`, a new user
starts every 1 / user_rate seconds whatever the server's pace (open loop: equal offered load for the
routers compared). Requests are streaming /v1/completions with token ids, `max_tokens` each, usage in
the last chunk (prompt_tokens_details.cached_tokens: the hit rate).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Workload:
    prefixes: int = 8
    prefix_len: int = 384
    users: int = 24
    turns: int = 3
    question_len: tuple[int, int] = (16, 48)
    answer_len: int = 24
    max_tokens: int = 4
    concurrency: int = 4
    user_rate: float = 0.0  # users started per second (open loop); 0: `concurrency` users at a time
    seed: int = 0


def conversations(w: Workload, vocab_size: int) -> list[list[list[int]]]:
    """Per user, the prompts of its turns (token ids)."""
    rng = random.Random(w.seed)
    token = lambda: rng.randrange(8, vocab_size - 8)  # noqa: E731 (clear of the special ids at the ends)
    systems = [[token() for _ in range(w.prefix_len)] for _ in range(w.prefixes)]
    users = []
    for u in range(w.users):
        history = list(systems[u % w.prefixes])
        turns = []
        for _ in range(w.turns):
            history += [token() for _ in range(rng.randint(*w.question_len))]
            turns.append(list(history))
            history += [token() for _ in range(w.answer_len)]
        users.append(turns)
    rng.shuffle(users)
    return users


async def _one(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage = None, None
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"status": resp.status_code, "error": (await resp.aread()).decode()[:300]}
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"status": 200, "error": event["error"]["message"]}
            if ttft is None and any(c.get("text") for c in event.get("choices", [])):
                ttft = time.perf_counter() - t0
            usage = event.get("usage") or usage
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"status": 200, "ttft": ttft, "prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached}


async def _run(url: str, model: str, w: Workload, vocab_size: int, headers: dict) -> list[dict]:
    todo = iter(conversations(w, vocab_size))
    results: list[dict] = []

    async def user_loop(http: httpx.AsyncClient) -> None:
        for turns in todo:
            for prompt in turns:
                results.append(await _one(http, model, prompt, w.max_tokens))

    async def user_at(http: httpx.AsyncClient, start: float, turns: list[list[int]]) -> None:
        await asyncio.sleep(start)
        for prompt in turns:
            results.append(await _one(http, model, prompt, w.max_tokens))

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as http:
        if w.user_rate > 0:
            users = list(todo)
            await asyncio.gather(*(user_at(http, i / w.user_rate, t) for i, t in enumerate(users)))
        else:
            await asyncio.gather(*(user_loop(http) for _ in range(w.concurrency)))
    return results


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def run(url: str, model: str, w: Workload, vocab_size: int, headers: dict | None = None) -> dict:
    """Run the workload once; the summary has hit_rate (cached / prompt tokens), TTFT p50/p99 in ms,
    requests/s and prompt tokens/s, and the failures."""
    t0 = time.perf_counter()
    results = asyncio.run(_run(url, model, w, vocab_size, headers or {}))
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttfts = sorted(1000 * r["ttft"] for r in ok if r["ttft"] is not None)
    prompt = sum(r["prompt_tokens"] for r in ok)
    hit = [r for r in ok if r["ttft"] is not None and r["cached_tokens"] >= r["prompt_tokens"] / 2]
    miss = [r for r in ok if r["ttft"] is not None and r["cached_tokens"] < r["prompt_tokens"] / 2]
    return {
        "requests": len(results),
        "failures": [r for r in results if "error" in r][:5],
        "num_failures": len(results) - len(ok),
        "hit_rate": round(sum(r["cached_tokens"] for r in ok) / prompt, 4) if prompt else 0.0,
        "ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
        "ttft_p99_ms": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1) if ttfts else None,
        # what a cache hit is worth: TTFT p50 of requests served mostly (or not) from the cache
        "ttft_p50_hit_ms": _p50([1000 * r["ttft"] for r in hit]),
        "ttft_p50_miss_ms": _p50([1000 * r["ttft"] for r in miss]),
        "requests_per_s": round(len(ok) / wall, 2),
        "prompt_tokens_per_s": round(prompt / wall, 1),
        "wall_s": round(wall, 2),
    }
