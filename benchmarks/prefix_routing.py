"""Prefix-aware routing against Serve's default router, through `serve run` (tiny model on CPU, or any
checkpoint on a GPU host), on the multi-prefix multi-turn workload of benchmarks/prefix_workload.py.

    python -m benchmarks.prefix_routing --replicas 2,4 --out benchmarks/reports/prefix_routing_cpu
    python -m benchmarks.prefix_routing --micro          # the routing cost alone, no server
    python -m benchmarks.prefix_routing --model llama-3.2-1b --prefix-len 1536 --blocks 640 \
        --max-tokens 16 --concurrency 8 --out benchmarks/reports/gpu/prefix_routing_h100   # GPU host

On a GPU host the replicas share the one GPU (num_gpus 1/R each, the pool sized by --blocks); a model
name from scripts.make_model (not a path) is made as random bf16 weights in /tmp/minserve_bench.

For R replicas the workload has 4R system prompts and each replica a KV pool of `--blocks`, which
holds about half of them: the default router makes every replica see every prompt, the prefix-aware
one gives each prompt a home. A single replica with all R pools in one is the reference hit rate.
Each configuration is a fresh `serve run`: one warm-up pass, then `--repeat` measured passes, each
with system prompts of its own; the table gives their mean (TTFT: mean of the passes' percentiles).
Those passes are closed loop (a faster router also gets more requests/s); `--open-loop F` adds one
open-loop pass per router at F times the default router's closed-loop requests/s, so both compare at
equal throughput.
"""

from __future__ import annotations

import argparse
import importlib
import pickle
import random
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

from benchmarks.common import environment, git_commit, write_report
from benchmarks.prefix_workload import Workload, run
from benchmarks.serve_stack import ROOT, Server, child_env, ensure_checkpoint, serve_config

PORT = 8000


def _config(
    device: str, ckpt: str, replicas: int, blocks: int, prefix_aware: bool | None, gpus: float | None = None
) -> dict:
    cfg = serve_config(device, ckpt, PORT, 16)
    args = cfg["applications"][0]["args"]
    args["engine"]["num_blocks"] = blocks
    cpus = 1.0 if device == "cuda" else min(1.0, 1.0 / replicas)  # the CPU box has 2 cores
    args.update(num_replicas=replicas, engine_num_cpus=cpus, ingress_num_cpus=0.25)
    if device == "cuda":
        args["num_gpus"] = gpus or round(1.0 / replicas, 4)  # default: fractional replicas on one GPU
    if prefix_aware is not None:
        args["prefix_aware_routing"] = prefix_aware
    return cfg


def measure(
    device: str,
    ckpt: str,
    replicas: int,
    blocks: int,
    prefix_aware: bool | None,
    w: Workload,
    run_dir: Path,
    repeat: int,
    gpus: float | None = None,
    open_rate: float | None = None,
    open_fraction: float = 0.0,
) -> dict:
    """One server; a warm-up pass, then `repeat` passes, each with system prompts of its own (seeds
    differ): the figures of each pass, and their mean; then one open-loop pass at `open_rate`
    requests/s, or at `open_fraction` times the closed-loop passes' requests/s (neither: none)."""
    cfg = _config(device, ckpt, replicas, blocks, prefix_aware, gpus)
    server = Server(cfg, run_dir, child_env(), PORT)
    server.start(timeout=420)
    try:
        import httpx

        info = httpx.get(f"{server.url}/v1/models").json()["data"][0]
        run(server.url, info["id"], replace(w, seed=w.seed + 1000), info["vocab_size"])  # warm-up
        before = _decisions(server.url)
        passes = [
            run(server.url, info["id"], replace(w, seed=w.seed + i), info["vocab_size"])
            for i in range(repeat)
        ]
        decisions = {k: v - before.get(k, 0) for k, v in _decisions(server.url).items()}
        open_rate = open_rate or open_fraction * _mean([p["requests_per_s"] for p in passes], 2)
        if open_rate:
            open_w = replace(w, seed=w.seed + 500, user_rate=open_rate / w.turns)
            opened = {"offered_requests_per_s": round(open_rate, 1)}
            opened |= run(server.url, info["id"], open_w, info["vocab_size"])
    finally:
        server.stop()
    keys = ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "requests_per_s", "prompt_tokens_per_s")
    keys += ("ttft_p50_hit_ms", "ttft_p50_miss_ms")
    mean = {k: _mean([p[k] for p in passes], 4 if k == "hit_rate" else 1) for k in keys}
    failures = sum(p["num_failures"] for p in passes)
    figures = {**mean, "num_failures": failures, "decisions": decisions, "passes": passes}
    return figures | ({"open_loop": opened} if open_rate else {})


