"""Summaries of served load runs: TTFT / ITL / E2E percentiles, and serve_overhead's report tables.

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
import statistics
from pathlib import Path

from benchmarks.ab_report import serve_ab_markdown

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
    """The summary of one load run directory (optional meta.json + Locust CSV or client summary)."""
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


# ---------------------------------------------------------------- benchmarks/serve_overhead.py's report
OVERHEAD_TARGETS = ((64, 0.85), (256, 0.80))  # served out tok/s >= this share of offline, at these users
TTFT_USERS, TTFT_SLACK_MS = 64, 25.0  # served TTFT p50 <= offline TTFT p50 + 25 ms, at 64 users
CPU_COLS = ("engine core", "replica", "ingress", "proxy", "controller", "client", "other ray")


def _metric(run: dict | None, key: str, q: str | None = None):
    s = (run or {}).get("summary") or {}
    return s.get(key) if q is None else (s.get(key) or {}).get(q)


def overhead_acceptance(runs: list[dict]) -> list[dict]:
    """The acceptance checks per variant, at the user counts that were run; pass None = not measurable."""
    offline = {r["users"]: r for r in runs if r["stack"] == "offline"}
    counts, checks = {r["users"] for r in runs}, []
    for variant in dict.fromkeys(r["variant"] for r in runs if r["stack"] == "served"):
        served = {r["users"]: r for r in runs if r["stack"] == "served" and r["variant"] == variant}
        for users, share in OVERHEAD_TARGETS:
            if users in counts:
                s, o = _metric(served.get(users), "output_tok_s"), _metric(offline.get(users), "output_tok_s")
                value = s / o if s is not None and o else None
                checks.append({"variant": variant, "users": users, "unit": "ratio", "limit": share,
                               "value": value, "check": f"served out tok/s >= {share:.0%} of offline",
                               "pass": None if value is None else value >= share})  # fmt: skip
        if TTFT_USERS in counts:
            s, o = (_metric(d.get(TTFT_USERS), "ttft_ms", "p50") for d in (served, offline))
            value = s - o if s is not None and o is not None else None
            check = f"served TTFT p50 <= offline TTFT p50 + {TTFT_SLACK_MS:g} ms"
            checks.append({"variant": variant, "users": TTFT_USERS, "unit": "ms", "limit": TTFT_SLACK_MS,
                           "value": value, "check": check,
                           "pass": None if value is None else value <= TTFT_SLACK_MS})  # fmt: skip
    return checks


def _busy_cells(run: dict) -> list[str]:
    """GPU busy (trace) and dmon's sm mean / p50 of a served or null window."""
    busy = run.get("gpu_busy") or {}
    trace, dmon = (busy.get("trace") or {}).get("busy_fraction"), busy.get("dmon") or {}
    sm = (
        f"{_f(dmon.get('sm_mean'), 0)} / {_f(dmon.get('sm_p50'), 0)}"
        if dmon.get("sm_mean") is not None
        else "-"
    )
    return ["-" if trace is None else f"{trace:.1%}", sm]


def _overhead_row(run: dict, offline: dict, trees: bool = False) -> str:
    tok = _metric(run, "output_tok_s")
    base = _metric(offline.get((run.get("tree", "new"), run["users"])), "output_tok_s")
    ratio = f"{tok / base:.1%}" if tok is not None and base and run["stack"] != "offline" else "-"
    ideal = f"{_f(run['ideal_tok_s'], 0)} ({run['null_step_ms']:.2f} ms)" if "ideal_tok_s" in run else "-"
    q = [_f(_metric(run, k, p), 1) for k in ("ttft_ms", "itl_ms") for p in ("p50", "p99")]
    fail = "error" if "error" in run else str(_metric(run, "failures"))
    cpu = [_f((run.get("cpu") or {}).get(c), 0) for c in CPU_COLS]
    if run["stack"] == "offline":  # the twin is one process: engine and load loop together
        cpu = [_f((run.get("cpu") or {}).get("offline twin"), 0)] + ["-"] * (len(CPU_COLS) - 1)
    cells = [run["variant"], run["stack"], str(run["users"]), _f(tok, 0), ratio, ideal, *_busy_cells(run), *q]
    cells = ([run.get("tree", "new")] if trees else []) + cells + [fail, *cpu]
    return "| " + " | ".join(cells) + " |"


def _busy_notes(runs: list[dict]) -> list[str]:
    """Why a window's GPU busy is missing (no CUDA, an old core, no nvidia-smi), once per reason."""
    notes = {}
    for r in runs:
        for how in ("trace", "dmon"):
            why = ((r.get("gpu_busy") or {}).get(how) or {}).get("reason")
            if why:
                notes.setdefault(f"{how}: {why}"[:300], []).append(
                    f"{r.get('tree', 'new')} {r['stack']} {r['users']}"
                )
    if not notes:
        return []
    return ["", "### GPU busy not measured", "", *(f"- {why} ({', '.join(at)})" for why, at in notes.items())]


def _check_value(c: dict) -> str:
    if c["value"] is None:
        return "not measured"
    return f"{c['value']:.1%}" if c["unit"] == "ratio" else f"{c['value']:+.1f} ms over offline"


LATENCY_COLS = (
    ("in_ingress_ms", "in ingress"), ("to_replica_ms", "to replica"), ("to_core_ms", "to core"),
    ("queue_ms", "queue"),
    ("engine_ttft_ms", "engine TTFT"), ("replica_ttft_ms", "replica TTFT"),
)  # fmt: skip


