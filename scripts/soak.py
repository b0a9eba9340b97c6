"""Soak test: Locust W2 against a running minserve for N minutes, then leak and failure checks.

    python -m scripts.soak --url http://127.0.0.1:8000 --minutes 10 --out benchmarks/reports/soak_cpu
    python -m scripts.soak --serve-config serve_config.yaml --minutes 10    # starts `serve run` itself
    MINSERVE_API_KEY=... python -m scripts.soak ...                          # server with an API key

It runs `locust -f loadtests/ --headless --workload W2` (streaming, closed loop) twice: a warm-up
run of `--warmup-s` (default min(60 s, 20% of the run)), then the main run for the rest. After each,
once the server is idle, it reads the engine replica's resident memory (GET /v1/engine/stats: `pid`,
`rss_bytes`); idle readings compare like with like, while under load the RSS swings by tens of MB
with the activations in flight (sampled every `--sample-s` for the report). It fails (exit 1) unless:
  * Locust recorded 0 failed requests in both runs (HTTP errors, error events, streams without
    [DONE]) and more than 0 successful ones;
  * after the run the KV audit (GET /v1/engine/audit) is clean and no KV block is in use;
  * the idle RSS at the end is less than `--max-rss-growth` (5%) above the idle RSS after warm-up;
  * the replica was not replaced during the run (one pid throughout).
Reports: PREFIX.json and PREFIX.md with `--out PREFIX` (Locust's CSV files next to them:
PREFIX_stats.csv for the main run, PREFIX_warmup_stats.csv for the warm-up).

Locust and the API key: when MINSERVE_API_KEY is set, this file is also handed to Locust as a second
locustfile; imported there, it adds the bearer header to every `requests` session (the load test's
users and its start-up calls), as loadtests/ has no option for it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _install_locust_auth() -> None:
    """Imported by Locust as a locustfile: send the API key with every request."""
    key = os.environ.get("MINSERVE_API_KEY")
    if not key:
        return
    import requests

    original = requests.Session.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        self.headers["Authorization"] = f"Bearer {key}"

    requests.Session.__init__ = init


if __name__ != "__main__" and "locust" in sys.modules:
    _install_locust_auth()


# ---------------------------------------------------------------- the soak run


def _locust_cmd(args, prefix: Path, seconds: float, with_auth: bool) -> list[str]:
    files = "loadtests/" + (f",{Path(__file__).resolve()}" if with_auth else "")
    users = str(args.users)
    return [sys.executable, "-m", "locust", "-f", files, "--host", args.url, "--headless"] + [
        "-u", users, "-r", users, "-t", f"{max(1, round(seconds))}s", "--workload", "W2",
        "--csv", str(prefix), "--only-summary", "--stop-timeout", "30",
    ]  # fmt: skip


def run_locust(args, http, prefix: Path, seconds: float, key: str) -> tuple[int, str, list[dict]]:
    """One headless Locust run; samples the replica's (pid, rss) every `sample_s` while it runs."""
    env = {**os.environ, "MINSERVE_GEN_SCALE": str(args.gen_scale), "MINSERVE_API_KEY": key}
    proc = subprocess.Popen(
        _locust_cmd(args, prefix, seconds, bool(key)), cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    samples = []
    try:
        while True:
            s = http.get("/v1/engine/stats").json()
            samples.append({"t": round(time.time(), 1), "pid": s.get("pid"), "rss": s.get("rss_bytes")})
            try:
                proc.wait(timeout=args.sample_s)
                break
            except subprocess.TimeoutExpired:
                pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, proc.stdout.read() if proc.stdout else "", samples


def locust_totals(prefix: Path) -> dict:
    rows = list(csv.DictReader(open(f"{prefix}_stats.csv")))
    by_type = {r["Type"]: r for r in rows if r["Name"].startswith("W2")}

    def num(kind: str, col: str) -> float | None:
        row = by_type.get(kind)
        return float(row[col]) if row and row[col] not in ("", "N/A") else None

    return {
        "requests": int(num("POST", "Request Count") or 0),
        "failures": sum(int(r["Failure Count"]) for r in rows if r["Name"] != "Aggregated"),
        "requests_per_s": round(num("POST", "Requests/s") or 0.0, 2),
        "ttft_ms": {"p50": num("TTFT", "50%"), "p95": num("TTFT", "95%")},
        "itl_ms": {"p50": num("ITL", "50%"), "p95": num("ITL", "95%")},
        "e2e_ms": {"p50": num("E2E", "50%"), "p95": num("E2E", "95%")},
    }


def idle_rss(http, timeout_s: float = 60.0) -> tuple[dict, int | None]:
    """Wait until the engine is idle (no stream, nothing running or waiting, no KV block held); then
    the replica's RSS, the median of 5 readings 0.2 s apart. Idle readings compare like with like:
    under load the RSS swings by tens of MB with the activations of whatever is running."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = http.get("/v1/engine/stats").json()
        busy = any(s[k] for k in ("kv_blocks_used", "num_running", "num_waiting", "ongoing_requests"))
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    readings = []
    for _ in range(5):
        readings.append(http.get("/v1/engine/stats").json().get("rss_bytes"))
        time.sleep(0.2)
    return s, (None if None in readings else sorted(readings)[2])


def soak(args) -> dict:
    """Warm-up run, idle RSS; main run, idle RSS, KV audit. Locust failures of both runs count."""
    import httpx

    key = args.api_key or os.environ.get("MINSERVE_API_KEY") or ""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    prefix = Path(args.out or f"{os.environ.get('TMPDIR', '/tmp')}/minserve_soak")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    warm_prefix = prefix.with_name(prefix.name + "_warmup")
    with httpx.Client(base_url=args.url, headers=headers, timeout=30) as http:
        warm_rc, warm_out, warm_samples = run_locust(args, http, warm_prefix, args.warmup_s, key)
        _, rss_warm = idle_rss(http)
        rc, out, samples = run_locust(args, http, prefix, args.duration_s - args.warmup_s, key)
        stats, rss_end = idle_rss(http)
        time.sleep(0.6)  # the engine refreshes its audit at its next idle pass (at most 0.5 s apart)
        audit = http.get("/v1/engine/audit").json()["problems"]
    warm, main_run = locust_totals(warm_prefix), locust_totals(prefix)
    growth = round(rss_end / rss_warm - 1, 4) if rss_warm and rss_end else None
    t0 = warm_samples[0]["t"] if warm_samples else 0
    report = {
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "users": args.users,
        "gen_scale": args.gen_scale,
        "locust_exit_codes": [warm_rc, rc],
        "warmup": {"requests": warm["requests"], "failures": warm["failures"]},
        **main_run,
        "failures": warm["failures"] + main_run["failures"],
        "rss": {
            "idle_after_warmup": rss_warm,
            "idle_at_end": rss_end,
            "growth": growth,
            "max_under_load": max((s["rss"] or 0 for s in samples), default=None),
        },
        "replica_pids": sorted({s["pid"] for s in warm_samples + samples}),
        "kv_blocks_used_after": stats["kv_blocks_used"],
        "audit_problems": audit,
        "rss_samples": [{**s, "t": round(s["t"] - t0, 1)} for s in warm_samples + samples],
    }
    report["ok"] = bool(
        warm_rc == 0
        and rc == 0
        and report["requests"] > 0
        and report["failures"] == 0
        and not audit
        and stats["kv_blocks_used"] == 0
        and growth is not None
        and growth < args.max_rss_growth
        and len(report["replica_pids"]) == 1
    )
    if not report["ok"]:
        report["locust_output_tail"] = (warm_out[-1500:] + "\n...\n" + out[-3000:]).strip()
    return report


# ---------------------------------------------------------------- optional server, CLI


def start_server(config: str, url: str) -> subprocess.Popen:
    import httpx

    log = open(f"{os.environ.get('TMPDIR', '/tmp')}/minserve_soak_server.log", "w")
    proc = subprocess.Popen([str(ROOT / ".venv/bin/serve"), "run", config], cwd=ROOT, stdout=log, stderr=log)
    key = os.environ.get("MINSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for _ in range(180):
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited; see {log.name}")
        time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"server not healthy after 180 s; see {log.name}")


def _markdown(r: dict) -> str:
    rss = r["rss"]
    mib = lambda b: f"{b / 2**20:.0f} MiB" if b else "n/a"  # noqa: E731
    return (
        f"# Soak: Locust W2, {r['duration_s'] / 60:.1f} min, {r['users']} users, "
        f"generation x{r['gen_scale']}\n\nResult: **{'PASS' if r['ok'] else 'FAIL'}**\n\n"
        f"| requests | failures | req/s | TTFT p50/p95 ms | ITL p50/p95 ms | E2E p50/p95 ms |\n"
        f"|---|---|---|---|---|---|\n| {r['requests']} | {r['failures']} | {r['requests_per_s']} | "
        f"{r['ttft_ms']['p50']} / {r['ttft_ms']['p95']} | {r['itl_ms']['p50']} / {r['itl_ms']['p95']} | "
        f"{r['e2e_ms']['p50']} / {r['e2e_ms']['p95']} |\n\n"
        f"* engine replica RSS, idle: {mib(rss['idle_after_warmup'])} after the {r['warmup_s']:.0f} s "
        f"warm-up, {mib(rss['idle_at_end'])} at the end: growth {rss['growth']} (limit 0.05); "
        f"at most {mib(rss['max_under_load'])} under load\n"
        f"* replica pid(s): {r['replica_pids']}; KV blocks in use after: {r['kv_blocks_used_after']}; "
        f"audit problems: {r['audit_problems'] or 'none'}\n"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--serve-config", default="", help="start `serve run CONFIG` first (and stop it)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--gen-scale", type=float, default=0.25, help="W2 generation lengths x this")
    p.add_argument("--warmup-s", type=float, default=None, help="default: min(60, 20%% of the run)")
    p.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--api-key", default="", help="default: $MINSERVE_API_KEY")
    p.add_argument("--out", default="", help="report prefix: PREFIX.json, PREFIX.md, PREFIX_*.csv")
    args = p.parse_args(argv)
    args.duration_s = args.minutes * 60
    if args.warmup_s is None:
        args.warmup_s = min(60.0, 0.2 * args.duration_s)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = start_server(args.serve_config, args.url) if args.serve_config else None
    try:
        report = soak(args)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    summary = {k: v for k, v in report.items() if k != "rss_samples"}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
        Path(f"{args.out}.md").write_text(_markdown(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
