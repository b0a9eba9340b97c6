"""The serving side of multi-LoRA without a server of its own: serve_config.yaml's `lora_modules` in vLLM's
forms and their errors, the CLI flags, the router's adapter affinity over fake replicas that behave as
Serve's multiplexer does (LRU, max_cpu_loras), and, on the shared default server (which runs without
`allow_runtime_lora_updating`), the absence of the load/unload routes. The served tests are
tests/test_serving_lora.py and tests/test_serving_lora_routing.py."""

from __future__ import annotations

import asyncio
import json
import random
from collections import OrderedDict
from types import SimpleNamespace

import httpx
import pytest

from app import routing_table
from app.adapter_affinity import AdapterLRU
from app.builder import AppArgs, _lora
from app.cli import load
from app.lora_modules import LoraTable, parse_lora_modules
from app.lora_replica import ReplicaAdapters
from app.prefix_keys import PrefixKeys
from app.router import HASHES_KWARG, PrefixAwareRouter
from engine import LoRARequest
from engine.config import EngineConfig
from engine.errors import LoRAError
from engine.sched.block_manager import BlockManager, BlockTable, adapter_seed
from tests.lora_fixtures import write_adapters

pytestmark = [pytest.mark.serving, pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    return write_adapters(tiny_model_dir, tmp_path_factory.mktemp("adapters"), ["sql", "chat"], rank=4)


def test_lora_modules_take_each_of_vllms_forms(adapters):
    sql, chat = adapters["sql"], adapters["chat"]
    want = {"sql": sql, "chat": chat}
    assert parse_lora_modules({"sql": sql, "chat": chat}) == want
    assert parse_lora_modules([f"sql={sql}", {"name": "chat", "path": chat}]) == want
    assert parse_lora_modules([json.dumps({"name": "sql", "path": sql}), f"chat={chat}"]) == want
    assert parse_lora_modules(None) == {}
    # the ingress's table: config order gives the ids; a runtime load takes a fresh one, never reused
    table = LoraTable(want)
    assert [(a.lora_name, a.lora_int_id, a.lora_path) for a in table] == [("sql", 1, sql), ("chat", 2, chat)]
    table.remove("sql")
    assert table.add("sql", chat).lora_int_id == 3


@pytest.mark.parametrize(
    "value, named",
    [
        ({"sql": "/no/such/adapter"}, "args.lora_modules.sql: no PEFT adapter at /no/such/adapter"),
        (["sql"], "args.lora_modules[0]: 'sql' is not 'name=path'"),
        ([{"name": "sql"}], "args.lora_modules[0]: give 'name=path' or an object"),
        (["{not json"], "args.lora_modules[0]: not JSON"),
        ("sql=/x", "args.lora_modules: give a mapping name -> path or a list"),
    ],
)
def test_bad_lora_modules_name_the_entry_and_the_fix(value, named):
    with pytest.raises(ValueError) as err:
        parse_lora_modules(value)
    assert named in str(err.value)


def test_an_adapter_name_must_be_its_own(adapters, tiny_model_dir):
    with pytest.raises(ValueError, match=r"args.lora_modules\[1\]: 'sql' is a name given twice"):
        parse_lora_modules([f"sql={adapters['sql']}", f"sql={adapters['chat']}"])
    with pytest.raises(ValueError, match="'tiny-llama' is the base model's name"):
        parse_lora_modules({"tiny-llama": adapters["sql"]}, "tiny-llama")
    # adapters need the engine's LoRA: refused in the driver, before any replica starts
    args = AppArgs(model=str(tiny_model_dir), lora_modules={"sql": adapters["sql"]})
    with pytest.raises(
        ValueError, match="args.lora_modules: serving LoRA adapters needs `enable_lora: true`"
    ):
        _lora(args, EngineConfig.from_kwargs(str(tiny_model_dir)), str(tiny_model_dir), "tiny-llama")
    config = EngineConfig.from_kwargs(str(tiny_model_dir), enable_lora=True)
    options = _lora(args, config, str(tiny_model_dir), "tiny-llama")
    assert options["modules"] == {"sql": adapters["sql"]} and options["allow_runtime_updating"] is False


def test_cli_takes_vllms_lora_flags(tiny_model_dir, monkeypatch):
    from tests.serving_fixtures import ROOT

    monkeypatch.chdir(ROOT)
    argv = ["serve", str(tiny_model_dir), "--enable-lora", "--max-loras", "4", "--max-lora-rank", "8",
            "--max-cpu-loras", "6", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
            "--allow-runtime-lora-updating"]  # fmt: skip
    args = load(argv)[1]["applications"][0]["args"]
    assert args["lora_modules"] == ["a=/x", '{"name": "b", "path": "/y"}']
    assert args["allow_runtime_lora_updating"] is True
    engine = {k: args["engine"][k] for k in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")}
    assert engine == {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8, "max_cpu_loras": 6}
    AppArgs.model_validate(args)  # the list form is a valid `args` value


def test_routing_keys_start_from_the_adapter(tiny_model_dir, adapters):
    """The ingress's keys of a prompt under an adapter are the blocks the engine caches for it under that
    adapter: different from the base model's and from another adapter's."""
    bs = 16
    keys = PrefixKeys(str(tiny_model_dir), bs)
    sql, chat = (LoRARequest(n, i, adapters[n]) for i, n in enumerate(("sql", "chat"), 1))
    rng = random.Random(5)
    ids = [rng.randrange(8, 2000) for _ in range(6 * bs + 3)]
    base, under_sql, under_chat = keys(ids), keys(ids, sql), keys(ids, chat)
    assert len(base) == len(under_sql) == len(under_chat) == 6
    assert not set(base) & set(under_sql) and not set(under_sql) & set(under_chat)
    bm = BlockManager(64, bs)
    table = BlockTable()
    bm.prepare_append(table, 0, len(ids))
    bm.register_full_blocks(table, ids, len(ids), seed=adapter_seed(sql))
    bm.free(table)
    for lora, found in ((sql, 6 * bs), (chat, 0), (None, 0)):
        probe = BlockTable()
        assert bm.match_prefix(probe, ids, seed=adapter_seed(lora)) == found
        assert probe.hashes == (under_sql if found else [])
        bm.free(probe)


# ---------------------------------------------------------------- one replica's adapters


class _Core:
    """The CoreClient calls the replica makes, recorded; `bad` adapters fail their check."""

    def __init__(self, bad: str = ""):
        self.held, self.log, self.bad = [], [], bad

    def add_lora(self, request: LoRARequest) -> None:
        if request.lora_name == self.bad:
            raise LoRAError(f"{request.lora_path}/adapter_model.safetensors: bad tensor", field="model")
        self.held.append(request.lora_name)
        self.log.append(("add", request.lora_name, request.lora_int_id))

    def remove_lora(self, name: str) -> bool:
        self.log.append(("remove", name))
        if name in self.held:
            self.held.remove(name)
            return True
        return False

    def list_loras(self) -> list[str]:
        return list(self.held)


class _Quiet:
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_a_replica_holds_max_cpu_loras_adapters_and_drops_the_least_recently_used(monkeypatch):
    """Serve's own multiplexer (its Ray metrics and controller pushes silenced) over a recording core:
    LRU eviction tells the core to drop the adapter, once; an adapter loaded again under a new id
    replaces the old one; a bad adapter is refused and not kept."""
    import gc

    import ray.serve.multiplex as multiplex

    context = SimpleNamespace(app_name="app", deployment="EngineDeployment", replica_id="r1")
    monkeypatch.setattr(multiplex, "_get_internal_replica_context", lambda: context)
    monkeypatch.setattr(multiplex, "metrics", SimpleNamespace(Histogram=_Quiet, Gauge=_Quiet, Counter=_Quiet))
    monkeypatch.setattr(multiplex, "MetricsPusher", _Quiet)
    monkeypatch.setattr(multiplex, "ServeUsageTag", SimpleNamespace(MULTIPLEXED_API_USED=_Quiet()))
    core = _Core(bad="broken")
    adapters = ReplicaAdapters(core, 2)
    requests = {n: LoRARequest(n, i, f"/adapters/{n}") for i, n in enumerate("xyz", 1)}

    async def scenario() -> None:
        for name in "xyxzx":  # z evicts y, the least recently used (x was used after it)
            await adapters.acquire(requests[name])
        gc.collect()  # the evicted entry's finaliser must not drop y a second time
        await adapters.acquire(LoRARequest("x", 9, "/adapters/x-v2"))  # unloaded and loaded again
        with pytest.raises(LoRAError):
            await adapters.acquire(LoRARequest("broken", 4, "/adapters/broken"))

    asyncio.run(scenario())
    assert core.log == [
        ("add", "x", 1), ("add", "y", 2), ("remove", "y"), ("add", "z", 3), ("remove", "x"), ("add", "x", 9),
        ("remove", "z"),  # Serve's multiplexer makes room before it loads, also for a load that fails
    ]  # fmt: skip
    assert adapters.stats() == {"lora_requests": 7, "lora_loads": 4, "lora_adapters": ["x"]}
    assert adapters.drop("x") and not adapters.drop("x")


# ---------------------------------------------------------------- the router's adapter affinity


class _Cache:
    def __init__(self, lens: dict[str, int]):
        self.lens = lens

    def get(self, replica_id):
        return self.lens.get(replica_id)


class FakeReplica(SimpleNamespace):
    """A replica as the router sees it, holding adapters as Serve's multiplexer does: LRU, `capacity`."""

    def __init__(self, name: str, capacity: int):
        super().__init__(replica_id=name, routing_stats={}, multiplexed_model_ids=set())
        self.lru: OrderedDict[str, None] = OrderedDict()
        self.capacity, self.requests, self.loads = capacity, 0, 0

    def serve(self, adapter: str, publish: bool) -> None:
        self.requests += 1
        if adapter in self.lru:
            self.lru.move_to_end(adapter)
        else:
            self.loads += 1
            self.lru[adapter] = None
            if len(self.lru) > self.capacity:
                self.lru.popitem(last=False)
        if publish:
            self.multiplexed_model_ids = set(self.lru)


def _router(replicas: list[FakeReplica], loads: dict[str, int] | None = None, **kwargs) -> PrefixAwareRouter:
    router = object.__new__(PrefixAwareRouter)  # the decision logic only: no Serve handle behind it
    router.initialize_state(**kwargs)
    router._replica_queue_len_cache = _Cache(loads or {r.replica_id: 0 for r in replicas})
    return router


def _pending(adapter: str, hashes: list[int] | None = None) -> SimpleNamespace:
    kwargs = {HASHES_KWARG: hashes} if hashes else {}
    return SimpleNamespace(kwargs=kwargs, metadata=SimpleNamespace(multiplexed_model_id=adapter))


@pytest.mark.parametrize("publish", [False, True])
def test_adapters_stay_where_they_are_held(publish):
    """2 replicas of 4 adapters, requests spread uniformly over 8: after the first 8 requests every one
    finds its adapter, whether Serve's publication is prompt or has not come at all."""
    replicas = [FakeReplica("r1", 4), FakeReplica("r2", 4)]
    router = _router(replicas, max_adapters=4)
    rng = random.Random(0)
    names = [f"a{i}" for i in range(8)]
    order = [n for _ in range(8) for n in rng.sample(names, len(names))]
    for i, adapter in enumerate(order):
        if i == 8:
            loads_after_8 = sum(r.loads for r in replicas)
        ranked = router.route(replicas, [], adapter)
        ranked[0].serve(adapter, publish)
        router.on_request_routed(_pending(adapter), ranked[0].replica_id, None)
    assert sum(r.loads for r in replicas) == loads_after_8 == 8
    assert sorted(len(r.lru) for r in replicas) == [4, 4]


def test_a_new_adapter_goes_where_it_evicts_least_and_published_evictions_age_out():
    r1, r2 = FakeReplica("r1", 2), FakeReplica("r2", 2)
    router = _router([r1, r2], {"r1": 0, "r2": 5}, max_adapters=2)
    r1.multiplexed_model_ids = {"x"}  # published: r1 holds one adapter, r2 none
    before = routing_table.ADAPTER_DECISIONS["adapter_new"]
    assert router.route([r1, r2], [], "y") == [r2, r1]  # fewest adapters first, though r2 is busier
    assert routing_table.ADAPTER_DECISIONS["adapter_new"] == before + 1
    assert router.route([r1, r2], [], "x") == [r1, r2]  # its holder
    # this router sent r1 two other adapters: its model of r1's LRU evicted x; the stale publication is
    # not believed while the eviction is recent
    for name in ("p", "q"):
        router.on_request_routed(_pending(name), "r1", None)
    assert router.route([r1, r2], [], "x")[0] == r2
    lru = AdapterLRU(2)
    for t, name in enumerate("xyz"):
        lru.sent(name, now=float(t))
    assert lru.known({"x", "y", "z"}, now=3.0, recent_s=5.0) == {"y", "z"}  # x was evicted at t=2
    lru = AdapterLRU(3)
    lru.sent("a", now=0.0)
    assert lru.known({"b", "c", "d"}, now=1.0, recent_s=5.0) == {"a", "b", "c"}  # room for two of them


def test_an_overloaded_holder_gives_way_and_the_prefix_decides_among_holders():
    r1, r2, r3 = FakeReplica("r1", 4), FakeReplica("r2", 4), FakeReplica("r3", 4)
    r1.multiplexed_model_ids = {"x"}
    router = _router([r1, r2], {"r1": 40, "r2": 4}, max_adapters=4)
    assert router.route([r1, r2], [], "x")[0] == r2  # 36 more and 10x the load: imbalanced
    assert routing_table.ADAPTER_DECISIONS["adapter_fallback"] >= 1
    r2.multiplexed_model_ids = {"x"}
    router = _router([r1, r2, r3], {"r1": 0, "r2": 3, "r3": 0}, max_adapters=4)
    hashes = [11, 12, 13, 14, 15, 16, 17, 18]
    assert router.route([r1, r2, r3], hashes, "x")[0] == r1  # nobody holds the prompt: the least loaded
    router.on_request_routed(_pending("x", hashes), "r2", None)  # r2 holds the prompt's blocks too
    assert router.route([r1, r2, r3], hashes, "x") == [r2, r1, r3]  # holders first, the prefix among them
    # a request without an adapter is routed as before: no adapter decision counted
    count = sum(routing_table.ADAPTER_DECISIONS.values())
    assert router.route([r1, r2, r3], hashes, "")[0] == r2
    assert sum(routing_table.ADAPTER_DECISIONS.values()) == count


def test_the_lora_routes_do_not_exist_unless_allowed(default_server):
    """The shared server runs without allow_runtime_lora_updating (serve_config.yaml's default)."""
    body = {"lora_name": "x", "lora_path": "/x"}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # whatever the body
        resp = httpx.post(f"{default_server.url}{path}", json=body, timeout=30)
        error = resp.json()["error"]
        assert resp.status_code == 404 and error["code"] == "not_found", error
        assert error["message"].startswith(f"no route POST {path}")
