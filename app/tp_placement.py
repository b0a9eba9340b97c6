"""Where a tensor-parallel engine replica runs: one placement-group bundle per rank, all on one node.

With `engine.tensor_parallel_size` P > 1 the engine deployment asks Serve for a placement group of P
bundles, STRICT_PACK (one node): Serve puts the replica (and so the engine core, rank 0) in bundle 0,
and bundle r stands for rank r. On GPUs each bundle is one whole GPU and `engine_num_cpus` CPUs; on a
CPU machine, `engine_num_cpus` CPUs. The ranks beyond 0 are subprocesses of the engine core
(engine/runner/tp_group.py), not Ray actors, so Ray gives the replica only bundle 0's GPU
(CUDA_VISIBLE_DEVICES): the replica asks each other bundle which GPU it holds (a task placed in that
bundle) and starts the core with all P GPUs visible in rank order, so that rank r uses cuda:r.

At P = 1 none of this applies: `num_gpus` keeps its meaning, and a fraction shares a GPU.

A placement group that no node can hold would leave Serve waiting for it forever, so the builder checks
the Ray cluster first (`check_cluster`): some node must have P GPUs, and the nodes' free GPUs, P of them
on one node per replica, must hold the replicas Serve starts with. GPUs that minserve engine replicas
hold already count as free: a redeploy releases them before its new replicas are placed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BUNDLE_GPU_TIMEOUT_S = 120.0  # the bundles are reserved before the replica starts: the tasks run at once
# Serve names a replica's placement group after the replica: SERVE_REPLICA::<app>#<deployment>#<id>
ENGINE_GROUP_PREFIX, ENGINE_GROUP_MARK = "SERVE_REPLICA::", "#EngineDeployment#"


def check_num_gpus(num_gpus: float | None, tp: int) -> None:
    """With P > 1 ranks a replica holds P whole GPUs, or none (CPU ranks): any other num_gpus is an error."""
    if tp > 1 and num_gpus is not None and num_gpus not in (0, tp):
        raise ValueError(
            f"args.num_gpus: {num_gpus:g} contradicts engine.tensor_parallel_size {tp}: an engine replica "
            f"of {tp} ranks reserves {tp} whole GPUs on one node, one per rank (a placement group). "
            f"Remove num_gpus (the default is {tp} with CUDA, else 0), or set it to {tp}, or to 0 for "
            "ranks on CPUs"
        )


def engine_resources(
    num_gpus: float | None, num_cpus: float, tp: int, cuda_available: Callable[[], bool]
) -> dict[str, Any]:
    """The engine deployment's resource options: `ray_actor_options`, and with tp > 1 the placement
    group (`placement_group_bundles`, `placement_group_strategy`). `num_gpus` None: the default, one
    GPU per rank where the driver sees CUDA, else none."""
    check_num_gpus(num_gpus, tp)
    if tp == 1:
        gpus = num_gpus if num_gpus is not None else (1 if cuda_available() else 0)
        return {"ray_actor_options": {"num_gpus": gpus, "num_cpus": num_cpus}}
    gpus = num_gpus if num_gpus is not None else (tp if cuda_available() else 0)
    per_rank = 1 if gpus else 0
    if not per_rank and num_cpus <= 0:
        raise ValueError(
            f"args.engine_num_cpus: {num_cpus:g} leaves the placement-group bundles of the "
            f"{tp} CPU ranks empty; set it above 0 (0.5 fits two ranks and the ingress on 2 cores)"
        )
    bundle = {k: v for k, v in {"CPU": num_cpus, "GPU": per_rank}.items() if v > 0}
    return {
        # Serve places the replica in bundle 0: its own share is exactly that bundle
        "ray_actor_options": {"num_gpus": per_rank, "num_cpus": num_cpus},
        "placement_group_bundles": [dict(bundle) for _ in range(tp)],
        "placement_group_strategy": "STRICT_PACK",
    }


def core_env(tp: int) -> dict[str, str]:
    """In the engine replica: the environment its engine core needs for `tp` ranks. On GPUs,
    CUDA_VISIBLE_DEVICES lists bundle 0's GPU (the replica's own) and then each other bundle's, in rank
    order; on CPUs, or at tp 1, nothing."""
    import ray

    own = ray.get_gpu_ids()
    if tp == 1 or not own:
        return {}
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = get_current_placement_group()
    if group is None:
        raise RuntimeError(
            f"tensor_parallel_size {tp}: this engine replica runs outside a placement group; deploy it "
            "through app.builder:build_app, which reserves one GPU bundle per rank"
        )

    def gpu_ids() -> list:  # nested, so Ray ships it by value: the task's worker needs no app/
        return ray.get_gpu_ids()

    ask = ray.remote(num_cpus=0, num_gpus=1)(gpu_ids)
    refs = [
        ask.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, rank)).remote()
        for rank in range(1, tp)
    ]
    others = [ids[0] for ids in ray.get(refs, timeout=BUNDLE_GPU_TIMEOUT_S)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in [own[0], *others])}


@dataclass(frozen=True)
class NodeGPUs:
    """One alive node of the Ray cluster, as the engine's placement groups see it."""

    node: str  # its address, for messages
    total: float
    free: float  # unreserved now, plus what minserve engine replicas hold (a redeploy releases them)


