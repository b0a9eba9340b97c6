"""A closed-loop streaming load client: loadtests/locustfile.py's workload and timings, without Locust.

    python -m benchmarks.serve_client --host http://127.0.0.1:8000 --users 64 --duration 60 --out DIR

benchmarks/serve_overhead.py runs it (the offline GPU host has no Locust). Requests are drawn from
loadtests/_workloads.py (W2 by default: prompt ids uniform in [32, 1024] tokens, max_tokens uniform
in [64, 256], ignore_eos), sent to /v1/completions with stream=true; each user sends its next request
when the last one ends. Users start at --spawn-rate per second; at --duration every user stops and a
request still in flight is dropped (as Locust's -t does). Writes DIR/summary.json: TTFT (sent -> first
chunk with text), ITL (gap between consecutive chunks with text), E2E (sent -> [DONE]), in ms.
A multi-turn workload (W4) keeps one conversation per user (loadtests/_workloads.Conversation): each
request resends the history, the answer as the ids the server returned (vLLM's return_token_ids; stand-in
ids of its length from a server that returns none); the summary adds TTFT by turn
(the opening turns and the later ones, which the prefix cache and the host KV tier can serve), the
highest turn reached and `live_session_tokens` (the users' current histories at the end: live KV).
--think-time S pauses each user for an exponential time of mean S seconds after each answer (its own
random stream, so the requests drawn are the same with and without it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "loadtests"))

from _workloads import SHAPES, Conversation, PromptMaker, parse_mix, sample, think_seconds  # noqa: E402

from benchmarks.serve_summary import percentiles  # noqa: E402


def _text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def stream_once(session, url: str, body: dict) -> dict:
    """One streamed completion; the chunk arrival times of every chunk that carries text."""
    start = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []  # return_token_ids: the answer's token ids, in order
    usage = None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return {"ok": False, "error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        async for raw in resp.content:  # one SSE line at a time
            line = raw.strip()
            if not line:
                continue
            if line == b"data: [DONE]":
                end = time.perf_counter()
                tokens = (usage or {}).get("completion_tokens", len(times))
                return {"ok": True, "start": start, "times": times, "end": end, "tokens": tokens, "ids": ids}
            chunk = json.loads(line.removeprefix(b"data: "))
            if "error" in chunk:
                return {"ok": False, "error": f"error event: {chunk['error']}"}
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                ids += c.get("token_ids") or []
            if any(_text(c) for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    return {"ok": False, "error": "stream ended without data: [DONE]"}


def user_rng(seed: int, user: int) -> random.Random:
    """User `user`'s request stream: the same in every load tool that draws W2 (see offline_twin)."""
    return random.Random(seed * 100_003 + user)


def draw(rng: random.Random, args, facts: dict) -> tuple[list[int], int]:
    """One request of the --workload mix: (token-id prompt, max_tokens), lengths scaled and clipped."""
    names, weights = zip(*parse_mix(args.workload))
    maker = PromptMaker(facts["vocab_size"], 1.0, as_text=False)
    req = sample(rng, SHAPES[rng.choices(names, weights)[0]], maker, args.prompt_scale, args.gen_scale,
                 facts["max_model_len"])  # fmt: skip
    return (req.prefix or []) + req.prompt, req.max_tokens


class UserRequests:
    """One user's requests: the --workload mix as `draw` gives it, a multi-turn shape through one
    Conversation per shape (its next turn; `answered` appends the answer's ids)."""

    def __init__(self, rng: random.Random, args, facts: dict):
        self.rng, self.args, self.facts = rng, args, facts
        self.maker = PromptMaker(facts["vocab_size"], 1.0, as_text=False)
        self.mix = parse_mix(args.workload)
        self.talks = {n: Conversation(SHAPES[n], self.maker) for n, _ in self.mix if SHAPES[n].multi_turn}
        self.last: Conversation | None = None

    def next(self) -> tuple[list[int], int, int]:
        """(prompt ids, max_tokens, turn: 0 for a single-turn request)."""
        names, weights = zip(*self.mix)
        talk = self.talks.get(self.rng.choices(names, weights)[0]) if self.talks else None
        self.last = talk
        if talk is None:
            return (*draw(self.rng, self.args, self.facts), 0)
        a = self.args
        req = talk.next(self.rng, a.prompt_scale, a.gen_scale, self.facts["max_model_len"])
        return req.prompt, req.max_tokens, talk.turn

    def answered(self, tokens: int, ids: list[int] | None = None) -> None:
        """The last answer joins its conversation: its token ids, or stand-ins of its length."""
        if self.last is not None:
            self.last.answered(ids if ids else self.maker.make(self.rng, tokens))


