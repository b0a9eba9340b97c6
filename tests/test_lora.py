"""Multi-LoRA against independent references (issue 48), on tiny models in fp32.

* Our model with an adapter in a slot == transformers with the same adapter merged into its weights
  by peft (merge_and_unload): logits within 1e-4 for every family (rank 8 on all seven modules), and
  an rsLoRA adapter on a subset of modules; greedy tokens through the engine == HF generate.
* The same with the only slot folded into the base projections (the gated-LoRA MTP gate's path on
  CUDA), and without adapted rows the folded model is the plain one bit for bit.
* A batch mixing 4 adapters and the base model == each request run alone.
* The prefix cache keeps adapters apart: the same prompt under two adapters shares no block, and each
  output equals its cold run.
* max_loras smaller than the adapters in flight: requests are deferred, slots and the host cache
  evict least recently used, and every output is still the one the request gets alone.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams, prompt_block_hashes
from engine.lora.cache import HostCache
from engine.lora.layers import wrap_model
from engine.lora.manager import LoRAManager
from engine.lora.slots import SlotTable
from engine.models.attention_context import AttentionMetadata, attention_context
from engine.models.loader import load_model
from engine.runner import tp_wire
from engine.runner.step_inputs import Layout, StepBatch, pack, unpack
from scripts.make_lora import make_lora
from tests.conftest_models import FAMILIES, save_checkpoint, tiny_hf_model

pytestmark = [pytest.mark.engine, pytest.mark.parity]
peft = pytest.importorskip("peft")

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=8, max_num_batched_tokens=64)


def merged_hf(model_dir, adapter_dir):
    """transformers' model with the adapter merged into its weights by peft (the reference)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


