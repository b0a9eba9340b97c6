"""Summarise a served load run (benchmarks/serve_w2.sh) into TTFT / ITL / E2E percentiles.

Two sources, same definitions (loadtests/locustfile.py's): TTFT = request sent -> first streamed chunk
with text; ITL = gap between consecutive such chunks; E2E = request sent -> [DONE].
  - Locust's `<prefix>_stats.csv`: the rows of Type TTFT / ITL / E2E (Locust rounds response times
    above 100 ms to 2 significant digits before taking percentiles);
  - benchmarks/serve_client.py's summary.json (exact percentiles), used where Locust is not installed.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

QUANTILES = ("p50", "p90", "p99")


def percentiles(values: list[float]) -> dict:
    """Nearest-rank p50/p90/p99 (the smallest value with at least q of the data at or below it)."""
    xs = sorted(values)
    if not xs:
        return {"count": 0, **{q: None for q in QUANTILES}}
    out = {"count": len(xs), "mean": sum(xs) / len(xs)}
    for q in QUANTILES:
        rank = math.ceil(int(q[1:]) / 100 * len(xs))
        out[q] = xs[max(rank, 1) - 1]
    return out


def _from_locust(stats_csv: Path) -> dict:
    rows = list(csv.DictReader(stats_csv.open()))
    out: dict = {"source": f"locust {stats_csv.name}"}
    for kind, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        sel = [r for r in rows if r["Type"] == kind]
        if not sel:
            continue
        r = max(sel, key=lambda r: int(r["Request Count"]))  # one row per workload name; W2 has one
        out[key] = {"count": int(r["Request Count"]), "mean": float(r["Average Response Time"]),
                    **{q: float(r[q[1:] + "%"]) for q in QUANTILES}}  # fmt: skip
        if kind == "E2E":
            out["requests"] = int(r["Request Count"])
            out["req_s"] = float(r["Requests/s"])
            out["output_tok_s"] = float(r["Requests/s"]) * float(r["Average Content Size"])
    http = [r for r in rows if r["Type"] == "POST"]
    out["failures"] = sum(int(r["Failure Count"]) for r in http)
    return out


def summarize_serving(run_dir: Path) -> dict:
    """The summary of one serve_w2.sh run directory (meta.json + Locust CSV or client summary)."""
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "meta.json").read_text()) if (run_dir / "meta.json").exists() else {}
    client = run_dir / "summary.json"
    stats = sorted(run_dir.glob("*_stats.csv"))
    if client.exists():
        out = json.loads(client.read_text())
    elif stats:
        out = _from_locust(stats[0])
    else:
        out = {"source": None, "error": f"no summary.json or *_stats.csv in {run_dir}: see its serve.log"}
    out["meta"] = meta
    return out


def serving_markdown(s: dict) -> str:
    meta = s.get("meta", {})
    lines = [f"## Serving ({meta.get('workload', 'W2')} through Ray Serve)", "",
             f"- Load: {meta.get('users')} closed-loop users for {meta.get('duration_s')} s against "
             f"{meta.get('model')} ({meta.get('gpu', '')}); source: {s.get('source')}",
             f"- Requests: {s.get('requests')} ({s.get('failures', 0)} failed), "
             f"{_f(s.get('req_s'), 2)} req/s, {_f(s.get('output_tok_s'), 0)} output tok/s", ""]  # fmt: skip
    if s.get("error"):
        lines.append(f"- error: {s['error']}")
    lines += ["| metric | count | p50 (ms) | p90 (ms) | p99 (ms) |", "|---|---|---|---|---|"]
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        q = s.get(key) or {}
        lines.append(
            f"| {name} | {q.get('count', '-')} | {_f(q.get('p50'), 1)} | {_f(q.get('p90'), 1)} | "
            f"{_f(q.get('p99'), 1)} |"
        )
    return "\n".join(lines)


def _f(x, digits: int) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"
