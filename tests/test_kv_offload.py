"""The host KV tier (kv_offloading_size, issue 50) on CPU: same greedy output with the tier on and off
across eviction and reload, a clean audit of both tiers after every step of random traffic, and no
block left in use in either tier after a disconnect storm. The pool is tiny (block_size 4, 16-24
blocks) so the prefix cache evicts all the time; the tier runs the same code as on a GPU host, the
copies synchronous."""

from __future__ import annotations

import random

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sched.block_manager import BlockManager, BlockTable, NoFreeBlocksError

pytestmark = pytest.mark.engine

BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 tokens, 2 KV heads, head_dim 16, fp32


def make_engine(model_dir, host_slots: int, num_blocks: int = 24, **kw) -> LLMEngine:
    gib = host_slots * BLOCK_BYTES / 2**30
    config = EngineConfig.from_kwargs(
        str(model_dir), dtype="float32", device="cpu", block_size=4, num_blocks=num_blocks,
        kv_offloading_size=gib, max_num_seqs=4, grammar_process=False, **kw,
    )  # fmt: skip
    return LLMEngine(config)


def drain(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    """Step until idle, collecting each request's output tokens; the audit is clean at every step."""
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        assert engine.audit() == []


def multi_turn(engine: LLMEngine, sessions: int = 4, turns: int = 4) -> dict[str, list[int]]:
    """Sessions in turns, each turn resending its whole history plus new tokens; a turn's sessions run
    together, so the pool (24 blocks) cannot keep every history and evicts between turns."""
    rng = random.Random(7)
    history = [[rng.randrange(8, 1700) for _ in range(10)] for _ in range(sessions)]
    tokens: dict[str, list[int]] = {}
    for turn in range(turns):
        for s in range(sessions):
            engine.add_request(history[s], SamplingParams(max_tokens=6, temperature=0), f"t{turn}s{s}")
        drain(engine, tokens)
        for s in range(sessions):
            history[s] += tokens[f"t{turn}s{s}"] + [rng.randrange(8, 1700) for _ in range(5)]
    return tokens


def assert_idle(engine: LLMEngine) -> None:
    """No block in use in either tier, nothing in flight, nothing waiting for a copy."""
    bm = engine.block_manager
    assert engine.audit() == []
    assert bm.num_used == 0 and not engine.scheduler.loading
    assert bm.host.num_referenced == 0 and not bm.host.in_flight and not bm.host.loading


def test_greedy_output_is_the_same_with_the_host_tier_across_eviction_and_reload(tiny_model_dir):
    plain = multi_turn(make_engine(tiny_model_dir, host_slots=0))
    engine = make_engine(tiny_model_dir, host_slots=256)
    tiered = multi_turn(engine)
    assert tiered == plain
    stats = engine.get_stats()
    # the tier was used both ways: blocks went out on eviction and prompts took them back
    assert stats["kv_offload_blocks"] > 10 and stats["kv_reload_blocks"] > 10
    assert stats["kv_host_hit_requests"] >= 4 and stats["kv_host_hit_blocks"] == stats["kv_reload_blocks"]
    assert stats["kv_reload_bytes"] == stats["kv_reload_blocks"] * BLOCK_BYTES
    assert stats["kv_offload_gbps"] > 0 and stats["kv_reload_gbps"] > 0
    assert_idle(engine)
    # routers see the tier's blocks apart from the GPU's (app/router.py weighs them lower)
    stride, gpu, host = engine.prefix_summary(4096)
    assert (
        stride == 1
        and set(host) == set(engine.block_manager.host.cached)
        and set(gpu) == set(engine.block_manager.cached)
    )
    # the comparison can fail: copies back that bring the wrong bytes change the output
    broken = make_engine(tiny_model_dir, host_slots=256)
    offload = broken.kv_offload
    copy_in = offload.copy_in

    def corrupted(pairs):
        offload.host.fill_(0)
        copy_in(pairs)

    offload.copy_in = corrupted
    assert multi_turn(broken) != plain


def test_the_audit_is_clean_after_every_step_of_random_traffic(tiny_model_dir):
    """Adds with shared prefixes, aborts and steps at random on a pool of 16 blocks and a tier of 12
    slots, so both tiers evict; the audit covers both after every operation."""
    engine = make_engine(tiny_model_dir, host_slots=12, num_blocks=16)
    rng = random.Random(3)
    prefixes = [[rng.randrange(8, 1700) for _ in range(12)] for _ in range(3)]
    live: list[str] = []
    loading_seen = 0
    for op in range(2000):
        kind = rng.random()
        if kind < 0.25 and len(live) < 8:
            prompt = rng.choice(prefixes)[: rng.randint(5, 12)] + [
                rng.randrange(8, 1700) for _ in range(rng.randint(0, 6))
            ]
            params = SamplingParams(max_tokens=rng.randint(1, 8), temperature=0)
            live.append(engine.add_request(prompt, params, f"r{op}"))
        elif kind < 0.33 and live:
            engine.abort(live.pop(rng.randrange(len(live))))
        elif engine.has_unfinished():
            finished = {o.request_id for o in engine.step() if o.finished}
            live = [r for r in live if r not in finished]
            loading_seen += bool(engine.scheduler.loading)
        assert engine.audit() == [], f"after op {op}"
    for rid in live:
        engine.abort(rid)
    assert_idle(engine)
    stats = engine.get_stats()
    assert stats["kv_reload_blocks"] > 0 and loading_seen > 0
    assert stats["kv_host_blocks_used"] == 12  # the tier filled up and evicted in its turn


def test_a_disconnect_storm_leaves_no_block_in_use_in_either_tier(tiny_model_dir):
    engine = make_engine(tiny_model_dir, host_slots=64, num_blocks=16, max_num_batched_tokens=8)
    rng = random.Random(5)
    prompts = [[rng.randrange(8, 1700) for _ in range(18)] for _ in range(6)]
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):  # the first turns: their blocks end up in the host tier
        engine.add_request(p, SamplingParams(max_tokens=2, temperature=0), f"a{i}")
        drain(engine, tokens)
    rids = []
    for i, p in enumerate(prompts * 2):  # second turns (reloads) beside fresh prompts
        prompt = p + tokens[f"a{i % 6}"] + [rng.randrange(8, 1700) for _ in range(3 + i)]
        rids.append(engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0), f"b{i}"))
    aborted_in: dict[str, int] = {}  # state -> requests aborted in it
    for _ in range(60):
        engine.step()
        sched = engine.scheduler
        by_state = {
            "loading": sched.loading,
            "prefill": [s for s in sched.running if not s.prompt_done],
            "decoding": [s for s in sched.running if s.prompt_done],
        }
        for state, seqs in by_state.items():
            if seqs and aborted_in.get(state, 0) < 2:  # mid-way through whatever it does
                engine.abort(seqs[0].request.request_id)
                aborted_in[state] = aborted_in.get(state, 0) + 1
        if len(aborted_in) == 3:
            break
    assert set(aborted_in) == {"loading", "prefill", "decoding"}
    for rid in rids:
        engine.abort(rid)
    assert not engine.has_unfinished()
    assert_idle(engine)
    # the engine is whole: a request afterwards runs to the end
    engine.add_request(prompts[0], SamplingParams(max_tokens=3, temperature=0), "after")
    after: dict[str, list[int]] = {}
    drain(engine, after)
    assert len(after["after"]) == 3
    assert_idle(engine)


