"""The served stack for benchmarks: `serve run` of serve_config.yaml in a session of its own, the
environment its children need on the offline GPU host, host facts, and a py-spy hook.

Used by benchmarks/serve_overhead.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.baseline_tree import tree_env
from benchmarks.common import git_commit
from benchmarks.proc_cpu import session_pids

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
_T0 = time.monotonic()
_FACTS = (
    "import json, ray; from benchmarks.common import environment as e; d = e(); "
    "d['versions']['ray'] = ray.__version__; print(json.dumps(d))"
)


def log(msg: str) -> None:
    print(f"[serve_overhead {time.monotonic() - _T0:5.0f}s] {msg}", file=sys.stderr, flush=True)


def serve_config(
    device: str,
    ckpt: str,
    port: int,
    users: int,
    null_step_ms: float | None = None,
    root: Path = ROOT,
    tp: int = 1,
) -> dict:
    """The serve_config.yaml of the tree at `root` (this repo's by default) with the checkpoint, GPUs,
    port and GPU engine options; `tp` > 1: one replica over that many ranks (a GPU each on CUDA;
    on CPU half a CPU each, so that the ranks and the ingress fit a small machine)."""
    import yaml

    cfg = yaml.safe_load((Path(root) / "serve_config.yaml").read_text())
    cfg["http_options"]["port"] = port
    args = cfg["applications"][0]["args"]
    gpus = tp if device == "cuda" else 0
    args.update(model=str(ckpt), num_gpus=gpus, max_ongoing_requests=max(256, 2 * users))
    if device == "cuda":
        args["engine"].update(max_num_seqs=256, gpu_memory_utilization=0.85)
        args["engine"].pop("cpu_kv_cache_bytes", None)
        # serve_config.yaml's GPU setting: one ingress process is CPU-bound at 256 streams of a 1B model
        args["ingress_num_replicas"] = 2
    if tp > 1:
        args["engine"]["tensor_parallel_size"] = tp
        if device != "cuda":
            args["engine_num_cpus"] = 0.5
    if null_step_ms is not None:
        args["null_core_step_ms"] = round(null_step_ms, 3)
    return cfg


def engine_options(device: str, root: Path = ROOT) -> dict:
    """The served engine's EngineConfig.from_kwargs options (the twin uses the same)."""
    return serve_config(device, "unused", 0, 1, root=root)["applications"][0]["args"]["engine"]


def with_app_args(cfg: dict, settings: dict) -> dict:
    """A variant's `args.NAME` entries, parsed as YAML values, set on the application's args; a dotted
    NAME reaches into a mapping (`args.engine.max_num_batched_tokens`: one engine option)."""
    import yaml

    app = cfg["applications"][0]["args"]
    for key, value in settings.items():
        if key.startswith("args."):
            *path, name = key[len("args.") :].split(".")
            target = app
            for part in path:
                target = target.setdefault(part, {})
            target[name] = yaml.safe_load(value)
    return cfg


def parse_variant(spec: str) -> tuple[str, dict]:
    """'tput=RAY_SERVE_THROUGHPUT_OPTIMIZED=1,FOO=2' -> ('tput', {...}). A key `args.NAME` sets the
    application argument NAME (a YAML value) instead of an environment variable."""
    name, _, rest = spec.partition("=")
    pairs = [kv.partition("=") for kv in rest.split(",") if kv]
    if not name or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise SystemExit(f"--serve-env {spec!r}: expected NAME=K=V[,K=V...]")
    return name, {k: v for k, _, v in pairs}


def _sh(cmd: list[str], env: dict, timeout: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=ROOT, text=True, capture_output=True, timeout=timeout)


def child_env() -> dict:
    """The children's environment: Ray Serve from .gpuwheels where missing (scripts.wheelhouse), the repo on
    the path."""
    env = dict(os.environ, TQDM_MININTERVAL=os.environ.get("TQDM_MININTERVAL", "5"), RAY_ADDRESS="local")
    path = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    if _sh([PY, "-c", "import ray.serve, fastapi"], env).returncode:
        from scripts.wheelhouse import DEFAULT_DIR, DEFAULT_TARGET, install

        log(f"installing {DEFAULT_DIR} into {DEFAULT_TARGET}")
        try:
            install(ROOT / DEFAULT_DIR, DEFAULT_TARGET, PY, env)
        except FileNotFoundError as e:
            sys.exit(f"serve_overhead: Ray Serve is missing and cannot be installed: {e}")
        path.insert(0, DEFAULT_TARGET)
        env["RAY_AUTH_MODE"] = "disabled"
    env["PYTHONPATH"] = ":".join(path)
    return env


def host_facts(env: dict) -> dict:
    """GPU, CPU count, versions: in a subprocess, so this process never holds a CUDA context."""
    out = _sh([PY, "-c", _FACTS], env, timeout=300)
    ok = out.returncode == 0
    facts = json.loads(out.stdout.strip().splitlines()[-1]) if ok else {"error": out.stderr[-500:]}
    return {**facts, "git_commit": git_commit(ROOT)}


def prepare_host() -> tuple[dict, dict, str]:
    """A served benchmark's start: SIGTERM unwinds (every `finally` stops its server); the children's
    environment, the host's facts and the device its servers run on."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    env = child_env()
    facts = host_facts(env)
    return env, facts, "cuda" if (facts.get("hardware") or {}).get("gpu") else "cpu"


def ensure_checkpoint(args, device: str, env: dict) -> Path:
    ckpt = Path(args.ckpt or f"/tmp/minserve_bench/{args.model}").resolve()
    if not (ckpt / "config.json").exists():
        log(f"making the {args.model} checkpoint in {ckpt}")
        make = [PY, "-m", "scripts.make_model", args.model, str(ckpt), "--device", device]
        _sh(make, env).check_returncode()
    return ckpt


class Server:
    """`serve run CONFIG` in a session of its own (setsid), ready once /v1/models answers. It runs the
    code of the tree at `root` (cwd and PYTHONPATH); `client_env` is `env` as given, for this tree's
    load client. Its engine cores write kernel-trace windows to `trace_dir` (MINSERVE_TRACE_DIR)."""

    def __init__(self, cfg: dict, run_dir: Path, env: dict, port: int, root: Path = ROOT):
        import yaml

        run_dir.mkdir(parents=True, exist_ok=True)
        self.config = run_dir / "serve_config.yaml"
        self.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.url, self.run_dir, self.root, self.client_env = f"http://127.0.0.1:{port}", run_dir, root, env
        self.trace_dir = run_dir / "kernel_trace"
        self.env = {**tree_env(env, root), "MINSERVE_TRACE_DIR": str(self.trace_dir)}
        self.proc: subprocess.Popen | None = None

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                return r.status == 200
        except Exception:
            return False

    def start(self, timeout: float) -> None:
        if self._answers():
            raise RuntimeError(f"something already answers at {self.url}: not ours to measure")
        # SIGINT stops `serve run` also where this runs with SIGINT ignored (a background job)
        launch = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        cmd = [PY, "-c", launch + "from ray.serve.scripts import cli; cli()", "run", str(self.config)]
        with open(self.run_dir / "serve.log", "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`serve run` exited ({self.proc.returncode}): {self.log_tail()}")
            if self._answers():
                return log(f"server ready after {time.monotonic() - t0:.0f} s ({self.run_dir.name})")
            time.sleep(2)
        raise RuntimeError(f"no answer from {self.url}/v1/models in {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        path = self.run_dir / "serve.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        """Ctrl-C to `serve run` (it stops Serve and its Ray), then TERM / KILL what its session left."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)  # graceful enough: what is left is killed below (no measurement runs now)
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            for pid in session_pids(proc.pid):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            t0 = time.monotonic()
            while session_pids(proc.pid) and time.monotonic() - t0 < wait:
                time.sleep(0.5)
        proc.poll()


# Ray's default session directory (serve run starts a local Ray; RAY_ADDRESS=local)
SERVE_LOGS = Path("/tmp/ray/session_latest/logs/serve")
# the tail of app/replica_support.log_finished's line: ms from the request's arrival at the ingress
# (older trees, as a baseline, write no "in ingress", "to replica" or "to core")
LATENCY_LINE = re.compile(
    r"(?:in ingress (\S+) ms, )?(?:to replica (\S+) ms, )?(?:to core (\S+) ms, )?"
    r"queue (\S+) ms, engine ttft (\S+) ms, ttft (\S+) ms, e2e (\S+) ms"
)
LATENCY_KEYS = (
    "in_ingress_ms", "to_replica_ms", "to_core_ms", "queue_ms", "engine_ttft_ms", "replica_ttft_ms",
    "replica_e2e_ms",
)  # fmt: skip


def replica_log_marks(
    logs: Path = SERVE_LOGS, pattern: str = "replica_*EngineDeployment*.log"
) -> dict[Path, int]:
    """The size of every engine replica log now (with `pattern`: of those Serve logs): a measured
    window's lines are the ones after it. Marks of every log (pattern "*.log") serve
    `replica_log_values` as well as `serve_warnings`."""
    return {p: p.stat().st_size for p in logs.glob(pattern)}


# Serve's own warnings that a call was held or refused, as its router (in the ingress) and replicas log them
SERVE_WARNINGS = {
    "probe_timeouts": "Failed to get queue length",  # a replica's queue length came too late: backoff
    "route_retries": "Failed to route request",  # a call still unrouted after 50 attempts (every 50th)
    "rejections": "rejecting request",  # a replica at max_ongoing_requests turned a call away
}


def serve_warnings(marks: dict[Path, int], logs: Path = SERVE_LOGS) -> dict[str, int]:
    """SERVE_WARNINGS -> how many such lines every Serve log (`replica_log_marks(pattern="*.log")`) got
    since `marks`. A lower bound: in throughput mode Serve buffers up to 1000 records a process, and the
    ingress, unlike the engine replica, does not flush its buffer every second."""
    counts = dict.fromkeys(SERVE_WARNINGS, 0)
    for path in logs.glob("*.log"):
        text = _since(path, marks)
        for key, needle in SERVE_WARNINGS.items():
            counts[key] += text.count(needle)
    return counts


def _since(path: Path, marks: dict[Path, int]) -> str:
    """What log `path` got after its mark (all of it if it has none)."""
    with open(path, "rb") as f:
        f.seek(marks.get(path, 0))
        return f.read().decode(errors="replace")


def replica_log_values(marks: dict[Path, int], logs: Path = SERVE_LOGS) -> dict[str, list[float]]:
    """LATENCY_KEYS -> the values of the replica's per-request lines written since `marks`: where a
    request's time to first token goes, from its arrival at the ingress (in ingress: until the ingress
    called the engine replica; to replica: until the replica's `generate` began; to core: until the
    engine core took it; queue: until the core first scheduled it; engine ttft: until the core sampled
    its first token; replica ttft: until the replica had it)."""
    values: dict[str, list[float]] = {k: [] for k in LATENCY_KEYS}
    for path in replica_log_marks(logs):
        for match in LATENCY_LINE.finditer(_since(path, marks)):
            for key, cell in zip(LATENCY_KEYS, match.groups(), strict=True):
                if cell not in (None, "-"):
                    values[key].append(float(cell))
    return values


def replica_latencies(marks: dict[Path, int]) -> dict:
    """Percentiles of `replica_log_values`."""
    from benchmarks.serve_summary import percentiles

    return {k: percentiles(v) for k, v in replica_log_values(marks).items()}


def profile_server(server: Server, name: str, delay: float, seconds: float, gil: bool = False) -> None:
    """py-spy (where installed) records the core, replica, ingress and proxy for `seconds` after `delay`,
    as folded stacks (one frame per thread first) in RUN_DIR/profile_<name>_<role>.txt; runs in the
    background. gil: only samples of the thread holding the GIL, which is where a process's CPU goes when
    its threads contend for it (without: every running thread's samples, GIL waits included)."""
    import shutil

    spy = shutil.which("py-spy", path=os.pathsep.join(["/tmp/pylib/bin", os.environ.get("PATH", "")]))
    if spy is None:
        return log("no py-spy: not profiling")

    def record() -> None:
        time.sleep(delay)
        import psutil

        from benchmarks.proc_cpu import assign_roles

        procs = {}
        for pid in session_pids(server.proc.pid):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                procs[pid] = {"text": " ".join(p.cmdline()) + " " + p.name(), "ppid": p.ppid()}
        roles = assign_roles(procs, set())
        for pid, role in roles.items():
            if role in ("engine core", "replica", "ingress", "proxy"):
                out = server.run_dir / f"profile_{name}_{role.replace(' ', '_')}_{pid}.txt"
                cmd = [spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "100", "-f", "raw",
                       "--nonblocking", "--threads", *(["--gil"] if gil else []), "-o", str(out)]  # fmt: skip
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    threading.Thread(target=record, daemon=True).start()
