"""Speculative decoding through the whole engine (n-gram and draft-model proposers) against references
that do not speculate.

* Greedy: a mixed batch (prompt lengths, shared prefixes under prefix caching, n=2, chunked prefill
  beside speculating rows) and a KV pool small enough to force preemption emit exactly what the same
  engine config emits without speculation; the KV audit is clean afterwards.
* Sampling (temperature 1, top-k 8): the pair (token0, token1) of N seeded requests, token1 being the
  first position that speculation verifies, follows the exact target distribution p(t0) p(t1 | t0)
  computed by transformers in float64. Pearson's chi-square goodness-of-fit test (cells with expected
  count < 5 pooled) at false-alarm rate 1e-4 per case; the seeds are fixed, so the outcome is
  deterministic. Drafts: another random model (seed 7: its top 8 never meets the target's, so every
  proposal is rejected and the residual draws), the target's weights plus noise (top-8 sets overlap in
  part: acceptances and residual draws), and n-gram lookup on a prompt built so that proposals land in
  the target's support (one-hot q).
* Seeded sampled requests give the same tokens alone, inside a batch, and in a second run.
* Bad speculative configs raise ValueError naming the field; the low-acceptance cut-off and
  disable_by_batch_size stop proposals.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from scripts.make_model import make_model
from scripts.model_shapes import get_spec
from tests.stats import chi_square_p

pytestmark = pytest.mark.engine
ALPHA = 1e-4
K = 2  # proposals per step
TOP_K = 8
N_SAMPLES = 2000


@pytest.fixture(scope="module")
def drafts(tiny_model_dir, tmp_path_factory):
    """self: the target itself; seed7: another random tiny model; near: the target plus weight noise."""
    root = tmp_path_factory.mktemp("drafts")
    near = shutil.copytree(tiny_model_dir, root / "near")
    g = torch.Generator().manual_seed(3)
    w = load_file(near / "model.safetensors")
    w = {k: v + 0.2 * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v for k, v in w.items()}
    save_file(w, str(near / "model.safetensors"), metadata={"format": "pt"})
    return {"self": tiny_model_dir, "seed7": make_model("tiny", root / "seed7", seed=7), "near": near}


def spec(drafts, method: str, **kw) -> dict:
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 1,
            **kw,
        }
    return {"method": "draft_model", "model": str(drafts[method]), "num_speculative_tokens": K, **kw}


def make_llm(model_dir, speculative=None, **kw) -> LLM:
    return LLM(str(model_dir), speculative_config=speculative, dtype="float64", device="cpu", **kw)


def generate(llm: LLM, prompts, params) -> list[list[list[int]]]:
    """Every sample's token ids per request; the KV audit must be clean and every block free after."""
    results = llm.generate(prompts, params)
    assert llm.engine.audit() == []
    assert llm.engine.block_manager.num_used == 0
    return [[o.token_ids for o in r.outputs] for r in results]


def run_metrics(llm: LLM, prompts, params) -> dict[str, object]:
    """Drive the engine by hand; each request's final RequestMetrics, keyed by request id."""
    for prompt, p in zip(prompts, params, strict=True):
        llm.engine.add_request(prompt, p)
    metrics = {}
    while llm.engine.has_unfinished():
        metrics.update({o.request_id: o.metrics for o in llm.engine.step() if o.finished})
    return metrics


