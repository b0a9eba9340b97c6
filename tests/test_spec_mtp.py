"""Self-speculation with a gated LoRA (speculative_config method gated_lora_mtp) through the whole engine.

* Greedy: the mixed batch of test_spec_engine (prompt lengths, shared prefixes, n=2, chunked prefill
  beside speculating rows, a pool small enough to preempt) emits exactly what plain decoding emits, with
  the random head of scripts/make_mtp (its drafts are almost never right) and with an oracle drafter
  that proposes the plain run's own continuation with some tokens corrupted (acceptances, rejections
  mid-chunk, and the KV of accepted proposals kept). The audit is clean afterwards.
* The gate: at the real rows of an MTP chunk, hidden states are bit-identical with the gated LoRA on
  and off; at the mask rows they differ. Folded into the base projections (as on CUDA), it keeps the
  greedy output and drafts what the separate shrink drafts.
* Drafting: the drafts of every verified chunk equal a recompute written another way: the sequence up to
  its last kept real token followed by k mask rows as one causal sequence without a KV cache (no
  visibility rule, no scratch slots), then the sampler head token by token from the bonus token.
* Sampling (temperature 1, top-k 3): the first position verified against a real proposal is the third
  output token; the triple (t0, t1, t2) of N seeded requests follows the target's exact distribution
  (transformers, float64), by Pearson's chi-square test at false-alarm rate 1e-4; with the acceptance
  rule broken (every proposal accepted) the same test fails.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from engine import LLM
from engine.lora.layers import LoRALinear
from engine.models.attention_context import AttentionMetadata, attention_context
from engine.runner import mtp_setup
from engine.sampling_params import SamplingParams
from scripts.make_mtp import write_mtp_dir
from tests.stats import chi_square_p
from tests.test_spec_engine import SCENARIOS, generate, make_llm, mixed_batch

pytestmark = pytest.mark.engine
K = 3
ALPHA = 1e-4
TOP_K = 3  # 27 cells of (t0, t1, t2): each expects ~22 of the N samples
N_SAMPLES = 600


@pytest.fixture(scope="module")
def mtp_dir(tiny_model_dir, tmp_path_factory):
    return write_mtp_dir(tmp_path_factory.mktemp("mtp") / "head", tiny_model_dir, num_mask_tokens=4, rank=8)


@pytest.fixture(scope="module")
def vocab_dir(tiny_model_dir, tmp_path_factory):
    """A head that drafts among a quarter of the vocabulary (draft_token_ids)."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    out = tmp_path_factory.mktemp("mtp") / "vocab"
    return write_mtp_dir(out, tiny_model_dir, num_mask_tokens=4, rank=8, draft_vocab_size=vocab // 4)


def mtp(mtp_dir, **kw) -> dict:
    """The engine's config; every running sequence speculates (no batch cut-off) unless kw says."""
    cfg = {"method": "gated_lora_mtp", "num_speculative_tokens": K, "model": str(mtp_dir)}
    return {**cfg, "disable_by_batch_size": 1 << 16, **kw}


def with_drafts(llm, future) -> None:
    """Replace the engine's drafts by future(seq, kept proposals, bonus token) -> k ids (the head still
    runs); the proposals of the next step are then whatever `future` says."""
    step = llm.engine.runner.mtp
    real = step.drafter

    def drafter(batch, hidden):
        inner, seqs = real(batch, hidden), list(batch.spec_samplers)

        def draft(accepted, bonus):
            inner(accepted, bonus)
            rows = [future(s, a, b) for s, a, b in zip(seqs, accepted.tolist(), bonus.tolist())]
            return torch.tensor(rows, dtype=torch.long)

        return draft

    step.drafter = drafter


def recording_drafts(llm: LLM) -> list[list[list[int]]]:
    """Record the head's drafts of every MTP step (the list fills as the engine runs)."""
    step, record = llm.engine.runner.mtp, []
    real = step.drafter

    def drafter(batch, hidden):
        inner = real(batch, hidden)

        def draft(accepted, bonus):
            out = inner(accepted, bonus)
            record.append(out.tolist())
            return out

        return draft

    step.drafter = drafter
    return record


@pytest.fixture(scope="module")
def plain_runs(tiny_model_dir):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    prompts, params = mixed_batch(vocab)
    runs = {s: generate(make_llm(tiny_model_dir, **kw), prompts, params) for s, kw in SCENARIOS.items()}
    return prompts, params, runs, vocab


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("drafts", ["head", "oracle"])
def test_greedy_matches_plain_decoding(tiny_model_dir, mtp_dir, plain_runs, drafts, scenario):
    prompts, params, plain, vocab = plain_runs
    llm = make_llm(tiny_model_dir, mtp(mtp_dir, disable_below_acceptance=0.0), **SCENARIOS[scenario])
    if drafts == "oracle":
        full = {tuple(p): p + out[0] for p, out in zip(prompts, plain[scenario])}
        rng = random.Random(3)

        def future(seq, kept, bonus):
            at = seq.num_computed + kept + 2  # the index the first draft will take
            ids = (full[tuple(seq.request.prompt_ids)][at : at + K] + [0] * K)[:K]
            return [(t + 1) % vocab if rng.random() < 0.2 else t for t in ids]

        with_drafts(llm, future)
    got = generate(llm, prompts, params)
    assert got == plain[scenario]
    stats = llm.engine.get_stats()
    assert stats["spec_verify_rows"] > 0 and stats["prefix_cache_hit_rate"] > 0
    if drafts == "oracle":  # most proposals right, some not: both paths taken, often within one chunk
        assert 0.3 * stats["spec_draft_tokens"] < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    if scenario == "preempt":
        assert stats["num_preemptions"] > 0


def test_the_gate_leaves_real_rows_bit_identical(tiny_model_dir, mtp_dir):
    llm = make_llm(tiny_model_dir, mtp(mtp_dir, disable_below_acceptance=0.0), block_size=4)
    step, seen = llm.engine.runner.mtp, []
    forward = step.forward

    def both(batch, block_size):
        hidden = forward(batch, block_size).clone()
        slots = batch.lora_slots
        batch.lora_slots = [-1] * len(slots)  # the same step with the gate closed everywhere
        off = forward(batch, block_size).clone()
        batch.lora_slots = slots
        seen.append((batch.mask_rows, hidden, off))
        return hidden

    step.forward = both
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([list(range(5, 30)), [9, 8, 7, 6]], params)
    assert len(seen) > 3
    for masks, on, off in seen:
        real = [r for r in range(on.shape[0]) if r not in set(masks)]
        assert torch.equal(on[real], off[real])
        assert not torch.allclose(on[masks], off[masks])


def test_a_folded_gate_keeps_greedy_output_and_drafts(tiny_model_dir, mtp_dir, plain_runs, monkeypatch):
    """The gate folded into the base projections (what CUDA runs, forced here on the CPU): the greedy
    output of plain decoding, and the drafts of the unfolded gate on the same steps."""
    prompts, params, plain, _ = plain_runs
    drafts = {}
    for fold in (False, True):
        if fold:
            monkeypatch.setattr(mtp_setup, "FOLD_DEVICES", ("cuda", "cpu"))
        llm = make_llm(tiny_model_dir, mtp(mtp_dir, disable_below_acceptance=0.0), **SCENARIOS["chunked"])
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, LoRALinear)]
        assert layers and all((m.stacked is not None) == fold for m in layers)
        drafts[fold] = recording_drafts(llm)
        assert generate(llm, prompts, params) == plain["chunked"]
    assert len(drafts[True]) > 10 and drafts[True] == drafts[False]


