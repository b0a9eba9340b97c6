"""Ctrl-C and restart of `serve run serve_config.yaml`, N times on one port: nothing may stay behind.

    python -m scripts.restart_check --rounds 10     # make restart-check; report in benchmarks/reports

Each round starts `serve run` on a copy of serve_config.yaml (the model and port changed, nothing else:
the project's own Serve settings) on the same port as the round before, waits for /health, sends the
README's completion request (it must answer 200 with text), then sends SIGINT as a terminal's Ctrl-C
does and checks that
  * `serve run` returns within --bound-s (10 s);
  * every process of its session (Ray, the replicas, the engine cores, HAProxy) is gone within
    --bound-s of the Ctrl-C, and no process anywhere listens on the port (a HAProxy reload can run in a
    session of its own);
  * the port is free, so the next round can bind it.
With --kill-after-s S the Ctrl-C is followed, S seconds later, by SIGKILL of `serve run`'s process group
(a second Ctrl-C's supervisor): the same must hold.
Exit 1 unless every round passes. Writes PREFIX.json and PREFIX.md (times per round, what was left).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
# SIGINT must raise KeyboardInterrupt in `serve run` even when this script runs as a background job
SERVE = [sys.executable, "-c", "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
         "from ray.serve.scripts import cli; cli()"]  # fmt: skip
PROMPT = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def port_bindable(port: int) -> bool:
    """Nothing holds the port: a socket can bind it on every address."""
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def write_report(out: Path, data: dict, text: str) -> int:
    """OUT.json and OUT.md, the markdown printed; the exit status: 0 when every round passed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".json").write_text(json.dumps(data, indent=1))
    out.with_name(out.name + ".md").write_text(text)
    print(text)
    return 0 if data["passed"] == data["of"] else 1


def session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    return [int(p) for p, s in (line.split() for line in out.splitlines()) if int(s) == sid]


def listeners(port: int) -> list[int]:
    """Processes listening on `port` anywhere (a HAProxy reload may run in a session of its own)."""
    import psutil

    conns = psutil.net_connections(kind="tcp")
    return sorted(
        {c.pid for c in conns if c.laddr and c.laddr.port == port and c.status == "LISTEN" and c.pid}
    )


def write_config(model: Path, port: int, workdir: Path) -> Path:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["model"] = str(model)
    path = workdir / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def wait_for(check, timeout_s: float) -> float | None:
    """Seconds until check() holds, or None after timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():
            return time.monotonic() - start
        time.sleep(0.25)
    return None


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def one_round(config: Path, port: int, log: Path, args) -> dict:
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        proc = subprocess.Popen([*SERVE, "run", str(config)], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        up_s = wait_for(lambda: healthy(url), 240)
        served = up_s is not None and answers(url)
        start = time.monotonic()
        exit_s = stop(proc, args.kill_after_s)
        empty_s = wait_for(lambda: not session_pids(proc.pid), max(0.5, args.bound_s - exit_s))
    left = sorted(set(session_pids(proc.pid)) | set(listeners(port)))
    result = {"up_s": up_s, "served": served, "ctrl_c_exit_s": round(exit_s, 2),
              "all_gone_s": None if empty_s is None else round(time.monotonic() - start, 2),
              "left_pids": left, "port_bound_after": port_answers(port)}  # fmt: skip
    result["ok"] = bool(served and exit_s <= args.bound_s and not left and not result["port_bound_after"])
    for pid in left:  # the next round must start clean whatever this one left
        _kill(pid)
    return result


def answers(url: str) -> bool:
    """The README's completion request gets a 200 with text."""
    answer = httpx.post(f"{url}/v1/completions", json=PROMPT, timeout=60)
    return answer.status_code == 200 and bool(answer.json()["choices"][0]["text"])


def stop(proc: subprocess.Popen, kill_after_s: float | None) -> float:
    """Ctrl-C; with kill_after_s, SIGKILL of the whole process group that long after, as an impatient
    second Ctrl-C's supervisor would. Returns the seconds until `serve run` was gone (and reaped)."""
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(120 if kill_after_s is None else kill_after_s)
    except subprocess.TimeoutExpired:
        if kill_after_s is None:
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return time.monotonic() - start


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def report(rounds: list[dict], args) -> tuple[dict, str]:
    ok = sum(r["ok"] for r in rounds)
    data = {"command": " ".join(["python -m scripts.restart_check", *sys.argv[1:]]), "bound_s": args.bound_s,
            "kill_after_s": args.kill_after_s, "rounds": rounds, "passed": ok, "of": len(rounds)}  # fmt: skip
    lines = [f"# Ctrl-C and restart of `serve run`: {ok} of {len(rounds)} rounds clean", "",
             f"`{data['command']}`; bound {args.bound_s:g} s; one port for every round"
             + ("." if args.kill_after_s is None else
                f"; SIGKILL of serve run's process group {args.kill_after_s:g} s after each Ctrl-C."), "",
             "| round | up | served | Ctrl-C returned | all processes gone | left | port bound after | ok |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, r in enumerate(rounds, 1):
        up = "-" if r["up_s"] is None else f"{r['up_s']:.1f} s"
        gone = "-" if r["all_gone_s"] is None else f"{r['all_gone_s']:.1f} s"
        lines.append(f"| {i} | {up} | {r['served']} | {r['ctrl_c_exit_s']:.1f} s | {gone} | "
                     f"{len(r['left_pids'])} | {r['port_bound_after']} | {r['ok']} |")  # fmt: skip
    return data, "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--bound-s", type=float, default=10.0, help="Ctrl-C to return, and everything to go")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llama")
    p.add_argument("--port", type=int, default=0, help="0: a free port, the same for every round")
    kill_help = "SIGKILL serve run's process group this long after Ctrl-C (default: never)"
    p.add_argument("--kill-after-s", type=float, default=None, help=kill_help)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "reports" / "restart_check_cpu")
    args = p.parse_args()
    port = args.port or free_port()
    workdir = Path(f"/tmp/restart_check_{port}")
    workdir.mkdir(parents=True, exist_ok=True)
    config = write_config(args.model.resolve(), port, workdir)
    rounds = []
    for i in range(args.rounds):
        rounds.append(one_round(config, port, workdir / f"serve_{i}.log", args))
        print(f"round {i + 1}: {rounds[-1]}", flush=True)
    return write_report(args.out, *report(rounds, args))


if __name__ == "__main__":
    sys.exit(main())
