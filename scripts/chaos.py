"""The fault benchmark: faults under a bounded W2 load against `serve run` with two engine replicas.

    python -m scripts.chaos --rounds 3          # make chaos; report in benchmarks/reports/chaos_cpu.*

Each round starts `serve run` on a copy of serve_config.yaml (two engine replicas, the model and a free
port changed: it runs beside the test suite's servers), starts the load (scripts/chaos_load.py) and
then, in turn, with --settle-s of load after each fault is over:
  redeploy        the application deployed again with a changed engine argument (a rolling update);
  scale_down      deployed again with one engine replica (then scaled back to two, outside the count);
  kill_core       SIGKILL of one replica's engine core;
  kill_replica    SIGKILL of one engine replica's process;
  ctrl_c_restart  Ctrl-C of `serve run`, and `serve run` again on the same port;
  kill_ingress    (only when --faults names it) SIGKILL of the ingress replica's process.
Per fault it counts the outcomes of the requests sent from the fault until the next one
(scripts/chaos_load.py: lost, refused, cut without an error event, ended with one, ...), the seconds
until a request is served again and until the replicas are all back, and, after the round's final
Ctrl-C, the processes and listeners left. Exit 1 if any request was lost or cut without an error
event, or anything was left behind.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from pathlib import Path

from tqdm import tqdm

from scripts.chaos_load import Load, count
from scripts.chaos_server import ChaosServer
from scripts.restart_check import ROOT, port_answers, port_bindable, wait_for, write_report

FAULTS = ("redeploy", "scale_down", "kill_core", "kill_replica", "ctrl_c_restart")
EXTRA_FAULTS = ("kill_ingress",)  # on request only (--faults)
RECOVER_S = 180.0


def fault(server: ChaosServer, name: str) -> set[int]:
    """Do the fault; return the engine replica pids that must be gone before it counts as recovered
    (a replica whose core died is replaced by Serve)."""
    before = server.replica_pids()
    if name == "redeploy":
        server.deploy(max_ongoing_requests=server.args["max_ongoing_requests"] + 1)
    elif name == "scale_down":
        server.deploy(num_replicas=1)
        return set()
    elif name in ("kill_core", "kill_replica"):
        victim = server.stats()
        os.kill(victim["core_pid" if name == "kill_core" else "pid"], signal.SIGKILL)
        return {victim["pid"]}
    elif name == "kill_ingress":
        os.kill(server.ingress_pid(), signal.SIGKILL)
        return set()
    elif name == "ctrl_c_restart":
        server.stop()
        server.start()
    return before


def one_fault(server: ChaosServer, name: str) -> dict:
    """The fault, then the seconds from it until every replica is back (and a request is served)."""
    start = time.monotonic()
    gone = fault(server, name)
    acted = time.monotonic() - start
    want = 1 if name == "scale_down" else server.replicas
    back = wait_for(lambda: server.serves() and server.replicas_up(want, gone), RECOVER_S)
    back_s = None if back is None else time.monotonic() - start
    return {"fault": name, "at": start, "action_s": round(acted, 1), "all_replicas_back_s": _round(back_s)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def one_round(server: ChaosServer, faults: list[str], args, bar: tqdm) -> dict:
    up_s = server.start()
    load = Load(server.url, users=args.users, prompt_scale=args.prompt_scale, gen_scale=args.gen_scale)
    load.start(server.facts())
    try:
        time.sleep(args.settle_s)
        phases = [_phase(server, load, name, args.settle_s, bar) for name in faults]
    finally:
        load.stop()
    ends = [p["at"] for p in phases[1:]] + [time.monotonic()]
    for phase, end in zip(phases, ends):
        phase.update(count(load.results, phase.pop("at"), end))
    left = server.final_stop()
    return {"up_s": round(up_s, 1), "requests": len(load.results), "phases": phases, **left}


def _phase(server: ChaosServer, load: Load, name: str, settle_s: float, bar: tqdm) -> dict:
    """One fault, then settle_s of load, then a pause of the load in which no KV block may stay held,
    on the survivors and on the replicas that came back."""
    bar.set_postfix_str(name)
    phase = one_fault(server, name)
    if name == "scale_down":  # back to two replicas for the next fault, outside the count
        server.deploy(num_replicas=server.replicas)
        wait_for(lambda: server.replicas_up(server.replicas, set()), RECOVER_S)
    time.sleep(settle_s)
    load.pause()
    phase["kv_leaks"] = server.kv_leaks()
    load.resume()
    bar.update()
    return phase


def passed(rnd: dict) -> bool:
    bad = sum(p["lost"] + p["cut"] + p["bad_end"] + p["no_retry_after"] for p in rnd["phases"])
    back = all(p["all_replicas_back_s"] is not None for p in rnd["phases"])
    leaks = any(p["kv_leaks"] for p in rnd["phases"])
    return bad == 0 and back and not leaks and not rnd["left_pids"] and not rnd["port_bound_after"]


COLUMNS = ("round", "fault", "ok", "lost", "refused", "cut, no error event", "one error event",
           "error status", "serving again", "replicas back", "KV leaks", "left after stop")  # fmt: skip


def quiet_port() -> int:
    """A free port below the kernel's ephemeral range. The servers beside this one (the test suite's)
    take theirs from that range (bind to port 0), and one of them could take this server's port while
    it restarts: HAProxy listens with SO_REUSEPORT, so both would then answer on it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random(os.getpid()).sample(range(max(1024, low - 12000), low), 200):
        if not port_answers(port) and port_bindable(port):
            return port
    raise RuntimeError("no free port below the ephemeral range; pass --port")