def _decisions(url: str) -> dict:
    """The ingress's prefix-aware routing decisions so far (one ingress replica)."""
    import httpx

    return httpx.get(f"{url}/v1/engine/stats", timeout=30).json().get("ingress_routing_decisions", {})


def _mean(values: list, digits: int) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), digits) if values else None


def micro(ckpt: str) -> dict:
    """Ingress and router costs per request, without a server (the checkpoint's tokenizer)."""
    from app.prefix_keys import PrefixKeys
    from app.router import PrefixAwareRouter
    from engine import prompt_block_hashes as block_hashes

    keys = PrefixKeys(ckpt, 16)
    words = ["alpha", "beta", "gamma", "delta", "words", "token", "serve"]
    text = " ".join(random.Random(0).choice(words) for _ in range(2000))
    ids, n = keys.tokenizer.encode(text), 200
    t = time.perf_counter()
    for _ in range(n):
        keys.tokenizer.encode(text)
    tokenize = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        hashes = block_hashes(ids, 16, 256)
    hashing = (time.perf_counter() - t) / n
    router = object.__new__(PrefixAwareRouter)  # the decision logic only
    router.initialize_state()
    router._replica_queue_len_cache = SimpleNamespace(get=lambda rid: 1)
    rng = random.Random(1)
    summary = {"prefix_stride": 4, "prefix_hashes": [4 * rng.getrandbits(60) for _ in range(4096)]}
    replicas = [SimpleNamespace(replica_id=f"r{i}", routing_stats=dict(summary)) for i in range(4)]
    router.rank(replicas, hashes)
    t = time.perf_counter()
    for _ in range(n):
        router.rank(replicas, hashes)
    rank = (time.perf_counter() - t) / n
    return {
        "prompt_tokens": len(ids),
        "tokenize_ms": round(1000 * tokenize, 3),
        "hash_ms": round(1000 * hashing, 3),
        "blocks_hashed": len(hashes),
        "rank_4_replicas_ms": round(1000 * rank, 3),
        "key_bytes": len(pickle.dumps(hashes)),
        "summary_bytes": len(pickle.dumps(summary)),
    }


def _hardware(env: dict) -> str:
    hw, v = env["hardware"], env["versions"]
    where = f"GPU {hw['gpu']} (replicas share it)" if hw.get("gpu") else f"CPU {hw['cpu']} x{hw['cpu_count']}"
    return f"{where}; Python {v['python']}, torch {v['torch']}"


