"""Metric check (issue 27): the server's TTFT histogram against Locust's client-side TTFT, one CPU run.

    .venv/bin/python -m benchmarks.ttft_check --users 4,16 --duration 60s

starts `serve run serve_config.yaml` (port 8000, in a session of its own; benchmarks/serve_stack.py),
warms it up, snapshots the Prometheus histograms at the Ray metrics port of that server's own Ray node
(read from its session directory, not from /tmp/ray/session_latest, which another Ray on the box may
own), then for each --users value runs `scripts/run_locust.sh` against it (HOST set, so the script
starts no server of its own), waits until the histograms stop moving, and compares that run's histogram
deltas with Locust's TTFT row. Writes benchmarks/reports/ttft_check_cpu.{json,md}; Locust's CSV files go
to benchmarks/runs/ttft_check/ (git-ignored). About 5 minutes for two 60 s runs on the 2-core CPU box.

Server p50 is interpolated inside the histogram bucket that holds the median (as Prometheus'
histogram_quantile does), so it is only as fine as the buckets (5 ms wide between 10 and 60 ms); the
median of the engine replica's one log line per request (first token in the replica, one hop before the
ingress), and both means (the histogram's sum / count is exact), are reported next to it. Target:
server p50 within 10% of Locust's p50.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.common import git_commit
from benchmarks.proc_cpu import session_pids
from benchmarks.serve_stack import ROOT, Server, child_env, log, replica_log_marks, replica_log_values

TTFT = "minserve_time_to_first_token_seconds"
TARGET = 0.10
_BUCKET = re.compile(r"^ray_(minserve_\w+)_bucket\{([^}]*)\} (\S+)$", re.M)
_SUM_COUNT = re.compile(r"^ray_(minserve_\w+_seconds)_(sum|count)\{([^}]*)\} (\S+)$", re.M)


def session_dir(server: Server) -> Path:
    """The Ray session directory of this server's own raylet (a process of the server's session)."""
    import psutil

    for pid in session_pids(server.proc.pid):
        try:
            args = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        for arg in args:
            if arg.startswith("--session_dir="):
                return Path(arg.split("=", 1)[1])
    raise RuntimeError("no raylet with --session_dir= among the server's processes")


def metrics_url(session: Path) -> str:
    (port_file,) = session.glob("metrics_export_port_*")
    return f"http://127.0.0.1:{int(port_file.read_text().strip())}/metrics"


def scrape(url: str) -> dict:
    """{histogram: {"buckets": {le: cumulative count}, "sum": s, "count": n}}, summed over replicas."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict = {}
    for name, labels, value in _BUCKET.findall(text):
        le = re.search(r'le="([^"]+)"', labels).group(1)
        h = out.setdefault(name, {"buckets": {}, "sum": 0.0, "count": 0.0})
        h["buckets"][le] = h["buckets"].get(le, 0.0) + float(value)
    for name, kind, _labels, value in _SUM_COUNT.findall(text):
        if name in out:
            out[name][kind] += float(value)
    return out


def delta(after: dict, before: dict) -> dict:
    out = {}
    for name, h in after.items():
        b = before.get(name, {"buckets": {}, "sum": 0.0, "count": 0.0})
        out[name] = {
            "buckets": {le: c - b["buckets"].get(le, 0.0) for le, c in h["buckets"].items()},
            "sum": h["sum"] - b["sum"],
            "count": h["count"] - b["count"],
        }
    return out


def quantile(h: dict, q: float) -> float | None:
    """histogram_quantile: linear inside the bucket that holds rank q * count (seconds)."""
    bounds = sorted(((float(le), c) for le, c in h["buckets"].items()), key=lambda x: x[0])
    total = bounds[-1][1] if bounds else 0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper, cum in bounds:
        if cum >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(cum - below, 1e-12)
        lower, below = upper, cum
    return lower


def bucket_of(h: dict, q: float) -> list[float]:
    bounds = sorted(((float(le), c) for le, c in h["buckets"].items()), key=lambda x: x[0])
    lower, rank = 0.0, q * bounds[-1][1]
    for upper, cum in bounds:
        if cum >= rank:
            return [lower, upper]
        lower = upper
    return [lower, float("inf")]


