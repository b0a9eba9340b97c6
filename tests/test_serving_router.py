"""Prefix-aware routing, without a cluster: routing keys against the engine's own prefix cache, the
replicas' published summaries, and the router's decisions (cache hit, balanced, fallback) over fake
replicas. The routing of a real two-replica deployment is in tests/test_serving_scaleout.py."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest

from app import routing_table
from app.chat import ChatPrompt
from app.engine_client import EngineStream
from app.prefix_keys import PrefixKeys
from app.prompts import prepare
from app.router import HASHES_KWARG, PrefixAwareRouter, ReplicaView
from engine import prompt_block_hashes as block_hashes
from engine.sched import admission
from engine.sched.block_manager import BlockManager, BlockTable
from engine.tokenizer import Tokenizer
from tests.conftest import ROOT

pytestmark = pytest.mark.serving
BS = 16


@pytest.fixture(autouse=True)
def _no_pending_work():
    """The routing table is process-wide: each test starts with no prefill pending anywhere."""
    routing_table.UNSTARTED.clear()
    routing_table.PENDING_BLOCKS.clear()
    yield
    routing_table.UNSTARTED.clear()
    routing_table.PENDING_BLOCKS.clear()


def _cached_pool(prompts: list[list[int]], num_blocks: int = 512) -> BlockManager:
    """A block manager holding the full blocks of these prompts, as the engine leaves them."""
    bm = BlockManager(num_blocks, BS)
    for ids in prompts:
        table = BlockTable()
        bm.match_prefix(table, ids)
        start = len(table.blocks) * BS
        bm.prepare_append(table, start, len(ids) - start)  # allocates the rest
        bm.register_full_blocks(table, ids, len(ids))
        bm.free(table)
    return bm


def test_routing_keys_are_the_prefix_cache_hashes(tiny_model_dir):
    """The ingress's hashes of a prompt are exactly what the engine's cache matches for it."""
    keys = PrefixKeys(str(tiny_model_dir), BS)
    rng = random.Random(0)
    shared = [rng.randrange(8, 200) for _ in range(5 * BS + 3)]
    bm = _cached_pool([shared + [rng.randrange(8, 200) for _ in range(7)]])
    probe = shared + [rng.randrange(8, 200) for _ in range(9)]
    hashes = keys(probe)
    table = BlockTable()
    matched = bm.match_prefix(table, probe)
    assert matched == 5 * BS and table.hashes == hashes[:5]  # the blocks the cache holds, hash for hash
    assert len(hashes) == (len(probe) - 1) // BS
    # text and chat prompts: tokenized as the engine replica does it (app/prompts.prepare, then
    # engine/sched/admission.tokenize in CoreClient.submit), chat template included
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    text = "The quick brown fox jumps over the lazy dog. " * 20
    chat = ChatPrompt([{"role": "system", "content": text}, {"role": "user", "content": "hello"}])
    for prompt in (text, chat):
        ids = admission.tokenize(tokenizer, prepare(tokenizer, prompt, False)[0], tokenizer.vocab_size)
        assert len(ids) > 3 * BS and keys(prompt) == block_hashes(ids, BS, 256)


def test_summary_finds_the_held_prefix_to_within_its_stride():
    rng = random.Random(1)
    prompts = [[rng.randrange(8, 30000) for _ in range(40 * BS + 1)] for _ in range(12)]
    bm = _cached_pool(prompts, num_blocks=1024)
    full_stride, everything = bm.prefix_summary(max_hashes=10_000)
    stride, sample = bm.prefix_summary(max_hashes=80)
    assert full_stride == 1 and len(everything) == 12 * 40
    assert stride == 8 and 0 < len(sample) <= 80 and all(h % stride == 0 for h in sample)
    keys = [block_hashes(ids + [5] * BS, BS, 256) for ids in prompts]  # 41 blocks, the last one not held
    exact, view = ReplicaView(max_recent=10), ReplicaView(max_recent=10)
    exact.refresh({"prefix_stride": 1, "prefix_hashes": everything})
    view.refresh({"prefix_stride": stride, "prefix_hashes": sample})
    assert [exact.held(k, now=100.0, recent_s=1.0) for k in keys] == [40] * 12
    held = [view.held(k, now=100.0, recent_s=1.0) for k in keys]
    # a sampled position is found exactly; the gap after the last one is about geometric, mean `stride`
    assert all(0 < h <= 40 for h in held) and sum(held) / len(held) >= 40 - 1.5 * stride
    assert view.held(block_hashes(list(range(100, 100 + 20 * BS)), BS, 256), 0.0, 1.0) == 0


class _Cache:
    def __init__(self, lens: dict):
        self.lens = lens

    def get(self, replica_id):
        return self.lens.get(replica_id)


def _router(loads: dict[str, int], published: dict[str, list[list[int]]], devices=None, **kwargs):
    """devices: replica -> the accelerator it publishes (default: one of its own)."""
    router = object.__new__(PrefixAwareRouter)  # the decision logic only: no Serve handle behind it
    router.initialize_state(**kwargs)
    router._replica_queue_len_cache = _Cache(loads)
    replicas = []
    for name in loads:
        stride, hashes = _cached_pool(published.get(name, [])).prefix_summary(4096)
        device = (devices or {}).get(name, f"node:{name}")
        stats = {"prefix_stride": stride, "prefix_hashes": hashes, "device": device}
        replicas.append(SimpleNamespace(replica_id=name, routing_stats=stats))
    return router, replicas


def test_router_sends_a_prefix_where_it_is_held_and_new_prefixes_to_the_least_loaded():
    rng = random.Random(2)
    sys_a, sys_b = ([rng.randrange(8, 30000) for _ in range(8 * BS)] for _ in range(2))
    router, (r1, r2, r3) = _router({"r1": 2, "r2": 3, "r3": 1}, {"r1": [sys_a], "r2": [sys_b]})
    ask = lambda ids: router.rank([r1, r2, r3], block_hashes(ids, BS, 256))  # noqa: E731
    assert ask(sys_a + [9] * 20) == ("cache_hit", [r1, r2, r3])
    assert ask(sys_b + [9] * 20) == ("cache_hit", [r2, r1, r3])
    assert ask([rng.randrange(8, 30000) for _ in range(6 * BS)]) == ("balanced", [r3, r1, r2])
    before = routing_table.DECISIONS["cache_hit"]
    ranks = asyncio.run(
        router.choose_replicas(
            [r1, r2, r3], SimpleNamespace(kwargs={HASHES_KWARG: block_hashes(sys_b, BS, 64)})
        )
    )
    assert ranks == [[r2], [r1], [r3]] and routing_table.DECISIONS["cache_hit"] == before + 1


def test_router_remembers_what_it_sent_until_the_replica_publishes_it():
    rng = random.Random(3)
    new = [rng.randrange(8, 30000) for _ in range(6 * BS)]
    router, (r1, r2) = _router({"r1": 0, "r2": 0}, {})
    hashes = block_hashes(new, BS, 256)
    decision, ranked = router.rank([r1, r2], hashes)
    assert decision == "balanced"
    pending = SimpleNamespace(kwargs={HASHES_KWARG: hashes, "request_id": "req-1"})
    router.on_request_routed(pending, ranked[0].replica_id, None)
    routing_table.started("req-1")  # its prefill is done (the ingress saw its first output)
    assert router.rank([r1, r2], hashes) == ("cache_hit", ranked)  # before any publication
    router.recent_s = 0.0  # the memory has aged out, and nothing was published: no affinity left
    assert router.rank([r1, r2], hashes)[0] == "balanced"


def test_router_falls_back_when_the_holder_is_overloaded():
    rng = random.Random(4)
    sys_a = [rng.randrange(8, 30000) for _ in range(8 * BS)]
    hashes = block_hashes(sys_a + [7] * 10, BS, 256)
    router, (r1, r2) = _router({"r1": 40, "r2": 4}, {"r1": [sys_a]})
    assert router.rank([r1, r2], hashes) == ("fallback", [])  # 36 more and 10x: imbalanced
    router, (r1, r2) = _router({"r1": 30, "r2": 4}, {"r1": [sys_a]})
    assert router.rank([r1, r2], hashes)[0] == "cache_hit"  # 26 more: within imbalance_abs (32)
    router, (r1, r2) = _router({"r1": 120, "r2": 85}, {"r1": [sys_a]})
    assert router.rank([r1, r2], hashes)[0] == "cache_hit"  # 35 more but only 1.41x: within imbalance_rel
    router, (r1, r2) = _router({"r1": 20, "r2": 4}, {"r1": [sys_a]}, imbalance_abs=8)
    assert router.rank([r1, r2], hashes) == ("fallback", [])  # a narrower margin set in serve_config


def test_prefill_queued_at_the_holder_can_outweigh_what_its_cache_saves():
    """Each replica on a GPU of its own: the holder wins while the work queued there is less than the
    request's 8 blocks the other replica would have to prefill, and loses once it is more."""
    rng = random.Random(6)
    sys_a = [rng.randrange(8, 30000) for _ in range(8 * BS)]
    hashes = block_hashes(sys_a + [7] * 10, BS, 256)
    router, (r1, r2) = _router({"r1": 3, "r2": 3}, {"r1": [sys_a]})
    routing_table.routed("queued-1", "r1", 5)
    assert router.rank([r1, r2], hashes) == ("cache_hit", [r1, r2])  # 5 + 0 blocks < 0 + 8
    routing_table.routed("queued-2", "r1", 20)
    assert router.rank([r1, r2], hashes) == ("balanced", [r2, r1])  # 25 + 0 > 0 + 8
    routing_table.started("queued-2")  # its first output came: no longer ahead of anyone
    routing_table.started("queued-2")  # (idempotent)
    assert router.rank([r1, r2], hashes)[0] == "cache_hit"
    assert routing_table.pending_blocks("r1") == 5