def _markdown(report: dict) -> str:
    lines = [
        "# Prefix-aware routing vs Serve's default router",
        "",
        f"Command: `{report['command']}`  ",
        f"Commit {report['commit']}; {_hardware(report['environment'])}",
        f"Workload (largest run): {report.get('workload')}",
        "",
        "| replicas | router | KV blocks each | hit rate (passes) "
        "| TTFT p50 ms | TTFT p99 ms | TTFT p50 hit / miss ms | req/s | prompt tok/s | fails | decisions |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["runs"]:
        f = row["figures"]
        each = ", ".join(f"{p['hit_rate']:.3f}" for p in f["passes"])
        lines.append(
            f"| {row['replicas']} | {row['router']} | {row['blocks']} | {f['hit_rate']:.3f} ({each}) | "
            f"{f['ttft_p50_ms']} | {f['ttft_p99_ms']} | "
            f"{f.get('ttft_p50_hit_ms')} / {f.get('ttft_p50_miss_ms')} | "
            f"{f['requests_per_s']} | "
            f"{f.get('prompt_tokens_per_s', '')} | {f['num_failures']} | "
            + " ".join(f"{k} {v}" for k, v in sorted(f.get("decisions", {}).items()))
            + " |"
        )
    lines += _open_loop_table(report["runs"])
    if report.get("micro"):
        lines += [
            "",
            "Routing cost per request (no server): "
            + ", ".join(f"{k} {v}" for k, v in report["micro"].items()),
        ]
    return "\n".join(lines) + "\n"


def _open_loop_table(runs: list[dict]) -> list[str]:
    rows = [r for r in runs if "open_loop" in r["figures"]]
    if not rows:
        return []
    lines = [
        "",
        "Open loop (equal offered load: users arrive at a fixed rate, whatever the router):",
        "",
        "| replicas | router | offered req/s | served req/s | hit rate | TTFT p50 ms | TTFT p99 ms | fails |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        o = row["figures"]["open_loop"]
        lines.append(
            f"| {row['replicas']} | {row['router']} | {o['offered_requests_per_s']} | "
            f"{o['requests_per_s']} | {o['hit_rate']:.3f} | {o['ttft_p50_ms']} | {o['ttft_p99_ms']} | "
            f"{o['num_failures']} |"
        )
    return lines


def _checkpoint(model: str, device: str) -> str:
    """A path as given; a make_model name made once as random weights (benchmarks/serve_stack). Ray
    Serve from the wheelhouse where missing, in this process too (the routing cost imports the router)."""
    env = child_env()
    for path in reversed(env["PYTHONPATH"].split(":")):
        if path not in sys.path:
            sys.path.insert(0, path)
    importlib.invalidate_caches()
    if Path(model).exists():
        return model
    return str(ensure_checkpoint(SimpleNamespace(ckpt=None, model=model), device, env))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"), help="path or make_model name")
    ap.add_argument("--prefix-len", type=int, default=384, help="tokens per system prompt")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2, help="users at a time, per replica")
    ap.add_argument("--replicas", default="2,4")
    ap.add_argument("--blocks", type=int, default=160, help="KV blocks per replica")
    ap.add_argument("--users-per-prefix", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3, help="measured passes per configuration")
    ap.add_argument("--micro", action="store_true", help="only the routing cost, no server")
    ap.add_argument("--gpus-per-replica", type=float, default=None, help="GPU host; default 1/R (one GPU)")
    ap.add_argument("--skip-reference", action="store_true", help="no one-replica reference run")
    ap.add_argument("--open-loop", type=float, default=0.0, help="F: open-loop pass at F x default req/s")
    ap.add_argument("--out", default=None, help="PREFIX for PREFIX.json and PREFIX.md")
    args = ap.parse_args(argv)
    device = "cuda" if (environment().get("hardware") or {}).get("gpu") else "cpu"
    ckpt = _checkpoint(args.model, device)
    report = {
        "command": "python -m benchmarks.prefix_routing " + " ".join(sys.argv[1:]),
        "micro": micro(ckpt),
    }
    report |= {"commit": git_commit(ROOT), "environment": environment(), "device": device, "runs": []}
    if not args.micro:
        for r in (int(x) for x in args.replicas.split(",")):
            w = Workload(
                prefixes=4 * r,
                prefix_len=args.prefix_len,
                users=4 * r * args.users_per_prefix,
                max_tokens=args.max_tokens,
                concurrency=args.concurrency * r,
            )
            report["workload"] = asdict(w)
            runs = [] if args.skip_reference else [(1, "one replica, all pools", r * args.blocks, None)]
            runs += [
                (r, "default (power of two)", args.blocks, False),
                (r, "prefix-aware", args.blocks, True),
            ]
            open_rate = None  # set from the default router's closed-loop throughput
            for replicas, name, blocks, aware in runs:
                run_dir = ROOT / "benchmarks" / "runs" / f"route{r}"
                opening = dict(open_rate=open_rate, open_fraction=args.open_loop if aware is False else 0.0)
                figures = measure(
                    device,
                    ckpt,
                    replicas,
                    blocks,
                    aware,
                    w,
                    run_dir,
                    args.repeat,
                    args.gpus_per_replica,
                    **(opening if aware is not None else {}),
                )
                if "open_loop" in figures:
                    open_rate = figures["open_loop"]["offered_requests_per_s"]
                print(f"{replicas} replicas, {name}: {figures}", flush=True)
                report["runs"].append(
                    {"replicas": replicas, "router": name, "blocks": blocks, "figures": figures}
                )
    if args.out:
        write_report(args.out, report, _markdown(report))  # prints the table too
    else:
        print(_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