# ---------------------------------------------------------------------- 1. greedy equality
def mixed_batch(vocab: int):
    rng = random.Random(5)

    def seg(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    shared, a, b = seg(12) * 3, seg(7), seg(5)
    prompts = [shared + a * 3, shared + seg(20), b * 4 + seg(3), seg(50) + a * 4 + seg(10), shared, seg(3)]
    ns, lens = [2, 1, 2, 1, 1, 2], [40, 20, 33, 25, 30, 40]
    return prompts, [
        SamplingParams(n=n, max_tokens=m, temperature=0.0, ignore_eos=True) for n, m in zip(ns, lens)
    ]


SCENARIOS = {
    "chunked": dict(block_size=8, max_num_batched_tokens=32, max_num_seqs=16, enable_prefix_caching=True),
    "preempt": dict(block_size=4, num_blocks=40, max_num_batched_tokens=64, enable_prefix_caching=True),
}


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    prompts, params = mixed_batch(vocab)
    return (
        prompts,
        params,
        {s: generate(make_llm(tiny_model_dir, **kw), prompts, params) for s, kw in SCENARIOS.items()},
    )


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("method", ["ngram", "self", "seed7"])
def test_greedy_matches_plain_decoding(tiny_model_dir, drafts, plain_outputs, method, scenario):
    prompts, params, plain = plain_outputs
    llm = make_llm(tiny_model_dir, spec(drafts, method, disable_below_acceptance=0.0), **SCENARIOS[scenario])
    schedule, mixed_steps = llm.engine.scheduler.schedule, []

    def spy():  # steps holding both a verifying decode and a prompt chunk
        out = schedule()
        mixed_steps.append(
            any(c.num_draft for c in out.chunks) and any(c.num_tokens > K + 1 for c in out.chunks)
        )
        return out

    llm.engine.scheduler.schedule = spy
    got = generate(llm, prompts, params)
    assert [[len(s) for s in r] for r in got] == [[p.max_tokens] * p.n for p in params]
    assert got == plain[scenario]
    stats = llm.engine.get_stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_verify_rows"] > 0
    assert stats["prefix_cache_hit_rate"] > 0 and any(mixed_steps)
    if method == "ngram":
        assert stats["spec_accepted_tokens"] > 0
    if method == "self":  # the draft is the target: greedy proposals are its argmaxes, all accepted
        assert stats["spec_acceptance_rate"] == 1.0
    if scenario == "preempt":
        assert stats["num_preemptions"] > 0


# ---------------------------------------------------------------------- 2. distribution
@pytest.fixture(scope="module")
def target_pairs(tiny_model_dir):
    """(prompt, {(t0, t1): probability}): the target's exact pair distribution at temperature 1, top-k 8.

    The prompt ends in a fixed tail; before it, each likely t0 followed by the target's argmax after t0
    (a fixed point, found in a few rounds), so an n-gram lookup proposes a token of the target's support."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64).eval()

    @torch.no_grad()
    def top(ids: list[int]) -> tuple[list[int], torch.Tensor]:
        vals, idx = hf(torch.tensor([ids])).logits[0, -1].topk(TOP_K + 1)
        assert vals[TOP_K - 1] - vals[TOP_K] > 1e-5, "a near tie at the top-k cut: change the prompt"
        return idx[:TOP_K].tolist(), vals[:TOP_K].softmax(-1)

    pairs: dict[int, int] = {}
    for _ in range(7):
        prompt = [t for pair in pairs.items() for t in pair] + [77, 5, 1000]
        for t0 in top(prompt)[0]:
            pairs[t0] = top(prompt + [t0])[0][0]
    t0s, p0 = top(prompt)
    table = {}
    for t0, p in zip(t0s, p0.tolist()):
        t1s, p1 = top(prompt + [t0])
        table.update({(t0, t1): p * q for t1, q in zip(t1s, p1.tolist())})
    return prompt, table


@pytest.mark.parametrize("method", ["near", "seed7", "ngram"])
def test_first_verified_position_follows_the_target(tiny_model_dir, drafts, target_pairs, method):
    prompt, table = target_pairs
    llm = make_llm(
        tiny_model_dir,
        spec(drafts, method, disable_below_acceptance=0.0),
        max_num_seqs=N_SAMPLES,
        max_waiting=N_SAMPLES,
        max_num_batched_tokens=N_SAMPLES * (len(prompt) + K + 1),
    )
    params = [SamplingParams(max_tokens=3, top_k=TOP_K, seed=i, ignore_eos=True) for i in range(N_SAMPLES)]
    outs = generate(llm, [prompt] * N_SAMPLES, params)
    counts: dict[tuple[int, int], int] = {}
    for ((t0, t1, _),) in outs:
        counts[t0, t1] = counts.get((t0, t1), 0) + 1
    assert set(counts) <= set(table), "a pair outside the target's top-k support"
    cells = list(table)
    p = chi_square_p([counts.get(c, 0) for c in cells], [N_SAMPLES * table[c] for c in cells])
    assert p > ALPHA, f"chi-square p = {p:.2e}"
    stats = llm.engine.get_stats()
    # each request verifies token1 (and token2 if x0 is accepted) in one row; n-gram: where a proposal exists
    assert stats["spec_verify_rows"] == N_SAMPLES or (
        method == "ngram" and stats["spec_verify_rows"] > 0.5 * N_SAMPLES
    )
    if method != "seed7":  # seed 7's top 8 is disjoint from the target's: it is all residual draws
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


# ---------------------------------------------------------------------- 3. seeded reproducibility
@pytest.mark.parametrize("method", ["ngram", "near"])
def test_seeded_sampling_ignores_the_batch(tiny_model_dir, drafts, method):
    rng = random.Random(9)
    seg = [rng.randrange(2000) for _ in range(6)]
    prompt = seg * 4 + [rng.randrange(2000) for _ in range(5)]
    params = SamplingParams(
        n=2, max_tokens=24, temperature=0.8, top_k=20, seed=11, ignore_eos=True, repetition_penalty=1.1
    )
    cfg = spec(drafts, method, disable_below_acceptance=0.0)
    alone = generate(make_llm(tiny_model_dir, cfg), [prompt], [params])[0]
    assert alone[0] != alone[1], "the n samples of a seeded request must differ"
    crowd = [[rng.randrange(2000) for _ in range(rng.randint(3, 60))] + seg * 2 for _ in range(6)]
    # (n, temperature, seed) of the crowd; unseeded sampled requests draw from engine-specific streams
    kinds = [(1, 0.0, None), (2, 1.0, 1), (1, 1.0, None), (2, 0.0, 3), (1, 1.0, None), (2, 1.0, 5)]
    crowd_params = [
        SamplingParams(n=n, max_tokens=10 + 3 * i, temperature=t, seed=s, ignore_eos=True)
        for i, (n, t, s) in enumerate(kinds)
    ]
    batch = crowd_params[:3] + [params] + crowd_params[3:]
    runs = []
    for _ in range(2):
        llm = make_llm(tiny_model_dir, cfg, block_size=8, max_num_batched_tokens=64)
        runs.append(generate(llm, crowd[:3] + [prompt] + crowd[3:], batch))
        assert llm.engine.get_stats()["spec_accepted_tokens"] > 0
    assert runs[0][3] == alone
    fixed = [i for i, p in enumerate(batch) if p.seed is not None or p.temperature == 0.0]
    assert [runs[1][i] for i in fixed] == [runs[0][i] for i in fixed]


# ---------------------------------------------------------------------- 4. bad configs
@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory):
    small = dataclasses.replace(get_spec("tiny"), name="tiny-v1000", vocab_size=1000)
    return make_model(small, tmp_path_factory.mktemp("vocab1000"))


BAD = {  # case: (speculative_config, the field its error must name); "{vocab}", "{absent}": draft paths
    "unknown_key": ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup": 3}, "prompt_lookup"),
    "zero_k": ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    "vocab": ({"method": "draft_model", "num_speculative_tokens": 2, "model": "{vocab}"}, "model"),
    "missing": ({"method": "draft_model", "num_speculative_tokens": 2, "model": "{absent}"}, "model"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_configs_name_the_field(tiny_model_dir, other_vocab_dir, tmp_path, case):
    cfg, field = BAD[case]
    paths = {"vocab": other_vocab_dir, "absent": tmp_path / "absent"}
    cfg = {k: v.format(**paths) if isinstance(v, str) else v for k, v in cfg.items()}
    if cfg["method"] == "ngram":  # caught before any model loads
        with pytest.raises(ValueError, match=rf"speculative_config\.{field}: "):
            EngineConfig.from_kwargs(str(tiny_model_dir), speculative_config=cfg)
    with pytest.raises(ValueError, match=rf"speculative_config\.{field}: "):
        make_llm(tiny_model_dir, cfg)


# ---------------------------------------------------------------------- 5. when speculation stops
def test_low_acceptance_stops_speculating(tiny_model_dir, drafts):
    rng = random.Random(3)
    prompts = [[rng.randrange(2000) for _ in range(10 + 7 * i)] for i in range(3)]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 3
    window = 6
    cut, never = (
        make_llm(tiny_model_dir, spec(drafts, "seed7", acceptance_window=window, disable_below_acceptance=r))
        for r in (0.5, 0.0)
    )
    for m in run_metrics(cut, prompts, params).values():  # K proposals a step until `window` is reached
        assert window <= m.spec_draft_tokens <= window + K - 1
        assert m.spec_accepted_tokens < 0.5 * m.spec_draft_tokens
    assert all(m.spec_draft_tokens > 3 * window for m in run_metrics(never, prompts, params).values())
    assert generate(cut, prompts, params) == generate(never, prompts, params)


def test_batch_size_limit_stops_proposals(tiny_model_dir, drafts):
    rng = random.Random(4)
    prompts = [[rng.randrange(2000) for _ in range(10)] for _ in range(3)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (8, 8, 30)]
    llm = make_llm(tiny_model_dir, spec(drafts, "self", disable_by_batch_size=1))
    engine = llm.engine
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    metrics, drafted_alone = {}, 0
    while engine.has_unfinished():
        before = engine.get_stats()
        outs = engine.step()
        new = engine.get_stats()["spec_draft_tokens"] - before["spec_draft_tokens"]
        if before["num_running"] + before["num_waiting"] > 1:
            assert new == 0, "proposals while more sequences than disable_by_batch_size ran"
        drafted_alone += new
        metrics.update({o.request_id: o.metrics for o in outs if o.finished})
    assert [metrics[i].spec_draft_tokens for i in ids[:2]] == [0, 0]
    assert drafted_alone > 0  # the long request speculates once it runs alone
    assert engine.audit() == []


# ---------------------------------------------------------------------- 6. benchmarks' synthetic acceptance
def test_synthetic_acceptance_meets_the_same_coins_for_every_proposer_and_batch(tiny_model_dir, drafts):
    """spec_bench compares proposers at one synthetic rate: each proposal's coin is keyed by its request
    and position, so n-gram with the requests together or one at a time accepts exactly the same
    proposals of each request, and a draft model the same up to its last step; the rate is near alpha."""
    rng = random.Random(6)
    prompts = [[rng.randrange(2000) for _ in range(12 + 5 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    cfg = dict(synthetic_acceptance_rate=0.6, disable_below_acceptance=0.0)

    def counts(method: str, together: bool) -> list[tuple[int, int]]:
        engine = make_llm(tiny_model_dir, spec(drafts, method, **cfg)).engine
        groups = [prompts] if together else [[p] for p in prompts]
        ids, metrics = [], {}
        for group in groups:
            ids += [engine.add_request(p, params) for p in group]
            while engine.has_unfinished():
                metrics.update({o.request_id: o.metrics for o in engine.step() if o.finished})
        return [(metrics[i].spec_draft_tokens, metrics[i].spec_accepted_tokens) for i in ids]

    ngram = counts("ngram", together=True)
    assert counts("ngram", together=False) == ngram
    # a draft model proposes k at a request's last step, where n-gram proposes only up to max_tokens:
    # one more proposal there, which its coin may keep; every earlier step meets the same coins
    for (d1, a1), (d2, a2) in zip(counts("seed7", together=True), ngram, strict=True):
        assert d1 - d2 in (0, 1) and a1 - a2 in (0, 1)
    drafted, accepted = (sum(c[j] for c in ngram) for j in (0, 1))
    assert drafted > 100 and 0.45 < accepted / drafted < 0.75