def test_kv_offloading_size_is_checked():
    with pytest.raises(ValueError, match="kv_offloading_size"):
        CacheConfig(kv_offloading_size=-1)
    with pytest.raises(ValueError, match="kv_offloading_size.*enable_prefix_caching"):
        CacheConfig(kv_offloading_size=1, enable_prefix_caching=False)


def test_a_tier_too_small_for_one_block_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_offloading_size.*holds no KV block"):
        make_engine(tiny_model_dir, host_slots=0.5)


def _evict_into_tier(bm: BlockManager, tokens: list[int]) -> BlockTable:
    """Compute `tokens` into a table, publish its full blocks, free it, then fill the pool with other
    blocks so every cached one is evicted (and offered to the tier). Returns the filler table."""
    table = BlockTable()
    bm.prepare_append(table, 0, len(tokens))
    bm.register_full_blocks(table, tokens, len(tokens))
    bm.free(table)
    filler = BlockTable()
    bm.prepare_append(filler, 0, bm.num_blocks * bm.block_size)
    return filler


def test_a_block_in_flight_is_neither_found_nor_reused_before_its_copy_completes():
    bm = BlockManager(num_blocks=4, block_size=2, host_blocks=8)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    filler = _evict_into_tier(bm, tokens)
    out = bm.take_transfers()
    assert len(out.offloads) == 3 and not out.reloads
    # copies out not complete: the tier does not offer them yet
    assert bm.host.cached == {} and not bm.host.loading
    bm.free(filler)
    assert bm.match_prefix(BlockTable(), tokens) == 0
    bm.complete_transfers([out.batch])
    assert len(bm.host.cached) == 3 and bm.audit([]) == []
    # a prompt with that prefix gets fresh GPU blocks, each held by its copy until it completes
    table = BlockTable()
    assert bm.match_prefix(table, tokens) == 6 and bm.is_loading(table)
    back = bm.take_transfers()
    assert [b for _, b in back.reloads] == table.blocks
    # handed to the runner: the table may run in a step that waits for this batch
    assert not bm.is_loading(table) and bm.copies_in_flight(table) == {back.batch}
    assert all(bm.ref_count[b] == 2 for b in table.blocks) and bm.audit([table]) == []
    bm.free(table)  # its request is aborted mid-copy: the blocks stay with the copy
    assert bm.num_free == 1 and bm.cached == {} and bm.audit([]) == []
    with pytest.raises(NoFreeBlocksError):
        bm.prepare_append(BlockTable(), 0, 4)
    bm.complete_transfers([back.batch])  # now they are cached on the GPU, free to evict
    assert bm.num_free == 4 and len(bm.cached) == 3 and bm.audit([]) == []
    assert bm.match_prefix(BlockTable(), tokens) == 6  # GPU hits, no copy
    assert bm.take_transfers() is None