def test_replicas_sharing_a_gpu_share_its_queue_and_only_the_cache_decides():
    rng = random.Random(7)
    sys_a = [rng.randrange(8, 30000) for _ in range(8 * BS)]
    hashes = block_hashes(sys_a + [7] * 10, BS, 256)
    router, (r1, r2) = _router({"r1": 3, "r2": 3}, {"r1": [sys_a]}, {"r1": "n:0", "r2": "n:0"})
    routing_table.routed("queued", "r1", 40)
    assert router.rank([r1, r2], hashes) == ("cache_hit", [r1, r2])  # 40 + 0 < 40 + 8


def test_routed_requests_count_the_blocks_their_replica_must_prefill():
    rng = random.Random(8)
    sys_a = [rng.randrange(8, 30000) for _ in range(8 * BS)]
    hashes = block_hashes(sys_a + [7] * 10, BS, 256)
    router, (r1, r2) = _router({"r1": 0, "r2": 0}, {"r1": [sys_a]})
    router.rank([r1, r2], hashes)  # the router learns the replicas' views as it ranks them
    for rid, replica in (("to-holder", "r1"), ("elsewhere", "r2")):
        router.on_request_routed(
            SimpleNamespace(kwargs={HASHES_KWARG: hashes, "request_id": rid}), replica, None
        )
    # the tail beyond the last full block is always prefilled: 1 block at the holder, 8 + 1 elsewhere
    assert (routing_table.pending_blocks("r1"), routing_table.pending_blocks("r2")) == (1, 9)
    routing_table.routed("elsewhere", "r1", 9)  # called again after r2 died: its work moves
    assert (routing_table.pending_blocks("r1"), routing_table.pending_blocks("r2")) == (10, 0)


