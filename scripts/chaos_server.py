"""The `serve run` that scripts/chaos.py puts faults into: start, deploy again, look, stop.

`serve run` starts its own Ray, as a user's shell would, with RAY_TMPDIR set to a folder of this run, so
that its session (and its GCS port) can be found among other Ray instances on the machine. A redeploy
is what `serve deploy` does: the changed config, sent to the running Serve controller by a short-lived
Ray driver (a subprocess, so that this process never holds a connection to the cluster it stops).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from scripts.restart_check import (
    ROOT,
    SERVE,
    _kill,
    free_port,
    healthy,
    listeners,
    port_answers,
    session_pids,
    stop,
    wait_for,
    write_config,
)

# serve run's Ray gets the machine's CPUs (2 here): the ingress and two engine replicas must fit
REPLICA_ARGS = {"num_replicas": 2, "engine_num_cpus": 0.5, "ingress_num_cpus": 0.5}
# HAProxy's stats and metrics listeners take fixed ports unless told otherwise: free ones let this server
# run beside another Serve instance (the test suite's)
HAPROXY_PORT_ENVS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
DEPLOY = """
import sys, yaml, ray
from ray.serve._private.api import serve_start
from ray.serve.schema import ServeDeploySchema
port = open(sys.argv[1]).read().strip()
ray.init(address=f"{ray.util.get_node_ip_address()}:{port}", log_to_driver=False, logging_level="ERROR")
config = ServeDeploySchema.model_validate(yaml.safe_load(open(sys.argv[2])))
serve_start(http_options=config.http_options.model_dump()).deploy_apps(config, _blocking=False)
"""


class ChaosServer:
    def __init__(self, model: Path, port: int, workdir: Path, replicas: int = 2):
        self.port, self.workdir, self.replicas = port, workdir, replicas
        self.url = f"http://127.0.0.1:{port}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = write_config(model, port, workdir)
        self.config = yaml.safe_load(self.config_path.read_text())
        self.args = self.config["applications"][0]["args"]
        self.args.update(REPLICA_ARGS, num_replicas=replicas)
        self._write()
        self.proc: subprocess.Popen | None = None
        self._starts = 0

    def _write(self) -> None:
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))

    def start(self) -> float:
        """`serve run` on the config; seconds until /health answers 200 (an error after 240 s)."""
        env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONPATH": str(ROOT), "RAY_TMPDIR": str(self.workdir)}
        env |= {name: str(free_port()) for name in HAPROXY_PORT_ENVS}
        self._starts += 1
        log = open(self.workdir / f"serve_{self._starts}.log", "w")
        self.proc = subprocess.Popen([*SERVE, "run", str(self.config_path)], cwd=ROOT, env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        log.close()
        up = wait_for(lambda: healthy(self.url) and self.replicas_up(self.replicas, set()), 240)
        if up is None:
            raise RuntimeError(f"serve run on port {self.port} not up after 240 s; see {log.name}")
        return up

    def stop(self) -> float:
        """Ctrl-C; seconds until `serve run` returned."""
        return stop(self.proc, None)

    def deploy(self, **args) -> None:
        """Deploy the config again with these application args changed (they stay changed)."""
        self.args.update(args)
        self._write()
        (gcs,) = (self.workdir / "ray" / "session_latest").glob("gcs_server_port_*")
        cmd = [sys.executable, "-c", DEPLOY, str(gcs), str(self.config_path)]
        # a local Ray made by `serve run` turns token authentication on; a driver joining it must too
        env = {**os.environ, "RAY_TMPDIR": str(self.workdir), "RAY_AUTH_MODE": "token"}
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"redeploy failed: {done.stderr[-2000:]}")

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/engine/stats", timeout=10).json()

    def facts(self) -> dict:
        card = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]
        return {"model": card["id"], "max_model_len": card["max_model_len"], "vocab_size": card["vocab_size"]}

    def replica_pids(self, samples: int = 16) -> set[int]:
        """Engine replica pids that answered stats calls (Serve spreads them over the replicas)."""
        pids = set()
        for _ in range(samples):
            try:
                pids.add(self.stats()["pid"])
            except (httpx.HTTPError, KeyError, ValueError):
                pass
        return pids

    def replicas_up(self, want: int, gone: set[int]) -> bool:
        pids = self.replica_pids()
        return len(pids) == want and not pids & gone

    def ingress_pid(self) -> int:
        """The ingress replica's process (Ray titles it ray::ServeReplica:APP:Ingress)."""
        for pid in session_pids(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"ServeReplica:" in cmdline and b":Ingress" in cmdline:
                return pid
        raise RuntimeError("no ingress replica process in serve run's session")

    def kv_leaks(self, timeout_s: float = 30.0) -> dict[int, int]:
        """Once the load has stopped: the KV blocks each engine replica still holds, where any does."""
        held: dict[int, int] = {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for _ in range(8):
                stats = self.stats()
                held[stats["pid"]] = stats["kv_blocks_used"]
            if len(held) >= self.replicas and not any(held.values()):
                return {}
            time.sleep(0.5)
        return {pid: n for pid, n in held.items() if n}

    def serves(self) -> bool:
        body = {
            "model": self.args.get("served_model_name") or "tiny-llama",
            "prompt": [9, 10, 11],
            "max_tokens": 2,
        }
        try:
            return httpx.post(f"{self.url}/v1/completions", json=body, timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def final_stop(self) -> dict:
        """Ctrl-C, then what is left of serve run's session and on the port."""
        exit_s = self.stop()
        sid = self.proc.pid
        wait_for(lambda: not session_pids(sid) and not listeners(self.port), 10)
        left = sorted(set(session_pids(sid)) | set(listeners(self.port)))
        return {
            "ctrl_c_exit_s": round(exit_s, 1),
            "left_pids": left,
            "port_bound_after": port_answers(self.port),
        }

    def kill_leftovers(self) -> None:
        """Whatever a failed round left: the next one must start clean."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in set(session_pids(self.proc.pid)) | set(listeners(self.port)):
            _kill(pid)
