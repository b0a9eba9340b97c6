"""Mixed steps three ways: a full CUDA graph, eager launches, and the host floor of piecewise graphs.

    python -m benchmarks.graph_modes --model llama-3.2-1b --out DIR      # GPU host

A mixed step here is D decodes at context C beside one prefill chunk of P tokens (synthetic block
tables over the engine's KV pool; the values in it do not matter for timing). For each (D, C, P):
  * graph: MixedGraphs.run (pack, two uploads, one replay) back to back, wall per step after a sync;
    and the device time of the replays alone (CUDA events around 20 replays);
  * eager: the same step through forward_batch without graphs (the same attention kernels);
  * piecewise host floor: what a piecewise graph (everything but attention captured, attention launched
    between the pieces) must spend on the host every step at least: L launches of the mixed attention
    (kernels.ops.attention, host time of the calls, no sync) plus L + 1 graph replays (the host time of
    one replay call, measured on the smallest decode graph). Host work beyond the forward (scheduling,
    sampling, outputs) comes on top in every mode; a piecewise graph only pays if its host floor stays
    well under the step's device time.
With --kernels N, each case's graph replays and eager steps also run under torch.profiler (CUDA
activity only) and the N kernels with the most device time per step are listed: where a mixed step's
device time goes.
Writes OUT/graph_modes_<model>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.common import environment, write_json

CASES = [(64, 512, 16), (64, 512, 256), (128, 1024, 512), (32, 256, 1024), (200, 700, 1800)]


def synthetic_batch(decodes: int, ctx: int, chunk: int, block_size: int, num_blocks: int):
    """D decodes at context `ctx` and one chunk of `chunk` new tokens after `ctx` cached ones."""
    from engine.runner.step_inputs import StepBatch, slots

    b, next_block = StepBatch(), 0
    for q_len in [1] * decodes + [chunk]:
        n = -(-(ctx + q_len) // block_size)
        blocks = [(next_block + i) % num_blocks for i in range(n)]
        next_block += n
        b.input_ids += [7] * q_len
        b.positions += range(ctx, ctx + q_len)
        b.slot_mapping += slots(blocks, range(ctx, ctx + q_len), block_size)
        b.query_lens.append(q_len)
        b.seq_lens.append(ctx + q_len)
        b.block_tables.append(blocks)
    return b


def _wall_us(fn, reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def _device_us(graph, reps: int = 20) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / reps


def piecewise_floor_us(runner, batch, reps: int = 20) -> float:
    """Host time of L mixed-attention launches plus L + 1 replay calls per step (no sync inside)."""
    import torch

    from engine.models.layers import Attention
    from engine.runner.step_inputs import pack, table_width, unpack
    from kernels import ops

    n, width = len(batch.seq_lens), table_width(batch)
    i64, i32 = (t.to(runner.device) for t in pack(batch, n, width))
    _, _, meta = unpack(i64, i32, batch, n, width, runner.block_size, mixed=True)
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    a = layers[0]
    q = torch.randn(len(batch.input_ids), a.num_heads, a.head_dim, device=runner.device, dtype=runner.dtype)
    k = q[:, : a.num_kv_heads]
    one = runner.graphs.graphs[runner.graphs.buckets[0]]

    def launches() -> None:
        for layer in layers:
            ops.attention(q, k, k, layer.k_cache, layer.v_cache, meta, a.scale)
        for _ in range(len(layers) + 1):
            one.replay()

    launches()
    torch.cuda.synchronize()
    hosts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        launches()
        hosts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return 1e6 * statistics.median(hosts)


def kernel_table(fn, reps: int, top: int) -> list[dict]:
    """The `top` kernels by device time per call of fn (torch.profiler over `reps` calls after a warm
    one), each with its calls per step; the first row is all device time per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    rows = [{"kernel": "(all)", "us": sum(e.device_time_total for e in events) / reps, "calls": None}]
    rows += [{"kernel": e.key[:80], "us": e.device_time_total / reps, "calls": e.count / reps}
             for e in events[:top]]  # fmt: skip
    return rows


