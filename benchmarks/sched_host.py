"""Host time of the scheduler per step: schedule_ahead + update_computed with N sequences decoding.

    python -m benchmarks.sched_host --seqs 64,256 --baseline-tree /tmp/base \
        --out benchmarks/reports/sched_host_cpu

The scheduler and block manager are pure Python, so this runs anywhere and measures exactly what the
engine's loop pays for them each step under load: N requests of 200-token prompts decode with steps
scheduled ahead (the served path), their sampled tokens appended by hand, no model. Median
microseconds per step over --steps steps after 50 warm-up steps, best of --reps runs; with
--baseline-tree the same runs on that tree's code, alternating, in subprocesses. JSON plus markdown.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.baseline_tree import make_trees, tree_env
from benchmarks.common import environment, write_report

WARMUP = 50


def step_times(seqs: int, steps: int) -> list[float]:
    """Seconds of schedule_ahead + update_computed per step, `seqs` sequences decoding."""
    from engine.config import SchedulerConfig
    from engine.sampling_params import SamplingParams
    from engine.sched.block_manager import BlockManager
    from engine.sched.request import Request
    from engine.sched.scheduler import Scheduler

    bm = BlockManager(seqs * 40, 16, True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=8192), bm, 1 << 20)
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    for i in range(seqs):
        sched.add(Request(f"r{i}", [(i * 7 + j) % 1000 + 8 for j in range(200)], params))
    out, times = sched.schedule(), []
    for _ in range(WARMUP + steps):
        t0 = time.perf_counter()
        nxt = sched.schedule_ahead(out)
        sched.update_computed(out)
        times.append(time.perf_counter() - t0)
        for chunk in out.chunks:
            for seq in chunk.samples:
                seq.token_ids.append(7)
                seq.masks.append(1)
        out = nxt
    return times[WARMUP:]


def run_in(root: Path, seqs: int, steps: int) -> float:
    """Median microseconds per step, measured in a subprocess on `root`'s engine (this file's
    `step_times`, sent as source: the other tree may not have this benchmark)."""
    source = inspect.getsource(step_times)
    call = f"print(statistics.median(step_times({seqs}, {steps})))"
    code = f"import time, statistics\nWARMUP = {WARMUP}\n{source}\n{call}"
    env = tree_env(dict(os.environ), root)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{root}: {out.stderr[-2000:]}")
    return 1e6 * float(out.stdout.strip().splitlines()[-1])


def render(report: dict) -> str:
    names = [t["name"] for t in report["trees"]]
    lines = ["# Scheduler host time per step (schedule_ahead + update_computed), microseconds", "",
             f"`{report['command']}`; Python {report['env']['versions']['python']}, "
             f"{report['env']['hardware']['cpu']}; best of {report['reps']} runs, median of each", "",
             "Trees: " + ", ".join(f"{t['name']} = {t.get('commit')}" for t in report["trees"]), "",
             "| sequences decoding | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
    for n in report["seqs"]:
        lines.append(f"| {n} | " + " | ".join(f"{report['us'][t][str(n)]:.0f}" for t in names) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="64,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline-tree", type=Path)
    ap.add_argument("--out", default="benchmarks/reports/sched_host_cpu")
    args = ap.parse_args(argv)
    trees = make_trees(args.baseline_tree)
    seqs = [int(n) for n in args.seqs.split(",")]
    runs: dict[str, dict[str, list[float]]] = {t.name: {str(n): [] for n in seqs} for t in trees}
    for _ in range(args.reps):  # alternating trees, so drift on a shared host hits both alike
        for n in seqs:
            for tree in trees:
                runs[tree.name][str(n)].append(run_in(tree.root, n, args.steps))
    report = {
        "env": environment(), "command": "python -m benchmarks.sched_host " + " ".join(argv or sys.argv[1:]),
        "trees": [t.describe() for t in trees], "seqs": seqs, "reps": args.reps, "runs": runs,
        "us": {t: {n: min(v) for n, v in by.items()} for t, by in runs.items()},
        "median_us": {t: {n: statistics.median(v) for n, v in by.items()} for t, by in runs.items()},
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_report(args.out, report, render(report))


if __name__ == "__main__":
    main()
