"""The host KV tier (issue 50) served: W4 multi-turn sessions, tier off against tier on, in one run.

    python -m benchmarks.kv_offload_bench             # GPU host: Llama-3.2-1B shape (about 6 minutes)
    python -m benchmarks.kv_offload_bench --model llama-3.1-8b --users 64
    python -m benchmarks.kv_offload_bench --think-time 2   # users pause 2 s on average between turns
    python -m benchmarks.kv_offload_bench --smoke     # CPU: the tiny model, tiny pool, seconds of load

Per variant (off, then on), one `serve run` of serve_config.yaml (benchmarks/serve_stack.py) whose GPU
pool is capped at --gpu-pool-gib by num_blocks, the other with a --tier-gib host tier as well; a --warmup
s load of other sessions, then benchmarks.serve_client's W4 for --duration s at --users users. Live KV
(the users' current session histories at the end, as tokens x KV bytes per token) should be 3-5x the
GPU pool and below the tier: the report gives the ratio. Without --think-time every user sends its next
turn as soon as the last answer ends, so every session is running at once and the pool cannot hold the
running turns (they queue for blocks, tier or not); with it (people reading and typing between turns)
many sessions are live but few run at once, the case the tier is for. Engine stats (GET
/v1/engine/stats) are read before and after the measured window; their differences give the window's
GPU and host-tier hit rates, blocks and bytes moved each way and the tier's copy rates (bytes over the
CUDA-event time of its copy batches, gathers and scatters included). After both servers have stopped, a
plain pinned host-to-device copy of the same total size as the tier's copies back is timed in a
subprocess (a CPU memcpy on CPU).
Writes OUT/kv_offload.{json,md}, and OUT/runs/<variant>/ (serve config, serve.log, client summaries).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.common import write_json, write_report
from benchmarks.serve_stack import (
    PY,
    ROOT,
    Server,
    ensure_checkpoint,
    log,
    prepare_host,
    serve_config,
)

DELTA_KEYS = (
    "prefix_cache_query_blocks", "prefix_cache_hit_blocks", "kv_host_hit_blocks", "kv_host_hit_requests",
    "kv_offload_blocks", "kv_offload_bytes", "kv_offload_seconds", "kv_reload_blocks", "kv_reload_bytes",
    "kv_reload_seconds", "num_preemptions", "prompt_tokens_total", "generation_tokens_total",
)  # fmt: skip
_H2D = """
import json, sys, time, torch
total = max(int(sys.argv[1]), 1 << 20)
chunk = min(total, 1 << 30)
n = max(1, round(total / chunk))
if torch.cuda.is_available():
    src = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    seconds, kind = start.elapsed_time(end) / 1e3, "pinned host-to-device copy"
else:
    src, dst = torch.ones(chunk, dtype=torch.uint8), torch.empty(chunk, dtype=torch.uint8)
    dst.copy_(src)
    began = time.perf_counter()
    for _ in range(n):
        dst.copy_(src)
    seconds, kind = time.perf_counter() - began, "CPU memcpy (no GPU)"
print(json.dumps({"bytes": n * chunk, "seconds": seconds, "gbps": n * chunk / seconds / 1e9, "kind": kind}))
"""


def kv_bytes_per_token(ckpt: Path, device: str) -> int:
    """K and V of every layer for one token, in the served dtype (bf16 on a GPU, fp32 on CPU)."""
    c = json.loads((ckpt / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * (2 if device == "cuda" else 4)


def engine_stats(server: Server) -> dict:
    with urllib.request.urlopen(server.url + "/v1/engine/stats", timeout=30) as r:
        return json.loads(r.read())


def run_client(args, server: Server, seed: int, duration: float, name: str) -> dict:
    out = server.run_dir / name
    cmd = [PY, "-m", "benchmarks.serve_client", "--host", server.url, "--out", str(out),
           "--users", str(args.users), "--spawn-rate", str(args.spawn_rate), "--duration", str(duration),
           "--workload", "W4", "--gen-scale", str(args.gen_scale), "--prompt-scale", str(args.prompt_scale),
           "--seed", str(seed), "--think-time", str(args.think_time)]  # fmt: skip
    with open(server.run_dir / f"{name}.log", "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=server.client_env, stdout=f, stderr=subprocess.STDOUT,
                            timeout=duration + 300).returncode  # fmt: skip
    if rc:
        raise RuntimeError(
            f"serve_client failed ({rc}): {(server.run_dir / f'{name}.log').read_text()[-800:]}"
        )
    return json.loads((out / "summary.json").read_text())


def window_stats(before: dict, after: dict) -> dict:
    """The measured window's tier and cache figures, from two stats snapshots."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in DELTA_KEYS}
    rate = lambda num, den: num / den if den else None  # noqa: E731
    gpu_misses = d["prefix_cache_query_blocks"] - d["prefix_cache_hit_blocks"]
    return {**d,
            "gpu_hit_rate": rate(d["prefix_cache_hit_blocks"], d["prefix_cache_query_blocks"]),
            "host_hit_rate_of_gpu_misses": rate(d["kv_host_hit_blocks"], gpu_misses),
            "offload_gbps": rate(d["kv_offload_bytes"] / 1e9, d["kv_offload_seconds"]),
            "reload_gbps": rate(d["kv_reload_bytes"] / 1e9, d["kv_reload_seconds"])}  # fmt: skip