def reference_drafts(model, head, slot: int, tokens: list[int], bonus: int) -> list[int]:
    """The k drafts after `tokens` (the sequence up to its last kept real token) and `bonus`, from a
    cache-free causal forward of tokens + k mask rows."""
    n = len(tokens)
    ids = torch.tensor(tokens + [0] * K)
    meta = AttentionMetadata.for_full_sequences([n + K])
    meta.lora_slots = torch.tensor([-1] * n + [slot] * K, dtype=torch.int32)
    meta.embed_rows = (torch.arange(n, n + K), head.mask_embeddings[:K])
    with torch.inference_mode(), attention_context(meta):
        hidden = model(ids, torch.arange(n + K))[n:]
        prev, out = torch.tensor([bonus]), []
        for i in range(K):
            prev = head.draft(hidden[i : i + 1], prev, model.embed, model.compute_logits)
            out.append(int(prev))
    return out


@pytest.mark.parametrize("head", ["whole vocabulary", "draft vocabulary", "draft vocabulary, fp8"])
def test_drafts_equal_a_causal_recompute(tiny_model_dir, mtp_dir, vocab_dir, head):
    path = vocab_dir if head.startswith("draft vocabulary") else mtp_dir
    quantization = "fp8" if head.endswith("fp8") else None
    llm = make_llm(
        tiny_model_dir, mtp(path, disable_below_acceptance=0.0, quantization=quantization), block_size=4
    )
    runner, checked = llm.engine.runner, []
    ids = runner.mtp_head.draft_token_ids
    assert (ids is None) == (head == "whole vocabulary") and (runner.mtp_head.draft_weight is None) == (
        ids is None
    )
    assert (runner.mtp.chain is None) == (ids is None)  # a draft vocabulary drafts through DraftChain

    def future(seq, kept, bonus):
        tokens = seq.token_ids[: seq.num_computed + 1] + seq.draft[:kept]
        want = reference_drafts(runner.model, runner.mtp_head, runner.mtp_lora_slot, tokens, bonus)
        checked.append(want)
        return want  # the engine's own drafts are compared in `inner` below

    step, real = runner.mtp, runner.mtp.drafter

    def drafter(batch, hidden):
        inner, seqs = real(batch, hidden), list(batch.spec_samplers)

        def draft(accepted, bonus):
            got = inner(accepted, bonus)
            rows = [future(s, a, b) for s, a, b in zip(seqs, accepted.tolist(), bonus.tolist())]
            assert got.tolist() == rows
            return got

        return draft

    step.drafter = drafter
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm.generate([list(range(40, 70)), [3, 1, 4, 1, 5], list(range(7, 19))], params)
    assert len(checked) >= 9
    if ids is not None:  # every draft is a token of the draft vocabulary
        assert set(t for row in checked for t in row) <= set(ids.tolist())