def cluster_gpus(nodes: list[dict], available: dict[str, dict], groups: dict[str, dict]) -> list[NodeGPUs]:
    """Per alive node, from ray.nodes(), available_resources_per_node() (node id -> resources) and
    ray.util.placement_group_table()."""
    held: dict[str, float] = defaultdict(float)
    for group in groups.values():
        name = group.get("name") or ""
        ours = name.startswith(ENGINE_GROUP_PREFIX) and ENGINE_GROUP_MARK in name
        if not ours or group.get("state") != "CREATED":
            continue
        where = group.get("bundles_to_node_id", {})
        for index, bundle in group.get("bundles", {}).items():
            held[where.get(index, "")] += bundle.get("GPU", 0)
    return [
        NodeGPUs(
            n.get("NodeManagerAddress") or n["NodeID"],
            n.get("Resources", {}).get("GPU", 0),
            available.get(n["NodeID"], {}).get("GPU", 0) + held[n["NodeID"]],
        )
        for n in nodes
        if n.get("Alive")
    ]


def check_gpus_fit(nodes: list[NodeGPUs], tp: int, replicas: int) -> None:
    """Raise ValueError naming tensor_parallel_size / num_replicas and the fix when the replicas' placement
    groups (`tp` GPUs on one node each) cannot all be placed on `nodes` now."""
    largest = max((n.total for n in nodes), default=0)
    if not largest:
        raise ValueError(
            f"engine.tensor_parallel_size: {tp} ranks on GPUs, but the Ray cluster has no GPU: set "
            "num_gpus: 0 to run the ranks on CPUs, or start Ray on nodes with GPUs"
        )
    if largest < tp:
        raise ValueError(
            f"engine.tensor_parallel_size: {tp} needs {tp} GPUs on one node (a replica's ranks share a "
            f"node), but the Ray cluster's largest node has {largest:g}: lower tensor_parallel_size to "
            f"{int(largest)} or less, or add a node with {tp} GPUs"
        )
    room = sum(int(n.free // tp) for n in nodes)
    if room < replicas:
        free = ", ".join(f"{n.node}: {n.free:g}" for n in nodes)
        raise ValueError(
            f"args.num_replicas: {replicas} engine replicas of engine.tensor_parallel_size {tp} need {tp} "
            f"free GPUs on one node each, but the Ray cluster has room for {room} (free GPUs per node: "
            f"{free}): lower num_replicas (or autoscaling_config's initial/min_replicas) or "
            "tensor_parallel_size, free the GPUs other applications hold, or add nodes"
        )


def start_replicas(num_replicas: int, autoscaling: dict[str, Any] | None) -> int:
    """The engine replicas Serve places at start-up: num_replicas, or autoscaling_config's
    initial_replicas (else min_replicas, whose default is 1)."""
    if not autoscaling:
        return num_replicas
    initial = autoscaling.get("initial_replicas")
    return int(initial if initial is not None else autoscaling.get("min_replicas", 1))


def check_cluster(resources: dict[str, Any], tp: int, replicas: int) -> None:
    """In the builder: check_gpus_fit against the Ray cluster it runs in (nothing without Ray or for
    ranks on CPUs, whose bundles are fractions of shared cores)."""
    import ray

    gpus = resources["ray_actor_options"].get("num_gpus")
    if tp == 1 or not gpus or "placement_group_bundles" not in resources or not ray.is_initialized():
        return
    from ray._private.state import available_resources_per_node
    from ray.util import placement_group_table

    nodes = cluster_gpus(ray.nodes(), available_resources_per_node(), placement_group_table())
    check_gpus_fit(nodes, tp, replicas)
