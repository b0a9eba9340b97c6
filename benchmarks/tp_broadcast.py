"""What reaching the other tensor-parallel ranks costs rank 0 per step (engine/runner/tp_model.py).

    python -m benchmarks.tp_broadcast --model models/tiny-llama --tp 2 --batches 1,8

Each forward of rank 0 first writes the step's header to every worker's pipe and broadcasts the
step's packed input buffers (engine/runner/tp_wire.py); this times that part (header encoding, pipe
writes, broadcasts) inside real decode steps of LLM.generate, per decode batch size, next to the
whole step's time. On CPU the broadcasts go over gloo (TCP on loopback). The workers run the same
forward, so rank 0's broadcast also absorbs any lag of theirs: the figure is an upper bound of the
transfer itself. Prints a table; --json writes the samples' summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.models.attention_context import get_context  # noqa: E402
from engine.runner import tp_model, tp_wire  # noqa: E402


class Timed:
    """TPModel.forward with its reach-the-ranks part timed (the same calls, in the same order)."""

    def __init__(self):
        self.reach: list[float] = []
        self.header_ints: list[int] = []
        self.span_bytes: list[int] = []

    def install(self) -> None:
        timed = self

        def forward(model, input_ids, positions):
            t0 = time.perf_counter()
            header, spans = tp_wire.encode_forward(input_ids, positions, get_context())
            model.group.send(header)
            for span in spans:
                dist.broadcast(span, 0)
            timed.reach.append(time.perf_counter() - t0)
            timed.header_ints.append(len(header))
            timed.span_bytes.append(sum(s.numel() * s.element_size() for s in spans))
            return model.inner(input_ids, positions)

        tp_model.TPModel.forward = forward


def measure(llm: LLM, timed: Timed, batch: int, tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 for j in range(8)] for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    timed.reach.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    decode = timed.reach[1:]  # the first forward is the prompts' prefill
    return {
        "batch": batch,
        "steps": len(timed.reach),
        "step_ms": 1e3 * wall / len(timed.reach),
        "reach_us_median": 1e6 * statistics.median(decode),
        "reach_us_p90": 1e6 * sorted(decode)[int(0.9 * len(decode))],
        "header_bytes": 8 * (timed.header_ints[-1] + 1),
        "span_bytes": timed.span_bytes[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-llama")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    timed = Timed()
    timed.install()
    llm = LLM(args.model, device=args.device, tensor_parallel_size=args.tp, max_num_seqs=64)
    rows = [measure(llm, timed, int(b), args.tokens) for b in args.batches.split(",")]
    llm.engine.runner.shutdown()
    where = f"TP={args.tp} on {args.device}, {os.cpu_count()} cores"
    print(f"{where}: rank 0's header + broadcast per decode step")
    print("| batch | steps | step ms | reach us median | p90 | header bytes | broadcast bytes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['steps']} | {r['step_ms']:.1f} | {r['reach_us_median']:.0f} | "
              f"{r['reach_us_p90']:.0f} | {r['header_bytes']} | {r['span_bytes']} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
