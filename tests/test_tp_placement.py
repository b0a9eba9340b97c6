"""A tensor-parallel deployment the Ray cluster cannot place fails at start-up (app/tp_placement.py).

The cluster is faked: the records below have the shapes ray.nodes(), available_resources_per_node()
and placement_group_table() return, so no Ray or Serve starts. The check against a live Ray (with
logical GPUs) is in tests/test_serving_tp.py.
"""

from __future__ import annotations

import pytest

from app import tp_placement
from app.tp_placement import (
    NodeGPUs,
    check_cluster,
    check_gpus_fit,
    cluster_gpus,
    engine_resources,
    start_replicas,
)

pytestmark = pytest.mark.serving


def node(node_id: str, gpus: float, alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": f"10.0.0.{node_id}",
            "Resources": {"CPU": 64.0, "GPU": gpus}}  # fmt: skip


def group(name: str, gpus_on: list[str], state: str = "CREATED") -> dict:
    bundles = {i: {"CPU": 1.0, "GPU": 1.0} for i in range(len(gpus_on))}
    return {"name": name, "state": state, "bundles": bundles, "bundles_to_node_id": dict(enumerate(gpus_on))}


def test_free_gpus_count_what_engine_replicas_hold():
    """Node 1: 8 GPUs, 2 free, 4 held by a minserve engine replica (released on redeploy), 2 by something
    else; node 2: 4 GPUs all free; node 3 is dead."""
    nodes = [node("1", 8), node("2", 4), node("3", 8, alive=False)]
    available = {"1": {"GPU": 2.0}, "2": {"GPU": 4.0}}
    groups = {
        "a": group("SERVE_REPLICA::default#EngineDeployment#x1", ["1"] * 4),
        "b": group("other-job", ["1"] * 2),
        "c": group("SERVE_REPLICA::default#EngineDeployment#gone", ["1"] * 4, state="REMOVED"),
    }
    assert cluster_gpus(nodes, available, groups) == [
        NodeGPUs("10.0.0.1", 8.0, 6.0),
        NodeGPUs("10.0.0.2", 4.0, 4.0),
    ]


@pytest.mark.parametrize(
    ("tp", "replicas", "nodes", "match"),
    [
        (4, 1, [NodeGPUs("a", 2, 2), NodeGPUs("b", 2, 2)], r"tensor_parallel_size: 4 needs 4 GPUs on one "
         r"node.*largest node has 2: lower tensor_parallel_size to 2 or less, or add a node with 4 GPUs"),
        (2, 1, [NodeGPUs("a", 8, 1), NodeGPUs("b", 8, 1)], r"num_replicas: 1 engine replicas of "
         r"engine.tensor_parallel_size 2 .* room for 0 \(free GPUs per node: a: 1, b: 1\): lower num_"),
        (2, 3, [NodeGPUs("a", 4, 4), NodeGPUs("b", 4, 1)], r"num_replicas: 3 .* room for 2"),
        (2, 1, [NodeGPUs("a", 0, 0)], r"tensor_parallel_size: 2 ranks on GPUs, but the Ray cluster has no "
         r"GPU: set num_gpus: 0"),
    ],
)  # fmt: skip
def test_a_deployment_the_cluster_cannot_place_is_refused(tp, replicas, nodes, match):
    with pytest.raises(ValueError, match=match):
        check_gpus_fit(nodes, tp, replicas)


def test_a_deployment_that_fits_passes():
    check_gpus_fit([NodeGPUs("a", 8, 4), NodeGPUs("b", 4, 4)], 4, 2)  # one replica on each node
    check_gpus_fit([NodeGPUs("a", 8, 8)], 4, 2)  # two on one node
    check_gpus_fit([NodeGPUs("a", 8, 0)], 4, 0)  # autoscaling from zero: only the node size matters


def test_start_replicas_follows_serve():
    assert start_replicas(3, None) == 3
    assert start_replicas(3, {"min_replicas": 2, "max_replicas": 5}) == 2
    assert start_replicas(3, {"min_replicas": 0, "initial_replicas": 1}) == 1
    assert start_replicas(3, {"max_replicas": 5}) == 1  # Serve's default min_replicas


def test_check_cluster_reads_the_live_cluster(monkeypatch):
    """check_cluster feeds Ray's own calls to the check; CPU ranks and TP=1 are never checked."""
    import ray
    import ray._private.state
    import ray.util

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: calls.append("nodes") or [node("1", 2)])
    monkeypatch.setattr(ray._private.state, "available_resources_per_node", lambda: {"1": {"GPU": 2.0}})
    monkeypatch.setattr(ray.util, "placement_group_table", lambda: {})
    on_gpus = engine_resources(None, 1.0, 4, lambda: True)
    with pytest.raises(ValueError, match="largest node has 2"):
        check_cluster(on_gpus, 4, 1)
    check_cluster(engine_resources(None, 1.0, 2, lambda: True), 2, 1)
    check_cluster(engine_resources(0, 1.0, 4, lambda: True), 4, 1)  # CPU bundles: no check
    check_cluster(engine_resources(None, 1.0, 1, lambda: True), 1, 5)  # TP=1: Serve's own business
    assert calls == ["nodes", "nodes"]


def test_engine_groups_are_recognised_by_serves_own_replica_names():
    """Serve names a replica's placement group after the replica's full id (deployment_scheduler)."""
    from ray.serve._private.common import DeploymentID, ReplicaID

    from app.engine_deployment import EngineDeployment

    full = ReplicaID("abc", DeploymentID(EngineDeployment.name, "default")).to_full_id_str()
    groups = {"g": group(full, ["1", "1"])}
    assert full.startswith(tp_placement.ENGINE_GROUP_PREFIX) and tp_placement.ENGINE_GROUP_MARK in full
    assert cluster_gpus([node("1", 2)], {"1": {"GPU": 0.0}}, groups) == [NodeGPUs("10.0.0.1", 2, 2)]
