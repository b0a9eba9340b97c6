"""Two tiny-model engine replicas from serve_config.yaml: prefix-aware routing against Serve's default
router on a multi-prefix, multi-turn workload (benchmarks/prefix_workload.py), and the loss of one
replica under load.

The KV pools are sized so that one replica holds about half of the workload's prefixes, and the
single-replica reference has both pools in one: with the default router each replica sees every prefix
and evicts them in turn; with prefix-aware routing each replica keeps its own, and the hit rate should
be what one big replica gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from benchmarks.prefix_workload import Workload, _one, run
from tests.serving_fixtures import process_alive, start_server, stop_server, wait_until

pytestmark = [pytest.mark.serving, pytest.mark.slow]
BLOCKS = 160  # per replica: about 5 of the workload's 8 prefixes (24 blocks each) and the running turns
TWO = {"num_replicas": 2, "engine_num_cpus": 0.5, "ingress_num_cpus": 0.5}
WORKLOAD = Workload(prefixes=8, prefix_len=384, users=24, turns=3, concurrency=4)


@contextlib.contextmanager
def serving(model_dir, overrides: dict, **kwargs):
    try:
        yield start_server(model_dir, overrides, **kwargs)
    finally:  # a failed start has stopped its own Ray already (start_server); this is then a no-op
        stop_server()


def _vocab(server) -> int:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["vocab_size"]


def test_prefix_routing_keeps_the_single_replica_hit_rate(tiny_model_dir):
    figures = {}
    configs = {
        "one replica, both pools": {"engine": {"num_blocks": 2 * BLOCKS}},
        "two replicas, default router": {
            **TWO,
            "prefix_aware_routing": False,
            "engine": {"num_blocks": BLOCKS},
        },
        "two replicas, prefix-aware": {**TWO, "engine": {"num_blocks": BLOCKS}},  # the default with 2
    }
    for name, overrides in configs.items():
        with serving(tiny_model_dir, overrides) as server:
            figures[name] = run(server.url, server.model, WORKLOAD, _vocab(server))
            expect = WORKLOAD.users * WORKLOAD.turns if name.endswith("aware") else 0
            figures[name]["decisions"] = _routing_decisions(server.metrics_url, expect)
    one, default, prefix = (figures[k] for k in configs)
    assert all(f["num_failures"] == 0 for f in figures.values()), figures
    assert prefix["hit_rate"] >= 0.9 * one["hit_rate"], figures
    assert default["hit_rate"] < prefix["hit_rate"] - 0.05, figures  # routing is what made the difference
    # the dashboard's routing panel: decisions counted at the router (the first turn of each of the 8
    # prefixes finds no holder; every later turn finds one)
    assert default["decisions"] == {} and prefix["decisions"].get("cache_hit", 0) >= 40, figures


def _routing_decisions(metrics_url: str, expect: int) -> dict[str, float]:
    """ray_minserve_routing_decisions_total by decision, from Ray's Prometheus endpoint, once they add
    up to `expect` (Ray exports them every second or so) or after a while."""
    pattern = re.compile(r'^ray_minserve_routing_decisions_total\{[^}]*decision="(\w+)"[^}]*\} (\S+)$', re.M)
    deadline = time.monotonic() + (20 if expect else 3)
    while True:
        found = {d: float(v) for d, v in pattern.findall(httpx.get(metrics_url, timeout=10).text)}
        if (expect and sum(found.values()) >= expect) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _kill_one_engine_replica() -> str:
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "EngineDeployment" in a["name"]]
    victim = sorted(names, key=lambda a: a["name"])[0]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    return victim["name"]


def _kill_one_core(server) -> int:
    core = httpx.get(f"{server.url}/v1/engine/stats", timeout=10).json()["core_pid"]
    os.kill(core, signal.SIGKILL)
    return core


def _replicas(server) -> set[int]:
    """Engine replicas with a live core that answer stats calls (Serve spreads them over the replicas)."""
    answers = [httpx.get(f"{server.url}/v1/engine/stats", timeout=10) for _ in range(16)]
    stats = [a.json() for a in answers if a.status_code == 200]
    return {s["pid"] for s in stats if process_alive(s["core_pid"])}


def _load_through(server, prompts: list[list[int]], kill) -> list[dict]:
    """The prompts as streamed completions, 8 at a time, with `kill()` run 2 s in. A request the dead
    replica had accepted may end with an error event after its 200 (it had started streaming); every
    other request must succeed: those routed to the dead replica are made again on the live one."""
    killed: list = []

    async def load() -> list[dict]:
        todo = iter(prompts)

        async def worker(http: httpx.AsyncClient) -> list[dict]:
            return [await _one(http, server.model, p, 48) for p in todo]

        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return sum(await asyncio.gather(*(worker(http) for _ in range(8))), [])

    timer = threading.Timer(2.0, lambda: killed.append(kill()))
    timer.start()
    t0 = time.monotonic()
    results = asyncio.run(load())
    timer.join()
    assert killed and time.monotonic() - t0 > 2.0, "the load ended before the kill"
    refused = [r for r in results if r["status"] != 200]
    cut = [r for r in results if r["status"] == 200 and "error" in r]
    assert refused == [], refused[:3]
    assert len(results) == len(prompts) and len(cut) <= 8, cut[:3]  # at most the open streams (8 workers)
    return results


def test_losing_a_replica_loses_no_request_that_had_not_started_streaming(tiny_model_dir):
    """Streaming requests run 8 at a time while one engine replica is killed; once Serve has replaced
    it, again while one replica's engine core is killed. A dead core refuses at once, which makes its
    replica look the least loaded: the ingress must call again until Serve's health check takes the
    replica out of routing (app/engine_client.py, app/engine_deployment.py)."""
    with serving(tiny_model_dir, TWO) as server:
        vocab = _vocab(server)
        prompts = [[(7 * i + j) % (vocab - 16) + 8 for j in range(40 + i % 50)] for i in range(160)]
        _load_through(server, prompts, _kill_one_engine_replica)
        wait_until(lambda: len(_replicas(server)) == 2, 90, "Serve to replace the killed replica")
        # prompts no replica holds: the router goes by load, and the dead core's replica has none
        fresh = [[(11 * i + j) % (vocab - 16) + 8 for j in range(30 + i % 40)] for i in range(80)]
        _load_through(server, fresh, lambda: _kill_one_core(server))
        wait_until(lambda: len(_replicas(server)) == 2, 90, "Serve to replace the replica of the dead core")
        after = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": server.model, "prompt": [9, 10, 11], "max_tokens": 2},
            timeout=60,
        )
        assert after.status_code == 200


def _replicas_answering_stats(url: str, rounds: int = 20) -> set[tuple[str, int]]:
    """(node, core pid) of the engine replicas that answer /v1/engine/stats. Calls go by Serve's power of
    two choices on queue lengths, which one at a time can keep choosing one idle replica (a stale cached
    length on the other); bursts of concurrent calls queue on the chosen one and spill to the other."""
    seen: set[tuple[str, int]] = set()
    with ThreadPoolExecutor(8) as pool:
        for _ in range(rounds):
            answers = pool.map(lambda _: httpx.get(f"{url}/v1/engine/stats", timeout=30).json(), range(16))
            seen |= {(s["node_id"], s["core_pid"]) for s in answers}
            if len(seen) >= 2:
                break
    return seen


def test_two_ray_nodes_on_one_host_serve_the_same_config(tiny_model_dir):
    """docs/scaling.md's recipe on one host: a head node and a second node joined to it (Ray's
    cluster_utils starts each as `ray start --head` / `ray start --address` would), the same
    serve_config, one engine replica on each node, and requests served by both."""
    import ray
    from ray.cluster_utils import Cluster

    # 1 CPU per node and 0.75 per engine replica: Ray must put the two replicas on different nodes
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        overrides = {**TWO, "engine_num_cpus": 0.75, "ingress_num_cpus": 0.25}
        server = start_server(tiny_model_dir, overrides, address=cluster.address)
        try:
            assert len({n["NodeID"] for n in ray.nodes() if n["Alive"]}) == 2
            figures = run(server.url, server.model, Workload(prefixes=4, users=8, turns=2), _vocab(server))
            assert figures["num_failures"] == 0 and figures["hit_rate"] > 0.3, figures
            replicas = _replicas_answering_stats(server.url)
            assert len(replicas) == 2 and len({node for node, _ in replicas}) == 2, replicas
        finally:
            stop_server()
    finally:
        cluster.shutdown()


def test_scale_down_lets_the_leaving_replica_finish_its_streams(tiny_model_dir):
    """The application is deployed again with one replica instead of two while long streams run on
    both. (`serve.run` of a freshly built application gives it a new code version, so Serve replaces
    every replica, the ingress's too: a rolling update.) Serve stops routing to the leaving replicas and
    waits up to engine_graceful_shutdown_timeout_s for their streams: every stream finishes, none is cut.

    The streams outlast Serve's own drain budget for an ingress replica (35 s with direct ingress), the
    leaving ingress holds their client connections, and a null core (engine/core/null_engine.py) paces them,
    so that their length does not depend on this machine's load. The ingress must wait as long as the
    engine does (app/builder.py, _INGRESS_DRAIN_MARGIN_S); with Serve's budget the streams were cut."""
    from ray import serve

    from tests.serving_fixtures import ROOT, _build, _merge

    # 45 s a stream: beyond the 35 s Serve gives a leaving ingress; slow steps keep its CPU cost low
    step_ms, max_tokens = 100, 450
    overrides = {**TWO, "prefix_aware_routing": True, "engine_graceful_shutdown_timeout_s": 120}
    overrides |= {"null_core_step_ms": step_ms}
    # Serve's own deregistration window for a leaving ingress, as in production (the 35 s above)
    with serving(tiny_model_dir, overrides, deregister_s=None) as server:
        vocab = _vocab(server)
        prompts = [[(11 * i + j) % (vocab - 16) + 8 for j in range(30)] for i in range(8)]

        async def streams() -> list[dict]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                return list(await asyncio.gather(*(_one(http, server.model, p, max_tokens) for p in prompts)))

        def scale_down() -> None:
            import yaml

            app = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
            args = _merge(app["args"], {"model": str(tiny_model_dir), **overrides, "num_replicas": 1})
            serve.run(_build(app["import_path"], args), name=app["name"], route_prefix="/", blocking=False)

        before = {httpx.get(f"{server.url}/v1/engine/stats").json()["core_pid"] for _ in range(20)}
        timer = threading.Timer(1.0, scale_down)
        timer.start()
        t0 = time.monotonic()
        results = asyncio.run(streams())
        streamed_s = time.monotonic() - t0
        timer.join()
        assert len(before) == 2 and all("error" not in r for r in results), (streamed_s, results)
        assert streamed_s > 40.0, f"the streams ({streamed_s:.1f} s) did not outlast the ingress's own budget"
        engine = lambda: serve.status().applications["minserve"].deployments["EngineDeployment"]  # noqa: E731
        wait_until(lambda: sum(engine().replica_states.values()) <= 1, 60, "the second replica to leave")
        after = {httpx.get(f"{server.url}/v1/engine/stats").json()["core_pid"] for _ in range(10)}
        assert len(after) == 1


def test_autoscaling_adds_a_replica_under_load_and_drains_it_when_the_load_ends(tiny_model_dir):
    """autoscaling_config instead of num_replicas (the prefix-aware router is on, since there can be
    two): 8 streams at a time against a target of 2 per replica bring a second replica, which gets
    requests although every prompt's prefix is cached on the first (the fallback margin follows the
    target); once the load stops, Serve removes it again. No request fails on the way up or down."""
    from ray import serve

    scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2}
    scaling |= {
        "upscale_delay_s": 1,
        "downscale_delay_s": 5,
        "metrics_interval_s": 1,
        "look_back_period_s": 2,
    }
    overrides = {**TWO, "autoscaling_config": scaling}
    overrides.pop("num_replicas")
    engine = lambda: serve.status().applications["minserve"].deployments["EngineDeployment"]  # noqa: E731
    running = lambda: engine().replica_states.get("RUNNING", 0)  # noqa: E731
    with serving(tiny_model_dir, overrides) as server:
        vocab, stop, results = _vocab(server), threading.Event(), []
        prompts = [[(13 * i + j) % (vocab - 16) + 8 for j in range(40)] for i in range(8)]

        async def load() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                while not stop.is_set():
                    results.extend(await asyncio.gather(*(_one(http, server.model, p, 200) for p in prompts)))

        assert running() == 1
        loader = threading.Thread(target=asyncio.run, args=(load(),))
        loader.start()
        try:
            wait_until(lambda: running() == 2, 120, "a second replica under load")
            served = lambda: sorted(_requests_logged(server).values())  # noqa: E731
            wait_until(lambda: len(served()) == 2 and served()[0] > 0, 60, "requests on the new replica")
        finally:
            stop.set()
            loader.join()
        wait_until(lambda: sum(engine().replica_states.values()) == 1, 120, "the second replica to leave")
        after = run(server.url, server.model, replace(WORKLOAD, users=4, turns=1), vocab)
    assert results and all("error" not in r for r in results), [r for r in results if "error" in r][:3]
    assert after["num_failures"] == 0, after


def _requests_logged(server) -> dict[str, int]:
    """Engine replica log -> its one-line-per-request records so far (app/replica_support.log_finished)."""
    logs = Path(server.session_dir) / "logs" / "serve"
    return {p.name: p.read_text().count(" -- request ") for p in logs.glob("replica_*EngineDeployment*.log")}
