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


def _check_fused_norm(rank: int, world: int, port: int) -> None:
    """kernels/triton_allreduce_norm.py against the sum in rank order then kernels/triton_norm.py, bit for
    bit, on every rank alike: plain calls of varying row counts, with bf16 and fp32 partials in turn
    (epochs and slot parities advance per program), then a CUDA graph replayed with new inputs."""
    from engine.models import all_reduce
    from kernels import triton_norm

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    all_reduce.install(device, torch.bfloat16, enabled=True)
    hidden, eps = 4096, 1e-5
    gen = torch.Generator(device="cpu").manual_seed(0)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16).to(device)

    def inputs(rows: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        parts = [torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).to(device) for _ in range(world)]
        return parts, torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).to(device)

    def want(parts, residual):
        total = torch.zeros_like(parts[0], dtype=torch.float32)
        for p in parts:  # rank order, fp32
            total += p.float()
        return triton_norm.add_rms_norm(total.to(torch.bfloat16), residual, weight, eps)

    for rows, takes in ((64, True), (65, False)):  # fp32 partials (tensor_parallel_fp32_reduce) fit alike
        wide = torch.zeros(rows, hidden, dtype=torch.float32, device=device)
        assert (all_reduce.fused_for(wide) is not None) == takes
    for i, rows in enumerate((1, 64, 3, 1, 17, 64, 1, 2, 1, 64)):
        parts, residual = inputs(rows)  # every rank draws the same; each passes its own part
        if i % 2:  # fp32 partials alternate with bf16 ones through the same slots
            parts = [p.float() + torch.randn(p.shape, generator=gen).to(device) * 1e-3 for p in parts]
        fused = all_reduce.fused_for(parts[rank])
        assert fused is not None
        got = fused(parts[rank], residual, weight, eps, 0.0)
        ref = want(parts, residual)
        assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0]), f"rows {rows}"
        seen = [torch.empty_like(got[0]) for _ in range(world)]
        dist.all_gather(seen, got[0])
        assert all(torch.equal(s, got[0]) for s in seen)
    static_x = torch.zeros(8, hidden, dtype=torch.bfloat16, device=device)
    static_r = torch.zeros_like(static_x)
    all_reduce.fused_for(static_x)(static_x, static_r, weight, eps, 0.0)  # warm-up: compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = all_reduce.fused_for(static_x)(static_x, static_r, weight, eps, 0.0)
    for _ in range(3):
        parts, residual = inputs(8)
        static_x.copy_(parts[rank])
        static_r.copy_(residual)
        graph.replay()
        ref = want(parts, residual)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert all_reduce.fused_for(torch.zeros(65, hidden, dtype=torch.bfloat16, device=device)) is None
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_fused_all_reduce_add_norm_equals_the_unfused_arithmetic(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    mp.spawn(_check_fused_norm, args=(world, _port()), nprocs=world, join=True)
