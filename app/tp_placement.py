"""Where a tensor-parallel engine replica runs: one placement-group bundle per rank, all on one node.

With `engine.tensor_parallel_size` P > 1 the engine deployment asks Serve for a placement group of P
bundles, STRICT_PACK (one node): Serve puts the replica (and so the engine core, rank 0) in bundle 0,
and bundle r stands for rank r. On GPUs each bundle is one whole GPU and `engine_num_cpus` CPUs; on a
CPU machine, `engine_num_cpus` CPUs. The ranks beyond 0 are subprocesses of the engine core
(engine/runner/tp_group.py), not Ray actors, so Ray gives the replica only bundle 0's GPU
(CUDA_VISIBLE_DEVICES): the replica asks each other bundle which GPU it holds (a task placed in that
bundle) and starts the core with all P GPUs visible in rank order, so that rank r uses cuda:r.

At P = 1 none of this applies: `num_gpus` keeps its meaning, and a fraction shares a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

BUNDLE_GPU_TIMEOUT_S = 120.0  # the bundles are reserved before the replica starts: the tasks run at once


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