def test_the_draft_chains_table_exists_before_the_kv_pool_is_sized(tiny_model_dir, vocab_dir, monkeypatch):
    """The DraftChain's table takes N x H elements of device memory: it is built before the KV pool is
    planned from what is left, never after."""
    from engine.runner import model_runner

    seen = []
    plan = model_runner.plan_kv_cache

    def recording_plan(*args, **kwargs):
        seen.append(len(built))  # how many tables existed when this pool was planned
        return plan(*args, **kwargs)

    built = []
    original = mtp_setup.DraftChain

    class RecordingChain(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(len(seen))  # how many pools had been planned when this table was built

    monkeypatch.setattr(model_runner, "plan_kv_cache", recording_plan)
    monkeypatch.setattr(mtp_setup, "DraftChain", RecordingChain)
    runner = make_llm(tiny_model_dir, mtp(vocab_dir)).engine.runner
    assert built == [0] and seen == [1] and isinstance(runner.mtp.chain, RecordingChain)
    ids, hidden = runner.mtp_head.draft_token_ids, runner.model_config.hidden_size
    assert runner.mtp.chain.table.shape == (len(ids), hidden)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_draft_vocabulary_keeps_greedy_output(tiny_model_dir, vocab_dir, plain_runs, quantization):
    prompts, params, plain, _ = plain_runs
    spec = mtp(vocab_dir, disable_below_acceptance=0.0, quantization=quantization)
    llm = make_llm(tiny_model_dir, spec, **SCENARIOS["preempt"])
    assert (llm.engine.runner.mtp_head.draft_weight.dtype == torch.float8_e4m3fn) == (quantization == "fp8")
    assert generate(llm, prompts, params) == plain["preempt"]
    stats = llm.engine.get_stats()
    assert stats["spec_verify_rows"] > 0 and stats["num_preemptions"] > 0


def test_an_fp8_head_computes_with_its_dequantized_weights(tiny_model_dir, vocab_dir):
    """quantization "fp8": fc1, fc2 and the draft rows in float8, one scale per row. The head's scores
    equal the same head's computed in float with the dequantized weights (q * scale), and lie within
    float8's rounding of the unquantized head's."""
    runner = make_llm(tiny_model_dir, mtp(vocab_dir)).engine.runner
    head = runner.mtp_head
    fp8, deq = copy.deepcopy(head), copy.deepcopy(head)
    fp8.quantize_fp8()
    assert set(fp8.fp8) == {"fc1", "fc2", "draft"} and fp8.draft_weight.dtype == torch.float8_e4m3fn
    for name, module in (("fc1", deq.sampler.fc1), ("fc2", deq.sampler.fc2)):
        q, scale = fp8.fp8[name]
        module.weight.data = (q.float() * scale[:, None]).to(module.weight.dtype)
    q, scale = fp8.fp8["draft"]
    deq.draft_weight = (q.float() * scale[:, None]).to(head.draft_weight.dtype)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, head.mask_embeddings.shape[1], generator=gen, dtype=head.draft_weight.dtype)
    prev = torch.randint(0, runner.model_config.vocab_size, (6,), generator=gen)

    def scores(h, weight):
        return h._linear(h._state(hidden, prev, runner.model.embed), "draft", weight)

    got, want, exact = (
        scores(fp8, fp8.draft_weight),
        scores(deq, deq.draft_weight),
        scores(head, head.draft_weight),
    )
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    assert 1e-4 < float((got - exact).norm() / exact.norm()) < 0.1


