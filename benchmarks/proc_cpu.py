"""Per-process CPU over a measurement window, attributed to the serving stack's roles by command line.

    sampler = CpuSampler(sessions={serve_pid}, roots={client_pid}).start()
    ...                                   # the load window
    report = sampler.stop()               # {"wall_s", "roles": {role: {cpu_s, cpu_pct, processes}}, ...}

Watched: every process of the given sessions (`serve run` is started with setsid, and Ray's workers stay
in that session), the given root processes, and all their descendants. Every `interval` s (and at start
and stop) psutil reads each one's user + system CPU seconds, so a process that exits inside the window
keeps what it used up to its last sample; one born inside the window counts from zero. CPU% = CPU
seconds / wall seconds x 100 (100 = one core busy).

Roles (`classify`, on the command line joined with psutil's name(), since Ray retitles its workers as
e.g. `ray::ServeReplica:minserve:EngineDeployment`): "engine core" (`engine.core.process` in the
command line: the engine replica's `python -m engine.core.process` child), "replica" (ServeReplica +
EngineDeployment), "ingress" (ServeReplica + Ingress), "proxy" (ProxyActor), "controller"
(ServeController), "client" (the root processes given as clients and their children, or
`benchmarks.serve_client`), "other ray" (raylet, gcs_server, dashboard, idle workers, the `serve run`
driver, ...), "other". A process that matches nothing but descends from an engine replica counts as
"engine core" (whatever way the replica starts its core); the report lists every process with its
role, so such a call can be checked.
"""

from __future__ import annotations

import os
import threading
import time

ROLES = ("engine core", "replica", "ingress", "proxy", "controller", "client", "other ray", "other")
_OTHER_RAY = ("ray::", "/ray/", "raylet", "gcs_server", "dashboard", "log_monitor", "ray.serve.scripts",
              "runtime_env", "default_worker")  # fmt: skip


def classify(text: str) -> str:
    """The role of one process from its command line (and name) alone."""
    if "engine.core.process" in text:
        return "engine core"
    if "ServeReplica" in text and "EngineDeployment" in text:
        return "replica"
    if "ServeReplica" in text and "Ingress" in text:
        return "ingress"
    for marker, role in (("ProxyActor", "proxy"), ("ServeController", "controller")):
        if marker in text:
            return role
    if "benchmarks.serve_client" in text:
        return "client"
    return "other ray" if any(m in text for m in _OTHER_RAY) else "other"


def assign_roles(procs: dict[int, dict], clients: set[int]) -> dict[int, str]:
    """pid -> role for {pid: {"ppid", "text"}}: classify, then unmatched processes by their ancestors."""
    roles = {pid: classify(p["text"]) for pid, p in procs.items()}
    for pid in procs:
        if pid in clients:
            roles[pid] = "client"
            continue
        if roles[pid] != "other":
            continue
        seen, up = {pid}, procs[pid]["ppid"]
        while up in procs and up not in seen:
            if up in clients or roles[up] == "client":
                roles[pid] = "client"
                break
            if roles[up] == "replica":
                roles[pid] = "engine core"
                break
            seen.add(up)
            up = procs[up]["ppid"]
    return roles


def summarize_cpu(procs: dict[int, dict], wall_s: float, clients: set[int]) -> dict:
    """Per-role CPU seconds and CPU% from {pid: {"ppid", "text", "first", "last"}} (CPU s at first/last)."""
    roles = assign_roles(procs, clients)
    out = {r: {"cpu_s": 0.0, "cpu_pct": 0.0, "processes": 0} for r in ROLES}
    rows = []
    for pid, p in procs.items():
        cpu = max(0.0, p["last"] - p["first"])
        r = out[roles[pid]]
        r["cpu_s"] += cpu
        r["processes"] += 1
        rows.append({"pid": pid, "role": roles[pid], "cpu_s": round(cpu, 3), "cmd": p["text"][:160]})
    for r in out.values():
        r["cpu_pct"] = 100 * r["cpu_s"] / wall_s if wall_s > 0 else 0.0
    rows.sort(key=lambda row: -row["cpu_s"])
    return {"wall_s": wall_s, "roles": out, "processes": rows}


def _getsid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def session_pids(sid: int) -> list[int]:
    """The live (not zombie) processes of session `sid`."""
    import psutil

    pids = []
    for p in psutil.process_iter(["pid", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and _getsid(p.info["pid"]) == sid:
            pids.append(p.info["pid"])
    return pids


def _watched(table: dict[int, dict], sessions: set[int], roots: set[int]) -> set[int]:
    """The pids in the sessions or among the roots, plus all their descendants."""
    children: dict[int, list[int]] = {}
    for pid, p in table.items():
        children.setdefault(p["ppid"], []).append(pid)
    todo = [pid for pid in table if pid in roots or _getsid(pid) in sessions]
    found: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


class CpuSampler:
    """Samples the watched processes' CPU seconds in a thread between start() and stop()."""

    def __init__(self, sessions=(), roots=(), clients=(), interval: float = 0.5):
        self.sessions, self.roots = set(sessions), set(roots) | set(clients)
        self.clients, self.interval = set(clients), interval
        self.procs: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> CpuSampler:
        self.t0, self.wall0 = time.monotonic(), time.time()
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="proc-cpu")
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return summarize_cpu(self.procs, time.monotonic() - self.t0, self.clients)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        import psutil

        table = {}
        for p in psutil.process_iter(["pid", "ppid", "name", "cmdline", "create_time", "cpu_times"]):
            i = p.info
            if i["cpu_times"] is None:  # gone, or not ours to read
                continue
            cmd = " ".join(i["cmdline"] or []).split()  # Ray pads its process titles with spaces
            cpu = i["cpu_times"].user + i["cpu_times"].system
            table[i["pid"]] = {"ppid": i["ppid"], "text": " ".join(cmd + [i["name"] or ""]), "cmd": bool(cmd),
                               "cpu": cpu, "born": i["create_time"] or 0}  # fmt: skip
        for pid in _watched(table, self.sessions, self.roots):
            t = table[pid]
            known = self.procs.get(pid)
            if known is None or abs(known["born"] - t["born"]) > 1:  # new, or a reused pid
                first = 0.0 if t["born"] >= self.wall0 else t["cpu"]
                known = self.procs[pid] = {"first": first, "born": t["born"]}
            if t["cmd"] or "text" not in known:  # an exiting process has lost its command line: keep the last
                known["text"] = t["text"]
            known.update(ppid=t["ppid"], last=t["cpu"])
