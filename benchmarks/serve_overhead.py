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
adds a variant with extra environment for `serve run` ("default": the project's own). --rounds N
measures every variant N times in alternating order (NAME#1, NAME#2, ...; the report adds each
variant's median and range): single served runs at 256 users vary by about a quarter. Ray always starts a
cluster of its own (RAY_ADDRESS=local). Writes OUT/serve_overhead.{json,md} after every run, and
OUT/runs/<run>/ (summaries, serve configs, serve.log).
GPU busy (benchmarks/gpu_busy.py), in every measured served and null window: the engine core's kernel
trace (SIGUSR1 / SIGUSR2, files in OUT/runs/<run>/kernel_trace/) and `nvidia-smi dmon`'s sm column.
--baseline-tree DIR (benchmarks/baseline_tree.py): every measurement runs with DIR's code too (its
offline twin, its `serve run` of its serve_config.yaml; this tree's load client), old then new per
measurement, and the report adds old, new and new / old per headline figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.ab_report import serve_ab
from benchmarks.baseline_tree import ROOT, Tree, make_trees, tree_env
from benchmarks.common import write_json, write_report
from benchmarks.gpu_busy import BusyProbe, tree_has_trace
from benchmarks.offline_twin import WARMUP_SEED
from benchmarks.proc_cpu import CpuSampler
from benchmarks.serve_stack import (
    PY,
    Server,
    engine_options,
    ensure_checkpoint,
    log,
    parse_variant,
    prepare_host,
    profile_server,
    replica_latencies,
    replica_log_marks,
    serve_config,
    serve_warnings,
    with_app_args,
)
from benchmarks.serve_summary import overhead_acceptance, overhead_markdown


def _load_args(args, users: int, seed: int, duration: float) -> list[str]:
    return ["--users", str(users), "--spawn-rate", str(args.spawn_rate), "--duration", str(duration),
            "--workload", args.workload, "--gen-scale", str(args.gen_scale),
            "--prompt-scale", str(args.prompt_scale), "--seed", str(seed)]  # fmt: skip


def _prefix(tree: Tree) -> str:
    """Run directories of the baseline tree's measurements start with its name."""
    return "" if tree.name == "new" else f"{tree.name}_"


def run_offline(args, ctx: dict, users: int, tree: Tree) -> dict:
    """The offline twin of `tree` at `users`, in a subprocess (its GPU memory is freed when it exits)."""
    out = args.out / "runs" / f"{_prefix(tree)}offline_u{users}"
    options = engine_options(ctx["device"], tree.root)
    cmd = [PY, "-m", "benchmarks.offline_twin", "--model", str(ctx["ckpt"]), "--warmup", str(args.warmup),
           "--engine-json", json.dumps(options), "--out", str(out),
           *_load_args(args, users, 1000 * args.seed + users, args.duration)]  # fmt: skip
    # torch's CPU threads as the served engine gets them: Ray sets OMP_NUM_THREADS to the replica's num_cpus
    # where it is unset, and the core inherits it (an idle core's extra threads stall a busy host)
    app = serve_config(ctx["device"], "unused", 0, 1, root=tree.root)["applications"][0]["args"]
    env = tree_env(
        {"OMP_NUM_THREADS": str(max(1, int(app.get("engine_num_cpus", 1)))), **ctx["env"]}, tree.root
    )
    res = subprocess.run(cmd, env=env, cwd=tree.root, text=True, capture_output=True,
                         timeout=args.duration + args.warmup + 900)  # fmt: skip
    if res.returncode:
        raise RuntimeError(f"offline twin failed ({res.returncode}): {res.stderr[-1500:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"summary": summary, "latency": summary.pop("latency", None), "cpu": summary.get("cpu", {})}


def busy_probe(args, server: Server) -> BusyProbe:
    """GPU busy over one window; the kernel trace only where the server's tree handles its signals."""
    why = "off (--no-kernel-trace)" if args.no_kernel_trace else ""
    if not why and not tree_has_trace(server.root):
        why = f"not measured: the engine core of {server.root} has no SIGUSR1 handler (never signalled)"
    return BusyProbe(server.proc.pid, None if why else server.trace_dir, why)


def run_client(args, server: Server, users: int, seed: int, duration: float, name: str) -> dict:
    """benchmarks.serve_client (this tree's) against `server` while proc_cpu samples the server's session
    and the client and, in a measured window (not the warm-up), gpu_busy measures the GPU."""
    out, log_path = server.run_dir / name, server.run_dir / f"{name}.log"
    cmd = [PY, "-m", "benchmarks.serve_client", "--host", server.url, "--out", str(out),
           *_load_args(args, users, seed, duration)]  # fmt: skip
    marks = replica_log_marks(pattern="*.log")  # every Serve log: the replica's lines and Serve's warnings
    probe = busy_probe(args, server).start() if name != "warmup" else None
    with open(log_path, "w") as f:
        client = subprocess.Popen(cmd, cwd=ROOT, env=server.client_env, stdout=f, stderr=subprocess.STDOUT)
    try:
        sampler = CpuSampler(sessions={server.proc.pid}, clients={client.pid}).start()
    except ImportError as exc:  # no psutil: figures without the CPU split
        sampler, cpu = None, {"error": str(exc), "roles": {}, "processes": []}
    if args.profile and name == f"u{args.users[0]}":
        profile_server(server, name, min(10.0, duration / 3), args.profile, args.profile_gil)
    try:
        rc = client.wait(timeout=duration + 300)
    finally:
        if client.poll() is None:
            client.kill()
        cpu = sampler.stop() if sampler else cpu
        gpu = probe.stop() if probe else None
    if rc:
        raise RuntimeError(f"serve_client failed ({rc}): {log_path.read_text()[-800:]}")
    cpu["processes"] = cpu["processes"][:20]
    time.sleep(1.5)  # the replica writes its buffered log lines once a second
    return {"summary": json.loads((out / "summary.json").read_text()), "latency": replica_latencies(marks),
            "serve_warnings": serve_warnings(marks),
            "cpu": {r: v["cpu_pct"] for r, v in cpu["roles"].items()}, "cpu_detail": cpu,
            **({"gpu_busy": gpu} if gpu else {})}  # fmt: skip


def attempt(args, report: dict, row: dict, fn) -> None:
    """Run one measurement; its row (figures or error) goes into the report, which is rewritten at once."""
    try:
        row.update(fn())
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    report["runs"].append(row)
    save(args, report)
    s, what = row.get("summary") or {}, f"{row['variant']} {row['stack']} {row['users']} users".lstrip("- ")
    what = f"[{row['tree']}] {what}" if len(report.get("trees", [])) > 1 else what
    p50 = lambda m: f"{s[m]['p50']:.1f}" if s[m]["p50"] is not None else "-"
    busy = (row.get("gpu_busy") or {}).get("trace", {}).get("busy_fraction")
    log(f"{what}: error {row['error'][:300]}" if "error" in row else
        f"{what}: {s['output_tok_s']:,.0f} out tok/s, TTFT p50 {p50('ttft_ms')} ms, "
        f"ITL p50 {p50('itl_ms')} ms, {s['failures']} failed" +
        (f", GPU busy {busy:.1%} (trace)" if busy is not None else ""))  # fmt: skip


def _raise(exc: Exception):
    raise exc


def measure_server(args, ctx: dict, report: dict, row: dict, cfg: dict, users: list[int], tree: Tree) -> None:
    """Start a server of `tree`'s code, load it for --warmup s, one measured window per user count in
    order, stop it."""
    name = f"{_prefix(tree)}{row['variant']}_{row['stack']}" + (
        f"_u{users[0]}" if row["stack"] == "null" else ""
    )
    env = {**ctx["env"], **row.pop("env")}
    server = Server(cfg, args.out / "runs" / name, env, args.port, root=tree.root)
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


def null_step_ms(args, report: dict, users: int, tree: str = "new") -> float:
    """X = 1000 x users / the steady-state out tok/s of the same tree's twin at `users` (or
    --null-step-ms)."""
    if args.null_step_ms:
        return args.null_step_ms
    off = [r for r in report["runs"] if r["stack"] == "offline" and r["users"] == users and "summary" in r
           and r.get("tree", "new") == tree]  # fmt: skip
    tok_s = off and (off[0]["summary"].get("steady_out_tok_s") or off[0]["summary"]["output_tok_s"])
    if not tok_s:
        raise RuntimeError("no offline pace at this user count: run the twin or pass --null-step-ms")
    return 1000 * users / tok_s


def run_null(args, ctx: dict, report: dict, variant: str, settings: dict, n: int, tree: Tree) -> None:
    """One null-core server of `tree` at `n` users, paced by that tree's twin."""
    row = {"variant": variant, "stack": "null", "users": n, "tree": tree.name}
    try:
        step = null_step_ms(args, report, n, tree.name)
    except RuntimeError as exc:
        return attempt(args, report, row, lambda e=exc: _raise(e))
    cfg = serve_config(ctx["device"], ctx["ckpt"], args.port, n, null_step_ms=step, root=tree.root)
    venv = {k: v for k, v in settings.items() if not k.startswith("args.")}
    row.update(env=venv, null_step_ms=step, ideal_tok_s=1000 * n / step)
    measure_server(args, ctx, report, row, with_app_args(cfg, settings), [n], tree)


def run_variant(args, ctx: dict, report: dict, variant: str, settings: dict) -> None:
    """The served stack (one server, every user count), then one null-core server per user count; each
    with every tree's code in turn (the baseline first)."""
    venv = {k: v for k, v in settings.items() if not k.startswith("args.")}
    for tree in ctx["trees"] if "served" not in args.skip else []:
        cfg = serve_config(ctx["device"], ctx["ckpt"], args.port, max(args.users), root=tree.root, tp=args.tp)
        row = {"variant": variant, "stack": "served", "tree": tree.name, "env": venv}
        measure_server(args, ctx, report, row, with_app_args(cfg, settings), args.users, tree)
    for n in args.users if "null" not in args.skip else []:
        for tree in ctx["trees"]:
            run_null(args, ctx, report, variant, settings, n, tree)


def save(args, report: dict, final: bool = False) -> None:
    report["acceptance"] = overhead_acceptance([r for r in report["runs"] if r.get("tree", "new") == "new"])
    if len(report.get("trees", [])) > 1:
        report["baseline"] = serve_ab(report["runs"])
    stem = args.out / "serve_overhead"
    if final:
        return write_report(stem, report, overhead_markdown(report))
    write_json(stem.with_suffix(".json"), report)
    stem.with_suffix(".md").write_text(overhead_markdown(report))


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
    add("--tp", type=int, default=1, help="tensor_parallel_size of the served engine (--skip offline,null)")
    add("--gen-scale", type=float, default=1.0)
    add("--prompt-scale", type=float, default=1.0)
    add("--seed", type=int, default=0)
    add("--port", type=int, default=8000)
    add("--ready-timeout", type=float, default=300.0, help="seconds for `serve run` to answer")
    add("--serve-env", action="append", default=[], metavar="NAME=K=V[,K=V]", help="a variant (repeatable)")
    add("--rounds", type=int, default=1, help="measure every variant this many times, alternating the order")
    add("--skip", default="", help="comma-separated: offline, served, null")
    add("--null-step-ms", type=float, default=None, help="the null core's step (default: from the twin)")
    add("--profile", type=float, default=0.0, help="py-spy seconds in each server's first window (0: off)")
    add("--profile-gil", action="store_true", help="py-spy keeps only the samples holding the GIL")
    add(
        "--baseline-tree", type=Path, default=None, help="also measure the code of this tree (old), same host"
    )
    add(
        "--no-kernel-trace",
        action="store_true",
        help="no SIGUSR1/2 kernel trace of the core (dmon still runs)",
    )
    add("--out", type=Path, default=ROOT / "benchmarks" / "reports" / "serve_overhead")
    args = p.parse_args(argv)
    args.users = [int(u) for u in args.users.split(",") if u.strip()]
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give 1 or more")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.tp > 1 and not {"offline", "null"} <= args.skip:
        p.error("--tp > 1 measures the served engine only: add --skip offline,null")
    args.variants = {"default": {}} | dict(parse_variant(v) for v in args.serve_env)
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env, facts, device = prepare_host()
    trees = make_trees(args.baseline_tree)  # one checkpoint for both
    ctx = {"device": device, "ckpt": ensure_checkpoint(args, device, env), "env": env, "trees": trees}
    log(f"{args.model} ({ctx['ckpt']}) on {device}; users {args.users}; variants {list(args.variants)}; "
        f"trees {[f'{t.name} {t.root}' for t in trees]}")  # fmt: skip
    cmd = [PY, "-m", "benchmarks.serve_overhead", *(sys.argv[1:] if argv is None else argv)]
    report = {"command": " ".join(cmd),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": facts, "device": device,
              "model": args.model, "checkpoint": str(ctx["ckpt"]), "variants": args.variants,
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                           if k not in ("variants", "out", "skip")},
              "trees": [{**t.describe(), "engine_options": engine_options(device, t.root)} for t in trees],
              "skipped": sorted(args.skip), "engine_options": engine_options(device), "runs": []}  # fmt: skip
    for n in args.users if "offline" not in args.skip else []:
        for tree in trees:
            row = {"variant": "-", "stack": "offline", "users": n, "tree": tree.name}
            attempt(args, report, row, lambda n=n, t=tree: run_offline(args, ctx, n, t))
    for variant, venv in rounds(args.variants, args.rounds):
        run_variant(args, ctx, report, variant, venv)
    save(args, report, final=True)


def rounds(variants: dict[str, dict], n: int) -> list[tuple[str, dict]]:
    """(name, settings) in the order to measure them: with n > 1 every variant n times, named NAME#R,
    each round in the reverse order of the one before, so no variant always runs first or last on a host
    that warms up or wears down over the call."""
    if n == 1:
        return list(variants.items())
    order = list(variants.items())
    each = [order if r % 2 == 0 else order[::-1] for r in range(n)]
    return [(f"{name}#{r + 1}", venv) for r, names in enumerate(each) for name, venv in names]


if __name__ == "__main__":
    main()
