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

import time
from pathlib import Path

from benchmarks.baseline_tree import make_trees
from benchmarks.host_ab import alternate, parser, run_source, table, write

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


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__, "seqs", 200, 5, "benchmarks/reports/sched_host_cpu").parse_args(argv)
    trees = make_trees(args.baseline_tree)
    seqs = [int(n) for n in args.seqs.split(",")]

    def measure(root: Path, n: int) -> float:
        return run_source(root, step_times, (n, args.steps), f"WARMUP = {WARMUP}")

    facts = {"seqs": seqs, "reps": args.reps, **alternate(trees, seqs, args.reps, measure)}
    title = "Scheduler host time per step (schedule_ahead + update_computed), microseconds"
    write(
        args.out, "sched_host", argv, trees, facts, lambda r: table(r, title, "sequences decoding", seqs, 0)
    )


if __name__ == "__main__":
    main()