def measure(engine, case, reps: int, top: int = 0) -> dict:
    from engine.runner.cuda_graph import forward_batch

    runner = engine.runner
    decodes, ctx, chunk = case
    batch = synthetic_batch(decodes, ctx, chunk, runner.block_size, runner.kv_spec.num_blocks)
    mixed = runner.mixed_graphs
    key = mixed.bucket(len(batch.input_ids), len(batch.seq_lens))

    def graph_step():
        return mixed.run(batch, runner.upload)

    def eager_step():
        return forward_batch(runner.model, {}, runner.upload, batch, runner.block_size)

    bucket = "{} tokens x {} seqs".format(*mixed.buckets[key])
    row = {"decodes": decodes, "context": ctx, "chunk": chunk, "tokens": len(batch.input_ids),
           "bucket": bucket, "graph_step_us": _wall_us(graph_step, reps),
           "graph_device_us": _device_us(mixed.graphs[key]), "eager_step_us": _wall_us(eager_step, reps),
           "piecewise_host_floor_us": piecewise_floor_us(runner, batch)}  # fmt: skip
    if top:
        row["kernels"] = {"graph": kernel_table(graph_step, reps, top),
                          "eager": kernel_table(eager_step, reps, top)}  # fmt: skip
    return row


def kernels_markdown(rows: list[dict]) -> list[str]:
    """Per case and mode: the top kernels' device time per step (us) and calls per step."""
    lines = []
    for r in rows:
        for mode, table in r.get("kernels", {}).items():
            lines += ["", f"#### {r['decodes']} decodes at {r['context']}, chunk {r['chunk']}: {mode}, "
                      f"{table[0]['us']:,.0f} us of device time per step", "",
                      "| kernel | us / step | calls / step |", "|---|---|---|"]  # fmt: skip
            lines += [f"| `{k['kernel']}` | {k['us']:,.1f} | {k['calls']:.1f} |" for k in table[1:]]
    return lines


def to_markdown(model: str, rows: list[dict], env: dict, command: str) -> str:
    lines = [f"# Mixed steps: full graph, eager, piecewise host floor ({model})", "",
             f"{env['hardware'].get('gpu')}; torch {env['versions']['torch']}; "
             f"triton {env['versions']['triton']}.",
             "", f"`{command}`", "",
             "| decodes | context | chunk | tokens (bucket) | graph step | graph device | eager step "
             "| piecewise host floor | floor / graph device |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ratio = r["piecewise_host_floor_us"] / r["graph_device_us"]
        lines.append(f"| {r['decodes']} | {r['context']} | {r['chunk']} | {r['tokens']} ({r['bucket']}) | "
                     f"{r['graph_step_us']:,.0f} us | {r['graph_device_us']:,.0f} us | "
                     f"{r['eager_step_us']:,.0f} us | "
                     f"{r['piecewise_host_floor_us']:,.0f} us | {ratio:.2f} |")  # fmt: skip
    return "\n".join(lines + kernels_markdown(rows)) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b", help="a benchmark shape (scripts.model_shapes)")
    p.add_argument("--ckpt-dir", default="/tmp/minserve_bench")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="benchmarks/reports/gpu")
    p.add_argument("--kernels", type=int, default=0, help="list the N kernels with most device time per case")
    p.add_argument("--cases", default=None, help="D:C:P,... (decodes:context:chunk) instead of CASES")
    args = p.parse_args()
    from benchmarks.quant_decode import checkpoint
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    path, _ = checkpoint(args.model, "bf16", Path(args.ckpt_dir))
    config = EngineConfig.from_kwargs(str(path), dtype="bfloat16", max_num_seqs=256,
                                      max_num_batched_tokens=2048, gpu_memory_utilization=0.85)  # fmt: skip
    engine = LLMEngine(config)
    import torch

    with torch.inference_mode():  # the runner's tensors are inference tensors
        cases = [tuple(map(int, c.split(":"))) for c in args.cases.split(",")] if args.cases else CASES
        rows = [measure(engine, case, args.reps, args.kernels) for case in cases]
    env = environment()
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
    command = f"python -m benchmarks.graph_modes {flags}"
    md = to_markdown(args.model, rows, env, command)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"graph_modes_{args.model}"  # the model's dots are no suffix: no Path.with_suffix
    write_json(out / f"{stem}.json", {"rows": rows, "env": env, "command": command})
    (out / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