@torch.no_grad()
def our_logits(
    model_dir, adapter_dir, ids: list[int], max_rank: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with the adapter in slot 1 of 2, logits of the same rows with no adapter)."""
    from engine.config import EngineConfig

    model, cfg = load_model(model_dir, dtype=torch.float32, progress=False)
    config = EngineConfig.from_kwargs(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=max_rank)
    manager = LoRAManager(config, cfg, wrap_model(model, 2, max_rank), torch.float32)
    manager.load_slot(1, LoRARequest("a", 1, str(adapter_dir)))
    out = []
    for slot in (1, -1):
        meta = AttentionMetadata.for_full_sequences([len(ids)])
        meta.lora_slots = torch.full((len(ids),), slot, dtype=torch.int32)
        with attention_context(meta):
            out.append(model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)))))
    return out[0], out[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_folded_slot_matches_peft_merged_model(family, tmp_path):
    """One slot folded into the base projections (engine/lora/layers.py), in every family: its
    rows equal peft's merged model, rows without it the base model; with no adapted row in the
    forward the folded model is the unwrapped one bit for bit."""
    hf = tiny_hf_model(family)
    model_dir = save_checkpoint(hf, tmp_path / "model", sharded=False)
    adapter = make_lora(model_dir, tmp_path / "lora", rank=8, alpha=16, targets="all", seed=1)
    ids = torch.randint(0, hf.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    from engine.config import EngineConfig

    model, cfg = load_model(model_dir, dtype=torch.float32, progress=False)
    with torch.no_grad():
        want = merged_hf(model_dir, adapter)(torch.tensor([ids])).logits[0]
        base = hf(torch.tensor([ids])).logits[0]
        plain = model.compute_logits(_forward(model, ids, None))
    config = EngineConfig.from_kwargs(str(model_dir), enable_lora=True, max_loras=1, max_lora_rank=8)
    layers = wrap_model(model, 1, 8)
    manager = LoRAManager(config, cfg, layers, torch.float32)
    manager.load_slot(0, LoRARequest("a", 1, str(adapter)))
    for layer in layers:
        layer.fold()
    assert layers[0].stacked.shape[0] == layers[0].base.weight.shape[0] + 3 * 8
    with torch.no_grad():
        got = model.compute_logits(_forward(model, ids, 0))
        got_base = model.compute_logits(_forward(model, ids, -1))
        assert torch.equal(model.compute_logits(_forward(model, ids, None)), plain)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_base, base, atol=ATOL, rtol=0)
    other = make_lora(model_dir, tmp_path / "lora2", rank=8, alpha=16, targets="all", seed=2)
    manager.load_slot(0, LoRARequest("b", 2, str(other)))  # a load after the fold reaches the stack
    with torch.no_grad():
        want = merged_hf(model_dir, other)(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(model.compute_logits(_forward(model, ids, 0)), want, atol=ATOL, rtol=0)


def _forward(model, ids: list[int], slot: int | None) -> torch.Tensor:
    meta = AttentionMetadata.for_full_sequences([len(ids)])
    if slot is not None:
        meta.lora_slots = torch.full((len(ids),), slot, dtype=torch.int32)
    with attention_context(meta):
        return model(torch.tensor(ids), torch.arange(len(ids)))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_peft_merged_model_in_every_family(family, tmp_path):
    hf = tiny_hf_model(family)
    model_dir = save_checkpoint(hf, tmp_path / "model", sharded=False)
    adapter = make_lora(model_dir, tmp_path / "lora", rank=8, alpha=16, targets="all", seed=1)
    ids = torch.randint(0, hf.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        want = merged_hf(model_dir, adapter)(torch.tensor([ids])).logits[0]
        base = hf(torch.tensor([ids])).logits[0]
    got, got_base = our_logits(model_dir, adapter, ids)
    assert (want - base).abs().max() > 100 * ATOL  # the adapter matters
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_base, base, atol=ATOL, rtol=0)  # rows without an adapter: the base


def test_rslora_on_a_subset_of_modules_matches_peft(tiny_model_dir, tmp_path):
    adapter = make_lora(tiny_model_dir, tmp_path / "rs", rank=4, alpha=8, targets="q_proj,v_proj,down_proj",
                        use_rslora=True, seed=2)  # fmt: skip
    ids = list(range(300, 331))
    with torch.no_grad():
        want = merged_hf(tiny_model_dir, adapter)(torch.tensor([ids])).logits[0]
    got, _ = our_logits(tiny_model_dir, adapter, ids, max_rank=8)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("loras")
    targets = ["all", "attn", "mlp", "q_proj,v_proj"]
    paths = [
        make_lora(tiny_model_dir, root / f"ad{i}", rank=2 + 2 * i, targets=t, seed=i)
        for i, t in enumerate(targets)
    ]
    return [LoRARequest(f"ad{i}", i + 1, str(path)) for i, path in enumerate(paths)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), enable_lora=True, max_loras=4, **ENGINE)


PROMPTS = [[(13 * i + 7 * k) % 1500 + 100 for k in range(9 + 5 * i)] for i in range(5)]


@pytest.fixture(scope="module")
def alone(llm, adapters) -> list[list[int]]:
    """Each prompt run alone, with adapter i (the last one with the base model)."""
    loras = [*adapters, None]
    return [
        llm.generate([p], GREEDY, lora_request=lora)[0].outputs[0].token_ids
        for p, lora in zip(PROMPTS, loras)
    ]


def test_greedy_tokens_match_hf_generate_with_the_merged_adapter(llm, adapters, alone, tiny_model_dir):
    hf = merged_hf(tiny_model_dir, adapters[0].lora_path)
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=6, do_sample=False)
    assert alone[0] == out[0, len(PROMPTS[0]) :].tolist()


def test_a_batch_mixing_four_adapters_and_the_base_equals_each_alone(llm, adapters, alone):
    assert len({tuple(t) for t in alone}) == 5  # every adapter changes the output
    results = llm.generate(PROMPTS, GREEDY, lora_request=[*adapters, None])
    assert [r.outputs[0].token_ids for r in results] == alone
    # same prompt under every adapter in one batch: each row gets its own adapter
    same = llm.generate([PROMPTS[0]] * 5, GREEDY, lora_request=[*adapters, None])
    assert same[0].outputs[0].token_ids == alone[0]
    assert same[4].outputs[0].token_ids == llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    assert llm.engine.audit() == []


def test_prefix_cache_is_isolated_between_adapters(tiny_model_dir, adapters):
    llm = LLM(str(tiny_model_dir), enable_lora=True, max_loras=2, **ENGINE)
    prompt = list(range(500, 530))
    a, b = adapters[0], adapters[2]
    cold_a = llm.generate([prompt], GREEDY, lora_request=a)[0]
    cold_b = llm.generate([prompt], GREEDY, lora_request=b)[0]
    cold_base = llm.generate([prompt], GREEDY)[0]
    assert cold_a.cached_tokens == cold_b.cached_tokens == cold_base.cached_tokens == 0  # nothing shared
    warm_a, warm_b = llm.generate([prompt, prompt], GREEDY, lora_request=[a, b])
    assert warm_a.cached_tokens > 0 and warm_b.cached_tokens > 0  # each finds its own blocks
    assert warm_a.outputs[0].token_ids == cold_a.outputs[0].token_ids
    assert warm_b.outputs[0].token_ids == cold_b.outputs[0].token_ids
    assert cold_a.outputs[0].token_ids != cold_b.outputs[0].token_ids
    # the routers' key of a prompt under an adapter is the engine's own chain for it
    cached = set(llm.engine.block_manager.cached)
    for lora in (a, b, None):
        keys = prompt_block_hashes(prompt, 4, 64, lora_request=lora)
        assert len(keys) == 7 and set(keys) <= cached
    assert not set(prompt_block_hashes(prompt, 4, 64, lora_request=a)) & set(
        prompt_block_hashes(prompt, 4, 64)
    )
    assert llm.engine.audit() == []


def test_more_adapters_than_slots_defers_and_evicts_but_completes_correctly(tiny_model_dir, adapters, alone):
    llm = LLM(str(tiny_model_dir), enable_lora=True, max_loras=1, max_cpu_loras=2, **ENGINE)
    runner = llm.engine.runner
    seen: list[set[int]] = []
    token_slots = runner.lora.token_slots

    def recording(chunks, pinned):
        rows = token_slots(chunks, pinned)
        seen.append(set(rows or []) - {-1})
        return rows

    runner.lora.token_slots = recording
    loras = [*adapters, None]
    order = [0, 1, 4, 2, 3, 0, 1]  # adapters interleaved, two of them twice: LRU reloads
    results = llm.generate([PROMPTS[i] for i in order], GREEDY, lora_request=[loras[i] for i in order])
    assert [r.outputs[0].token_ids for r in results] == [alone[i] for i in order]
    assert max(len(s) for s in seen) == 1  # never two adapters in one step with one slot
    # the waiting requests of the running adapter went first: each adapter was read and slotted once
    assert runner.lora.host.loads == runner.lora.slot_loads == 4
    assert llm.generate([PROMPTS[0]], GREEDY, lora_request=adapters[0])[0].outputs[0].token_ids == alone[0]
    assert runner.lora.host.loads == 5  # max_cpu_loras 2 < 4 adapters: ad0 was evicted and read again
    assert llm.engine.audit() == []


def test_tensor_parallel_adapters_match_tp1(tiny_model_dir, adapters):
    """TP=2 on gloo (float64, so a different summation order cannot flip a greedy choice): column-
    parallel layers shard B, row-parallel ones A, and each worker loads its share of every slot."""
    options = {**ENGINE, "dtype": "float64", "enable_lora": True, "max_loras": 2}
    loras = [adapters[0], adapters[3], None, adapters[2]]  # 3 adapters, 2 slots: a worker reloads a slot
    prompts = PROMPTS[:4]
    want = [
        r.outputs[0].token_ids
        for r in LLM(str(tiny_model_dir), **options).generate(prompts, GREEDY, lora_request=loras)
    ]
    tp = LLM(str(tiny_model_dir), tensor_parallel_size=2, **options)
    try:
        got = [r.outputs[0].token_ids for r in tp.generate(prompts, GREEDY, lora_request=loras)]
    finally:
        tp.engine.runner.shutdown()
    assert got == want


def test_speculative_verification_applies_each_rows_adapter(tiny_model_dir, adapters):
    """n-gram proposals verified in one step per sequence: its k + 1 rows take its adapter's slot, so
    the greedy output equals the plain engine's (float64: verification's batch shapes cannot flip a
    near-tie)."""
    options = {**ENGINE, "dtype": "float64", "enable_lora": True, "max_loras": 2}
    prompts = [p * 3 for p in PROMPTS[:3]]  # repeated: the n-gram lookup proposes
    loras = [adapters[1], None, adapters[3]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(tiny_model_dir), **options).generate(prompts, params, lora_request=loras)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llm = LLM(str(tiny_model_dir), speculative_config=spec, **options)
    got = llm.generate(prompts, params, lora_request=loras)
    assert llm.engine.get_stats()["spec_draft_tokens"] > 0
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in plain]


def test_row_slots_travel_in_the_int32_buffer_and_the_tp_header():
    """pack/unpack put each row's slot between seq_lens and the block tables (16-byte aligned; padding
    rows -1), a graph bucket's buffer has the segment even for a step without adapters, and a
    tensor-parallel forward header gives the workers the same view."""
    b = StepBatch([5, 6, 7, 8], [0, 1, 2, 9], [4, 5, 6, 13], [3, 1], [3, 10], [[1], [2, 3, 4]])
    b.lora_slots = [1, 1, 1, -1]
    i64, i32 = pack(b, 4, 16, pad_q=0, rows=16)
    ids, pos, meta = unpack(i64, i32, b, 4, 16, 4, pad_q=0, rows=16, mixed=True)
    assert Layout(16, 4, True).lora_at % 4 == 0 and meta.lora_slots.tolist() == [1, 1, 1, -1] + [-1] * 12
    assert meta.block_tables[1, :3].tolist() == [2, 3, 4]
    header, spans = tp_wire.encode_forward(ids, pos, meta)
    assert torch.equal(
        tp_wire.decode_forward(header, [s.clone() for s in spans])[2].lora_slots, meta.lora_slots
    )
    b.lora_slots = None
    assert unpack(*pack(b, 2, 16), b, 2, 16, 4)[2].lora_slots is None  # eager, no adapter row: no segment
    _, _, graph = unpack(*pack(b, 2, 16, lora=True), b, 2, 16, 4, lora=True)
    assert graph.lora_slots.tolist() == [-1] * 4
    header = tp_wire.encode_lora(3, "a", 7, "/x/ä")
    assert tp_wire.decode_lora(header) == (3, "a", 7, "/x/ä")


def test_slots_evict_the_least_recently_used_adapter_no_running_request_holds():
    table = SlotTable(2)
    a, b, c = ("a", 1, "/a"), ("b", 2, "/b"), ("c", 3, "/c")
    assert table.assign([a, b], set()) == ({a: 0, b: 1}, [(a, 0), (b, 1)])
    table.assign([a], {a, b})
    assert table.assign([c], {b}) == ({c: 0}, [(c, 0)])  # a is older but not held: its slot goes
    with pytest.raises(RuntimeError, match="max_loras=2"):
        table.assign([a], {b, c})  # both slots held by running requests: a scheduler bug
    reads = []
    cache = HostCache(2, lambda r: reads.append(r.lora_name) or r.lora_name)
    for name in "abab":
        cache.get(LoRARequest(name, 1, "/p"))
    cache.get(LoRARequest("c", 1, "/p"))  # evicts a, the least recently used
    cache.get(LoRARequest("b", 1, "/p"))
    cache.get(LoRARequest("a", 1, "/p"))
    assert reads == ["a", "b", "c", "a"] and cache.names() == ["b", "a"]


def test_structured_output_with_an_adapter_equals_peft_merged_checkpoint(
    llm, adapters, tiny_model_dir, tmp_path
):
    """Rows with an adapter under a grammar: the engine with the adapter gives the tokens the engine gives
    on the checkpoint peft merged the adapter into, grammar and greedy choice alike."""
    import re
    import shutil

    from engine.sampling_params import StructuredOutput

    merged = tmp_path / "merged"
    merged_hf(tiny_model_dir, adapters[0].lora_path).save_pretrained(merged)
    for f in tiny_model_dir.iterdir():  # the tokenizer and its template
        if f.is_file() and not (merged / f.name).exists():
            shutil.copy(f, merged / f.name)
    pattern = "[0-9]{3}-[0-9]{4}"
    sp = SamplingParams(max_tokens=16, temperature=0.0, structured=StructuredOutput("regex", pattern))
    want = LLM(str(merged), **ENGINE).generate([PROMPTS[1]], sp)[0].outputs[0]
    got = llm.generate([PROMPTS[1]], sp, lora_request=adapters[0])[0].outputs[0]
    base = llm.generate([PROMPTS[1]], sp)[0].outputs[0]
    assert re.fullmatch(pattern, got.text) and got.token_ids == want.token_ids
    assert base.token_ids != got.token_ids  # the adapter matters under the grammar too
