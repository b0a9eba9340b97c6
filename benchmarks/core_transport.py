"""What one engine step's message costs on the engine core <-> replica socket (engine/core/process.py).

    python -m benchmarks.core_transport --out benchmarks/reports/core_transport

The core sends a Step(records, stats) (engine/core/messages.py) once per step through
multiprocessing.connection over a Unix socketpair (pickle protocol 5); the replica's reader thread
receives it. This times, per message of N
decode records (one token each, as in a decode step of N sequences): the core's pickling, its send,
and the receiving process's unpickling, with the receiver in a process of its own as in serving.
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import time
from pathlib import Path

from benchmarks.common import environment, write_report
from engine.core.messages import Record, Records, Sample, Step

REPEATS = 3000


def step_message(n: int) -> Step:
    """A decode step's message: one new token for each of n requests (each its own lists, as a real
    step's are: pickle writes a shared object once)."""
    records = [Record(f"cmpl-{i:032x}-0", [Sample(0, [12345], [1])]) for i in range(n)]
    return Step(Records.of(records), None)


def _receiver(conn, repeats: int, out) -> None:
    times = []
    for _ in range(repeats):
        data = conn.recv_bytes()  # waits for the message: not part of its cost
        t0 = time.perf_counter()
        pickle.loads(data)
        times.append(time.perf_counter() - t0)
    out.send(statistics.median(times[repeats // 10 :]))


def measure(n: int, repeats: int = REPEATS) -> dict:
    msg = step_message(n)
    ours, theirs = mp.Pipe(duplex=True)
    result_r, result_w = mp.Pipe(duplex=False)
    proc = mp.get_context("spawn").Process(target=_receiver, args=(theirs, repeats, result_w))
    proc.start()
    sends = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ours.send(msg)
        sends.append(time.perf_counter() - t0)
        time.sleep(0.0005)  # a step apart, so the receiver is waiting as it is in serving
    recv = result_r.recv()
    proc.join()
    t0 = time.perf_counter()
    for _ in range(repeats):
        pickle.dumps(msg, protocol=5)
    dumps = (time.perf_counter() - t0) / repeats
    return {
        "records": n,
        "bytes": len(pickle.dumps(msg, protocol=5)),
        "pickle_us": 1e6 * dumps,
        "send_us": 1e6 * statistics.median(sends),
        "unpickle_us": 1e6 * recv,
    }


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "## Engine core -> replica: one step message",
        "",
        f"- `{command}`; medians over {REPEATS} messages; receiver in its own process",
        "",
        "| records | bytes | pickle (core) us | send incl. pickle (core) us | unpickle (replica) us |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        us = " | ".join(f"{r[k]:.0f}" for k in ("pickle_us", "send_us", "unpickle_us"))
        lines.append(f"| {r['records']} | {r['bytes']:,} | {us} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", default="1,64,256")
    p.add_argument("--out", type=Path, default=Path("benchmarks/reports/core_transport"))
    args = p.parse_args(argv)
    rows = [measure(int(n)) for n in args.records.split(",")]
    command = "python -m benchmarks.core_transport " + " ".join(argv or [])
    report = {"command": command.strip(), "host": environment(), "rows": rows}
    write_report(args.out, report, markdown(rows, command.strip()))


if __name__ == "__main__":
    main()