def wait_settled(url: str, name: str, timeout_s: float = 90.0, every_s: float = 6.0) -> dict:
    """Scrape until the histogram's count is the same twice in a row (Ray reports every few seconds)."""
    last, deadline = None, time.monotonic() + timeout_s
    while True:
        time.sleep(every_s)
        snap = scrape(url)
        count = snap.get(name, {}).get("count")
        if (count is not None and count == last) or time.monotonic() > deadline:
            return snap
        last = count


def median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def locust_row(prefix: Path, kind: str) -> dict:
    rows = [r for r in csv.DictReader(open(f"{prefix}_stats.csv")) if r["Type"] == kind]
    (row,) = [r for r in rows if r["Name"] != "Aggregated"] or rows
    return {
        "name": row["Name"],
        "count": int(row["Request Count"]),
        "median_ms": float(row["Median Response Time"]),
        "p50_ms": float(row["50%"]),
        "p90_ms": float(row["90%"]),
        "mean_ms": float(row["Average Response Time"]),
    }


def warm_up(url: str, model: str, n: int = 4) -> None:
    body = json.dumps({"model": model, "prompt": "warm up " * 20, "max_tokens": 8, "stream": True}).encode()
    for _ in range(n):
        req = urllib.request.Request(
            f"{url}/v1/completions", data=body, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()


def machine() -> dict:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.machine(),
    )
    load = os.getloadavg()
    return {
        "cpu": model,
        "cpu_count": os.cpu_count(),
        "loadavg_at_end": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "hostname": platform.node(),
        "git_commit": git_commit(ROOT),
    }


def run_summary(run: dict, prefix: Path, lines: dict, users: int) -> dict:
    """One Locust run: Locust's TTFT row beside the server's histogram deltas and log lines."""
    hist = run[TTFT]
    locust = locust_row(prefix, "TTFT")
    server = {
        "histogram": f"ray_{TTFT}",
        "hist_p50_ms": 1000 * quantile(hist, 0.5),
        "hist_p50_bucket_ms": [1000 * b for b in bucket_of(hist, 0.5)],
        "hist_mean_ms": 1000 * hist["sum"] / hist["count"],
        "hist_count": hist["count"],
        "hist_buckets_delta": hist["buckets"],
        "other_ttft_histograms": {
            f"ray_{name}": {
                "p50_ms": 1000 * quantile(h, 0.5),
                "mean_ms": 1000 * h["sum"] / max(h["count"], 1),
                "count": h["count"],
            }
            for name, h in run.items()
            if "first_token" in name and name != TTFT and h["count"] > 0
        },
        "log_count": len(lines["replica_ttft_ms"]),
        "log_ttft_p50_ms": median(lines["replica_ttft_ms"]),
        "log_engine_ttft_p50_ms": median(lines["engine_ttft_ms"]),
        "log_queue_p50_ms": median(lines["queue_ms"]),
    }
    ratio = server["hist_p50_ms"] / locust["p50_ms"]
    return {
        "users": users,
        "locust": locust,
        "server": server,
        "ratio_p50": ratio,
        "within_target": abs(ratio - 1) <= TARGET,
    }


