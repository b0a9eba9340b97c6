"""Tensor parallelism through `serve run`'s path (issue 47): `tensor_parallel_size: 2` under `args.engine`
gives the engine replica a placement group of two CPU bundles (STRICT_PACK) and its core a gloo group of
two ranks; greedy completions through the official `openai` SDK equal the TP=1 offline engine's; kill -9
of the worker (the core idle, no request open) fails the core, so the replica turns unhealthy and Serve
replaces it; kill -9 of the replica and `serve shutdown` leave no core or worker behind. Both engines
run in float64 (as tests/test_tp.py does), so a different summation order across ranks cannot flip a
greedy choice.

GPU bundles cannot run a model here, but Ray assigns the ids of logical GPUs as it does real ones: on
the same Ray (given fake GPUs), an actor placed as Serve places a replica must give its core every
bundle's GPU, its own first (app/tp_placement.core_env).

The configuration rules of app/tp_placement.py (num_gpus against the TP size, the bundles) are checked
without a server.
"""

from __future__ import annotations

import os
import signal

import httpx
import openai
import psutil
import pytest

from app.builder import AppArgs, build_app
from app.tp_placement import check_cluster, check_num_gpus, core_env, engine_resources
from engine import LLM, SamplingParams
from tests.serving_fixtures import Server, process_alive, start_server, stop_server, wait_until

