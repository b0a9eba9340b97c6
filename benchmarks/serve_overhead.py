"""What serving costs: W2 through the served stack, its offline twin and a null-engine stand-in, in one go.

    python -m benchmarks.serve_overhead                      # GPU host (carry .gpuwheels): 64 and 256 users
    python -m benchmarks.serve_overhead --model tiny --users 4 --duration 8 --gen-scale 0.1 --prompt-scale 0.1

offline: benchmarks.offline_twin per user count, in a subprocess (GPU memory freed before any server), with
  the served engine options and the served engine's torch threads (OMP_NUM_THREADS as Ray sets it).
served: per variant, one `serve run` (serve_config.yaml with the GPU engine options, max_ongoing_requests >=
  2 x users), a --warmup s load, then benchmarks.serve_client for --duration s at each user count in turn.
null: per variant and user count, the same stack with `args.null_core_step_ms: X` (a core without a model:
  one token per running request every X ms, through the real replica / ingress / proxy). X = 1000 x users
  / the twin's steady-state out tok/s (after the last user started; the whole-window rate, lowered by the
  ramp, would overstate X), so each stream is paced as offline; X depends on the count, hence one server
  per count. Ideal = users x 1000 / X; with the ramp, the zero-overhead figure is the twin's out tok/s.
proc_cpu samples the server's session and the client while a client runs (CPU% by role). A window at N
users uses seed 1000 x --seed + N in twin and client alike (the same requests; no window reuses another's
prompts, so the prefix cache cannot help); warm-ups use offline_twin.WARMUP_SEED. --serve-env NAME=K=V[,..]
adds a variant with extra environment for `serve run` ("default": the project's own). Ray always starts a
cluster of its own (RAY_ADDRESS=local). Writes OUT/serve_overhead.{json,md} after every run, and
OUT/runs/<run>/ (summaries, serve configs, serve.log).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import write_json, write_report
from benchmarks.offline_twin import WARMUP_SEED
from benchmarks.proc_cpu import CpuSampler
from benchmarks.serve_stack import (
    PY,
    ROOT,
    Server,
    _sh,
    child_env,
    engine_options,
    ensure_checkpoint,
    host_facts,
    log,
    profile_server,
    replica_latencies,
    replica_log_marks,
    serve_config,
)
from benchmarks.serve_summary import overhead_acceptance, overhead_markdown


def _load_args(args, users: int, seed: int, duration: float) -> list[str]:
    return ["--users", str(users), "--spawn-rate", str(args.spawn_rate), "--duration", str(duration),
            "--workload", args.workload, "--gen-scale", str(args.gen_scale),
            "--prompt-scale", str(args.prompt_scale), "--seed", str(seed)]  # fmt: skip


def run_offline(args, ctx: dict, users: int) -> dict:
    """The offline twin at `users`, in a subprocess (its GPU memory is freed when it exits)."""
    out = args.out / "runs" / f"offline_u{users}"
    cmd = [PY, "-m", "benchmarks.offline_twin", "--model", str(ctx["ckpt"]), "--warmup", str(args.warmup),
           "--engine-json", json.dumps(engine_options(ctx["device"])), "--out", str(out),
           *_load_args(args, users, 1000 * args.seed + users, args.duration)]  # fmt: skip
    # torch's CPU threads as the served engine gets them: Ray sets OMP_NUM_THREADS to the replica's num_cpus
    # where it is unset, and the core inherits it (an idle core's extra threads stall a busy host)
    cpus = serve_config(ctx["device"], "unused", 0, 1)["applications"][0]["args"].get("engine_num_cpus", 1)
    env = {"OMP_NUM_THREADS": str(max(1, int(cpus))), **ctx["env"]}
    res = _sh(cmd, env, timeout=args.duration + args.warmup + 900)
    if res.returncode:
        raise RuntimeError(f"offline twin failed ({res.returncode}): {res.stderr[-1500:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"summary": summary, "latency": summary.pop("latency", None), "cpu": summary.get("cpu", {})}


def run_client(args, server: Server, users: int, seed: int, duration: float, name: str) -> dict:
    """benchmarks.serve_client against `server` while proc_cpu samples the server's session and the client."""
    out, log_path = server.run_dir / name, server.run_dir / f"{name}.log"
    cmd = [PY, "-m", "benchmarks.serve_client", "--host", server.url, "--out", str(out),
           *_load_args(args, users, seed, duration)]  # fmt: skip
    marks = replica_log_marks()
    with open(log_path, "w") as f:
        client = subprocess.Popen(cmd, cwd=ROOT, env=server.env, stdout=f, stderr=subprocess.STDOUT)
    try:
        sampler = CpuSampler(sessions={server.proc.pid}, clients={client.pid}).start()
    except ImportError as exc:  # no psutil: figures without the CPU split
        sampler, cpu = None, {"error": str(exc), "roles": {}, "processes": []}
    if args.profile and name == f"u{args.users[0]}":
        profile_server(server, name, delay=min(10.0, duration / 3), seconds=args.profile)
    try:
        rc = client.wait(timeout=duration + 300)
    finally:
        if client.poll() is None:
            client.kill()
        cpu = sampler.stop() if sampler else cpu
    if rc:
        raise RuntimeError(f"serve_client failed ({rc}): {log_path.read_text()[-800:]}")
    cpu["processes"] = cpu["processes"][:20]
    time.sleep(1.5)  # the replica writes its buffered log lines once a second
    return {"summary": json.loads((out / "summary.json").read_text()), "latency": replica_latencies(marks),
            "cpu": {r: v["cpu_pct"] for r, v in cpu["roles"].items()}, "cpu_detail": cpu}  # fmt: skip


