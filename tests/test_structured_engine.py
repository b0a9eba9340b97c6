"""Structured output in the engine: grammar-constrained decoding against the tiny random model.

The model's weights are random, so at temperature 1.0 only the grammar can make an output valid: every
output that finishes with "stop" must validate (jsonschema / re.fullmatch / membership), and at least
90% must finish with "stop". Then the engine features around it: async scheduling on and off, n > 1,
preemption, the prefix cache, constrained next to unconstrained requests, errors that name the field,
the sampler's fast path, and a mutation check (no mask applied -> invalid outputs).
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time

import pytest
import torch

from benchmarks.structured_cases import CHOICES, GRAMMARS, REGEXES, SCHEMAS
from engine.config import EngineConfig
from engine.device.uploader import device_view
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.sched import admission
from engine.structured import state as grammar_state
from engine.structured.compiler import compiler_for
from engine.structured.process import GrammarProcess
from engine.structured.remote import ProcessBitmaskFiller
from engine.structured.state import BitmaskFiller, GrammarError, GrammarState
from kernels import ops, torch_ops
from tests.structured_helpers import PROMPT, make_engine, run, so

# a bare GPU host (`pytest -m gpu`) may lack both: skip this module there instead of failing collection
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return make_engine(tiny_model_dir)


def sampled(structured: StructuredOutput, seed: int, max_tokens: int = 160, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured=structured, **kw)


def valid(kind: str, spec, text: str) -> bool:
    try:
        if kind == "json":
            jsonschema.validate(json.loads(text), json.loads(spec) if isinstance(spec, str) else spec)
            return True
        if kind == "json_object":
            return isinstance(json.loads(text), dict)
    except (ValueError, jsonschema.ValidationError):
        return False
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    return re.fullmatch(spec[1], text) is not None  # grammar cases carry a regex of their language


def check_outputs(cases: list[tuple[str, object]], results: list[dict], min_stop: float = 0.9) -> None:
    stops = 0
    for (kind, spec), samples in zip(cases, results, strict=True):
        for _, text, reason in samples.values():
            assert reason in ("stop", "length"), reason
            if reason == "stop":
                stops += 1
                assert valid(kind, spec, text), f"{kind} {spec!r}: invalid output {text!r}"
    total = sum(len(s) for s in results)
    assert stops >= min_stop * total, f"only {stops}/{total} outputs finished with stop"


def test_json_schemas_give_valid_json(engine):
    cases = [("json", s) for s in SCHEMAS for _ in range(2)] + [("json_object", None)] * 3
    reqs = [(PROMPT, sampled(so(k, s), seed=i, max_tokens=200)) for i, (k, s) in enumerate(cases)]
    check_outputs(cases, run(engine, reqs))


def test_regexes_choices_and_lark_grammars(engine):
    cases = [("regex", r) for r in REGEXES for _ in range(2)]
    cases += [("choice", c) for c in CHOICES for _ in range(3)]
    reqs = [(PROMPT, sampled(so(k, s), seed=50 + i)) for i, (k, s) in enumerate(cases)]
    for lark, language in GRAMMARS:
        for seed in range(3):
            cases.append(("grammar", (lark, language)))
            reqs.append((PROMPT, sampled(so("grammar", lark), seed=seed)))
    check_outputs(cases, run(engine, reqs), min_stop=0.95)


def mixed(prompt: str = PROMPT) -> list[tuple[str, SamplingParams]]:
    """Constrained (greedy and seeded) and unconstrained requests side by side."""
    reqs = []
    for i, schema in enumerate(SCHEMAS[:6]):
        reqs.append((prompt, sampled(so("json", schema), seed=i, max_tokens=80)))
    reqs.append((prompt, SamplingParams(max_tokens=30, temperature=0.0, structured=so("regex", REGEXES[0]))))
    reqs.append((prompt, SamplingParams(max_tokens=60, temperature=0.0, structured=so("json", SCHEMAS[0]))))
    for i in range(3):
        reqs.append((prompt + " free", SamplingParams(max_tokens=25, temperature=1.0, seed=90 + i)))
    reqs.append((prompt, SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)))
    return reqs


def test_async_scheduling_on_and_off_give_the_same_outputs(tiny_model_dir):
    sync, eng = make_engine(tiny_model_dir, async_scheduling=False), make_engine(tiny_model_dir)
    ahead = []
    original = eng.scheduler.schedule_ahead
    eng.scheduler.schedule_ahead = lambda prev, **kw: ahead.append(original(prev, **kw)) or ahead[-1]
    reqs = mixed()
    assert run(sync, reqs) == run(eng, reqs)
    constrained_ahead = [o for o in ahead if o is not None and any(c.seq.grammar for c in o.chunks)]
    assert len(constrained_ahead) > 10, "constrained rows must run in steps launched ahead"


def test_n_samples_fork_the_matcher(engine):
    schema = SCHEMAS[2]
    (samples,) = run(engine, [(PROMPT, sampled(so("json", schema), seed=4, n=4))])
    assert len(samples) == 4 and len({s[1] for s in samples.values()}) > 1, samples
    check_outputs([("json", schema)], [samples], min_stop=1.0)


def test_preemption_keeps_matchers_consistent(tiny_model_dir, engine):
    reqs = [(PROMPT + f" {i}", sampled(so("json", SCHEMAS[i]), seed=i, max_tokens=70)) for i in range(8)]
    small = make_engine(tiny_model_dir, block_size=4, num_blocks=40)
    got = run(small, reqs)
    assert small.scheduler.num_preemptions > 0, "the pool must be small enough to preempt"
    assert got == run(engine, reqs)
    check_outputs([("json", SCHEMAS[i]) for i in range(8)], got, min_stop=0.75)


def test_prefix_cache_hit_gives_the_same_constrained_output(tiny_model_dir):
    eng = make_engine(tiny_model_dir, block_size=4)
    prompt = PROMPT + " the same long prompt, twice over, so that whole blocks are cached."
    params = sampled(so("json", SCHEMAS[5]), seed=8)
    first = run(eng, [(prompt, params)])
    rid = eng.add_request(prompt, params)
    again: list = []
    while eng.has_unfinished():
        outs = eng.step()
        again += [o for o in outs if o.request_id == rid]
    assert again[-1].cached_tokens > 0
    assert [t for o in again for d in o.outputs for t in d.token_ids] == first[0][0][0]


def test_unconstrained_neighbours_are_unaffected(tiny_model_dir, engine):
    reqs = mixed()
    free = [(p, sp) for p, sp in reqs if sp.structured is None]
    together = run(engine, reqs)
    alone = run(make_engine(tiny_model_dir), free)
    assert [r for (_, sp), r in zip(reqs, together, strict=True) if sp.structured is None] == alone


@pytest.mark.parametrize(
    "structured, words",
    [
        (so("regex", "a(b"), "regex"),
        (so("regex", ""), "regex"),
        (so("json", {"type": "objectx"}), "json"),
        (so("json", "{not json"), "JSON"),
        (so("json", {"type": "object", "if": {}}), "json"),
        (so("json", [1, 2]), "schema"),
        (so("yaml", "a: 1"), "unknown kind"),
        (so("choice", []), "choice"),
        (so("choice", ["a", 3]), "choice"),
        (so("grammar", "start: foo\n"), "grammar"),
        (so("json_object", {"type": "object"}), "json_object"),
        (so("json", {"enum": {1, 2}}), "not JSON"),
        (so("json", {"type": "number", "minimum": float("nan")}), "not JSON"),
        (so("json", False), "json"),
    ],
)
def test_bad_constraints_raise_naming_the_field(engine, structured, words):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(PROMPT, SamplingParams(structured=structured))
    assert err.value.field == "response_format" and str(err.value).startswith("response_format: ")
    assert words.lower() in str(err.value).lower()
    with pytest.raises(InvalidRequestError):  # the replica's admission check, before the engine core
        admission.check([1, 2], SamplingParams(structured=structured), engine.limits, engine.tokenizer)


def test_structured_cannot_combine_with_forced_tokens(engine):
    from engine.sampling_params import ToolConfig

    with pytest.raises(InvalidRequestError, match="tool"):
        engine.add_request(PROMPT, SamplingParams(structured=so("regex", "a+"), tool=ToolConfig()))


def test_compiles_are_cached(engine):
    compiler = compiler_for(engine.tokenizer, engine.limits.vocab_size)
    schema = {"type": "object", "properties": {"cached": {"type": "boolean"}}, "required": ["cached"]}
    before = compiler.compiles
    for text in (schema, json.dumps(schema), json.dumps(schema, indent=2)):
        compiler.prototype(StructuredOutput("json", text))
    assert compiler.compiles == before + 1


def chain_grammar(n: int) -> str:
    """A Lark grammar of n rules nested in one chain (r0 -> r1 -> ... -> rn)."""
    return "start: r0\n" + "".join(f'r{i}: "x" r{i + 1} | "y"\n' for i in range(n)) + f'r{n}: "z"\n'


def test_compile_limits_are_enforced(engine, monkeypatch):
    from engine.structured import compiler as structured

    compiler = structured.GrammarCompiler(engine.tokenizer, engine.limits.vocab_size)
    # deep nesting overflowed the caller's 8 MiB stack (SIGSEGV); the compile thread's stack holds it
    compiler.prototype(so("grammar", chain_grammar(3000)))
    with pytest.raises(InvalidRequestError, match="longer than"):
        compiler.prototype(so("regex", "a" * (structured.MAX_SPEC_CHARS + 1)))
    monkeypatch.setattr(structured, "MAX_GRAMMAR_SIZE", 50)
    with pytest.raises(InvalidRequestError, match="too complex"):
        structured.GrammarCompiler(engine.tokenizer, engine.limits.vocab_size).prototype(
            so("grammar", chain_grammar(100))
        )
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 1e-4)
    with pytest.raises(InvalidRequestError, match="took longer than"):
        compiler.prototype(so("grammar", chain_grammar(2000)))


def test_unconstrained_steps_never_touch_the_mask(tiny_model_dir, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the mask code ran for an unconstrained step")

    monkeypatch.setattr(ops, "apply_token_bitmask", boom)
    monkeypatch.setattr(BitmaskFiller, "start", boom)
    monkeypatch.setattr(ProcessBitmaskFiller, "start", boom)
    monkeypatch.setattr(GrammarProcess, "__init__", boom)
    eng = make_engine(tiny_model_dir)
    reqs = [
        (PROMPT, SamplingParams(max_tokens=12, temperature=t, seed=1, logprobs=lp))
        for t in (0, 1)
        for lp in (None, 2)
    ]
    assert all(s[0][2] == "length" or s[0][2] == "stop" for s in run(eng, reqs))


def test_outputs_are_invalid_without_the_mask(tiny_model_dir, monkeypatch):
    """Mutation check: with every token allowed by the mask, the same requests produce invalid outputs,
    so the tests above would catch a mask that is not applied."""
    monkeypatch.setattr(BitmaskFiller, "_device_rows", lambda self, host, turn: torch.full_like(host, -1))
    eng = make_engine(tiny_model_dir)
    cases = [("json", s) for s in SCHEMAS[:6]] + [("regex", r) for r in REGEXES[:6]]
    reqs = [(PROMPT, sampled(so(k, s), seed=i, max_tokens=30)) for i, (k, s) in enumerate(cases)]
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    texts = dict.fromkeys(ids, "")
    while eng.has_unfinished():  # a token the grammar refuses fails its request (an error, no crash)
        for o in eng.step():
            texts[o.request_id] += "".join(d.text for d in o.outputs)
    results = [valid(k, s, texts[rid]) for (k, s), rid in zip(cases, ids, strict=True)]
    assert sum(results) <= 1, results


def test_grammar_state_fork_and_rollback(engine):
    proto = compiler_for(engine.tokenizer, engine.limits.vocab_size).prototype(so("regex", "ab(c|d)e"))
    ll_tok = compiler_for(engine.tokenizer, engine.limits.vocab_size).ll_tokenizer
    state = GrammarState.start(proto)
    ids = ll_tok.tokenize_str("abc")
    for t in ids:
        assert not state.advance(t)
    child = state.fork()
    state.rollback(1)
    assert state.num_consumed == len(ids) - 1 and child.num_consumed == len(ids)
    for t in ll_tok.tokenize_str(ll_tok.decode_str(ids[-1:])):
        state.advance(t)
    finished = [state.advance(t) for t in ll_tok.tokenize_str("e")]
    assert finished[-1] and state.finished and not child.finished
    with pytest.raises(ValueError):
        child.rollback(len(ids) + 1)


def test_finish_reasons_and_raw_logprobs(engine):
    """A complete grammar ends with "stop" even with ignore_eos; max_tokens still ends with "length";
    reported logprobs are the model's own distribution, not the masked one."""
    choice = SamplingParams(
        max_tokens=20, temperature=1.0, seed=3, ignore_eos=True, structured=so("choice", CHOICES[0])
    )
    short = sampled(so("json", SCHEMAS[0]), seed=1, max_tokens=3)
    greedy = dict(max_tokens=1, temperature=0.0, logprobs=5)
    masked = SamplingParams(**greedy, structured=so("regex", "zzz[0-9]"))
    got = run(engine, [(PROMPT, choice), (PROMPT, short)])
    assert got[0][0][2] == "stop" and got[0][0][1] in CHOICES[0]
    assert got[1][0][2] == "length" and len(got[1][0][0]) == 3
    free_id = engine.add_request(PROMPT, SamplingParams(**greedy))
    masked_id = engine.add_request(PROMPT, masked)
    lps = {}
    while engine.has_unfinished():
        for o in engine.step():
            lps.setdefault(o.request_id, []).extend(lp for d in o.outputs for lp in d.logprobs or [])
    (free,), (constrained,) = lps[free_id], lps[masked_id]
    assert constrained.top == free.top  # the same raw top 5 at the same position
    assert constrained.token_id != free.token_id  # the grammar picked another token
    assert constrained.logprob < free.logprob <= 0