def measure(args, ctx: dict, variant: str, tier_gib: float) -> dict:
    cfg = serve_config(ctx["device"], ctx["ckpt"], args.port, args.users)
    engine = cfg["applications"][0]["args"]["engine"]
    engine.update(num_blocks=ctx["num_blocks"], kv_offloading_size=tier_gib)
    if args.smoke:
        engine.update(max_num_seqs=8, max_num_batched_tokens=256)
    server = Server(cfg, args.out / "runs" / variant, ctx["env"], args.port)
    try:
        server.start(args.ready_timeout)
        run_client(args, server, seed=10_000 + args.seed, duration=args.warmup, name="warmup")
        before = engine_stats(server)
        summary = run_client(args, server, seed=args.seed, duration=args.duration, name="measured")
        time.sleep(2.5)  # the core publishes its stats about once a second
        after = engine_stats(server)
    finally:
        server.stop()
    live = summary.get("live_session_tokens", 0) * ctx["bytes_per_token"]
    return {"variant": variant, "tier_gib": tier_gib, "summary": summary,
            "window": window_stats(before, after), "live_kv_gib": live / 2**30,
            "live_kv_over_gpu_pool": live / (ctx["pool_bytes"] or 1)}  # fmt: skip


def plain_h2d(env: dict, total: int) -> dict:
    out = subprocess.run([PY, "-c", _H2D, str(total)], cwd=ROOT, env=env, text=True, capture_output=True,
                         timeout=600)  # fmt: skip
    if out.returncode:
        return {"error": out.stderr[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _f(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(report: dict) -> str:
    rows = {r["variant"]: r for r in report["runs"] if "summary" in r}
    lines = [f"# Host KV tier, W4 served: {report['model']} on {report['device']}", "",
             f"`{report['command']}`", "",
             f"GPU pool {report['gpu_pool_gib']:.2f} GiB ({report['num_blocks']} blocks), tier "
             f"{report['tier_gib']} GiB, {report['settings']['users']} users, "
             f"{report['settings']['duration']} s measured after a warm-up, think time "
             f"{report['settings'].get('think_time', 0.0)} s (mean).", "",
             "| tier | TTFT p50 ms | TTFT p50 later turns ms | out tok/s | requests | live KV / GPU pool "
             "| GPU hit rate | host hit rate (of GPU misses) | host hit prompts | blocks out / back "
             "| GB out / back | copy GB/s out / back | preemptions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in rows.items():
        s, w = r["summary"], r["window"]
        lines.append(
            f"| {name} | {_f(s['ttft_ms']['p50'])} | {_f((s.get('ttft_ms_later_turns') or {}).get('p50'))} "
            f"| {s['output_tok_s']:.0f} | {s['requests']} | {r['live_kv_over_gpu_pool']:.1f}x "
            f"| {_f(w['gpu_hit_rate'], '{:.1%}')} | {_f(w['host_hit_rate_of_gpu_misses'], '{:.1%}')} "
            f"| {w['kv_host_hit_requests']} | {w['kv_offload_blocks']} / {w['kv_reload_blocks']} "
            f"| {w['kv_offload_bytes'] / 1e9:.2f} / {w['kv_reload_bytes'] / 1e9:.2f} "
            f"| {_f(w['offload_gbps'])} / {_f(w['reload_gbps'])} | {w['num_preemptions']} |"
        )  # fmt: skip
    h2d, acc = report.get("plain_h2d") or {}, report.get("acceptance") or {}
    lines += ["", f"Plain {h2d.get('kind', 'copy')} of {h2d.get('bytes', 0) / 1e9:.2f} GB: "
              f"{_f(h2d.get('gbps'))} GB/s; the tier's copies back: {_f(acc.get('reload_gbps'))} GB/s "
              f"({_f(acc.get('h2d_share'), '{:.0%}')} of it).", "",
              f"Acceptance (issue 50): TTFT p50 off / on {_f(acc.get('ttft_speedup'), '{:.2f}')}x (>= 2), "
              f"out tok/s on / off {_f(acc.get('tok_s_speedup'), '{:.2f}')}x (>= 1.3), copy rate "
              f"{_f(acc.get('h2d_share'), '{:.0%}')} of a plain copy (>= 50%): "
              f"{'PASS' if acc.get('pass') else 'not met'}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def acceptance(report: dict) -> dict:
    rows = {r["variant"]: r for r in report["runs"] if "summary" in r}
    if not {"off", "on"} <= set(rows):
        return {}
    off, on = rows["off"]["summary"], rows["on"]["summary"]
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    reload_gbps = rows["on"]["window"]["reload_gbps"]
    out = {"ttft_speedup": ratio(off["ttft_ms"]["p50"], on["ttft_ms"]["p50"]),
           "tok_s_speedup": ratio(on["output_tok_s"], off["output_tok_s"]), "reload_gbps": reload_gbps,
           "h2d_share": ratio(reload_gbps, (report.get("plain_h2d") or {}).get("gbps"))}  # fmt: skip
    out["pass"] = bool(
        (out["ttft_speedup"] or 0) >= 2
        and (out["tok_s_speedup"] or 0) >= 1.3
        and (out["h2d_share"] or 0) >= 0.5
    )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--model", default="llama-3.2-1b", help="a scripts.make_model shape")
    add("--ckpt", default=None, help="its directory (default /tmp/minserve_bench/MODEL; made if missing)")
    add("--gpu-pool-gib", type=float, default=4.0, help="the GPU KV pool, set through num_blocks")
    add("--tier-gib", type=float, default=24.0, help="kv_offloading_size of the 'on' variant")
    add("--users", type=int, default=256, help="concurrent sessions (live KV 3-5x the pool at 1B)")
    add("--duration", type=float, default=60.0, help="measured seconds per variant")
    add("--warmup", type=float, default=15.0, help="seconds of load (other sessions) after each start")
    add("--spawn-rate", type=float, default=32.0, help="users started per second")
    add("--think-time", type=float, default=0.0, help="mean pause between turns, s (exponential)")
    add("--gen-scale", type=float, default=1.0)
    add("--prompt-scale", type=float, default=1.0)
    add("--seed", type=int, default=0)
    add("--port", type=int, default=8000)
    add("--ready-timeout", type=float, default=300.0, help="seconds for `serve run` to answer")
    add("--block-size", type=int, default=16)
    add("--smoke", action="store_true", help="tiny model and sizes: the whole path in a few minutes on CPU")
    add("--out", type=Path, default=ROOT / "benchmarks" / "reports" / "kv_offload")
    args = p.parse_args(argv)
    if args.smoke:  # 48 blocks of 16 tokens: a few sessions outgrow it; a tier of 1024 blocks (fp32 tiny)
        args.model, args.gpu_pool_gib, args.tier_gib = "tiny", 48 * 16 * 512 / 2**30, 0.01
        args.users, args.duration, args.warmup, args.spawn_rate = 8, 12.0, 3.0, 8.0
        args.prompt_scale, args.gen_scale = 0.1, 0.1
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env, facts, device = prepare_host()
    ckpt = ensure_checkpoint(args, device, env)
    per_token = kv_bytes_per_token(ckpt, device)
    num_blocks = max(1, int(args.gpu_pool_gib * 2**30) // (per_token * args.block_size))
    ctx = {"device": device, "ckpt": ckpt, "env": env, "bytes_per_token": per_token, "num_blocks": num_blocks,
           "pool_bytes": num_blocks * args.block_size * per_token}  # fmt: skip
    cmd = [PY, "-m", "benchmarks.kv_offload_bench", *(sys.argv[1:] if argv is None else argv)]
    report = {"command": " ".join(cmd), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": facts,
              "device": device, "model": args.model, "checkpoint": str(ckpt), "num_blocks": num_blocks,
              "gpu_pool_gib": ctx["pool_bytes"] / 2**30, "tier_gib": args.tier_gib,
              "kv_bytes_per_token": per_token,
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "runs": []}  # fmt: skip
    log(f"{args.model} on {device}: GPU pool {num_blocks} blocks ({ctx['pool_bytes'] / 2**30:.2f} GiB), "
        f"tier {args.tier_gib} GiB, {args.users} users of W4")  # fmt: skip
    stem = args.out / "kv_offload"
    for variant, gib in (("off", 0.0), ("on", args.tier_gib)):
        try:
            row = measure(args, ctx, variant, gib)
            s = row["summary"]
            log(f"tier {variant}: TTFT p50 {_f(s['ttft_ms']['p50'])} ms, {s['output_tok_s']:.0f} out tok/s, "
                f"live KV {row['live_kv_over_gpu_pool']:.1f}x the pool")  # fmt: skip
        except Exception as exc:
            row = {"variant": variant, "tier_gib": gib, "error": f"{type(exc).__name__}: {exc}"}
            log(f"tier {variant}: error {row['error'][:300]}")
        report["runs"].append(row)
        write_json(stem.with_suffix(".json"), report)
    on = next((r for r in report["runs"] if r["variant"] == "on" and "window" in r), None)
    report["plain_h2d"] = plain_h2d(env, on["window"]["kv_reload_bytes"] if on else 1 << 30)
    report["acceptance"] = acceptance(report)
    write_report(stem, report, markdown(report))


if __name__ == "__main__":
    main()
