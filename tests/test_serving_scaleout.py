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
import threading
import time

import httpx
import pytest

from benchmarks.prefix_workload import Workload, _one, run
from tests.serving_fixtures import start_server, stop_server

pytestmark = [pytest.mark.serving, pytest.mark.slow]
BLOCKS = 160  # per replica: about 5 of the workload's 8 prefixes (24 blocks each) and the running turns
TWO = {"num_replicas": 2, "engine_num_cpus": 0.5, "ingress_num_cpus": 0.5}
WORKLOAD = Workload(prefixes=8, prefix_len=384, users=24, turns=3, concurrency=4)


@contextlib.contextmanager
def serving(model_dir, overrides: dict):
    try:
        yield start_server(model_dir, overrides)
    finally:  # also after a failed start: its Ray and HAProxy would hold the ports of the next one
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
    one, default, prefix = (figures[k] for k in configs)
    assert all(f["num_failures"] == 0 for f in figures.values()), figures
    assert prefix["hit_rate"] >= 0.9 * one["hit_rate"], figures
    assert default["hit_rate"] < prefix["hit_rate"] - 0.05, figures  # routing is what made the difference


def _kill_one_engine_replica() -> str:
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "EngineDeployment" in a["name"]]
    victim = sorted(names, key=lambda a: a["name"])[0]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    return victim["name"]


def test_losing_a_replica_loses_no_request_that_had_not_started_streaming(tiny_model_dir):
    """Streaming requests run 8 at a time while one engine replica is killed. A request the dead
    replica had accepted may end with an error event after its 200 (it had started streaming); every
    other request must succeed: those routed to the dead replica are made again on the live one."""
    with serving(tiny_model_dir, TWO) as server:
        vocab = _vocab(server)
        prompts = [[(7 * i + j) % (vocab - 16) + 8 for j in range(40 + i % 50)] for i in range(160)]
        killed: list[str] = []

        async def load() -> list[dict]:
            todo = iter(prompts)

            async def worker(http: httpx.AsyncClient) -> list[dict]:
                return [await _one(http, server.model, p, 48) for p in todo]

            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                return sum(await asyncio.gather(*(worker(http) for _ in range(8))), [])

        timer = threading.Timer(2.0, lambda: killed.append(_kill_one_engine_replica()))
        timer.start()
        t0 = time.monotonic()
        results = asyncio.run(load())
        timer.join()
        assert killed and time.monotonic() - t0 > 2.0, "the load ended before the replica was killed"
        refused = [r for r in results if r["status"] != 200]
        cut = [r for r in results if r["status"] == 200 and "error" in r]
        assert refused == [], refused[:3]
        assert len(results) == len(prompts) and len(cut) <= 8, cut[:3]  # at most the open streams (8 workers)
        after = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": server.model, "prompt": [9, 10, 11], "max_tokens": 2},
            timeout=60,
        )
        assert after.status_code == 200