class _Gen:
    """A DeploymentResponseGenerator stand-in: yields the given items, records cancel()."""

    def __init__(self, items: list[dict]):
        self.items, self.cancelled = list(items), False

    async def __anext__(self) -> dict:
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


def test_an_engine_stream_is_pending_until_its_first_output_or_its_end():
    accepted, output = {"kind": "accepted"}, {"kind": "output", "finished": False}

    async def run() -> None:
        routing_table.routed("a", "r1", 6)
        stream = EngineStream(0, "a", _Gen([accepted, output]), lambda rid: None, 1)
        await stream.next()
        assert routing_table.pending_blocks("r1") == 6  # accepted, still queued for prefill
        await stream.next()
        assert routing_table.pending_blocks("r1") == 0
        routing_table.routed("b", "r1", 4)
        stream = EngineStream(0, "b", _Gen([accepted]), lambda rid: None, 1)
        await stream.next()
        stream.cancel()  # the client left before its first token
        assert routing_table.pending_blocks("r1") == 0 and stream.gen.cancelled

    asyncio.run(run())


def test_a_small_gain_goes_to_the_least_loaded_replica():
    """Both replicas hold the shared prompt; only r1 holds this user's history, 2 of 10 blocks: r2, less
    loaded, takes it. With half the prompt held nowhere else, the cache decides again."""
    rng = random.Random(9)
    sys_a = [rng.randrange(8, 30000) for _ in range(8 * BS)]
    history = sys_a + [rng.randrange(8, 30000) for _ in range(2 * BS)]
    hashes = block_hashes(history + [7] * 10, BS, 256)
    router, (r1, r2) = _router({"r1": 6, "r2": 2}, {"r1": [history], "r2": [sys_a]})
    assert router.rank([r1, r2], hashes) == ("balanced", [r2, r1])
    router, (r1, r2) = _router({"r1": 6, "r2": 2}, {"r1": [history], "r2": [sys_a]}, min_gain=0.0)
    assert router.rank([r1, r2], hashes) == ("cache_hit", [r1, r2])
    router, (r1, r2) = _router({"r1": 6, "r2": 2}, {"r1": [history], "r2": [sys_a[: 4 * BS]]})
    assert router.rank([r1, r2], hashes) == ("cache_hit", [r1, r2])  # 6 of 10 blocks more


