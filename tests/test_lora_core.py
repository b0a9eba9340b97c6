"""LoRA through the engine core process (engine/core_client.py): the serving side's API. A request's
adapter is checked in the caller's process (LoRAError at submit), runs in the core as it does offline,
and add_lora / list_loras / remove_lora reach the core's host cache."""

from __future__ import annotations

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.config import EngineConfig
from engine.core_client import CoreClient
from engine.errors import InvalidRequestError, LoRAError
from engine.lora.admission import LoRAAdmission
from engine.lora.mirror import LoRAMirror
from scripts.make_lora import make_lora
from tests.test_engine_core import Collector, wait_for

pytestmark = pytest.mark.engine
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
OPTIONS = dict(device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2)


@pytest.fixture(scope="module")
def loras(tiny_model_dir, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("core-loras")
    return [
        LoRARequest(f"c{i}", i + 1, str(make_lora(tiny_model_dir, root / f"c{i}", seed=10 + i)))
        for i in range(3)
    ]


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    sink = Collector()
    c = CoreClient(EngineConfig.from_kwargs(str(tiny_model_dir), **OPTIONS), sink)
    c.sink = sink
    yield c
    c.shutdown()


def test_requests_with_adapters_equal_the_offline_engine(client, loras, tiny_model_dir):
    prompts = [[7, 8, 9, 10, 11, 12], [300, 301, 302], [7, 8, 9, 10, 11, 12]]
    want = LLM(str(tiny_model_dir), **OPTIONS).generate(
        prompts, GREEDY, lora_request=[loras[0], None, loras[1]]
    )
    rids = [
        client.submit(p, GREEDY, lora_request=lora) for p, lora in zip(prompts, [loras[0], None, loras[1]])
    ]
    for rid in rids:
        client.sink.wait(rid)
    assert [client.sink.tokens[f"{rid}/0"] for rid in rids] == [r.outputs[0].token_ids for r in want]


def test_a_bad_adapter_is_refused_at_submit(client, tmp_path):
    with pytest.raises(LoRAError, match="is not a directory") as info:
        client.submit([1, 2, 3], GREEDY, lora_request=LoRARequest("gone", 9, str(tmp_path / "gone")))
    assert info.value.field == "lora_path"
    assert client.is_alive()


def test_add_list_and_remove_reach_the_core(client, loras):
    client.add_lora(loras[2])
    assert client.list_loras()[-1] == "c2"  # at once: the mirror does not wait for the core
    client.submit([4, 5, 6], GREEDY)  # a step: the core's stats confirm what it holds
    wait_for(lambda: client.list_loras()[-1:] == ["c2"], what="the core's host cache")
    assert client.remove_lora("c2") is True
    assert "c2" not in client.list_loras() and client.remove_lora("c2") is False
    with pytest.raises(LoRAError):
        client.add_lora(LoRARequest("bad", 4, "/nonexistent/adapter"))


def test_the_mirror_takes_only_snapshots_after_every_command_sent(loras):
    """A stats snapshot the core sent before applying the latest add or remove never undoes it; a
    client without LoRA refuses adapters at submit (field "model", as the API's 404/400 needs)."""
    mirror = LoRAMirror(LoRAAdmission(None, 16))
    with pytest.raises(InvalidRequestError, match="enable_lora=True") as info:
        mirror.check(loras[0])
    assert info.value.field == "model"
    mirror.added(loras[0])
    mirror.take((0, []))  # from before the add: ignored
    assert mirror.names() == ["c0"]
    mirror.take((1, ["c1", "c0"]))  # the core applied it (and holds another adapter too)
    assert mirror.names() == ["c1", "c0"]
    assert mirror.removed("c1") is True and mirror.removed("zz") is False
    mirror.take((2, ["c0"]))  # applied the first remove only: ignored
    assert mirror.names() == ["c0"]
