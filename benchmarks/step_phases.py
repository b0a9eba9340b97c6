"""Host time per engine step, split by phase: where a host-bound step spends its microseconds.

    python -m benchmarks.step_phases --model llama-3.2-1b --tokenizer /tmp/gtoks/bpe128k \
        --modes none,all,none,all --runs 6 --out DIR
    python -m benchmarks.step_phases --model CKPT --modes none --batch 64 --prompt 1000 --gen 128 \
        --tp 4 --out DIR

Each phase of `LLMEngine._step` (scheduling ahead, the deferred draw's join, the launch of the next
step, the token append, the mask fill's start, the emit) and a few costs inside them (the fill on its
worker thread, the upload, the matchers' advance, waits on the fill) is wrapped with a wall-clock
timer, then `runs` batches of greedy requests run through `engine.step()` per mode (none, half or all
rows constrained, as in benchmarks/structured_bench; "all/thread" keeps the matchers on a thread of the
engine's process instead of the matcher process, "all/process:8" a matcher process with 8 threads,
and "all/thread@20" runs those fills with a 20 us switch
interval instead of grammar_state.HANDOFF_SWITCH_INTERVAL_S). The launch is split too (the runner's
execute, its uploads and LM head) and, with --tp, rank 0's commands to the workers, its announced graph
replays and its logits calls. Per mode: mean microseconds per step of each
phase, calls per step, step-time percentiles and decode tok/s. The first run of each mode is a
warm-up. The timers cost about half a microsecond a call, so per-row phases (advance) read high.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import environment, git_commit, random_prompts, write_report
from benchmarks.structured_bench import checkpoint, decode_run, ensure_llguidance, params

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 128


def phases() -> list[tuple[object, str]]:
    from engine import llm_engine
    from engine.device import uploader
    from engine.output import sink as token_sink
    from engine.runner import in_flight, model_runner, plain_draw, tp_group, tp_model
    from engine.sampling import sampler
    from engine.sched import scheduler
    from engine.structured import process as grammar_process
    from engine.structured import remote as grammar_remote
    from engine.structured import state as grammar_state
    from kernels import ops

    eng, sink, step = llm_engine.LLMEngine, token_sink.TokenSink, in_flight.InFlightStep
    return [
        (eng, "_step"), (scheduler.Scheduler, "schedule_ahead"), (step, "finish"),
        (eng, "_launch_next"), (sink, "receive"), (sink, "complete"), (step, "start"), (sink, "emit"),
        (ops, "apply_token_bitmask"), (ops, "argmax"), (grammar_state.BitmaskFiller, "_run"),
        (grammar_state.BitmaskFiller, "_plan"), (grammar_state.BitmaskFiller, "_device_rows"),
        (grammar_state.GrammarState, "advance"), (sampler.Sampler, "draw"),
        (grammar_remote.ProcessBitmaskFiller, "start"), (grammar_process.GrammarProcess, "submit"),
        (grammar_process.GrammarProcess, "wait"), (grammar_process.Channel, "recv"),
        (grammar_process.Channel, "send"), (plain_draw.PlainDraw, "sample"),
        (sampler.PendingSample, "resolve"), (sampler.PendingSample, "__init__"),
        (sampler.Sampler, "__call__"), (uploader.Uploader, "values"), (uploader.Uploader, "__call__"),
        (model_runner.ModelRunner, "execute"), (model_runner.ModelRunner, "_logits"),
        (tp_model.TPModel, "compute_logits"), (tp_model.TPModel, "compute_own_logits"),
        (tp_model._AnnouncedGraph, "replay"), (tp_group.TPGroup, "send"),
    ]  # fmt: skip


def checked_phases() -> list[tuple[object, str]]:
    """phases(), each of which must exist: a renamed or removed method is an error, never a silently
    missing row of the report."""
    found = phases()
    missing = [f"{cls.__name__}.{name}" for cls, name in found if not hasattr(cls, name)]
    if missing:
        raise AttributeError(f"step_phases.phases() names methods that do not exist: {', '.join(missing)}")
    return found


class PhaseTimer:
    """Wraps methods with accumulating wall-clock timers (and keeps every `_step` duration)."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.steps: list[float] = []

    def wrap(self, cls, name: str) -> None:
        inner, label = getattr(cls, name), f"{cls.__name__.rpartition('.')[2]}.{name}"

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                self.seconds[label] += dt
                self.calls[label] += 1
                if name == "_step":
                    self.steps.append(dt)
                elif name == "wait" and hasattr(args[0], "ended_at"):  # the matcher process's times
                    service, now = args[0], time.perf_counter()
                    for key, span in (
                        ("child: wake-up", service.began_at - service.sent_at),
                        ("child: consume + fill", service.ended_at - service.began_at),
                        ("child: reply to join", now - service.ended_at),
                        ("child: from its end to the join's start", service.ended_at - t),
                    ):
                        self.seconds[key] += span
                        self.calls[key] += 1

        setattr(cls, name, timed)

    def reset(self) -> None:
        self.seconds.clear(), self.calls.clear(), self.steps.clear()

    def summary(self) -> dict:
        steps = self.calls["LLMEngine._step"]
        q = sorted(self.steps)
        pct = {f"p{p}": 1e6 * q[round(p / 100 * (len(q) - 1))] for p in (10, 50, 90, 99)}
        per_step = {
            k: {"us_per_step": 1e6 * v / steps, "calls_per_step": self.calls[k] / steps}
            for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])
        }
        return {"steps": steps, "step_us": pct, "phases": per_step}


