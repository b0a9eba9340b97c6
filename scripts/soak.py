"""Soak test: Locust W2 against a running minserve for N minutes, then leak and failure checks.

    python -m scripts.soak --url http://127.0.0.1:8000 --minutes 10 --out benchmarks/reports/soak_cpu
    python -m scripts.soak --serve-config serve_config.yaml --minutes 10    # starts `serve run` itself
    MINSERVE_API_KEY=... python -m scripts.soak ...                          # server with an API key

It primes the server with W2's largest requests (see `prime`), then runs `locust -f loadtests/
--headless --workload W2` (streaming, closed loop) while it reads the engine replica's resident
memory from GET /v1/engine/stats (`pid`, `rss_bytes`) every `--sample-s`.
It fails (exit 1) unless:
  * Locust recorded 0 failed requests (HTTP errors, error events, streams without [DONE]) and more
    than 0 successful ones;
  * once the server is idle afterwards, the KV audit (GET /v1/engine/audit) is clean and no KV block
    is in use;
  * the RSS after warm-up (the first `--warmup-s`, default min(60 s, 20% of the run)) grows less than
    `--max-rss-growth` (5%): the highest reading in the last fifth of the run after warm-up against
    the highest in its first fifth (see `rss_growth`);
  * the replica was not replaced during the run (one pid throughout).
Reports: PREFIX.json and PREFIX.md with `--out PREFIX`, Locust's PREFIX_*.csv next to them.

Locust and the API key: when MINSERVE_API_KEY is set, this file is also handed to Locust as a second
locustfile; imported there, it adds the bearer header to every `requests` session (the load test's
users and its start-up calls), as loadtests/ has no option for it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# glibc malloc settings for the server processes a soak measures. By default glibc raises its mmap
# threshold to the largest block freed so far, after which big CPU tensors come from the heap, and each
# thread may get its own arena; the heap then fragments and the RSS climbs in steps of tens of MB with
# no leak (a 6-minute W2 soak on the tiny model: floor 516 -> 567 MiB, peaks +9%). A fixed threshold
# (big blocks are always mmapped and returned on free) and two arenas keep the RSS at the live memory
# (same soak, 4 minutes: peaks 531-551 MiB throughout, growth -0.2%), so a rise means a leak. Costs
# ~14% of CPU serving throughput (page faults on fresh mmaps); not needed where tensors live on a GPU.
STEADY_MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "131072",
}


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
    """Locust W2, headless, closed loop; with a key, this file is a second locustfile (see the top)."""
    files = "loadtests/" + (f",{Path(__file__).resolve()}" if with_auth else "")
    users = str(args.users)
    return [sys.executable, "-m", "locust", "-f", files, "--host", args.url, "--headless"] + [
        "-u", users, "-r", users, "-t", f"{max(1, round(seconds))}s", "--workload", "W2",
        "--csv", str(prefix), "--only-summary", "--stop-timeout", "30",
    ]  # fmt: skip


def run_locust(args, http, prefix: Path, key: str) -> tuple[int, str, list[dict]]:
    """The headless Locust run; samples the replica's (pid, rss) every `sample_s` while it runs."""
    env = {**os.environ, "MINSERVE_GEN_SCALE": str(args.gen_scale), "MINSERVE_API_KEY": key}
    proc = subprocess.Popen(
        _locust_cmd(args, prefix, args.duration_s, bool(key)), cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    start, samples = time.monotonic(), []
    try:
        while True:
            s = http.get("/v1/engine/stats").json()
            t = round(time.monotonic() - start, 1)
            samples.append({"t": t, "pid": s.get("pid"), "rss": s.get("rss_bytes")})
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


def rss_growth(samples: list[dict], warmup_s: float) -> dict:
    """Highest RSS in the last fifth of the run after warm-up over the highest in its first fifth.

    Peaks of windows, not single readings: under load the RSS swings by tens of MB between readings
    (activations in flight), and glibc's malloc ratchets up once (its mmap threshold rises to the
    largest freed block, after which big tensors come from the heap and stay resident), so a reading
    low in the first window proves nothing. A leak raises the later peaks above the earlier ones."""
    after = [s for s in samples if s["t"] >= warmup_s and s["rss"]]
    if len(after) < 6:
        return {"first_window": None, "last_window": None, "growth": None}
    k = max(3, len(after) // 5)
    first, last = max(s["rss"] for s in after[:k]), max(s["rss"] for s in after[-k:])
    return {
        "first_window": first,
        "last_window": last,
        "growth": round(last / first - 1, 4),
        "window_samples": k,
        "min": min(s["rss"] for s in after),
        "max": max(s["rss"] for s in after),
    }


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


def wait_idle(http, timeout_s: float = 60.0) -> dict:
    """Stats once no stream is open, nothing runs or waits and no KV block is held (or at timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = http.get("/v1/engine/stats").json()
        busy = any(s[k] for k in ("kv_blocks_used", "num_running", "num_waiting", "ongoing_requests"))
        if not busy or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def prime(http, args, rounds: int = 2) -> None:
    """Send W2's largest requests (1024-token prompts, the longest generation), `users` at a time.

    The allocator's footprint ratchets up to the largest transient tensors it has seen (glibc serves
    freed sizes from its heap afterwards instead of returning them), so the RSS only settles once the
    biggest shapes went through; under random W2 traffic that can take minutes. Priming gets there at
    once, and the warm-up window after it measures the steady state."""
    card = http.get("/v1/models").json()["data"][0]
    gen = max(1, round(256 * args.gen_scale))
    length = max(1, min(1024, int(card.get("max_model_len") or 2048) - gen - 8))
    vocab = int(card.get("vocab_size") or 1000)
    rng = random.Random(0)
    body = {"model": card["id"], "max_tokens": gen, "ignore_eos": True}
    with ThreadPoolExecutor(args.users) as pool:
        for _ in range(rounds):
            prompts = [[rng.randrange(8, vocab) for _ in range(length)] for _ in range(args.users)]
            for resp in pool.map(lambda p: http.post("/v1/completions", json={**body, "prompt": p}), prompts):
                resp.raise_for_status()


def soak(args) -> dict:
    import httpx

    key = args.api_key or os.environ.get("MINSERVE_API_KEY") or ""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    prefix = Path(args.out or f"{os.environ.get('TMPDIR', '/tmp')}/minserve_soak")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with httpx.Client(base_url=args.url, headers=headers, timeout=300) as http:
        if args.prime:
            prime(http, args)
        rc, output, samples = run_locust(args, http, prefix, key)
        stats = wait_idle(http)
        time.sleep(0.6)  # the engine refreshes its audit at its next idle pass (at most 0.5 s apart)
        audit = http.get("/v1/engine/audit").json()["problems"]
    report = {
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "users": args.users,
        "gen_scale": args.gen_scale,
        "locust_exit_code": rc,
        **locust_totals(prefix),
        "rss": rss_growth(samples, args.warmup_s),
        "replica_pids": sorted({s["pid"] for s in samples}),
        "kv_blocks_used_after": stats["kv_blocks_used"],
        "audit_problems": audit,
        "rss_samples": samples,
    }
    growth = report["rss"]["growth"]
    report["ok"] = bool(
        rc == 0
        and report["requests"] > 0
        and report["failures"] == 0
        and not audit
        and stats["kv_blocks_used"] == 0
        and growth is not None
        and growth < args.max_rss_growth
        and len(report["replica_pids"]) == 1
    )
    if not report["ok"]:
        report["locust_output_tail"] = output[-3000:]
    return report


# ---------------------------------------------------------------- optional server, CLI


def start_server(config: str, url: str) -> subprocess.Popen:
    import httpx

    log = open(f"{os.environ.get('TMPDIR', '/tmp')}/minserve_soak_server.log", "w")
    env = {**os.environ, **STEADY_MALLOC_ENV}  # inherited by the Ray cluster `serve run` starts
    proc = subprocess.Popen([str(ROOT / ".venv/bin/serve"), "run", config], cwd=ROOT, stdout=log, stderr=log,
                            env=env)  # fmt: skip
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


def _mib(b: int | None) -> str:
    return f"{b / 2**20:.0f} MiB" if b else "n/a"


def _markdown(r: dict) -> str:
    rss = r["rss"]
    return (
        f"# Soak: Locust W2, {r['duration_s'] / 60:.1f} min, {r['users']} users, "
        f"generation x{r['gen_scale']}\n\nResult: **{'PASS' if r['ok'] else 'FAIL'}**\n\n"
        f"| requests | failures | req/s | TTFT p50/p95 ms | ITL p50/p95 ms | E2E p50/p95 ms |\n"
        f"|---|---|---|---|---|---|\n| {r['requests']} | {r['failures']} | {r['requests_per_s']} | "
        f"{r['ttft_ms']['p50']} / {r['ttft_ms']['p95']} | {r['itl_ms']['p50']} / {r['itl_ms']['p95']} | "
        f"{r['e2e_ms']['p50']} / {r['e2e_ms']['p95']} |\n\n"
        f"* engine replica RSS after the {r['warmup_s']:.0f} s warm-up: peak "
        f"{_mib(rss['first_window'])} in the first fifth, {_mib(rss['last_window'])} in the last fifth: "
        f"growth {rss['growth']} (limit 0.05); range {_mib(rss.get('min'))} to {_mib(rss.get('max'))}\n"
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
    p.add_argument("--no-prime", dest="prime", action="store_false", help="skip the priming requests")
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
