"""Where a decode step's time goes: kernel time by kind, and the idle gaps between kernels (GPU).

    python -m benchmarks.decode_profile --model llama-3.1-8b --batch 1 --prompt 128 --out DIR
    python -m benchmarks.decode_profile --model qwen3-0.6b --batch 256 --prompt 512 --out DIR
    python -m benchmarks.decode_profile --model llama-3.1-8b --batch 1 --tp 2 --out DIR

With --tp > 1 the trace is rank 0's: a collective kernel's time includes its wait for the other ranks.

It drives `LLM.engine.step()` on `batch` requests until every one of them is decoding, times
`--steps` decode steps by wall clock, then records the same number of steps under torch.profiler.
From the profiler's GPU kernel records (kernels inside CUDA-graph replays are recorded one by one)
it reports, per step:
  * each kernel kind's total time (matmuls are every cuBLAS / CUTLASS kernel, the rest are named by
    their Triton or ATen kernel), and the weight bandwidth the matmuls reach (step weights / matmul time);
  * GPU busy time (the union of kernel intervals) and idle time (wall time of a step minus busy):
    launch gaps inside a graph plus any host time the GPU waited for;
  * the device time of a step with no host in the way: the batch's CUDA graph, the logits and the
    argmax replayed back to back (CUDA events, median). The engine step's wall time minus this is what
    the host costs, since the profiler itself slows the host down.
With programmatic dependent launch (kernels.pdl, on Hopper) a kernel starts while its predecessor drains
and its record includes the time it spent waiting, so kernel times overlap: shares can sum past 100%,
and a kind's time bounds what removing it could save rather than measuring it.
The markdown table goes to stdout and <out>/decode_profile_<model>_b<batch>.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import environment, random_prompts, write_json
from engine.core.kernel_trace import busy_time  # the union of kernel intervals, shared with the core

MATMUL_MARKERS = ("gemm", "gemv", "cutlass", "xmma", "sm90_", "cublas", "nvjet")  # gemv: ours too


def kernel_kind(name: str) -> str:
    """A short, stable label for one kernel name: 'matmul' for every GEMM/GEMV, else the kernel's name."""
    low = name.lower()
    if any(m in low for m in MATMUL_MARKERS):
        return "matmul"
    if "elementwise" in low or "vectorized" in low:
        return "aten elementwise"
    return name.split("(")[0][:48]


HOST_GAP_US = 20.0  # an idle stretch this long is the host, not a launch gap inside a graph


def gaps(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(summed short gaps, summed long gaps) between consecutive kernels: short ones (< HOST_GAP_US) are
    launch gaps between back-to-back kernels, long ones are the GPU waiting for the host."""
    short = long = 0.0
    last_end = None
    for start, end in sorted(intervals):
        if last_end is not None and start > last_end:
            gap = start - last_end
            if gap < HOST_GAP_US:
                short += gap
            else:
                long += gap
        last_end = end if last_end is None else max(last_end, end)
    return short, long


def summarise(kernels: list[tuple[str, float, float]], steps: int, step_wall_us: float) -> dict:
    """kernels: (name, start_us, end_us) over `steps` decode steps -> per-step breakdown in us."""
    by_kind: dict[str, list[float]] = {}
    for name, start, end in kernels:
        by_kind.setdefault(kernel_kind(name), []).append(end - start)
    intervals = [(s, e) for _, s, e in kernels]
    busy = busy_time(intervals) / steps
    short, long = gaps(intervals)
    rows = sorted(
        ({"kind": k, "calls": len(v) / steps, "us": sum(v) / steps} for k, v in by_kind.items()),
        key=lambda r: -r["us"],
    )
    return {
        "step_wall_us": step_wall_us,
        "gpu_busy_us": busy,
        "idle_us": max(0.0, step_wall_us - busy),
        "launch_gaps_us": short / steps,  # between kernels, < HOST_GAP_US
        "host_waits_us": long / steps,
        "kernels_per_step": len(kernels) / steps,
        "kinds": rows,
    }


def decode_until_steady(engine, batch: int) -> None:
    """Step until every request has its first token (prefill done) and a few decode steps ran."""
    seen: set[str] = set()
    extra = 0
    while extra < 4:
        for out in engine.step():
            if any(d.token_ids for d in out.outputs):
                seen.add(out.request_id)
        extra += len(seen) == batch


def start_decoding(engine, batch: int, prompt: int, max_tokens: int) -> None:
    """Add `batch` greedy requests of `prompt`-token random prompts and step until all are decoding."""
    from engine import SamplingParams

    vocab = engine.runner.model_config.vocab_size
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for p in random_prompts(random.Random(0), batch, prompt, vocab):
        engine.add_request(p, sp)
    decode_until_steady(engine, batch)


def timed_steps(engine, steps: int) -> list[float]:
    """Wall seconds of each of `steps` calls of engine.step()."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def device_step_us(engine, batch: int, reps: int = 30) -> float | None:
    """us per decode step on the device alone: graph replay + logits + argmax, back to back (None when the
    engine runs eagerly). Replays reuse the last step's inputs, so every replay does the same work and
    writes the same K/V into the same cache slots: the engine's state is unchanged."""
    import torch

    from kernels import ops

    graphs = engine.runner.graphs
    bucket = None if graphs is None else graphs.bucket(batch)
    if bucket is None:
        return None
    graph, model = graphs.graphs[bucket], engine.runner.model

    def step() -> None:
        graph.replay()
        ops.argmax(model.compute_logits(graphs.hidden[:batch]))

    step()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    events[0].record()
    for e in events[1:]:
        step()
        e.record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:]))


