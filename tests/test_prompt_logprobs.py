"""Prompt logprobs, score-only requests (max_tokens=0) and logit_bias (issue 27), against independent
references: transformers' log_softmax of the same checkpoint for prompt logprobs, the naive
full-recompute generator with the bias added by hand for logit_bias.

* prompt_logprobs (k = 0 and 3) == transformers, in one prefill chunk and split over many, after a
  prefix-cache hit (identical to the uncached values), and under preemption (emitted exactly once);
* max_tokens=0: no tokens, finish_reason "length", prompt logprobs when asked, offline and through the
  engine core (whose outputs equal the offline ones);
* logit_bias: +100 forces a token (greedy and sampled), -100 on the greedy token gives the reference's
  second choice, unbiased neighbours in the batch are unchanged;
* validation errors name the field; steps without these features never reach their code.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from engine import LLM
from engine.config import EngineConfig
from engine.core_client import CoreClient
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.outputs import TokenLogprob
from engine.sampling.sampler import Sampler
from engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from tests.reference import NaiveGenerator

pytestmark = pytest.mark.engine
transformers = pytest.importorskip("transformers")
GREEDY = dict(temperature=0.0, ignore_eos=True)
ATOL = 1e-5  # float64 model, log_softmax in float32 (values near -7: float32 resolves ~5e-7)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir):
    """prompt -> transformers' log_softmax over the vocabulary at every position, float64."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), attn_implementation="eager"
    ).double()
    model.eval()

    @torch.no_grad()
    def logprobs(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return NaiveGenerator(tiny_model_dir)


def make_engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="float64", device="cpu", **kw))


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1500) for _ in range(n)]


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    """Drain the engine; per request: tokens and finish reason per sample, logprobs, the prompt
    logprobs and how many outputs carried them."""
    rids = [engine.add_request(p, sp) for p, sp in requests]
    got = {rid: {"tokens": {}, "finish": {}, "logprobs": {}, "prompt": None, "carried": 0} for rid in rids}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in got:  # others (started before) run alongside
                absorb(got[out.request_id], out)
    return {rid: got[rid] for rid in rids}


def absorb(r: dict, out) -> None:
    for d in out.outputs:
        r["tokens"].setdefault(d.index, []).extend(d.token_ids)
        if d.logprobs is not None:
            r["logprobs"].setdefault(d.index, []).extend(d.logprobs)
        if d.finish_reason:
            r["finish"][d.index] = d.finish_reason
    if out.prompt_logprobs is not None:
        r["prompt"], r["carried"] = out.prompt_logprobs, r["carried"] + 1
    r["cached"] = out.cached_tokens


