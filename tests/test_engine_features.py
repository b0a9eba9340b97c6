"""Engine behaviours: prefix caching, chunked prefill fairness, abort, tool calls, stops, budget forcing,
fault injection (off: never called per token; on: fails only its request)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from engine import LLM
from engine.config import EngineConfig
from engine.core.faults import FaultInjector
from engine.core.messages import Add
from engine.llm_engine import LLMEngine
from engine.nanochat import Engine as NanochatEngine
from engine.sampling.sampler import PendingSample
from engine.sampling_params import BudgetForcing, SamplingParams, ToolConfig
from tests.reference import NaiveGenerator
from tests.test_engine_core import InProcessCore

pytestmark = pytest.mark.engine
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return NaiveGenerator(tiny_model_dir)


def make_engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="float64", device="cpu", **kw))


def drain(engine: LLMEngine, on_step=None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            for d in o.outputs:
                tokens.setdefault(o.request_id, []).extend(d.token_ids)
        if on_step:
            on_step()
    return tokens


def record_schedules(engine: LLMEngine) -> list:
    """Wrap the scheduler so every step's SchedulerOutput (also those scheduled ahead) is kept."""
    seen = []

    def wrap(original):
        def record(*args, **kw):
            out = original(*args, **kw)
            if out is not None:
                seen.append([(c.seq.request.request_id, c.num_tokens) for c in out.chunks])
            return out

        return record

    engine.scheduler.schedule = wrap(engine.scheduler.schedule)
    engine.scheduler.schedule_ahead = wrap(engine.scheduler.schedule_ahead)
    return seen


def test_prefix_cache_computes_only_the_tail(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, block_size=16)
    rng = random.Random(3)
    prefix = [rng.randrange(1000) for _ in range(200)]
    a, b = prefix + [1, 2, 3], prefix + [7, 8, 9, 10]
    engine.add_request(a, SamplingParams(max_tokens=4, **GREEDY))
    drain(engine)
    seen = record_schedules(engine)
    rid = engine.add_request(b, SamplingParams(max_tokens=4, **GREEDY))
    out = drain(engine)
    computed = sum(n for step in seen for r, n in step if r == rid)
    assert computed == len(b) - 192 + 3  # tail of the prompt + 3 decode steps (the 4th token is not fed back)
    assert out[rid] == reference.greedy(b, 4)


def test_outputs_stay_correct_under_eviction_pressure(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, block_size=4, num_blocks=40)
    rng = random.Random(5)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(20, 120))] for _ in range(12)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, **GREEDY)) for p in prompts + prompts[:4]]
    out = drain(engine)
    for rid, p in zip(ids, prompts + prompts[:4]):
        assert out[rid] == reference.greedy(p, 6)
    assert engine.audit() == []


def test_long_prompt_never_stalls_running_decodes(tiny_model_dir):
    engine = make_engine(tiny_model_dir, block_size=16, max_num_batched_tokens=256)
    decoders = [engine.add_request([i + 1] * 10, SamplingParams(max_tokens=40, **GREEDY)) for i in range(8)]
    for _ in range(3):
        engine.step()
    seen = record_schedules(engine)
    long_id = engine.add_request(list(range(2000)), SamplingParams(max_tokens=2, **GREEDY))
    drain(engine)
    prefill_steps = [s for s in seen if any(r == long_id and n > 1 for r, n in s)]
    assert len(prefill_steps) >= 2000 // 256, "the long prompt must be chunked"
    assert set(decoders) <= {r for r, _ in prefill_steps[0]}
    # every decoder took part in every step until it finished
    for d in decoders:
        steps_with_d = [i for i, s in enumerate(seen) if any(r == d for r, _ in s)]
        assert steps_with_d == list(range(len(steps_with_d))), "a decode skipped a step"


def test_abort_frees_blocks_at_once(tiny_model_dir):
    engine = make_engine(tiny_model_dir, block_size=4)
    rid = engine.add_request(list(range(1, 50)), SamplingParams(max_tokens=100, n=3, **GREEDY))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used > 0
    final = engine.abort(rid)
    assert final.finished and {d.finish_reason for d in final.outputs} == {"abort"}
    assert engine.block_manager.num_used == 0 and engine.audit() == []
    assert not engine.has_unfinished()