def test_the_host_tier_evicts_its_least_recently_used_slot():
    bm = BlockManager(num_blocks=2, block_size=2, host_blocks=2)
    first, second = [1, 2, 3], [4, 5, 6]
    for tokens in (first, second, [7, 8, 9]):
        bm.free(_evict_into_tier(bm, tokens))
        bm.complete_transfers([bm.take_transfers().batch])
    # two slots: the third block evicted took the slot of the least recently used, `first`'s
    assert bm.match_prefix(BlockTable(), first) == 0
    assert bm.match_prefix(BlockTable(), second) == 2 and bm.take_transfers().reloads
    assert bm.host.audit() == [] and bm.host.num_used == 2


def test_w4_sessions_resend_their_whole_history_for_eight_turns_or_more():
    """loadtests' W4 through benchmarks.serve_client's per-user requests: each turn's prompt is the last
    one, its answer and a new message; a session has 8-12 turns, then a new one opens."""
    import sys
    from types import SimpleNamespace

    from tests.conftest import ROOT

    sys.path.insert(0, str(ROOT / "loadtests"))
    from benchmarks.serve_client import UserRequests, user_rng

    args = SimpleNamespace(workload="W4", prompt_scale=1.0, gen_scale=1.0)
    user = UserRequests(user_rng(0, 3), args, {"vocab_size": 32000, "max_model_len": 8192})
    sessions, prompt, answer = [], None, None
    for _ in range(40):
        ids, max_tokens, turn = user.next()
        assert 64 <= max_tokens <= 128
        if turn == 1:
            sessions.append(0)
            assert 512 <= len(ids) <= 1024
        else:
            assert ids[: len(prompt) + len(answer)] == prompt + answer  # the whole history, resent
            assert 64 <= len(ids) - len(prompt) - len(answer) <= 128  # plus one new user message
        sessions[-1] += 1
        prompt, answer = ids, list(range(8, 8 + max_tokens))
        user.answered(max_tokens, answer)  # as serve_client does with the ids the server returned
    assert all(8 <= n <= 12 for n in sessions[:-1]) and len(sessions) >= 3