def assert_matches_reference(entries: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """entries[i] == TokenLogprob(ids[i], ref[i - 1, ids[i]], top k of ref[i - 1]); entry 0 is None."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        e = entries[i]
        assert isinstance(e, TokenLogprob) and e.token_id == ids[i]
        assert abs(e.logprob - ref[i - 1, ids[i]].item()) < ATOL, i
        assert len(e.top) == k
        if k:
            lps = torch.tensor([lp for _, lp in e.top], dtype=torch.float64)
            torch.testing.assert_close(lps, ref[i - 1].topk(k).values, atol=ATOL, rtol=0)
            for token, lp in e.top:  # the ids are the reference's (ties aside: same value at that id)
                assert abs(ref[i - 1, token].item() - lp) < ATOL


# ---------------------------------------------------------------- prompt logprobs
@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("budget", [2048, 16], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_match_transformers(tiny_model_dir, hf_logprobs, k, budget):
    engine = make_engine(tiny_model_dir, block_size=4, max_num_batched_tokens=budget)
    ids = prompt(70, seed=k)
    other = prompt(23, seed=9)  # a neighbour without prompt logprobs shares the steps
    requests = [
        (ids, SamplingParams(max_tokens=3, prompt_logprobs=k, **GREEDY)),
        (other, SamplingParams(max_tokens=3, **GREEDY)),
    ]
    res = run(engine, requests)
    mine, neighbour = res.values()
    assert mine["carried"] == 1 and neighbour["carried"] == 0
    assert_matches_reference(mine["prompt"], ids, hf_logprobs(ids), k)
    assert len(mine["tokens"][0]) == 3


def test_n_samples_get_one_list_per_request(tiny_model_dir, hf_logprobs):
    engine = make_engine(tiny_model_dir, block_size=4, max_num_batched_tokens=16)
    ids = prompt(30, seed=4)
    (r,) = run(engine, [(ids, SamplingParams(n=3, max_tokens=4, prompt_logprobs=2, seed=1))]).values()
    assert r["carried"] == 1 and sorted(r["tokens"]) == [0, 1, 2]
    assert_matches_reference(r["prompt"], ids, hf_logprobs(ids), 2)


def test_prefix_cache_hit_does_not_lose_prompt_logprobs(tiny_model_dir):
    ids = prompt(41, seed=5)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY)
    (uncached,) = run(make_engine(tiny_model_dir, block_size=4), [(ids, params)]).values()
    engine = make_engine(tiny_model_dir, block_size=4)
    (warm,) = run(engine, [(ids, SamplingParams(max_tokens=2, **GREEDY))]).values()
    (scored,) = run(engine, [(ids, params)]).values()
    assert warm["prompt"] is None
    assert scored["cached"] == 0  # took no cached blocks: every position was computed
    assert scored["prompt"] == uncached["prompt"]
    assert scored["tokens"] == uncached["tokens"]
    (again,) = run(engine, [(ids, SamplingParams(max_tokens=2, **GREEDY))]).values()
    assert again["cached"] == 40  # the prompt's blocks are still published for others


def test_preempted_requests_emit_prompt_logprobs_once(tiny_model_dir, hf_logprobs, reference):
    engine = make_engine(tiny_model_dir, block_size=4, num_blocks=24, max_num_batched_tokens=32)
    prompts = [prompt(30 + 7 * i, seed=20 + i) for i in range(4)]
    res = run(engine, [(p, SamplingParams(max_tokens=24, prompt_logprobs=1, **GREEDY)) for p in prompts])
    assert engine.scheduler.num_preemptions > 0
    for p, r in zip(prompts, res.values(), strict=True):
        assert r["carried"] == 1
        assert_matches_reference(r["prompt"], p, hf_logprobs(p), 1)
        assert r["tokens"][0] == reference.greedy(p, 24)
    assert engine.audit() == []


# ---------------------------------------------------------------- max_tokens = 0
def test_max_tokens_zero_scores_the_prompt_only(tiny_model_dir, hf_logprobs):
    engine = make_engine(tiny_model_dir, block_size=4, max_num_batched_tokens=16)
    ids = prompt(37, seed=7)
    res = run(
        engine,
        [
            (ids, SamplingParams(max_tokens=0, prompt_logprobs=2, logprobs=2, temperature=0.0)),
            (ids[:9], SamplingParams(max_tokens=0, n=2)),
            ([5], SamplingParams(max_tokens=0, prompt_logprobs=0)),
            (ids[:5], SamplingParams(max_tokens=3, **GREEDY)),
        ],
    )
    scored, pair, single, normal = res.values()
    assert scored["tokens"] == {0: []} and scored["finish"] == {0: "length"}
    assert scored["logprobs"].get(0, []) == []
    assert_matches_reference(scored["prompt"], ids, hf_logprobs(ids), 2)
    assert pair["tokens"] == {0: [], 1: []} and pair["finish"] == {0: "length", 1: "length"}
    assert pair["prompt"] is None
    assert single["prompt"] == [None] and single["finish"] == {0: "length"}
    assert len(normal["tokens"][0]) == 3
    assert engine.audit() == [] and engine.get_stats()["generation_tokens_total"] == 3


@pytest.mark.parametrize("k", [0, 2])
def test_one_token_prompt_alone(tiny_model_dir, k):
    """Nothing to score (entry 0 only): the step has a scored chunk with no rows."""
    engine = make_engine(tiny_model_dir)
    for max_tokens in (0, 2):
        (r,) = run(
            engine, [([42], SamplingParams(max_tokens=max_tokens, prompt_logprobs=k, **GREEDY))]
        ).values()
        assert r["prompt"] == [None] and r["carried"] == 1
        assert r["finish"] == {0: "length"} and len(r["tokens"][0]) == max_tokens


def test_max_tokens_zero_offline_generate(tiny_model_dir, hf_logprobs):
    llm = LLM(str(tiny_model_dir), dtype="float64", device="cpu")
    ids = prompt(12, seed=8)
    (result,) = llm.generate([ids], SamplingParams(max_tokens=0))
    assert result.outputs[0].token_ids == [] and result.outputs[0].text == ""
    assert result.outputs[0].finish_reason == "length" and result.prompt_logprobs is None
    (scored,) = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert_matches_reference(scored.prompt_logprobs, ids, hf_logprobs(ids), 2)


# ---------------------------------------------------------------- through the engine core
class Sink:
    def __init__(self) -> None:
        self.results: dict[str, dict] = {}
        self.done: dict[str, threading.Event] = {}
        self.lock = threading.RLock()  # the reader thread makes events while holding it

    def __call__(self, outputs) -> None:
        with self.lock:
            for out in outputs:
                r = self.results.setdefault(
                    out.request_id, {"tokens": {}, "finish": {}, "logprobs": {}, "prompt": None, "carried": 0}
                )
                absorb(r, out)
                if out.finished:
                    self.event(out.request_id).set()

    def event(self, rid: str) -> threading.Event:
        with self.lock:
            return self.done.setdefault(rid, threading.Event())


def test_engine_core_carries_prompt_logprobs_as_offline(tiny_model_dir):
    options = dict(dtype="float64", device="cpu", block_size=4, max_num_batched_tokens=16)
    cases = [
        (prompt(45, seed=11), SamplingParams(max_tokens=4, prompt_logprobs=3, **GREEDY)),
        (prompt(20, seed=12), SamplingParams(max_tokens=0, prompt_logprobs=0)),
        (prompt(20, seed=13), SamplingParams(max_tokens=0)),
        (prompt(9, seed=14), SamplingParams(max_tokens=3, logit_bias={77: 100.0}, **GREEDY)),
    ]
    engine = make_engine(tiny_model_dir, block_size=4, max_num_batched_tokens=16)
    offline = [next(iter(run(engine, [case]).values())) for case in cases]
    sink = Sink()
    client = CoreClient(EngineConfig.from_kwargs(str(tiny_model_dir), **options), sink)
    try:
        for (ids, params), expected in zip(cases, offline, strict=True):
            rid = client.submit(ids, params)  # one at a time: the same batches as offline
            assert sink.event(rid).wait(60), f"no final output for {rid}"
            got = sink.results[rid]
            assert got["carried"] == expected["carried"] <= 1
            assert got["tokens"] == expected["tokens"] and got["finish"] == expected["finish"]
            assert got["prompt"] == expected["prompt"]
    finally:
        client.shutdown()
    assert offline[3]["tokens"] == {0: [77, 77, 77]}
    assert offline[1]["tokens"] == {0: []} and offline[1]["prompt"] is not None


# ---------------------------------------------------------------- logit_bias
def test_positive_bias_forces_the_token(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    ids = prompt(10, seed=15)
    greedy, sampled = run(
        engine,
        [
            (ids, SamplingParams(max_tokens=5, logit_bias={321: 100.0}, **GREEDY)),
            (
                ids,
                SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True, logit_bias={321: 100}),
            ),
        ],
    ).values()
    assert greedy["tokens"][0] == [321] * 5
    assert sampled["tokens"][0] == [321] * 5


def test_negative_bias_on_the_greedy_token_gives_the_second_choice(tiny_model_dir, reference):
    ids = prompt(10, seed=16)
    first, second = reference.next_logits(ids).topk(2).indices.tolist()
    # the naive recompute with the bias added by hand to every step's logits
    expected, seq = [], list(ids)
    for _ in range(4):
        logits = reference.next_logits(seq).clone()
        logits[first] -= 100.0
        expected.append(int(logits.argmax()))
        seq.append(expected[-1])
    (r,) = run(
        make_engine(tiny_model_dir), [(ids, SamplingParams(max_tokens=4, logit_bias={first: -100}, **GREEDY))]
    ).values()
    assert r["tokens"][0][0] == second
    assert r["tokens"][0] == expected


def test_unbiased_neighbours_are_unchanged(tiny_model_dir):
    others = [
        (prompt(12, seed=17), SamplingParams(max_tokens=6, **GREEDY)),
        (
            prompt(15, seed=18),
            SamplingParams(max_tokens=6, temperature=0.8, top_k=50, seed=5, ignore_eos=True),
        ),
        (prompt(9, seed=19), SamplingParams(max_tokens=6, logprobs=2, presence_penalty=0.5, **GREEDY)),
    ]
    biased = [
        (prompt(11, seed=20), SamplingParams(max_tokens=6, logit_bias={3: 100, 4: -50}, **GREEDY)),
        (prompt(8, seed=21), SamplingParams(max_tokens=6, temperature=1.0, seed=2, logit_bias={9: 100})),
    ]
    alone = list(run(make_engine(tiny_model_dir), others).values())
    mixed = list(run(make_engine(tiny_model_dir), biased + others).values())
    assert mixed[0]["tokens"][0] == [3] * 6 and mixed[1]["tokens"][0] == [9] * 6
    for a, m in zip(alone, mixed[2:], strict=True):
        assert a["tokens"] == m["tokens"]
        for la, lm in zip(a["logprobs"].get(0, []), m["logprobs"].get(0, []), strict=True):
            assert la.token_id == lm.token_id and abs(la.logprob - lm.logprob) < 1e-6


# ---------------------------------------------------------------- validation and cost
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt_logprobs=MAX_TOP_LOGPROBS + 1), "prompt_logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(prompt_logprobs="3"), "prompt_logprobs"),
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={5: -101}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(max_tokens=-1), "max_tokens"),
    ],
)
def test_validation_errors_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and str(err.value).startswith(field)


def test_logit_bias_keys_and_empty_bias():
    assert SamplingParams(logit_bias={"50": 2, 7: -1.5}).logit_bias == {50: 2.0, 7: -1.5}
    assert SamplingParams(logit_bias={}).logit_bias is None  # nothing to apply: costs nothing


def test_bias_token_outside_the_vocabulary_is_refused(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    vocab = engine.limits.vocab_size
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request([1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    assert err.value.field == "logit_bias"
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, logit_bias={vocab - 1: 1.0}))


def test_requests_without_the_features_never_reach_their_code(tiny_model_dir, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("called for a step that does not need it")

    monkeypatch.setattr(Sampler, "score_prompt", forbidden)
    monkeypatch.setattr(Sampler, "_apply_bias", forbidden)
    engine = make_engine(tiny_model_dir, block_size=4, max_num_batched_tokens=16)
    res = run(
        engine,
        [
            (prompt(40, seed=30), SamplingParams(max_tokens=4, **GREEDY)),
            (prompt(20, seed=31), SamplingParams(max_tokens=4, temperature=0.7, seed=1, logprobs=1)),
            (prompt(20, seed=32), SamplingParams(max_tokens=4, repetition_penalty=1.2, **GREEDY)),
        ],
    )
    assert all(len(r["tokens"][0]) == 4 and r["prompt"] is None for r in res.values())


# ---------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prompt_logprobs_and_bias_beside_graph_decodes(tiny_model_dir, hf_logprobs):
    """fp32 on the GPU with CUDA-graph decodes running: chunked prompt scoring (Triton prefill), a
    one-token score-only prompt in a decode-shaped step, and a biased request."""
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            str(tiny_model_dir), dtype="float32", device="cuda", max_num_batched_tokens=64, num_blocks=200
        )
    )
    assert engine.runner.graphs is not None
    decoders = [
        engine.add_request(prompt(8, seed=40 + i), SamplingParams(max_tokens=30, **GREEDY)) for i in range(4)
    ]
    for _ in range(3):
        engine.step()
    ids = prompt(150, seed=41)
    res = run(
        engine,
        [
            (ids, SamplingParams(max_tokens=5, prompt_logprobs=3, **GREEDY)),
            ([17], SamplingParams(max_tokens=0, prompt_logprobs=2)),
            (
                prompt(6, seed=42),
                SamplingParams(max_tokens=6, logit_bias={555: 100}, temperature=0.9, seed=1),
            ),
        ],
    )
    scored, single, biased = res.values()
    ref = hf_logprobs(ids)
    entries = scored["prompt"]
    assert scored["carried"] == 1 and len(entries) == len(ids) and entries[0] is None
    got = torch.tensor([e.logprob for e in entries[1:]], dtype=torch.float64)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    for i, e in enumerate(entries[1:], start=1):
        assert len(e.top) == 3 and all(abs(ref[i - 1, t].item() - lp) < 2e-3 for t, lp in e.top)
    assert single["prompt"] == [None] and single["tokens"] == {0: []} and single["finish"] == {0: "length"}
    assert biased["tokens"][0] == [555] * 6
    assert not any(engine.state.requests.get(d) for d in decoders) and engine.audit() == []