def test_through_the_engine_core_process(tiny_model_dir, engine):
    """The replica (CoreClient.submit) refuses a bad constraint before the core sees it; a good one
    gives what the offline engine gives."""
    from engine.core_client import CoreClient
    from tests.test_engine_core import Collector

    sink = Collector()
    client = CoreClient(EngineConfig.from_kwargs(str(tiny_model_dir), dtype="float32", device="cpu"), sink)
    try:
        with pytest.raises(InvalidRequestError, match="response_format"):
            client.submit(PROMPT, SamplingParams(structured=so("regex", "a(b")))
        params = sampled(so("json", SCHEMAS[1]), seed=5, n=2)
        rid = client.submit(PROMPT, params)
        sink.wait(rid)
    finally:
        client.shutdown()
    (want,) = run(engine, [(PROMPT, params)])
    for index, (ids, _, _) in want.items():
        assert sink.tokens[f"{rid}/{index}"] == ids
    assert sorted(sink.finish[rid]) == [(i, want[i][2], None) for i in sorted(want)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_reads_pinned_mask_rows_in_place():
    """device_view: a device tensor over pinned host rows sees each later host write (nothing is
    copied), and the masked argmax over it picks what the torch twin picks over an uploaded copy."""
    host = torch.zeros(4, 8, dtype=torch.int32, pin_memory=True)
    view = device_view(host, torch.device("cuda"))
    assert view.is_cuda and view.data_ptr() == host.data_ptr()
    logits = torch.randn(4, 256, device="cuda")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        host.copy_(torch.randint(-(2**31), 2**31 - 1, (4, 8), dtype=torch.int32, generator=gen))
        host[:, 0] |= 1  # every row allows a token
        want = torch_ops.masked_by_bitmask(logits, host.cuda()).argmax(dim=-1)
        assert torch.equal(ops.argmax(logits, view), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_mask_turn_is_refilled_only_after_its_draw_ran():
    """The filler's host rows are what the draw reads, so a turn taken again (two fills later) must
    wait for the draw enqueued after the turn was handed out, however far behind the device is."""
    filler = BitmaskFiller(64, torch.device("cuda"))
    logits = torch.zeros(1, 64, device="cuda")
    rows = filler._buffer(1)
    rows.zero_()
    rows[0, 0] = 1 << 3  # only token 3
    view = filler._device_rows(rows, filler._turn)
    torch.cuda._sleep(200_000_000)  # the device is busy for a good while
    drawn = ops.argmax(logits, view)  # enqueued behind the sleep
    filler._buffer(1)  # the other turn
    again = filler._buffer(1)  # this turn again: waits for `drawn`
    again.zero_()
    again[0, 0] = 1 << 5
    assert drawn.item() == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_with_graphs_and_async_scheduling(tiny_model_dir):
    """CUDA graphs, the mask read in place from pinned memory, the Triton mask kernel and the late draw
    of steps run ahead: valid outputs, and the same with async scheduling off."""
    cases = [("json", s) for s in SCHEMAS] + [("regex", r) for r in REGEXES]
    reqs = [(PROMPT, sampled(so(k, s), seed=i, max_tokens=200)) for i, (k, s) in enumerate(cases)]
    reqs += mixed()

    def gpu_engine(**kw) -> LLMEngine:
        # a fixed pool (not a share of the free memory), so the second engine fits beside the first
        config = EngineConfig.from_kwargs(
            str(tiny_model_dir), dtype="float32", device="cuda", num_blocks=512, **kw
        )
        return LLMEngine(config)

    eng = gpu_engine()
    assert eng.runner.graphs is not None
    got = run(eng, reqs)
    del eng
    check_outputs(cases, got[: len(cases)])
    assert got == run(gpu_engine(async_scheduling=False), reqs)


def test_a_background_fill_shortens_the_switch_interval_until_it_ends(engine, monkeypatch):
    """The step loop runs pure Python, so the fill's worker gets the GIL only when the interpreter
    forces a switch: with the default 5 ms interval that is at the join, and the fill overlaps
    nothing (benchmarks/step_phases measures the effect). While a fill runs the interval is short; its
    end restores the caller's, joined or not."""
    proto = compiler_for(engine.tokenizer, engine.limits.vocab_size).prototype(so("regex", "[a-z]{8}"))
    states = [GrammarState.start(proto) for _ in range(4)]
    filler = BitmaskFiller(engine.limits.vocab_size, torch.device("cpu"))
    gate, run = threading.Event(), BitmaskFiller._run
    monkeypatch.setattr(BitmaskFiller, "_run", lambda self, *a: (gate.wait(10), run(self, *a)))
    before = sys.getswitchinterval()
    join = filler.start(states)
    assert sys.getswitchinterval() <= grammar_state.HANDOFF_SWITCH_INTERVAL_S < before
    gate.set()
    bitmask = join()
    assert sys.getswitchinterval() == before
    assert torch.equal(bitmask, filler.fill(states))  # the same rows as a fill on the caller's thread
    filler.start(states)  # never joined: its end still restores the interval
    deadline = time.monotonic() + 10
    while sys.getswitchinterval() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sys.getswitchinterval() == before


def test_the_fill_consumes_pushed_tokens_like_advancing_on_the_host(engine):
    """Pushed tokens are consumed by the fill (llguidance's parallel consume, on the worker); masks and
    matcher states equal those of matchers advanced one token at a time on the caller's thread, and a
    refused token is recorded, masks that row to EOS only and raises at the row's next check."""
    compiler = compiler_for(engine.tokenizer, engine.limits.vocab_size)
    proto = compiler.prototype(so("regex", "(ab|cd)[0-9]{3}x"))
    texts = ["ab123x", "cd9", "ab", "cd45"]
    tokens = [compiler.ll_tokenizer.tokenize_str(t) for t in texts]
    lagged = [GrammarState.start(proto) for _ in texts]
    eager = [GrammarState.start(proto) for _ in texts]
    filler = BitmaskFiller(engine.limits.vocab_size, torch.device("cpu"))
    for step in range(max(map(len, tokens))):
        live = [i for i, t in enumerate(tokens) if step < len(t)]
        for i in live:
            lagged[i].push(tokens[i][step])
            eager[i].advance(tokens[i][step])
        got = filler.start([lagged[i] for i in live])()
        assert torch.equal(got, filler.fill([eager[i] for i in live]))
    assert [s.num_consumed for s in lagged] == [len(t) for t in tokens] and not any(s.pending for s in lagged)
    assert lagged[0].finished and not lagged[1].finished
    bad = GrammarState.start(proto)
    bad.push(compiler.ll_tokenizer.tokenize_str("zz")[0])
    mask = filler.start([bad, lagged[1]])()
    allowed = [t for t in range(engine.limits.vocab_size) if mask[0, t // 32] >> (t % 32) & 1]
    assert bad.error and set(allowed) <= set(engine.tokenizer.eos_token_ids)
    with pytest.raises(GrammarError, match="refused"):
        bad.check()


def test_a_failed_background_fill_raises_at_its_join_and_the_next_fill_works(engine, monkeypatch):
    proto = compiler_for(engine.tokenizer, engine.limits.vocab_size).prototype(so("regex", "[a-z]{8}"))
    states = [GrammarState.start(proto) for _ in range(3)]
    filler = BitmaskFiller(engine.limits.vocab_size, torch.device("cpu"))
    expected = filler.fill(states)  # foreground, for reference
    run = BitmaskFiller._run

    def broken(self, plan, host):
        raise RuntimeError("matcher exploded")

    monkeypatch.setattr(BitmaskFiller, "_run", broken)
    join = filler.start(states)
    with pytest.raises(RuntimeError, match="matcher exploded"):
        join()
    monkeypatch.setattr(BitmaskFiller, "_run", run)
    assert torch.equal(filler.start(states)(), expected)