@pytest.fixture(scope="module")
def target_triples(tiny_model_dir):
    """(prompt, {(t0, t1, t2): p}, {(t0, t1): argmax t2}) at temperature 1, top-k 3, from transformers."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64).eval()

    @torch.no_grad()
    def top(ids: list[int]) -> tuple[list[int], list[float]]:
        vals, idx = hf(torch.tensor([ids])).logits[0, -1].topk(TOP_K + 1)
        assert vals[TOP_K - 1] - vals[TOP_K] > 1e-5, "a near tie at the top-k cut: change the prompt"
        return idx[:TOP_K].tolist(), vals[:TOP_K].softmax(-1).tolist()

    prompt, table, best = [77, 5, 1000, 42], {}, {}
    for t0, p0 in zip(*top(prompt)):
        for t1, p1 in zip(*top(prompt + [t0])):
            t2s, p2s = top(prompt + [t0, t1])
            best[t0, t1] = t2s[0]
            table.update({(t0, t1, t2): p0 * p1 * p2 for t2, p2 in zip(t2s, p2s)})
    return prompt, table, best


def sampled_triples(tiny_model_dir, mtp_dir, prompt, best) -> tuple[dict, dict]:
    llm = make_llm(
        tiny_model_dir,
        mtp(mtp_dir, disable_below_acceptance=0.0),
        max_num_seqs=N_SAMPLES,
        max_waiting=N_SAMPLES,
        max_num_batched_tokens=N_SAMPLES * (len(prompt) + (K + 1) ** 2),
    )
    # t2's proposal: the target's argmax there, accepted often but not always at temperature 1
    with_drafts(llm, lambda seq, kept, bonus: [best.get((seq.token_ids[-1], bonus), 0)] + [0] * (K - 1))
    # 4 tokens: a request speculates only with at least 2 left to draw
    params = [SamplingParams(max_tokens=4, top_k=TOP_K, seed=i, ignore_eos=True) for i in range(N_SAMPLES)]
    counts: dict[tuple, int] = {}
    for (tokens,) in generate(llm, [prompt] * N_SAMPLES, params):
        counts[tuple(tokens[:3])] = counts.get(tuple(tokens[:3]), 0) + 1
    return counts, llm.engine.get_stats()


def test_third_token_follows_the_target(tiny_model_dir, mtp_dir, target_triples):
    prompt, table, best = target_triples
    counts, stats = sampled_triples(tiny_model_dir, mtp_dir, prompt, best)
    assert set(counts) <= set(table), "a triple outside the target's top-k support"
    cells = list(table)
    p = chi_square_p([counts.get(c, 0) for c in cells], [N_SAMPLES * table[c] for c in cells])
    assert p > ALPHA, f"chi-square p = {p:.2e}"
    assert 0.1 * N_SAMPLES < stats["spec_accepted_tokens"] < N_SAMPLES


def test_a_broken_acceptance_rule_fails_the_same_test(tiny_model_dir, mtp_dir, target_triples, monkeypatch):
    import engine.spec.sampler as spec_sampler

    verify = spec_sampler.verify

    def accept_all(probs, x, num_draft, q, greedy, u):
        return verify(probs, x, num_draft, q, greedy, torch.zeros_like(u))  # u = 0: every proposal passes

    monkeypatch.setattr(spec_sampler, "verify", accept_all)
    prompt, table, best = target_triples
    counts, _ = sampled_triples(tiny_model_dir, mtp_dir, prompt, best)
    cells = list(table)
    p = chi_square_p([counts.get(c, 0) for c in cells], [N_SAMPLES * table[c] for c in cells])
    assert p < ALPHA, f"chi-square p = {p:.2e}"


def drafted_for(llm) -> set:
    """The adapter names (None: no adapter) of the requests whose chunks the head drafts for."""
    step, seen = llm.engine.runner.mtp, set()
    real = step.drafter

    def drafter(batch, hidden):
        seen.update(s.request.lora_request and s.request.lora_request.lora_name for s in batch.spec_samplers)
        return real(batch, hidden)

    step.drafter = drafter
    return seen


def test_beside_lora_adapters_and_the_host_tier(tiny_model_dir, mtp_dir, tmp_path):
    """An adapter's request speculates beside requests without one (its real rows under its adapter,
    its mask rows under the gate), and a host KV tier sits beside the scratch blocks: the text of the
    same engines without MTP, which for the adapter's request is its adapted model's."""
    from engine.lora.request import LoRARequest
    from tests.lora_fixtures import write_adapters

    adapter = LoRARequest("a1", 1, write_adapters(tiny_model_dir, tmp_path, ["a1"], rank=8)["a1"])
    prompts = [list(range(5, 45)), [7, 8, 9], list(range(300, 320))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cases = [
        (dict(enable_lora=True, max_loras=2, max_lora_rank=8), [adapter, None, None]),
        (dict(kv_offloading_size=0.01, num_blocks=24), None),
    ]
    for opts, loras in cases:
        outs = []
        for spec in (None, mtp(mtp_dir, disable_below_acceptance=0.0)):
            llm = make_llm(tiny_model_dir, spec, block_size=4, **opts)
            seen = drafted_for(llm) if spec else set()
            outs.append([r.outputs[0].token_ids for r in llm.generate(prompts, params, lora_request=loras)])
        assert outs[0] == outs[1] and llm.engine.get_stats()["spec_verify_rows"] > 0
        assert seen == ({"a1", None} if loras else {None})


def test_spec_bench_adds_the_fp8_head_beside_the_last_mtp_head():
    """spec_bench --mtp-fp8: one more engine, the last MTP head (the draft-vocabulary one when there is
    one) with quantization fp8; without the flag, none."""
    import argparse

    from benchmarks import spec_bench

    args = argparse.Namespace(proposers=["mtp"], ks=[4], alphas=[0.7], mtp_dir="/m", mtp_vocab_dir="/v",
                              mtp_draft_vocab=32000, mtp_fp8=True)  # fmt: skip
    rows = {label: cfg for label, cfg, _ in spec_bench.configs(args)}
    fp8 = rows["gated-LoRA MTP, k=4, draft vocabulary 32000, fp8 head"]
    assert (fp8["model"], fp8["quantization"]) == ("/v", "fp8")
    assert "quantization" not in rows["gated-LoRA MTP, k=4, draft vocabulary 32000"]
    args.mtp_draft_vocab, args.mtp_fp8 = 0, False
    assert [label for label, _, _ in spec_bench.configs(args)] == ["plain", "gated-LoRA MTP, k=4"]
    args.mtp_fp8 = True
    assert spec_bench.configs(args)[-1][1]["model"] == "/m"


def test_spec_bench_pairs_each_engine_with_ngram_by_round_and_rep():
    """--rounds: a figure is its median over rounds, and vs n-gram the median of the ratios of runs of
    the same round and rep (hand-computed below); --mtp-heads last keeps only the last MTP engine."""
    import argparse

    from benchmarks import spec_bench

    def row(config, rnd, runs):
        return {"config": config, "alpha": "0.7", "batch": 1, "round": rnd, "tok_s": runs[-1], "runs": runs,
                "acceptance": 0.4, "mean_emitted": 2.7}  # fmt: skip

    mtp = "gated-LoRA MTP, k=4, fp8 head"
    rows = [row("n-gram, k=4", 0, [500.0, 600.0]), row(mtp, 0, [400.0, 540.0]),
            row("n-gram, k=4", 1, [400.0, 480.0]), row(mtp, 1, [360.0, 384.0]),
            row("n-gram, k=2", 0, [100.0, 100.0])]  # fmt: skip
    got = {r["config"]: r for r in spec_bench.summary(rows)}
    # ratios 0.8, 0.9 (round 0) and 0.9, 0.8 (round 1): median 0.85; never against k=2
    assert got[mtp]["vs_ngram"] == 0.85 and got[mtp]["rounds"] == [540.0, 384.0]
    assert got[mtp]["tok_s"] == 462.0 and got["n-gram, k=4"]["vs_ngram"] is None
    assert got["n-gram, k=2"]["tok_s"] == 100.0

    args = argparse.Namespace(proposers=["ngram", "mtp"], ks=[4], alphas=[0.7], mtp_dir="/m",
                              mtp_vocab_dir="/v", mtp_draft_vocab=32000, mtp_fp8=True,
                              mtp_heads="last")  # fmt: skip
    labels = [label for label, _, _ in spec_bench.configs(args)]
    assert labels == ["plain", "n-gram, k=4", "gated-LoRA MTP, k=4, draft vocabulary 32000, fp8 head"]