class _PoolModel:
    """What the runner would hold: each GPU block's and host slot's contents (the token prefix up to the
    block's end), copied as KVOffload copies: a batch's copies out, then in, at submission; then the
    step's copy-on-write copies and writes."""

    def __init__(self, bm: BlockManager):
        self.bm, self.gpu, self.host, self.prefix_of = bm, {}, {}, {}

    def submit(self) -> int | None:
        batch = self.bm.take_transfers()
        if batch is None:
            return None
        for block, slot in batch.offloads:
            self.host[slot] = self.gpu.get(block)
        for slot, block in batch.reloads:
            self.gpu[block] = self.host[slot]
        return batch.batch

    def compute(self, table: BlockTable, tokens: list[int], start: int) -> int | None:
        """One step computing the rest of `tokens`; returns its batch of tier copies (None: none)."""
        bs = self.bm.block_size
        copies = self.bm.prepare_append(table, start, len(tokens) - start)
        batch = self.submit()  # before the step's copy-on-write and writes, which may reuse evicted blocks
        for src, dst in copies:
            self.gpu[dst] = self.gpu.get(src)
        for i in range(start // bs, len(table.blocks)):
            self.gpu[table.blocks[i]] = tuple(tokens[: min(len(tokens), (i + 1) * bs)])
        self.bm.register_full_blocks(table, tokens, len(tokens))
        for i, h in enumerate(table.hashes):
            self.prefix_of[h] = tuple(tokens[: (i + 1) * bs])
        return batch

    def check(self, ready: list[tuple[BlockTable, list[int]]]) -> None:
        """Every hash findable in either tier names a block holding its prefix; ready tables read theirs."""
        for h, block in self.bm.cached.items():
            assert self.gpu.get(block) == self.prefix_of[h]
        for h, slot in self.bm.host.cached.items():
            assert self.host.get(slot) == self.prefix_of[h]
        for table, tokens in ready:
            for i, block in enumerate(table.blocks[: len(table.hashes)]):
                assert self.gpu.get(block) == tuple(tokens[: (i + 1) * self.bm.block_size])


def test_random_traffic_keeps_what_each_tier_holds_right():
    """Seeded random admissions (prefix matches through both tiers), aborts mid-copy and completions,
    on a pool of 8 blocks and a tier of 5 slots: after every operation the audit is clean and every
    block findable by a hash holds that hash's tokens, as the copies put them there."""
    rng = random.Random(11)
    bm = BlockManager(num_blocks=8, block_size=2, host_blocks=5)
    pool, flights = _PoolModel(bm), []
    loading: list[tuple[BlockTable, list[int]]] = []
    held: list[tuple[BlockTable, list[int]]] = []
    reloads = 0
    for op in range(3000):
        r, batch = rng.random(), None
        if r < 0.4:
            tokens = [rng.randint(0, 1) for _ in range(rng.randint(1, 7))]
            table = BlockTable()
            cached = bm.match_prefix(table, tokens)
            if bm.is_loading(table):
                reloads += 1
                loading.append((table, tokens))
            elif bm.can_append(table, cached, len(tokens) - cached):
                batch = pool.compute(table, tokens, cached)
                held.append((table, tokens))
            else:
                bm.free(table)
        elif r < 0.55 and loading:
            bm.free(loading.pop(rng.randrange(len(loading)))[0])  # an abort mid-copy
        elif r < 0.8 and held:
            bm.free(held.pop(rng.randrange(len(held)))[0])
        elif flights:
            bm.complete_transfers([flights.pop(0)])
            for entry in [e for e in loading if not bm.is_loading(e[0])]:
                loading.remove(entry)
                held.append(entry)  # loaded: it reads its reloaded blocks from now on
        flights += [b for b in (batch, pool.submit()) if b is not None]
        assert bm.audit([t for t, _ in loading + held]) == [], f"after op {op}"
        pool.check(held)
    assert reloads > 50 and bm.host.offloaded_blocks > 50


def test_sequences_loaded_from_the_tier_never_block_the_head_of_the_queue():
    """A and B both reload their prefixes from the tier; once in, A (first in line) needs two more
    blocks but B's reloaded blocks leave one free, and nothing runs to free any. Admission must not
    keep B's blocks while A waits: A runs, then B."""
    from engine.config import SchedulerConfig
    from engine.sched.request import Request
    from engine.sched.scheduler import Scheduler

    bm = BlockManager(num_blocks=10, block_size=2, host_blocks=20)
    a, b = list(range(100, 114)), list(range(200, 209))  # 7 blocks (6 matchable), 5 blocks (4)
    for tokens in (a[:10], b[:8]):  # their first 5 and 4 blocks go to the tier
        bm.free(_evict_into_tier(bm, tokens + [0]))
        bm.complete_transfers([bm.take_transfers().batch])
    assert len(bm.host.cached) >= 9 and bm.num_used == 0
    config = SchedulerConfig(max_num_batched_tokens=64, async_scheduling=False)
    sched = Scheduler(config, bm, max_model_len=1 << 20)
    requests = [Request(name, tokens, SamplingParams(max_tokens=1)) for name, tokens in (("a", a), ("b", b))]
    for request in requests:
        sched.add(request)
    started = []
    for _ in range(10):
        out = sched.schedule()
        if out.kv_transfers:  # the copies, done at once
            bm.complete_transfers([out.kv_transfers.batch])
        sched.update_computed(out)
        for chunk in out.chunks:
            started.append(chunk.seq.request.request_id)
            sched.finish(chunk.seq, "length")
        assert bm.audit(sched.live_tables()) == []
        if len(started) == 2:
            break
    assert started == ["a", "b"] and requests[0].cached_tokens == 10


def test_a_sequence_runs_once_its_copies_are_sent_in_a_step_that_waits_for_them():
    """The copies of A's prefix go out with step 1; A runs in step 2, whose kv_waits names their batch
    (the compute stream waits for it: tests/test_gpu_kv_offload.py), before the batch is complete."""
    from engine.config import SchedulerConfig
    from engine.sched.request import Request
    from engine.sched.scheduler import Scheduler

    bm = BlockManager(num_blocks=16, block_size=2, host_blocks=20)
    a = list(range(100, 111))
    bm.free(_evict_into_tier(bm, a[:10] + [0]))
    bm.complete_transfers([bm.take_transfers().batch])
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, async_scheduling=False), bm, 1 << 20)
    sched.add(Request("a", a, SamplingParams(max_tokens=1)))
    first = sched.schedule()
    assert not first.chunks and len(sched.loading) == 1 and len(first.kv_transfers.reloads) == 5
    second = sched.schedule()  # the batch is in flight, not complete
    assert [c.seq.request.request_id for c in second.chunks] == ["a"] and second.chunks[0].start == 10
    assert second.kv_waits == {first.kv_transfers.batch} and bm.cached == {}
    assert bm.audit(sched.live_tables()) == []
    bm.complete_transfers([first.kv_transfers.batch])  # now published on the GPU
    assert len(bm.cached) == 5 and bm.audit(sched.live_tables()) == []


