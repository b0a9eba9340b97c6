"""The host KV tier's copies on a GPU (engine/runner/kv_offload.py): their order against the steps on
the compute stream. The side stream is held back with torch.cuda._sleep so that a missing wait would
let the wrong write land last."""

from __future__ import annotations

import pytest
import torch

from engine.runner.kv_cache import KVCacheSpec, allocate_kv_cache
from engine.runner.kv_offload import KVOffload
from engine.sched.host_tier import TierTransfers
from tests.test_kv_offload import multi_turn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLEEP_CYCLES = 200_000_000  # about 0.1 s on an H100's clock


def make(num_blocks: int = 32) -> tuple[list, KVOffload]:
    spec = KVCacheSpec(num_blocks, 16, 4, 2, 64, torch.bfloat16)
    caches = allocate_kv_cache(spec, torch.device("cuda"))
    for b in range(num_blocks):  # block b holds the value b in every cache
        for k, v in caches:
            k[b].fill_(b)
            v[b].fill_(b)
    torch.cuda.synchronize()
    return caches, KVOffload(caches, spec, gib=num_blocks * spec.bytes_per_block / 2**30)


def block_values(caches, block: int) -> set[float]:
    return {float(x) for k, v in caches for x in (k[block].unique().tolist() + v[block].unique().tolist())}


def test_a_step_writes_a_block_only_after_its_copy_out():
    caches, off = make()
    with torch.cuda.stream(off.out_stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy out starts late
    off.submit(TierTransfers(0, offloads=[(b, 31 - b) for b in range(8)]))
    for k, v in caches:  # the step that reuses blocks 0..7, enqueued on the compute stream
        k[:8].fill_(-1)
        v[:8].fill_(-1)
    torch.cuda.synchronize()
    assert off.poll() == [0]
    back = off.host.view(torch.bfloat16)  # slot 31 - b holds block b as it was
    assert all(set(back[31 - b].unique().tolist()) == {float(b)} for b in range(8))
    assert block_values(caches, 0) == {-1.0}


def test_a_copy_in_lands_after_the_steps_enqueued_before_it_and_the_next_step_does_not_wait():
    caches, off = make()
    off.submit(TierTransfers(0, offloads=[(5, 0)]))  # slot 0 holds block 5's values
    torch.cuda.synchronize()
    assert off.poll() == [0]
    torch.cuda._sleep(SLEEP_CYCLES)  # a long step still on the device, which writes block 9
    for k, v in caches:
        k[9].fill_(-2)
        v[9].fill_(-2)
    off.submit(TierTransfers(1, reloads=[(0, 9)]))
    after = torch.cuda.current_stream().record_event()  # the next step: not held by the copy in
    after.synchronize()
    off.synchronize()
    assert block_values(caches, 9) == {5.0}  # the copy in came after the step's write
    assert off.poll() == [1]
    assert off.back.blocks == 1 and off.back.gbps > 0


def test_copies_in_overlap_the_step_that_follows_and_the_step_that_reads_them_waits():
    caches, off = make()
    off.submit(TierTransfers(0, offloads=[(b, b) for b in range(16)]))
    torch.cuda.synchronize()
    off.poll()
    with torch.cuda.stream(off.in_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    off.submit(TierTransfers(1, reloads=[(b, 16 + b) for b in range(16)]))
    torch.cuda.current_stream().record_event().synchronize()  # the compute stream is free at once
    assert off.poll() == []  # the copy in is still in flight
    off.wait({1})  # a step that reads the blocks: its compute stream waits for the copy
    assert block_values(caches, 20) == {4.0}  # read on the compute stream, after the copy
    assert off.poll() == [1]


def test_greedy_output_is_the_same_with_the_host_tier_on_a_gpu(tiny_model_dir):
    """fp32 (as tests/test_gpu_engine.py): with the tier a turn's prefix is read back instead of
    recomputed, different kernels for the same values, so one sequence in 16 may flip a near tie."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    def engine(gib: float) -> LLMEngine:
        config = EngineConfig.from_kwargs(
            str(tiny_model_dir), dtype="float32", device="cuda", block_size=4, num_blocks=24,
            kv_offloading_size=gib, max_num_seqs=4, grammar_process=False,
        )  # fmt: skip
        return LLMEngine(config)

    tiered = engine(0.001)
    got, want = multi_turn(tiered), multi_turn(engine(0))
    assert sum(got[k] != want[k] for k in want) <= 1
    stats = tiered.get_stats()
    assert stats["kv_reload_blocks"] > 0 and stats["kv_offload_blocks"] > 0 and stats["kv_reload_gbps"] > 0
    assert tiered.audit() == [] and tiered.block_manager.num_used == 0