pytestmark = [pytest.mark.serving, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
PROMPTS = ["The quick brown fox", "Tensor parallel ranks", "one two one two one two"]
MAX_TOKENS = 16
# two ranks of 0.5 CPU and the ingress's 0.5 fit the test's Ray of 2 CPUs
OVERRIDES = {"engine": {"tensor_parallel_size": 2, "dtype": "float64"}, "engine_num_cpus": 0.5}
# the serving replica's processes after the replacement; "stopped": the last test stopped the server
_state: dict = {}


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Server:
    srv = start_server(tiny_model_dir, OVERRIDES, fake_gpus=3)  # the deployment itself uses none
    yield srv
    if "stopped" not in _state:
        stop_server()


@pytest.fixture(scope="module")
def tp1_texts(tiny_model_dir) -> list[str]:
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float64")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [r.outputs[0].text for r in llm.generate(PROMPTS, params)]


def engine_processes(url: str) -> tuple[int, int, list[int]]:
    """(replica pid, engine core pid, the core's tensor-parallel worker pids) of the serving replica."""
    stats = httpx.get(f"{url}/v1/engine/stats", timeout=10).json()
    children = psutil.Process(stats["core_pid"]).children()
    workers = [p.pid for p in children if "engine.runner.tp_worker" in " ".join(p.cmdline())]
    return stats["pid"], stats["core_pid"], workers


def assert_greedy(server: Server, want: list[str]) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    for prompt, text in zip(PROMPTS, want, strict=True):
        kw = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        got = client.completions.create(**kw, extra_body={"ignore_eos": True})
        assert got.choices[0].text == text
        assert got.usage.completion_tokens == MAX_TOKENS


def replaced(url: str, old_core: int) -> bool:
    """The server is healthy again, on a replica other than the one of `old_core`."""
    try:
        return status(url) == 200 and engine_processes(url)[1] != old_core
    except (httpx.HTTPError, KeyError, psutil.Error):
        return False


def status(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def placement_groups() -> list[tuple[str, list[dict]]]:
    from ray.util import placement_group_table

    groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
    return [(g["strategy"], list(g["bundles"].values())) for g in groups]


def test_tp2_greedy_completions_equal_the_tp1_engine(server, tp1_texts):
    _, _, workers = engine_processes(server.url)
    assert len(workers) == 1  # rank 1; rank 0 is the core itself
    assert placement_groups() == [("STRICT_PACK", [{"CPU": 0.5}, {"CPU": 0.5}])]
    assert_greedy(server, tp1_texts)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    kw = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0.0}
    chunks = client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tp1_texts[0]


def test_a_killed_worker_fails_the_idle_replica_and_serve_replaces_it(server, tp1_texts):
    replica, core, (worker,) = engine_processes(server.url)
    os.kill(worker, signal.SIGKILL)  # no request open: the idle core must notice by itself
    wait_until(lambda: not process_alive(core), 15, "the idle core to fail on its dead worker")
    wait_until(lambda: status(server.url) == 503, 10, "/health to report the dead engine")
    wait_until(lambda: replaced(server.url, core), 120, "Serve to replace the unhealthy replica")
    new_replica, new_core, new_workers = engine_processes(server.url)
    assert new_core != core and len(new_workers) == 1 and process_alive(new_workers[0])
    assert len(placement_groups()) == 1  # the dead replica's was removed
    assert_greedy(server, tp1_texts)
    gone = [replica, core, worker]
    wait_until(lambda: not any(process_alive(p) for p in gone), 60, "the dead replica's processes to go")
    _state["processes"] = [new_replica, new_core, *new_workers]


def test_kill_9_of_the_replica_leaves_no_worker(server):
    processes = _state.get("processes") or _flat(engine_processes(server.url))
    os.kill(processes[0], signal.SIGKILL)  # the replica: its core and the core's worker go with it
    wait_until(
        lambda: not any(process_alive(p) for p in processes), 15, "the replica's core and worker to go"
    )
    wait_until(lambda: replaced(server.url, processes[1]), 120, "Serve to replace the killed replica")
    _state["processes"] = _flat(engine_processes(server.url))


def test_gpu_bundles_give_the_core_each_ranks_gpu_in_rank_order(server):
    import ray
    from ray.util import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    class Holder:  # a GPU holder, the replica's stand-in; defined here, so Ray ships it by value
        def gpus(self) -> list:
            return ray.get_gpu_ids()

        def core_envs(self) -> tuple[str, dict, dict]:
            return os.environ["CUDA_VISIBLE_DEVICES"], core_env(2), core_env(1)

    hog = ray.remote(num_gpus=1, num_cpus=0)(Holder).remote()  # so that the group's GPUs are not 0, 1
    assert ray.get(hog.gpus.remote()) == [0]
    group = placement_group([{"GPU": 1}] * 2, strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=30)
    where = PlacementGroupSchedulingStrategy(group, 0, placement_group_capture_child_tasks=True)
    replica = ray.remote(num_gpus=1, num_cpus=0)(Holder).options(scheduling_strategy=where).remote()
    try:
        own, env, env1 = ray.get(replica.core_envs.remote(), timeout=60)
        assert env1 == {} and env == {"CUDA_VISIBLE_DEVICES": f"{own},{3 - int(own)}"} and own in ("1", "2")
    finally:
        ray.kill(replica)
        ray.kill(hog)
        remove_placement_group(group)


def test_a_placement_the_live_cluster_cannot_hold_is_refused(server):
    """check_cluster against this Ray (one node of 3 logical GPUs, none held once the test above let go):
    TP=4 can never be placed, and two TP=2 replicas not now; one TP=2 replica can."""
    import ray

    wait_until(lambda: ray.available_resources().get("GPU") == 3, 15, "the GPU holders to go")
    tp2, tp4 = (engine_resources(None, 1.0, tp, lambda: True) for tp in (2, 4))
    check_cluster(tp2, 2, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 needs 4 GPUs on one node.*largest .* 3"):
        check_cluster(tp4, 4, 1)
    with pytest.raises(ValueError, match=r"num_replicas: 2 engine replicas .* room for 1 \(free GPUs"):
        check_cluster(tp2, 2, 2)


def test_serve_shutdown_leaves_no_worker(server):
    processes = _state.get("processes") or _flat(engine_processes(server.url))
    _state["stopped"] = True
    stop_server()  # serve.shutdown(), what `serve shutdown` does, then Ray's
    wait_until(lambda: not any(process_alive(p) for p in processes), 30, "the replica's processes to exit")


def _flat(found: tuple[int, int, list[int]]) -> list[int]:
    replica, core, workers = found
    return [replica, core, *workers]


# ---------------------------------------------------------------- configuration, without a server


def test_tp_reserves_one_bundle_per_rank_on_one_node():
    on_gpus = engine_resources(None, 1.0, 4, lambda: True)
    assert on_gpus == {
        "ray_actor_options": {"num_gpus": 1, "num_cpus": 1.0},  # the replica sits in bundle 0
        "placement_group_bundles": [{"CPU": 1.0, "GPU": 1}] * 4,
        "placement_group_strategy": "STRICT_PACK",
    }
    assert engine_resources(4, 1.0, 4, lambda: False) == on_gpus  # num_gpus = TP: the same
    on_cpus = engine_resources(None, 0.5, 2, lambda: False)
    assert on_cpus["placement_group_bundles"] == [{"CPU": 0.5}] * 2
    assert on_cpus["ray_actor_options"] == {"num_gpus": 0, "num_cpus": 0.5}
    assert engine_resources(0, 1.0, 2, lambda: True)["placement_group_bundles"] == [{"CPU": 1.0}] * 2


def test_tp1_keeps_num_gpus_as_it_was():
    assert engine_resources(0.5, 1.0, 1, lambda: True) == {
        "ray_actor_options": {"num_gpus": 0.5, "num_cpus": 1.0}
    }
    assert engine_resources(None, 1.0, 1, lambda: True)["ray_actor_options"]["num_gpus"] == 1
    assert engine_resources(None, 1.0, 1, lambda: False)["ray_actor_options"]["num_gpus"] == 0


@pytest.mark.parametrize("num_gpus", [1, 0.5, 3])
def test_a_num_gpus_that_contradicts_tp_is_refused(num_gpus):
    with pytest.raises(
        ValueError, match=r"args.num_gpus: .* contradicts engine.tensor_parallel_size 2.*set it to 2"
    ):
        check_num_gpus(num_gpus, 2)


def test_the_builder_refuses_it_at_start_up(tiny_model_dir):
    args = AppArgs(model=str(tiny_model_dir), num_gpus=1, engine={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="args.num_gpus: 1 contradicts engine.tensor_parallel_size 2"):
        build_app(args)
    with pytest.raises(ValueError, match="args.engine_num_cpus: 0 leaves"):
        build_app(
            AppArgs(
                model=str(tiny_model_dir), num_gpus=0, engine_num_cpus=0, engine={"tensor_parallel_size": 2}
            )
        )