def test_adapters_keep_their_own_kv_through_the_host_tier(tiny_model_dir, tmp_path):
    """Multi-LoRA with the tier: sessions with the same history under two adapters and the base model
    never take each other's blocks from either tier (the hashes are seeded by the adapter), so each
    equals its run on an engine that caches nothing."""
    from engine.lora.request import LoRARequest
    from scripts.make_lora import make_lora

    loras = [None] + [
        LoRARequest(f"a{i}", i + 1, str(make_lora(tiny_model_dir, tmp_path / f"a{i}", rank=4, seed=i)))
        for i in range(2)
    ]
    lora_options = dict(enable_lora=True, max_loras=2, max_lora_rank=4)

    def sessions(engine: LLMEngine) -> dict[str, list[int]]:
        history = [[(11 * k) % 1500 + 20 for k in range(10)] for _ in loras]  # one history, three models
        tokens: dict[str, list[int]] = {}
        for turn in range(4):
            for s, lora in enumerate(loras):
                sp = SamplingParams(max_tokens=6, temperature=0)
                engine.add_request(history[s], sp, f"t{turn}s{s}", lora_request=lora)
            drain(engine, tokens)
            for s in range(len(loras)):
                history[s] += tokens[f"t{turn}s{s}"] + [100 + turn] * 5
        return tokens

    # the reference shares nothing: no prefix cache, no tier
    plain = sessions(make_engine(tiny_model_dir, host_slots=0, enable_prefix_caching=False, **lora_options))
    engine = make_engine(tiny_model_dir, host_slots=256, **lora_options)
    assert sessions(engine) == plain
    assert engine.get_stats()["kv_reload_blocks"] > 0
    assert len({tuple(plain[f"t0s{s}"]) for s in range(len(loras))}) == len(loras)  # the adapters matter
    assert_idle(engine)