def report(rounds: list[dict], args) -> tuple[dict, str]:
    ok = sum(r["ok"] for r in rounds)
    data = {"command": " ".join(["python -m scripts.chaos", *sys.argv[1:]]), "users": args.users,
            "prompt_scale": args.prompt_scale, "gen_scale": args.gen_scale, "settle_s": args.settle_s,
            "rounds": rounds, "passed": ok, "of": len(rounds)}  # fmt: skip
    lines = [
        f"# Faults under W2 load against `serve run` (2 engine replicas): {ok} of {len(rounds)} rounds clean",
        "",
        f"`{data['command']}`: {args.users} users, W2 lengths x{args.prompt_scale:g} (prompt) and "
        f"x{args.gen_scale:g} (generation), {args.settle_s:g} s of load after each fault. Outcomes count "
        "the requests sent from the fault until the next one (scripts/chaos_load.py).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for i, r in enumerate(rounds, 1):
        if "error" in r:
            lines.append(f"| {i} | broke off: {r['error'][:200]} |" + " |" * (len(COLUMNS) - 2))
        left = f"{len(r['left_pids'])} processes, port bound: {r['port_bound_after']}"
        for p in r["phases"]:
            cut = p["cut"] + p["bad_end"]
            times = _s(p["serving_again_s"]), _s(p["all_replicas_back_s"])
            cells = (i, p["fault"], p["ok"], p["lost"], p["refused"], cut, p["error_event"], p["status"],
                     *times, p["kv_leaks"] or 0, left)  # fmt: skip
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return data, "\n".join(lines) + "\n"


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS + EXTRA_FAULTS)}"
    )
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--prompt-scale", type=float, default=0.25, help="W2 prompt lengths times this")
    p.add_argument("--gen-scale", type=float, default=0.25, help="W2 generation lengths times this")
    p.add_argument("--settle-s", type=float, default=5.0, help="seconds of load after each fault")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llama")
    p.add_argument("--port", type=int, default=0, help="0: a free port below the ephemeral range")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "reports" / "chaos_cpu")
    args = p.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS) - set(EXTRA_FAULTS)
    if unknown:
        p.error(f"--faults: unknown {sorted(unknown)}; choose from {', '.join(FAULTS + EXTRA_FAULTS)}")
    rounds = run(args, faults)
    return write_report(args.out, *report(rounds, args))


def workdir(port: int) -> Path:
    """serve run's config, logs and Ray session (a short path: Ray's socket paths must stay short)."""
    return Path(f"/tmp/chaos_{port}")


def run(args, faults: list[str]) -> list[dict]:
    port = args.port or quiet_port()
    server = ChaosServer(args.model.resolve(), port, workdir(port))
    rounds = []
    with tqdm(total=args.rounds * len(faults), desc="chaos", unit="fault") as bar:
        for _ in range(args.rounds):
            try:
                rnd = one_round(server, faults, args, bar)
            except Exception as exc:  # a round that broke off counts, as not clean
                rnd = {"error": repr(exc)[:1000], "phases": [], "left_pids": [], "port_bound_after": None}
            finally:
                server.kill_leftovers()
            rounds.append({**rnd, "ok": "error" not in rnd and passed(rnd)})
            tqdm.write(f"round {len(rounds)}: {'clean' if rounds[-1]['ok'] else 'NOT clean'}")
    return rounds


if __name__ == "__main__":
    sys.exit(main())
