"""Start the real server once for the serving tests: serve_config.yaml's application on a free port.

The application (import_path and args) is read from serve_config.yaml, so the tests run what
`serve run serve_config.yaml` runs, with the few test settings in TEST_OVERRIDES merged into `args`.
Ray is started in-process (small num_cpus, no dashboard) with a 1 s metrics report interval, so
metric values reach Ray's metrics export port quickly.

Ray hosts one Serve instance per process, so one server runs at a time. The modules that need only the
default configuration share one (`shared_server`, through conftest's `default_server` fixture); a module
that starts a server of its own stops the shared one first, and it starts again when next asked for.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from scripts.soak import STEADY_MALLOC_ENV

ROOT = Path(__file__).resolve().parents[1]

# Set once this process has run a Ray driver; conftest then ends the test process without interpreter
# finalization (see pytest_unconfigure there for why).
ray_driver_started = False

TEST_OVERRIDES = {
    # The overload test opens this many streams and expects the next one to get 503; the Locust test
    # runs 16 users (at most 16 open streams), safely below it.
    "max_ongoing_requests": 20,
    # `__fault:sample__` in a prompt then fails that request inside the engine (engine/core/faults.py).
    "engine": {"fault_injection": True},
}
# With direct ingress, a leaving ingress replica stays reachable this long before it drains, so that an
# external load balancer can deregister it: Serve's default (30 s) would be added to every server stop.
# Nothing deregisters here. `start_server(deregister_s=None)` keeps Serve's default.
DEREGISTER_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
# HAProxy's stats and metrics listeners bind fixed ports (8404, 9101) unless told otherwise: free ones
# let a server start while another Serve instance runs on the same machine.
HAPROXY_PORT_ENVS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")

# The running shared server (keys "model_dir" and "server"), empty when none runs.
_shared: dict = {}


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    model: str
    metrics_url: str  # Ray's Prometheus endpoint of this node
    session_dir: str = ""  # this Ray session's directory (logs/serve/ holds the replica logs)
    headers: dict = field(default_factory=dict)  # the Authorization header when an api_key is set


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _build(import_path: str, args: dict):
    """What `serve run` does with import_path + args: validate args with the builder's pydantic type."""
    module, _, attr = import_path.partition(":")
    builder = getattr(importlib.import_module(module), attr)
    (param,) = inspect.signature(builder).parameters.values()
    return builder(param.annotation.model_validate(args))


def start_server(
    model_dir: Path,
    overrides: dict | None = None,
    address: str | None = None,
    deregister_s: float | None = 0,
    fake_gpus: int = 0,
) -> Server:
    """`overrides` are merged into `args` after TEST_OVERRIDES (nested dicts key by key). `address`: join
    that Ray cluster instead of starting one (its nodes' CPUs, not 2); the HTTP front on the head only.
    `deregister_s`: see DEREGISTER_ENV. `fake_gpus`: Ray counts this many GPUs on a machine without them
    (placement tests: Ray assigns their ids as it would real ones). A running shared server is stopped
    first."""
    import ray
    from ray import serve

    stop_shared_server()
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = config["applications"][0]
    args = _merge(app.get("args") or {}, {**TEST_OVERRIDES, "model": str(model_dir)})
    args = _merge(args, overrides or {})
    headers = {"Authorization": f"Bearer {args['api_key']}"} if args.get("api_key") else {}
    global ray_driver_started
    ray_driver_started = True
    # "local": a Ray of its own, never one that `ray start` (or another test's `serve run`) left to find
    local = {"address": "local", "num_cpus": 2, "include_dashboard": False}
    where = {"address": address} if address else local
    if fake_gpus:
        where["num_gpus"] = fake_gpus
    context = ray.init(
        **where,
        log_to_driver=False,
        # replicas import app/ and engine/ from ROOT; steady malloc so the soak's RSS check sees leaks only
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), **STEADY_MALLOC_ENV}},
        **({} if address else {"_system_config": {"metrics_report_interval_ms": 1000}}),
    )
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": port, **({"location": "HeadOnly"} if address else {})},
            controller_options=_controller_options(config, deregister_s),
        )
        route = app.get("route_prefix", "/")
        serve.run(_build(app["import_path"], args), name=app["name"], route_prefix=route)
        model = _wait_ready(url, headers)
    except BaseException:
        stop_server()  # a Ray left running would fail every later start in this process
        raise
    metrics_port = context.address_info["metrics_export_port"]
    return Server(
        url=url,
        model=model,
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
        session_dir=context.address_info["session_dir"],
        headers=headers,
    )


def serve_test_env(deregister_s: float | None = 0) -> dict[str, str]:
    """Serve's settings for a test server (DEREGISTER_ENV, HAPROXY_PORT_ENVS), as environment variables."""
    env = {name: str(_free_port()) for name in HAPROXY_PORT_ENVS}
    if deregister_s is not None:
        env[DEREGISTER_ENV] = str(deregister_s)
    return env


def _controller_options(config: dict, deregister_s: float | None) -> dict:
    """serve_config.yaml's controller options (its runtime_env carries Serve's throughput settings, and
    the proxy and the replicas inherit it), with serve_test_env added to that environment."""
    env = {"runtime_env": {"env_vars": serve_test_env(deregister_s)}}
    return _merge(config.get("controller_options") or {}, env)


def _wait_ready(url: str, headers: dict, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=5).status_code == 200:
                return httpx.get(f"{url}/v1/models", headers=headers, timeout=5).json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"server at {url} not healthy after {timeout_s} s")
        time.sleep(0.5)


def stop_server() -> None:
    import ray
    from ray import serve

    _shared.clear()
    if ray.is_initialized():  # else serve.shutdown() would connect to whatever Ray it finds, or wait for one
        serve.shutdown()
    ray.shutdown()


def shared_server(model_dir: Path) -> Server:
    """serve_config.yaml's application with TEST_OVERRIDES only: the running one, or a new one where none
    runs, it serves another model, or it does not answer /health (an earlier module, whose tests failed
    for it, left it broken)."""
    running = _shared.get("server")
    if running is not None and not _healthy(running):
        stop_server()
    elif running is not None and _shared["model_dir"] == str(model_dir):
        return running
    server = start_server(model_dir)  # stops a shared one first
    _shared.update(model_dir=str(model_dir), server=server)
    return server


def _healthy(server: Server) -> bool:
    try:
        return httpx.get(f"{server.url}/health", headers=server.headers, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def stop_shared_server() -> None:
    """Stop the shared server if one runs. serve.shutdown(), what `serve shutdown` does, must leave no
    engine core behind: the core of the replica serving then must exit."""
    server = _shared.get("server")
    if server is None:
        return
    try:
        core = httpx.get(f"{server.url}/v1/engine/stats", timeout=10).json()["core_pid"]
    finally:
        stop_server()
    wait_until(lambda: not process_alive(core), 30, f"engine core {core} to exit after serve.shutdown()")


def wait_idle(url: str, timeout_s: float = 15.0, headers: dict | None = None) -> dict:
    """Poll /v1/engine/stats until no stream is open, nothing runs or waits and no KV block is held."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = httpx.get(f"{url}/v1/engine/stats", headers=headers, timeout=5).json()
        idle = (
            stats["ongoing_requests"],
            stats["num_running"],
            stats["num_waiting"],
            stats["kv_blocks_used"],
        )
        if idle == (0, 0, 0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll `predicate` every 0.5 s until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.5)