class ForcedSampler:
    """Wraps the real sampler; rows for which `when(call, row_index, row)` holds sample `token` instead.
    The forced ids replace the sampled ones on the device too, where a step scheduled ahead reads them."""

    def __init__(self, runner, token: int, when):
        self.real, self.token, self.when, self.calls = runner.sampler, token, when, 0

    def __call__(self, logits, rows):
        sampled = self.real(logits, rows).sampled
        self.calls += 1
        forced = torch.tensor([bool(self.when(self.calls, i, r)) for i, r in enumerate(rows)])
        return PendingSample(torch.where(forced.to(sampled.device), self.token, sampled), None, rows)


def test_calculator_result_is_forced_with_mask_zero(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    tok = engine.tokenizer
    tool = ToolConfig()
    start, end = tok.token_id(tool.python_start), tok.token_id(tool.python_end)
    prompt = (
        tok.encode("Compute:", add_special_tokens=False)
        + [start]
        + tok.encode("12*(3+4)", add_special_tokens=False)
    )
    with_tool = engine.add_request(prompt, SamplingParams(max_tokens=12, tool=tool, **GREEDY))
    bystander = engine.add_request(prompt, SamplingParams(max_tokens=12, **GREEDY))
    engine.runner.sampler = ForcedSampler(engine.runner, end, lambda call, i, r: call == 1 and r.params.tool)
    masks = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            for d in o.outputs:
                tokens.setdefault(o.request_id, []).extend(d.token_ids)
                masks.setdefault(o.request_id, []).extend(d.token_masks)
    forced = (
        [tok.token_id(tool.output_start)]
        + tok.encode("84", add_special_tokens=False)
        + [tok.token_id(tool.output_end)]
    )
    got = tokens[with_tool]
    assert got[: 1 + len(forced)] == [end] + forced
    assert masks[with_tool][: 1 + len(forced)] == [1] + [0] * len(forced)
    # the tool row continues exactly as a naive recompute of its own sequence; the other row is untouched
    rest = reference.greedy(prompt + got[: 1 + len(forced)], 12 - 1 - len(forced))
    assert got[1 + len(forced) :] == rest
    assert tokens[bystander] == reference.greedy(prompt, 12)


def test_calculator_works_inside_the_engine_core_loop(tiny_model_dir):
    """The tool's forced tokens come from the core's own loop (detokenize=False: no text there)."""
    core = InProcessCore(tiny_model_dir, dtype="float64")
    tok, tool = core.engine.tokenizer, ToolConfig()
    end = tok.token_id(tool.python_end)
    runner = core.engine.runner
    runner.sampler = ForcedSampler(runner, end, lambda call, i, r: call == 1)
    prompt = [tok.token_id(tool.python_start)] + tok.encode("6*7", add_special_tokens=False)
    try:
        core.conn.send([Add("calc", prompt, SamplingParams(max_tokens=8, tool=tool, **GREEDY), 0.0)])
        core.gate.set()
        tokens = []
        core.finals(
            {"calc"}, on_record=lambda rec: tokens.extend(t for s in rec.samples for t in s.token_ids)
        )
    finally:
        core.close()
    forced = [tok.token_id(tool.output_start)] + tok.encode("42", add_special_tokens=False)
    assert tokens[: 1 + len(forced)] == [end] + forced


def test_stop_string_across_tokens_is_trimmed(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    tok = engine.tokenizer
    prompt = tok.encode("Once upon a time", add_special_tokens=False)
    expected = reference.greedy(prompt, 16)
    text = tok.decode(expected)
    # a stop string made of the end of token 3's text and the start of token 4's text
    t3, t4 = tok.decode(expected[:4]), tok.decode(expected[:5])
    stop = text[len(t3) - 1 : len(t4) - 1] if len(t4) - len(t3) > 1 else text[len(t3) - 1 : len(t4)]
    assert len(stop) >= 2
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer = engine, tok
    (res,) = llm.generate([prompt], SamplingParams(max_tokens=16, stop=[stop], **GREEDY))
    out = res.outputs[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert out.text == text[: text.find(stop)]


def test_budget_forcing_holds_the_suppress_token_until_the_budget(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    tok = engine.tokenizer
    think_end = tok.token_id("</think>")
    bf = BudgetForcing(suppress="</think>", replacements=["Wait"], min_tokens=15)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, budget_forcing=bf, **GREEDY))
    engine.runner.sampler = ForcedSampler(engine.runner, think_end, lambda call, i, r: call % 3 == 0)
    tokens = drain(engine)[rid]
    first = tokens.index(think_end)
    assert first >= 15
    wait = tok.encode("Wait", add_special_tokens=False)
    assert tokens[2 : 2 + len(wait)] == wait  # the first suppressed sample became "Wait"


def test_budget_forcing_cycles_its_replacements(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    tok = engine.tokenizer
    bf = BudgetForcing(suppress="</think>", replacements=["Wait", "Hmm"], min_tokens=20)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, budget_forcing=bf, **GREEDY))
    (seq,) = engine.state.requests[rid].seqs
    forced_at = {1, 8}  # the first two samples, then every later one until the budget is spent: none
    engine.runner.sampler = ForcedSampler(
        engine.runner, tok.token_id("</think>"), lambda call, i, r: call in forced_at
    )
    drain(engine)
    assert seq.state.budget_forcings == 2
    pairs = zip(seq.output_ids, seq.masks, strict=True)
    forced_runs = [[t for t, _ in run] for mask, run in itertools.groupby(pairs, lambda p: p[1]) if not mask]
    assert forced_runs == [tok.encode(w, add_special_tokens=False) for w in ("Wait", "Hmm")]


def test_faults_off_never_call_the_injector(tiny_model_dir, monkeypatch):
    def boom(*args):
        raise AssertionError("FaultInjector.check called with fault injection off")

    monkeypatch.setattr(FaultInjector, "check", boom)
    llm = LLM(str(tiny_model_dir), dtype="float64")
    params = SamplingParams(max_tokens=6, stop=["zzz"], tool=ToolConfig(), **GREEDY)
    (res,) = llm.generate(["__fault:sample__ __fault:detokenize__ hi"], params)
    assert res.outputs[0].finish_reason == "length" and res.outputs[0].error is None


@pytest.mark.parametrize("point", ["sample", "detokenize"])
def test_a_fault_fails_only_its_request(tiny_model_dir, point):
    engine = make_engine(tiny_model_dir, fault_injection=True)
    params = SamplingParams(max_tokens=4, **GREEDY)
    faulty = engine.add_request(f"__fault:{point}__ hi", params)
    healthy = engine.add_request("hi", params)
    finals = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o.outputs[0]
    assert finals[faulty].finish_reason == "error"
    assert f"injected fault at {point}" in finals[faulty].error
    assert finals[healthy].finish_reason == "length" and finals[healthy].error is None


def test_nanochat_generate_batch_matches_llm(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    results, masks = NanochatEngine(engine).generate_batch(
        prompt, num_samples=2, max_tokens=10, temperature=0.0
    )
    expected = reference.greedy(prompt, 10, stop_ids=NanochatEngine(engine).terminals)
    for row, mask in zip(results, masks):
        assert row == prompt + [t for t in expected if t not in NanochatEngine(engine).terminals]
        assert mask == [0] * len(prompt) + [1] * (len(row) - len(prompt))
    assert engine.audit() == [] and engine.block_manager.num_used == 0


def test_llm_generate_accepts_text_ids_and_chat(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float64")
    p = SamplingParams(max_tokens=5, **GREEDY)
    chat = [{"role": "user", "content": "hi"}]
    res = llm.generate(["hello", [1, 2, 3], chat], [p, p, p])
    assert [len(r.outputs[0].token_ids) for r in res] == [5, 5, 5]
    assert res[2].prompt_token_ids == llm.tokenizer.encode_chat(chat)
    assert res[0].outputs[0].text == llm.tokenizer.decode(res[0].outputs[0].token_ids)
