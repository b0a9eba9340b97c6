"""NCCL against the one-shot all-reduce (engine/models/all_reduce.py), per message size, on the GPUs here.

    python -m benchmarks.tp_allreduce --world-sizes 2,4 --out benchmarks/reports/gpu/tp_allreduce

One process per GPU. For each bf16 message size, each path runs plainly (one launch per call, timed
over a loop) and inside a CUDA graph (REPS calls captured in one graph, as a decode step's graph holds
them). Times are CUDA-event medians over rounds, per call, on rank 0. Each path's sum is checked against
the exact sum first. JSON plus a markdown table; the crossover is the largest size where one-shot in a
graph beats NCCL in a graph.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import environment, write_report
from engine.runner.tp_group import NO_MULTICAST

SIZES_KIB = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
REPS, ROUNDS = 20, 7


def _time(fn, device) -> float:
    """Median microseconds of one of REPS calls of fn, over ROUNDS rounds (after a warm-up round)."""
    fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPS)
    return statistics.median(times)


def _graphed(call, device):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            call()
    return graph.replay


def _paths(x: torch.Tensor, one_shot) -> dict:
    def nccl():
        dist.all_reduce(x)

    def shot():
        one_shot(x)

    return {"nccl": nccl, "one_shot": shot}


def _check(x: torch.Tensor, one_shot, world: int) -> None:
    """Each path's sum of (rank + 1) over the ranks, against the exact one."""
    want = float(sum(range(1, world + 1)))
    for name in ("nccl", "one_shot"):
        x.fill_(dist.get_rank() + 1)
        if name == "nccl":
            dist.all_reduce(x)
        got = (x if name == "nccl" else one_shot(x)).float().unique().tolist()
        if got != [want]:
            raise RuntimeError(f"{name}: sum {got}, expected {want}")


def _worker(rank: int, world: int, port: int, queue, sizes: tuple[int, ...] = SIZES_KIB) -> None:
    from engine.models.all_reduce import OneShot

    os.environ.update(NO_MULTICAST)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    one_shot = OneShot(device, torch.bfloat16, max(sizes) * 1024)
    rows = []
    for kib in sizes:
        x = torch.ones(kib * 512, dtype=torch.bfloat16, device=device)
        _check(x, one_shot, world)
        row = {"world": world, "kib": kib}
        for name, fn in _paths(x, one_shot).items():
            row[f"{name}_plain_us"] = _time(lambda fn=fn: [fn() for _ in range(REPS)], device)
            row[f"{name}_graph_us"] = _time(_graphed(fn, device), device)
        rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, sizes: tuple[int, ...] = SIZES_KIB) -> list[dict]:
    """The rows of one world size: per message size (KiB), NCCL and one-shot, plain and in a graph."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(_worker, args=(world, _free_port(), queue, tuple(sizes)), nprocs=world, join=True)
    return queue.get()


def crossover(rows: list[dict]) -> int | None:
    """The largest size (KiB) up to which one-shot in a graph beats NCCL in a graph at every size."""
    best = None
    for r in sorted(rows, key=lambda r: r["kib"]):
        if r["one_shot_graph_us"] >= r["nccl_graph_us"]:
            break
        best = r["kib"]
    return best


def render(report: dict) -> str:
    env = report["env"]
    lines = ["# All-reduce per message size: NCCL against one-shot (bf16, microseconds a call)", "",
             f"GPUs: {env['hardware'].get('gpu')}, torch {env['versions']['torch']}; "
             f"command: `{report['command']}`", "",
             "| GPUs | KiB | NCCL plain | NCCL graph | one-shot plain | one-shot graph |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in report["rows"]:
        lines.append(f"| {r['world']} | {r['kib']} | {r['nccl_plain_us']:.1f} | {r['nccl_graph_us']:.1f} | "
                     f"{r['one_shot_plain_us']:.1f} | {r['one_shot_graph_us']:.1f} |")  # fmt: skip
    lines += ["", "Crossover (one-shot faster in a graph up to): "
              + ", ".join(f"{w} GPUs: {c} KiB" for w, c in report["crossover_kib"].items())]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", default="2")
    ap.add_argument("--out", default="benchmarks/reports/gpu/tp_allreduce")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.world_sizes.split(",") if int(w) <= torch.cuda.device_count()]
    rows = [r for w in worlds for r in measure(w)]
    cross = {w: crossover([r for r in rows if r["world"] == w]) for w in worlds}
    command = f"python -m benchmarks.tp_allreduce --world-sizes {args.world_sizes}"
    report = {"env": environment(), "command": command, "rows": rows, "crossover_kib": cross}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_report(args.out, report, render(report))


if __name__ == "__main__":
    main()
