"""The offline twin of a served W2 load: benchmarks.serve_client's closed loop, driven through
`LLMEngine.step()` in one process (no Ray, no HTTP), so the gap to the served figures is the serving path.

    python -m benchmarks.offline_twin --model DIR --users 64 --duration 40 --out DIR [--engine-json '{...}']

Same load as the client: user i starts at i / --spawn-rate seconds, draws its requests from its own
`serve_client.user_rng(seed, i)` with `serve_client.draw` (token-id prompts of the --workload mix, scaled
by --prompt-scale / --gen-scale, ignore_eos, the server's default sampling: temperature 1), and adds its
next request as soon as the last one finishes. At --duration every request still in flight is dropped
and aborted. Timings, taken by the loop after each `step()` returns: TTFT = first output carrying
tokens - the moment the request was added; ITL = gaps between consecutive outputs carrying tokens;
E2E = added -> finished; out tok/s = completion tokens of completed requests / elapsed. The summary has
serve_client.summarize's shape (p50/p90/p99), plus `steady_out_tok_s` (every token emitted after the last
user started / that window: the engine's pace once all users run), the loop's CPU use and the options.

Warm-up, not measured: before the clock starts the same closed loop runs for --warmup seconds (5) with
other prompts (seed WARMUP_SEED, as serve_overhead's served warm-up), then is aborted, so compilation,
autotuning and CUDA-graph capture are out of the measured window. Engine options default to the served
configuration's (serve_overhead.engine_options: serve_config.yaml plus its GPU settings). serve_overhead
runs it with the served engine's torch threads (OMP_NUM_THREADS as Ray sets it for the replica): on the
2-core CPU box, with other work running, 2 intra-op threads gave 16 tok/s where 1 gave 470.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.serve_client import add_load_args, draw, summarize, user_rng

WARMUP_SEED = 999_983  # warm-up prompts share nothing with a measured window's (prefix cache)


@dataclass
class _User:
    index: int
    ready_at: float  # when it may add its next request
    rng: object


@dataclass
class _Live:
    user: _User
    max_tokens: int
    start: float
    times: list[float] = field(default_factory=list)
    tokens: int = 0


def _submit(engine, args, facts: dict, idle: list[_User], live: dict, results: list) -> list[_User]:
    """Add a request for every idle user whose time has come; returns the users still idle."""
    from engine import SamplingParams

    now, waiting = time.perf_counter(), []
    for user in idle:
        if user.ready_at > now:
            waiting.append(user)
            continue
        prompt, max_tokens = draw(user.rng, args, facts)
        start = time.perf_counter()
        try:
            rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        except Exception as exc:  # queue full, prompt too long: a failed request, as a 4xx/5xx would be
            results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            user.ready_at = start
            waiting.append(user)
            continue
        live[rid] = _Live(user, max_tokens, start)
    return waiting


def _absorb(outs, t: float, live: dict, idle: list[_User], results: list) -> int:
    """Fold one step's outputs in at time t; finished users go idle. Returns the tokens emitted."""
    emitted = 0
    for out in outs:
        rec = live.get(out.request_id)
        if rec is None:
            continue
        n = sum(len(d.token_ids) for d in out.outputs)
        if n:
            rec.times.append(t)
            rec.tokens += n
            emitted += n
        errors = [d.error for d in out.outputs if d.error]
        if out.finished or errors:
            del live[out.request_id]
            results.append({"ok": not errors, "start": rec.start, "times": rec.times, "end": t,
                            "tokens": rec.tokens, "max_tokens": rec.max_tokens, "metrics": out.metrics,
                            "error": errors[0] if errors else None})  # fmt: skip
            rec.user.ready_at = t
            idle.append(rec.user)
    return emitted