async def user_loop(i: int, args, session, facts: dict, deadline: float, results: list, users: list) -> None:
    await asyncio.sleep(i / args.spawn_rate)
    user = UserRequests(user_rng(args.seed, i), args, facts)
    users.append(user)
    pauses = random.Random(f"think {args.seed} {i}")
    while time.perf_counter() < deadline:
        prompt, max_tokens, turn = user.next()
        body = {"model": facts["model"], "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
        if turn:  # a conversation resends the answer's own ids
            body["return_token_ids"] = True
        try:
            res = await asyncio.wait_for(stream_once(session, args.host + "/v1/completions", body),
                                         timeout=max(0.01, deadline - time.perf_counter()))  # fmt: skip
        except asyncio.TimeoutError:
            return  # in flight at the deadline: dropped
        except Exception as exc:  # a refused connection, a reset stream
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if res["ok"]:
            user.answered(res["tokens"], res["ids"])
        results.append({**res, "turn": turn})
        pause = think_seconds(pauses, args.think_time)
        if pause:
            await asyncio.sleep(min(pause, max(0.0, deadline - time.perf_counter())))


async def run(args) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.users + 4),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:  # fmt: skip
        async with session.get(args.host + "/v1/models") as resp:
            card = (await resp.json())["data"][0]
        facts = {"model": card["id"], "max_model_len": card.get("max_model_len") or 2048,
                 "vocab_size": card.get("vocab_size") or 32000}  # fmt: skip
        results: list[dict] = []
        users: list[UserRequests] = []
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        await asyncio.gather(
            *(user_loop(i, args, session, facts, deadline, results, users) for i in range(args.users))
        )
        elapsed = time.perf_counter() - t0
    summary = summarize(results, elapsed, facts)
    live = [len(t.history) for u in users for t in u.talks.values() if t.history is not None]
    return {**summary, "live_session_tokens": sum(live)} if live else summary


def summarize(results: list[dict], elapsed: float, facts: dict) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [1e3 * (r["times"][0] - r["start"]) for r in ok if r["times"]]
    itl = [1e3 * (b - a) for r in ok for a, b in zip(r["times"], r["times"][1:])]
    e2e = [1e3 * (r["end"] - r["start"]) for r in ok]
    errors = [r["error"] for r in results if not r["ok"]]
    return {"source": "benchmarks.serve_client", "model": facts["model"], "requests": len(ok),
            "failures": len(errors), "first_errors": errors[:3], "elapsed_s": elapsed,
            "req_s": len(ok) / elapsed, "output_tok_s": sum(r["tokens"] for r in ok) / elapsed,
            "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl), "e2e_ms": percentiles(e2e),
            **_by_turn(ok)}  # fmt: skip


def _by_turn(ok: list[dict]) -> dict:
    """Multi-turn loads: TTFT of the opening turns and of the later ones, and the turns seen."""
    if not any(r.get("turn") for r in ok):
        return {}
    ttft = lambda rs: percentiles([1e3 * (r["times"][0] - r["start"]) for r in rs if r["times"]])  # noqa: E731
    return {"ttft_ms_first_turn": ttft([r for r in ok if r["turn"] == 1]),
            "ttft_ms_later_turns": ttft([r for r in ok if r["turn"] > 1]),
            "max_turn": max(r["turn"] for r in ok)}  # fmt: skip


def add_load_args(p: argparse.ArgumentParser, duration: float) -> None:
    """The closed-loop load's options, shared with benchmarks.offline_twin (the same requests)."""
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--spawn-rate", type=float, default=16.0, help="users started per second")
    p.add_argument("--duration", type=float, default=duration, help="measured seconds")
    p.add_argument("--workload", default="W2", help="W1, W2, W3, W4 or a mix like W1:1,W2:3")
    p.add_argument("--gen-scale", type=float, default=1.0)
    p.add_argument("--prompt-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="directory for summary.json")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="http://127.0.0.1:8000")
    p.add_argument("--think-time", type=float, default=0.0, help="mean pause after each answer, s (0: none)")
    add_load_args(p, duration=60.0)
    args = p.parse_args(argv)
    think_seconds(random.Random(), args.think_time)  # a negative mean fails here, naming the flag
    summary = {**asyncio.run(run(args)), "think_time_s": args.think_time}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    q = lambda m: " ".join(
        f"{k} {summary[m][k]:.1f}" for k in ("p50", "p90", "p99") if summary[m][k] is not None
    )
    print(
        f"{summary['requests']} requests ({summary['failures']} failed), "
        f"{summary['output_tok_s']:.0f} tok/s; "
        f"TTFT ms {q('ttft_ms')}; ITL ms {q('itl_ms')}"
    )


if __name__ == "__main__":
    main()