def markdown(r: dict) -> str:
    verdicts = ", ".join(f"{x['users']} users {'PASS' if x['within_target'] else 'FAIL'}" for x in r["runs"])
    lines = [
        f"# TTFT check, CPU: server histogram p50 vs Locust p50 ({verdicts})",
        "",
        f"Locust W2, {r['duration']} per run, generation x{r['gen_scale']}, against one "
        f"`serve run serve_config.yaml` (tiny model, CPU); the runs follow each other, each compared with "
        f"the histogram's growth over that run. Target: server p50 within {int(TARGET * 100)}% of "
        "Locust's p50. Server TTFT is observed in the ingress, from its arrival time to the first generated "
        "text handed to the HTTP response; Locust's from sending the request to reading the first "
        "streamed text.",
        "",
        "| users | figure | Locust (client) | server | server / Locust |",
        "|---|---|---|---|---|",
    ]
    for x in r["runs"]:
        s, lc, u = x["server"], x["locust"], x["users"]
        lo, hi = s["hist_p50_bucket_ms"]
        lines.append(
            f"| {u} | TTFT p50, ms | {lc['p50_ms']:.1f} | {s['hist_p50_ms']:.1f} (histogram, interpolated "
            f"in its [{lo:.0f}, {hi:.0f}] ms bucket) | **{x['ratio_p50']:.3f}** |"
        )
        if s.get("log_ttft_p50_ms") is not None:
            lines.append(
                f"| {u} | first token in the engine replica, p50 ms | {lc['p50_ms']:.1f} | "
                f"{s['log_ttft_p50_ms']:.1f} (replica log lines, {s['log_count']} requests) | "
                f"{s['log_ttft_p50_ms'] / lc['p50_ms']:.3f} |"
            )
        lines.append(
            f"| {u} | TTFT mean, ms | {lc['mean_ms']:.1f} | {s['hist_mean_ms']:.1f} (histogram sum / "
            f"count) | {s['hist_mean_ms'] / lc['mean_ms']:.3f} |"
        )
        lines.append(f"| {u} | requests | {lc['count']} | {s['hist_count']:.0f} | |")
    lines.append("")
    for x in r["runs"]:
        s = x["server"]
        parts = [
            f"`{name}` p50 {h['p50_ms']:.1f} ms, mean {h['mean_ms']:.1f} ms"
            for name, h in s["other_ttft_histograms"].items()
        ]
        if s.get("log_engine_ttft_p50_ms") is not None:
            parts.append(
                f"replica log p50s from ingress arrival: queue {s['log_queue_p50_ms']:.1f} ms, first token "
                f"sampled in the core {s['log_engine_ttft_p50_ms']:.1f} ms, first token in the replica "
                f"{s['log_ttft_p50_ms']:.1f} ms"
            )
        lines.append(f"* {x['users']} users: " + "; ".join(parts) + ".")
    m = r["machine"]
    lines += [
        "",
        f"Machine: {m['cpu']}, {m['cpu_count']} cores, shared with other work (load average at the end "
        f"{m['loadavg_at_end']}); Python {m['python']}; commit {m['git_commit']}; {r['when']}.",
        "",
        f"Command: `{r['command']}`. Each Locust run: "
        + "; ".join(f"`{x['locust_command']}`" for x in r["runs"])
        + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", default="4", help="comma-separated: one Locust run per value")
    ap.add_argument("--duration", default="60s")
    ap.add_argument("--gen-scale", default="0.25")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "reports" / "ttft_check_cpu")
    ap.add_argument("--runs", type=Path, default=ROOT / "benchmarks" / "runs" / "ttft_check")
    args = ap.parse_args(argv)

    import yaml

    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    cfg["http_options"]["port"] = args.port
    server = Server(cfg, args.runs, child_env(), args.port)
    runs = []
    try:
        server.start(timeout=240)
        session = session_dir(server)
        url = metrics_url(session)
        model = json.load(urllib.request.urlopen(f"{server.url}/v1/models", timeout=10))["data"][0]["id"]
        log(f"session {session.name}, metrics at {url}")
        warm_up(server.url, model)
        for users in [int(u) for u in args.users.split(",")]:
            prefix = args.runs / f"locust_w2_u{users}"
            env = {
                **os.environ,
                "HOST": server.url,
                "USERS": str(users),
                "DURATION": args.duration,
                "OUT": str(prefix),
                "MINSERVE_GEN_SCALE": args.gen_scale,
            }
            locust_cmd = (
                f"HOST={server.url} USERS={users} DURATION={args.duration} "
                f"OUT={prefix.relative_to(ROOT)} MINSERVE_GEN_SCALE={args.gen_scale} scripts/run_locust.sh"
            )
            before = wait_settled(url, TTFT)
            marks = replica_log_marks(session / "logs" / "serve")
            log(f"locust: {locust_cmd}")
            proc = subprocess.run(["bash", "scripts/run_locust.sh"], cwd=ROOT, env=env, text=True)
            if proc.returncode:
                log(f"locust exited {proc.returncode}")
                return 1
            after = wait_settled(url, TTFT)
            time.sleep(2)  # the replica flushes its buffered log lines about once a second
            lines = replica_log_values(marks, session / "logs" / "serve")
            summary = run_summary(delta(after, before), prefix, lines, users)
            runs.append({**summary, "locust_command": locust_cmd})
    finally:
        server.stop()

    result = {
        "command": ".venv/bin/python -m benchmarks.ttft_check " + " ".join(argv or sys.argv[1:]),
        "duration": args.duration,
        "gen_scale": args.gen_scale,
        "target": TARGET,
        "runs": runs,
        "within_target": all(x["within_target"] for x in runs),
        "machine": machine(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