def test_one_strided_gather_and_scatter_move_each_caches_block():
    """KVOffload's copies through the stacked view of one allocation (allocate_kv_cache) against a
    per-cache reference: host slot s holds block b of cache 0, then cache 1, ... byte for byte, and a
    copy back writes each cache's block from its slot; every other block is untouched. Caches that
    are not views of one allocation are refused with the fix."""
    import torch

    from engine.runner.kv_cache import KVCacheSpec, allocate_kv_cache
    from engine.runner.kv_offload import KVOffload

    spec = KVCacheSpec(12, 4, 3, 2, 8, torch.bfloat16)
    gib = 8 * spec.bytes_per_block / 2**30
    pooled = allocate_kv_cache(spec, torch.device("cpu"))
    torch.manual_seed(0)
    for k, v in pooled:
        k.copy_(torch.randn_like(k, dtype=torch.float32))
        v.copy_(torch.randn_like(v, dtype=torch.float32))
    caches = [c for pair in pooled for c in pair]
    as_bytes = [c.view(torch.uint8).view(c.shape[0], -1) for c in caches]
    tier = KVOffload(pooled, spec, gib)
    out = [(b, s) for b, s in zip([7, 2, 9, 3, 11], [0, 1, 2, 5, 6])]  # slots in runs and apart
    tier.copy_out(out)
    for b, s in out:
        assert torch.equal(tier.host[s], torch.stack([c[b] for c in as_bytes]))
    before = [c.clone() for c in as_bytes]
    back = [(s, b) for s, b in zip([0, 1, 2, 5, 6], [1, 4, 0, 10, 5])]
    tier.copy_in(back)
    slot_of = {b: s for s, b in back}
    for j, (c, old) in enumerate(zip(as_bytes, before)):
        for b in range(c.shape[0]):
            want = tier.host[slot_of[b], j] if b in slot_of else old[b]
            assert torch.equal(c[b], want), (j, b)
    apart = [(k.clone(), v.clone()) for k, v in pooled]  # separate allocations
    with pytest.raises(ValueError, match="allocate_kv_cache"):
        KVOffload(apart, spec, gib)
