"""Where served requests waited, by when they arrived: the engine replica's per-request log lines, binned.

    python -m benchmarks.request_waits REPLICA_LOG [--bin-s 0.2] [--start 15 --end 25]

REPLICA_LOG: an engine replica's log, or its request lines (app/replica_support.log_finished), plain or
gzipped. Each line gives, from the request's arrival at the ingress, when the ingress called the replica
(in ingress), when the replica's `generate` began (to replica), when the core took it (to core) and
first scheduled it (queue). A request's arrival time is its line's stamp less its e2e. Per bin of arrival
times (seconds from the first arrival): how many arrived, and the medians of
  hop        the ingress's call until the replica began (Serve's routing and transport);
  replica    the replica until the core took it;
  core wait  the core until its first step with the request;
  prefill    that step until the replica had the first token.
A load that arrives evenly but reaches the replica in bursts shows as bins whose hop falls from
hundreds of ms to a few: requests held and then let through together.
"""

from __future__ import annotations

import argparse
import gzip
import re
import statistics
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from benchmarks.serve_stack import LATENCY_KEYS, LATENCY_LINE

_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")  # the log record's time
_LEGS = ("in_ingress_ms", "to_replica_ms", "to_core_ms", "queue_ms", "replica_ttft_ms", "replica_e2e_ms")
COLUMNS = ("hop", "replica", "core wait", "prefill")


@dataclass(frozen=True)
class Waits:
    arrival: float  # seconds since the epoch
    hop: float  # ms, each
    replica: float
    core_wait: float
    prefill: float


def parse(text: str) -> list[Waits]:
    """The requests of log `text` whose every stamp is present, in order of arrival."""
    rows = []
    for line in text.splitlines():
        stamp, m = _STAMP.search(line), LATENCY_LINE.search(line)
        if stamp is None or m is None:
            continue
        fields = dict(zip(LATENCY_KEYS, m.groups(), strict=True))
        cells = [fields[k] for k in _LEGS]
        if any(c in (None, "-") for c in cells):
            continue  # a request that never reached some point (cancelled, failed), or an older tree's line
        ingress, replica, core, queue, ttft, e2e = (float(c) for c in cells)
        stamp = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        rows.append(Waits(stamp - e2e / 1000, replica - ingress, core - replica, queue - core, ttft - queue))
    return sorted(rows, key=lambda w: w.arrival)


def binned(rows: list[Waits], bin_s: float, start: float = 0.0, end: float = float("inf")) -> list[dict]:
    """One dict per non-empty bin of arrivals within [start, end) seconds of the first: t, n, medians."""
    if not rows:
        return []
    bins: dict[int, list[Waits]] = {}
    for w in rows:
        bins.setdefault(int((w.arrival - rows[0].arrival) / bin_s), []).append(w)
    out = []
    for k in sorted(bins):
        if start <= k * bin_s < end:
            ws = bins[k]
            med = {c: statistics.median(getattr(w, c.replace(" ", "_")) for w in ws) for c in COLUMNS}
            out.append({"t": k * bin_s, "n": len(ws), **med})
    return out


def read(path: Path) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", errors="replace") as f:
        return f.read()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path)
    p.add_argument("--bin-s", type=float, default=0.2)
    p.add_argument("--start", type=float, default=0.0, help="seconds after the first arrival")
    p.add_argument("--end", type=float, default=float("inf"))
    args = p.parse_args(argv)
    rows = parse(read(args.log))
    print(f"{len(rows)} requests; medians in ms per {args.bin_s} s of arrivals")
    print("| t (s) | arrived | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for b in binned(rows, args.bin_s, args.start, args.end):
        print(f"| {b['t']:.2f} | {b['n']} | " + " | ".join(f"{b[c]:.1f}" for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()
