"""The all-reduce of tensor-parallel forwards (engine/models/all_reduce.py) against the exact sum.

On CPU (gloo) every message goes through torch.distributed's all-reduce; on two or more GPUs the
one-shot path over symmetric memory is checked too, plainly and replayed from a CUDA graph, at sizes on
both sides of its limit.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.engine


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_sums(rank: int, world: int, port: int, cuda: bool) -> None:
    from engine.models import all_reduce

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dtype = torch.bfloat16 if cuda else torch.float32
    all_reduce.install(device, dtype, enabled=True)
    assert (all_reduce._one_shot is not None) == cuda
    limit = all_reduce.ONE_SHOT_MAX_BYTES // dtype.itemsize
    for numel in (64, 4096, limit, limit + 64):
        x = torch.full((numel // 64, 64), float(rank + 1), dtype=dtype, device=device)
        want = float(sum(range(1, world + 1)))
        assert all_reduce.all_reduce(x.clone()).float().unique().tolist() == [want]
        if cuda:  # replayed from a graph, with new inputs written into the captured buffer
            static = x.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = all_reduce.all_reduce(static)
            static.fill_(2.0 * (rank + 1))
            graph.replay()
            torch.cuda.synchronize()
            assert out.float().unique().tolist() == [2 * want]
    if not cuda:  # NCCL's destroy waits on peers that may have left (engine/runner/tp_group.close)
        dist.destroy_process_group()


def test_all_reduce_sums_over_gloo():
    mp.spawn(_check_sums, args=(2, _port(), False), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_shot_and_nccl_sum_exactly_on_two_gpus_plain_and_in_graphs():
    mp.spawn(_check_sums, args=(2, _port(), True), nprocs=2, join=True)