def attempt(args, report: dict, row: dict, fn) -> None:
    """Run one measurement; its row (figures or error) goes into the report, which is rewritten at once."""
    try:
        row.update(fn())
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    report["runs"].append(row)
    save(args, report)
    s, what = row.get("summary") or {}, f"{row['variant']} {row['stack']} {row['users']} users".lstrip("- ")
    p50 = lambda m: f"{s[m]['p50']:.1f}" if s[m]["p50"] is not None else "-"
    log(f"{what}: error {row['error'][:300]}" if "error" in row else
        f"{what}: {s['output_tok_s']:,.0f} out tok/s, TTFT p50 {p50('ttft_ms')} ms, "
        f"ITL p50 {p50('itl_ms')} ms, {s['failures']} failed")  # fmt: skip


def _raise(exc: Exception):
    raise exc


def measure_server(args, ctx: dict, report: dict, row: dict, cfg: dict, users: list[int]) -> None:
    """Start a server, load it for --warmup s, one measured window per user count in order, stop it."""
    name = f"{row['variant']}_{row['stack']}" + (f"_u{users[0]}" if row["stack"] == "null" else "")
    server = Server(cfg, args.out / "runs" / name, {**ctx["env"], **row.pop("env")}, args.port)
    failed: Exception | None = None
    try:
        try:
            server.start(args.ready_timeout)
            run_client(args, server, users[0], WARMUP_SEED, args.warmup, "warmup")
        except Exception as exc:  # no server: each window gets its error
            failed = exc
        for n in users:
            window = lambda n=n: run_client(args, server, n, 1000 * args.seed + n, args.duration, f"u{n}")
            attempt(args, report, {**row, "users": n}, window if failed is None else lambda: _raise(failed))
    finally:
        server.stop()


def null_step_ms(args, report: dict, users: int) -> float:
    """X = 1000 x users / the twin's steady-state out tok/s at `users` (or --null-step-ms)."""
    if args.null_step_ms:
        return args.null_step_ms
    off = [r for r in report["runs"] if r["stack"] == "offline" and r["users"] == users and "summary" in r]
    tok_s = off and (off[0]["summary"].get("steady_out_tok_s") or off[0]["summary"]["output_tok_s"])
    if not tok_s:
        raise RuntimeError("no offline pace at this user count: run the twin or pass --null-step-ms")
    return 1000 * users / tok_s


def _with_app_args(cfg: dict, settings: dict) -> dict:
    """A variant's `args.NAME` entries, parsed as YAML values, set on the application's args."""
    import yaml

    app = cfg["applications"][0]["args"]
    for key, value in settings.items():
        if key.startswith("args."):
            app[key[len("args.") :]] = yaml.safe_load(value)
    return cfg