def profile(
    llm, batch: int, prompt: int, steps: int
) -> tuple[list[float], list[tuple[str, float, float]], float | None]:
    """(wall seconds of each timed step, GPU kernel records of the profiled steps, device_step_us)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine = llm.engine
    start_decoding(engine, batch, prompt, 2 * steps + 64)
    walls = timed_steps(engine, steps)
    torch.cuda.synchronize()
    device_us = device_step_us(engine, batch)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_steps(engine, steps)
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    kernels = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    ]
    return walls, kernels, device_us


def to_markdown(model: str, batch: int, prompt: int, s: dict, weight_bytes: int) -> str:
    matmul = next((r["us"] for r in s["kinds"] if r["kind"] == "matmul"), 0.0)
    gbs = weight_bytes / (matmul * 1e-6) / 1e9 if matmul else 0.0
    lines = [
        f"### {model}, batch {batch}, {prompt}-token prompts: decode step {s['step_wall_us']:.0f} us",
        "",
        f"GPU busy {s['gpu_busy_us']:.0f} us, idle {s['idle_us']:.0f} us: launch gaps between kernels "
        f"{s['launch_gaps_us']:.0f} us, waits for the host {s['host_waits_us']:.0f} us "
        f"(gaps >= {HOST_GAP_US:.0f} us); "
        f"{s['kernels_per_step']:.0f} kernels per step; matmuls read the weights at {gbs:.0f} GB/s.",
        "Kernels launched with PDL overlap their predecessors (kernels.pdl): shares may sum past 100%.",
    ]
    device = s.get("device_step_us")
    if device:
        lines.append(
            f"The same step replayed back to back on the device (graph + logits + argmax, no host): "
            f"{device:.0f} us; the engine step minus that, the host's share (noise near zero): "
            f"{s['step_wall_us'] - device:+.0f} us."
        )
    lines += [
        "",
        "| kernel | calls / step | us / step | share of step |",
        "|---|---|---|---|",
    ]
    for r in s["kinds"]:
        share = 100 * r["us"] / s["step_wall_us"]
        lines.append(f"| {r['kind']} | {r['calls']:.0f} | {r['us']:.1f} | {share:.1f}% |")
    lines.append(f"| (idle) | | {s['idle_us']:.1f} | {100 * s['idle_us'] / s['step_wall_us']:.1f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="a benchmark shape (scripts.model_shapes)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--ckpt-dir", default="/tmp/minserve_bench")
    parser.add_argument("--out", default="benchmarks/reports")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--format", default="bf16", help="weights: bf16, fp8-block, fp8-channel or int8")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    args = parser.parse_args()

    from benchmarks.quant_decode import FORMATS, checkpoint, weight_bytes
    from engine import LLM

    if args.format not in FORMATS:
        parser.error(f"--format must be one of {', '.join(FORMATS)}")
    path, opts = checkpoint(args.model, args.format, Path(args.ckpt_dir))
    llm = LLM(str(path), dtype="bfloat16", max_num_seqs=max(args.batch, 8), enforce_eager=args.enforce_eager,
              gpu_memory_utilization=0.85, enable_prefix_caching=False, tensor_parallel_size=args.tp,
              **opts)  # fmt: skip
    walls, kernels, device_us = profile(llm, args.batch, args.prompt, args.steps)
    summary = summarise(kernels, args.steps, 1e6 * statistics.median(walls))
    summary["device_step_us"] = device_us
    step_bytes = weight_bytes(llm.engine.runner.model)[1]
    title = args.model if args.format == "bf16" else f"{args.model} ({args.format})"
    title += "" if args.tp == 1 else f", TP={args.tp} (rank 0)"
    md = to_markdown(title, args.batch, args.prompt, summary, step_bytes)
    print(md)
    out = Path(args.out)
    stem = f"decode_profile_{args.model}_b{args.batch}" + ("" if args.format == "bf16" else f"_{args.format}")
    stem += "" if args.tp == 1 else f"_tp{args.tp}"
    record = {"model": args.model, "format": args.format, "batch": args.batch, "prompt": args.prompt,
              "steps": args.steps, "tp": args.tp, "summary": summary, "env": environment()}  # fmt: skip
    write_json(out / f"{stem}.json", record)
    (out / f"{stem}.md").write_text(md)


if __name__ == "__main__":
    main()