def test_new_prefixes_spread_evenly_over_equally_loaded_replicas():
    """With equal loads (as when Serve has no fresh queue lengths), new prefixes must not pile up on
    one replica: the one this router has sent the fewest blocks to takes the next."""
    rng = random.Random(5)
    router, replicas = _router({f"r{i}": 0 for i in range(4)}, {})
    homes = []
    for _ in range(8):
        hashes = block_hashes([rng.randrange(8, 30000) for _ in range(8 * BS + 1)], BS, 256)
        decision, ranked = router.rank(replicas, hashes)
        assert decision == "balanced"
        router.on_request_routed(SimpleNamespace(kwargs={HASHES_KWARG: hashes}), ranked[0].replica_id, None)
        homes.append(ranked[0].replica_id)
    assert sorted(homes) == ["r0", "r0", "r1", "r1", "r2", "r2", "r3", "r3"], homes


def test_chain_hashes_are_equal_in_every_process():
    """The ingress hashes a prompt in its own process, the engine core in another: the values must not
    depend on the process (before Python 3.12 hash(None) is an address, which ASLR moves)."""
    import subprocess
    import sys

    code = "from engine import prompt_block_hashes as h; print(h(list(range(8, 80)), 16, 8))"
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    assert runs[0].stdout == runs[1].stdout == f"{block_hashes(list(range(8, 80)), 16, 8)}\n"


def test_router_is_the_default_with_several_replicas_and_takes_its_margins_from_the_config():
    from app.builder import AppArgs, _routing

    assert _routing(AppArgs(num_replicas=1)) == {}
    assert _routing(AppArgs(num_replicas=2, prefix_aware_routing=False)) == {}
    scaling = {"min_replicas": 1, "max_replicas": 3}
    margins = [  # the fallback margin: as set, else 32, else half the autoscaling target
        (AppArgs(num_replicas=2, routing_imbalance_abs=8), 8),
        (AppArgs(num_replicas=2), 32),
        (AppArgs(autoscaling_config=scaling), 1),  # Serve's default target: 2
        (AppArgs(autoscaling_config={**scaling, "target_ongoing_requests": 24}), 12),
        (AppArgs(autoscaling_config={**scaling, "target_ongoing_requests": 256}), 32),
    ]
    for args, margin in margins:
        config = _routing(args)["request_router_config"]
        assert config.request_router_kwargs == {
            "imbalance_abs": margin,
            "imbalance_rel": 1.5,
            "min_gain": 0.25,
        }
    router = object.__new__(PrefixAwareRouter)
    router.initialize_state(
        **_routing(AppArgs(num_replicas=2, routing_imbalance_abs=8))[
            "request_router_config"
        ].request_router_kwargs
    )
    assert (router.imbalance_abs, router.imbalance_rel) == (8, 1.5)


def test_a_router_shipped_by_value_shares_its_tables_with_the_ingress():
    """Serve pickles the router class by value, and the ingress's handle runs that copy, with its own
    copy of app/router.py's globals: what it routed must still reach app/engine_client's abort
    grouping and the ingress's decision counts. The class is loaded in another process, as in Serve
    (in the process that pickled it, cloudpickle hands back the original class)."""
    from ray import cloudpickle

    import app.router

    cloudpickle.register_pickle_by_value(app.router)  # as RequestRouterConfig does
    try:
        shipped = cloudpickle.dumps(PrefixAwareRouter)
    finally:
        cloudpickle.unregister_pickle_by_value(app.router)
    hashes = block_hashes(list(range(10, 10 + 4 * BS)), BS, 64)
    out = subprocess.run(
        [sys.executable, "-c", _INGRESS_SIDE, repr(hashes)],
        input=shipped,
        capture_output=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split() == ["copy", "decisions", "1", "routed", "r1"]


_INGRESS_SIDE = """
import asyncio, sys
from types import SimpleNamespace
from ray import cloudpickle
import app.engine_client  # the ingress imports app.router and app.routing_table before the handle runs
from app import router as module, routing_table
cls = cloudpickle.loads(sys.stdin.buffer.read())
print("copy" if cls is not module.PrefixAwareRouter else "same")
r = object.__new__(cls)
r.initialize_state()
r._replica_queue_len_cache = SimpleNamespace(get=lambda rid: {"r1": 0, "r2": 5}[rid])
replicas = [SimpleNamespace(replica_id=n, routing_stats={}) for n in ("r1", "r2")]
pending = SimpleNamespace(kwargs={module.HASHES_KWARG: eval(sys.argv[1]), "request_id": "req-1"})
ranks = asyncio.run(r.choose_replicas(replicas, pending))
r.on_request_routed(pending, ranks[0][0].replica_id, None)
print("decisions", sum(routing_table.DECISIONS.values()), "routed", routing_table.replica_of("req-1"))
"""