def run_variant(args, ctx: dict, report: dict, variant: str, settings: dict) -> None:
    """The served stack (one server, every user count), then one null-core server per user count."""
    venv = {k: v for k, v in settings.items() if not k.startswith("args.")}
    if "served" not in args.skip:
        cfg = _with_app_args(serve_config(ctx["device"], ctx["ckpt"], args.port, max(args.users)), settings)
        row = {"variant": variant, "stack": "served", "env": venv}
        measure_server(args, ctx, report, row, cfg, args.users)
    for n in args.users if "null" not in args.skip else []:
        row = {"variant": variant, "stack": "null", "users": n}
        try:
            step = null_step_ms(args, report, n)
        except RuntimeError as exc:
            attempt(args, report, row, lambda e=exc: _raise(e))
            continue
        cfg = _with_app_args(
            serve_config(ctx["device"], ctx["ckpt"], args.port, n, null_step_ms=step), settings
        )
        row.update(env=venv, null_step_ms=step, ideal_tok_s=1000 * n / step)
        measure_server(args, ctx, report, row, cfg, [n])


def save(args, report: dict, final: bool = False) -> None:
    report["acceptance"] = overhead_acceptance(report["runs"])
    stem = args.out / "serve_overhead"
    if final:
        return write_report(stem, report, overhead_markdown(report))
    write_json(stem.with_suffix(".json"), report)
    stem.with_suffix(".md").write_text(overhead_markdown(report))


def parse_variant(spec: str) -> tuple[str, dict]:
    """'tput=RAY_SERVE_THROUGHPUT_OPTIMIZED=1,FOO=2' -> ('tput', {...}). A key `args.NAME` sets the
    application argument NAME (a YAML value) instead of an environment variable."""
    name, _, rest = spec.partition("=")
    pairs = [kv.partition("=") for kv in rest.split(",") if kv]
    if not name or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise SystemExit(f"--serve-env {spec!r}: expected NAME=K=V[,K=V...]")
    return name, {k: v for k, _, v in pairs}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--model", default="llama-3.2-1b", help="a scripts.make_model shape")
    add("--ckpt", default=None, help="its directory (default /tmp/minserve_bench/MODEL; made if missing)")
    add("--users", default="64,256", help="comma-separated user counts")
    add("--duration", type=float, default=40.0, help="seconds per measured window")
    add("--warmup", type=float, default=5.0, help="seconds of unmeasured load after each start")
    add("--spawn-rate", type=float, default=16.0, help="users started per second")
    add("--workload", default="W2")
    add("--gen-scale", type=float, default=1.0)
    add("--prompt-scale", type=float, default=1.0)
    add("--seed", type=int, default=0)
    add("--port", type=int, default=8000)
    add("--ready-timeout", type=float, default=300.0, help="seconds for `serve run` to answer")
    add("--serve-env", action="append", default=[], metavar="NAME=K=V[,K=V]", help="a variant (repeatable)")
    add("--skip", default="", help="comma-separated: offline, served, null")
    add("--null-step-ms", type=float, default=None, help="the null core's step (default: from the twin)")
    add("--profile", type=float, default=0.0, help="py-spy seconds in each server's first window (0: off)")
    add("--out", type=Path, default=ROOT / "benchmarks" / "reports" / "serve_overhead")
    args = p.parse_args(argv)
    args.users = [int(u) for u in args.users.split(",") if u.strip()]
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    args.variants = {"default": {}} | dict(parse_variant(v) for v in args.serve_env)
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every `finally` stops its server
    env = child_env()
    facts = host_facts(env)
    device = "cuda" if (facts.get("hardware") or {}).get("gpu") else "cpu"
    ctx = {"device": device, "ckpt": ensure_checkpoint(args, device, env), "env": env}
    log(f"{args.model} ({ctx['ckpt']}) on {device}; users {args.users}; variants {list(args.variants)}")
    cmd = [PY, "-m", "benchmarks.serve_overhead", *(sys.argv[1:] if argv is None else argv)]
    report = {"command": " ".join(cmd),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": facts, "device": device,
              "model": args.model, "checkpoint": str(ctx["ckpt"]), "variants": args.variants,
              "settings": {k: v for k, v in vars(args).items() if k not in ("variants", "out", "skip")},
              "skipped": sorted(args.skip), "engine_options": engine_options(device), "runs": []}  # fmt: skip
    for n in args.users if "offline" not in args.skip else []:
        row = {"variant": "-", "stack": "offline", "users": n}
        attempt(args, report, row, lambda n=n: run_offline(args, ctx, n))
    for variant, venv in args.variants.items():
        run_variant(args, ctx, report, variant, venv)
    save(args, report, final=True)


if __name__ == "__main__":
    main()