def markdown(report: dict) -> str:
    modes = report["modes"]
    names = list(dict.fromkeys(k for m in modes for k in m["phases"]))
    head = "| phase | " + " | ".join(f"{m['mode']} ({i + 1})" for i, m in enumerate(modes)) + " |"
    lines = [
        "# Host time per step, by phase",
        "",
        f"git `{report['git']}`; command: `{report['command']}`",
        f"hardware: {report['environment']['hardware'].get('gpu')}; "
        f"versions: {report['environment'].get('versions')}",
        "",
        "Microseconds per engine step (mean over the timed runs); calls per step in brackets.",
        "",
        head,
        "|---" * (len(modes) + 1) + "|",
        "| decode tok/s (median) | " + " | ".join(f"{m['tok_s']:,.0f}" for m in modes) + " |",
    ]
    for p in ("p10", "p50", "p90"):
        lines.append(f"| step {p} | " + " | ".join(f"{m['step_us'][p]:,.0f}" for m in modes) + " |")
    for n in names:
        cells = [m["phases"].get(n) for m in modes]
        row = [f"{c['us_per_step']:,.1f} ({c['calls_per_step']:.2f})" if c else "" for c in cells]
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer dir of the model's vocab size")
    ap.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/minserve_bench"))
    ap.add_argument("--modes", default="none,all", help="comma list of none, half, all (repeats allowed)")
    ap.add_argument("--constraint", default="json-free")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens of each request")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (rank 0's host is timed)")
    ap.add_argument("--fill-threads", type=int, default=None, help="override grammar_state.FILL_THREADS")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    to_time = checked_phases()  # before the model loads: a stale name fails at once
    ensure_llguidance()
    if args.fill_threads is not None:
        from engine.structured import state as grammar_state

        grammar_state.FILL_THREADS = args.fill_threads  # read when the filler's pool is made
    import torch

    from engine import LLM

    opts = {"max_num_seqs": args.batch, "max_model_len": args.prompt + args.gen + 16}
    opts["tensor_parallel_size"] = args.tp
    if not torch.cuda.is_available():
        opts.update(dtype="float32", device="cpu")
    path = checkpoint(args.model, args.ckpt_dir, args.tokenizer) if "/" not in args.model else args.model
    llm = LLM(str(path), **opts)
    timer, rng = PhaseTimer(), random.Random(0)
    for cls, name in to_time:
        timer.wrap(cls, name)
    vocab, modes = llm.engine.runner.model_config.vocab_size, []
    from engine.structured import remote as grammar_remote
    from engine.structured import state as grammar_state

    default_interval = grammar_state.HANDOFF_SWITCH_INTERVAL_S
    runner = llm.engine.runner
    fillers = {"process": runner.bitmasks, "thread": grammar_state.BitmaskFiller(vocab, runner.device)}
    for mode in args.modes.split(","):
        mode_only, _, via = mode.partition("/")  # all/thread: the matchers on a thread of this process
        via = via or "process"
        if via not in fillers:  # process:8: a matcher process with 8 threads; process:8:free unpinned
            _, threads, free = via.split(":") + [""] * (3 - len(via.split(":")))
            fillers[via] = grammar_remote.ProcessBitmaskFiller(
                vocab, runner.device, args.batch, int(threads), pin_cores=free != "free"
            )
        runner.bitmasks = fillers[via]
        base, _, switch_us = mode_only.partition("@")  # e.g. all@20: a 20 us switch interval during fills
        grammar_state.HANDOFF_SWITCH_INTERVAL_S = float(switch_us) * 1e-6 if switch_us else default_interval
        runs = []
        for i in range(args.runs + 1):
            if i == 1:
                timer.reset()
            sps = params(base, args.constraint, args.batch, args.gen)
            prompts = random_prompts(rng, args.batch, args.prompt, vocab)
            runs.append(decode_run(llm.engine, prompts, sps, args.gen))
        row = {"mode": mode, "tok_s": statistics.median(runs[1:]), "runs": runs[1:], **timer.summary()}
        modes.append(row)
        print(f"{mode}: {row['tok_s']:,.0f} tok/s, step p50 {row['step_us']['p50']:,.0f} us", flush=True)
    report = {
        "command": "python -m benchmarks.step_phases " + " ".join(sys.argv[1:] if argv is None else argv),
        "git": git_commit(ROOT),
        "environment": environment(),
        "model": args.model,
        "modes": modes,
    }
    write_report(args.out / "step_phases", report, markdown(report))
    if args.tp > 1:  # a process runs one tensor-parallel engine at a time: stop its workers
        llm.engine.runner.shutdown()


if __name__ == "__main__":
    main()