def _latency_table(runs: list[dict]) -> list[str]:
    """Where the time to first token goes, p50 in ms from the request's arrival (at the ingress when
    served, from the replica's log lines; at add_request offline) next to the client's TTFT p50."""
    rows = [r for r in runs if r.get("latency")]
    if not rows:
        return []
    trees = any(r.get("tree", "new") != "new" for r in runs)
    head = [*(["tree"] if trees else []), "variant", "stack", "users", "client TTFT"]
    head += [name for _, name in LATENCY_COLS]
    lines = ["", "### Where TTFT goes (p50, ms from arrival: ingress if served, add_request offline)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for r in rows:
        cells = [_f((r["latency"].get(k) or {}).get("p50"), 1) for k, _ in LATENCY_COLS]
        client = _f(_metric(r, "ttft_ms", "p50"), 1)
        tree = [r.get("tree", "new")] if trees else []
        lines.append(
            "| " + " | ".join([*tree, r["variant"], r["stack"], str(r["users"]), client, *cells]) + " |"
        )
    return lines


def warning_lines(runs: list[dict]) -> list[str]:
    """Serve's warnings that held or refused calls (serve_stack.SERVE_WARNINGS), per window that had any."""
    rows = [(r, w) for r in runs if (w := r.get("serve_warnings")) and any(w.values())]
    if not rows:
        return []
    lines = ["", "### Serve's warnings in the window (router probe timeouts, unrouted calls, rejections)", ""]
    for r, w in rows:
        counts = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in w.items())
        lines.append(f"- {r.get('tree', 'new')} {r['variant']} {r['stack']} {r['users']} users: {counts}")
    return lines


def rounds_table(runs: list[dict]) -> list[str]:
    """With --rounds: per (tree, variant, stack, users), the median and the range over the rounds
    (variants named NAME#R) of out tok/s and TTFT p50; empty without rounds."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        name, sep, _ = r["variant"].partition("#")
        if sep and "summary" in r:
            groups.setdefault((r.get("tree", "new"), name, r["stack"], r["users"]), []).append(r)
    if not groups:
        return []
    head = "| tree | variant | stack | users | rounds | out tok/s | TTFT p50 |"
    lines = ["", "### Over rounds (median, min-max)", "", head, "|---|---|---|---|---|---|---|"]
    for (tree, name, stack, users), rs in groups.items():
        cells = []
        for key, q, d in (("output_tok_s", None, 0), ("ttft_ms", "p50", 1)):
            v = sorted(x for x in (_metric(r, key, q) for r in rs) if x is not None)
            cells.append(f"{_f(statistics.median(v), d)} ({_f(v[0], d)}-{_f(v[-1], d)})" if v else "-")
        lines.append(f"| {tree} | {name} | {stack} | {users} | {len(rs)} | {cells[0]} | {cells[1]} |")
    return lines


def overhead_markdown(report: dict) -> str:
    """serve_overhead's table: one row per (variant, stack, users), then the acceptance lines."""
    runs, host = report.get("runs", []), report.get("host") or {}
    offline = {(r.get("tree", "new"), r["users"]): r for r in runs if r["stack"] == "offline"}
    gpu, trees = (host.get("hardware") or {}).get("gpu") or "CPU", len(report.get("trees") or []) > 1
    head = [*(["tree"] if trees else []), "variant", "stack", "users", "out tok/s", "vs offline",
            "ideal tok/s (step)", "GPU busy (trace)", "SM% dmon mean / p50", "TTFT p50", "TTFT p99",
            "ITL p50", "ITL p99", "failed", *(f"CPU% {c}" for c in CPU_COLS)]  # fmt: skip
    s = report.get("settings") or {}
    lines = [f"## Serving overhead: {report.get('model')} on {gpu}", "",
             f"- `{report.get('command')}` at {host.get('git_commit')}, {report.get('started')}",
             f"- {s.get('workload')} closed loop, {s.get('duration')} s per window after a "
             f"{s.get('warmup')} s warm-up, users start at {s.get('spawn_rate')}/s; times in ms; CPU% = "
             "CPU s / wall s x 100 (offline: the twin's one process, engine and load loop)",
             "- GPU busy (trace): the engine core's kernel trace over the window (SIGUSR1 .. SIGUSR2), the "
             "union of its device intervals / wall; SM% dmon: `nvidia-smi dmon -s u -d 1`, the driver's "
             "sampled SM utilisation (% of each ~1 s sample with a kernel running), mean / p50 over the "
             "window's samples", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    lines += [_overhead_row(r, offline, trees) for r in runs]
    lines += serve_ab_markdown(report) + _busy_notes(runs) + _latency_table(runs) + rounds_table(runs)
    lines += warning_lines(runs)
    lines += ["", "### Acceptance", ""]
    if not report.get("acceptance"):
        at = ", ".join(str(u) for u, _ in OVERHEAD_TARGETS)
        lines.append(f"- no served run at the user counts with targets ({at} users)")
    for c in report.get("acceptance") or []:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[c["pass"]]
        lines.append(f"- {verdict} ({c['variant']}, {c['users']} users) {c['check']}: {_check_value(c)}")
    errors = [f"- {r['variant']} {r['stack']} {r['users']}: {r['error'][:400]}" for r in runs if "error" in r]
    return "\n".join(lines + (["", "### Errors", "", *errors] if errors else [])) + "\n"
