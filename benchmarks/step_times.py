"""Wall time of the engine's steady decode steps (p50, mean, p90), optionally under cProfile (GPU).

    python -m benchmarks.step_times --model CKPT --batch 64 --prompt 1000 --tp 2
    MINSERVE_TP_PIN=0 python -m benchmarks.step_times --model CKPT --batch 64 --tp 2   # workers unpinned
    MINSERVE_TP_PIN=2 python -m benchmarks.step_times --model CKPT --batch 64 --tp 4   # two cores each

It adds `batch` greedy requests, steps until every one is decoding, then times `--steps` calls of
`engine.step()`. The mean and p90 show what a median hides: occasional slow steps, such as a
tensor-parallel worker woken on rank 0's CPU (engine/device/cpus.py). `--profile N` then prints the
top N functions of rank 0's host by own time over the same number of steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics

from benchmarks.decode_profile import start_decoding, timed_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--profile", type=int, default=0, help="print the top N functions under cProfile")
    args = ap.parse_args()

    from engine import LLM

    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=max(args.batch, 8), gpu_memory_utilization=0.85,
              enable_prefix_caching=False, tensor_parallel_size=args.tp)  # fmt: skip
    engine = llm.engine
    start_decoding(engine, args.batch, args.prompt, 2 * args.steps + 64)
    times = sorted(1e3 * t for t in timed_steps(engine, args.steps))
    pin = os.environ.get("MINSERVE_TP_PIN", "1")
    print(f"tp={args.tp} batch={args.batch} pin={pin}: "
          f"step p50 {statistics.median(times):.2f} mean {statistics.fmean(times):.2f} "
          f"p90 {times[int(0.9 * (len(times) - 1))]:.2f} ms")  # fmt: skip
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            engine.step()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
        print(out.getvalue())
    if args.tp > 1:
        engine.runner.shutdown()


if __name__ == "__main__":
    main()