def closed_loop(engine, args, facts: dict, seed: int, duration: float) -> dict:
    """`args.users` closed-loop users for `duration` s; raw results, elapsed, steady-state tokens, CPU s."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    deadline, ramp_end = t0 + duration, t0 + (args.users - 1) / args.spawn_rate
    idle = [_User(i, t0 + i / args.spawn_rate, user_rng(seed, i)) for i in range(args.users)]
    live: dict[str, _Live] = {}
    results: list[dict] = []
    steady = 0
    while time.perf_counter() < deadline:
        idle = _submit(engine, args, facts, idle, live, results)
        if not live:  # nobody running yet: wait for the next user's start
            time.sleep(max(0.0, min(min(u.ready_at for u in idle), deadline) - time.perf_counter()))
            continue
        outs = engine.step()
        t = time.perf_counter()
        if t > deadline:
            break  # a step that ends after the deadline is dropped, as the client drops it
        n = _absorb(outs, t, live, idle, results)
        steady += n if t >= ramp_end else 0
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    for rid in list(live):  # in flight at the deadline: dropped
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return {"results": results, "elapsed": elapsed, "steady_tokens": steady,
            "steady_s": max(0.0, elapsed - (ramp_end - t0)), "cpu_s": cpu_s}  # fmt: skip


def run_twin(args) -> dict:
    """Load the engine, warm it up, run the measured window; serve_client.summarize's dict plus extras."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    opts = json.loads(args.engine_json) if args.engine_json else _default_options()
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig.from_kwargs(str(args.model), **opts))
    load_s = time.perf_counter() - t0
    facts = {"model": Path(args.model).resolve().name, "max_model_len": engine.max_model_len,
             "vocab_size": engine.tokenizer.vocab_size}  # fmt: skip
    if args.warmup > 0:
        closed_loop(engine, args, facts, WARMUP_SEED, args.warmup)
    run = closed_loop(engine, args, facts, args.seed, args.duration)
    out = summarize(run["results"], run["elapsed"], facts)
    out["latency"] = _latency(run["results"])
    steady = run["steady_tokens"] / run["steady_s"] if run["steady_s"] > 0 else None
    out.update(source="benchmarks.offline_twin", users=args.users, spawn_rate=args.spawn_rate,
               seed=args.seed, warmup_s=args.warmup, steady_out_tok_s=steady, load_s=load_s,
               engine_options=opts, torch_threads=_torch_threads(),
               cpu={"offline twin": 100 * run["cpu_s"] / run["elapsed"]},
               completed_max_tokens=sum(r["max_tokens"] for r in run["results"] if r["ok"]))  # fmt: skip
    return out


def _latency(results: list[dict]) -> dict:
    """The engine's own view, as the served replica logs it: ms from add_request to first scheduled
    (queue) and to the first token sampled (engine TTFT)."""
    from benchmarks.serve_summary import percentiles

    ms = lambda m, t: 1000 * (t - m.arrival_time)
    done = [r["metrics"] for r in results if r["ok"] and r.get("metrics")]
    return {
        "queue_ms": percentiles([ms(m, m.first_scheduled_time) for m in done if m.first_scheduled_time]),
        "engine_ttft_ms": percentiles([ms(m, m.first_token_time) for m in done if m.first_token_time]),
    }


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _default_options() -> dict:
    import torch

    from benchmarks.serve_stack import engine_options

    return engine_options("cuda" if torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    add_load_args(p, duration=40.0)
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of unmeasured load first")
    p.add_argument("--engine-json", default=None, help="EngineConfig.from_kwargs options as JSON")
    args = p.parse_args(argv)
    summary = run_twin(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    q = lambda m: " ".join(f"{k} {summary[m][k]:.1f}" for k in ("p50", "p99") if summary[m][k] is not None)
    print(f"offline twin, {args.users} users: {summary['requests']} requests ({summary['failures']} failed), "
          f"{summary['output_tok_s']:.0f} tok/s; TTFT ms {q('ttft_ms')}; ITL ms {q('itl_ms')}")  # fmt: skip


if __name__ == "__main__":
    main()
