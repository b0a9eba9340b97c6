"""Speculative decoding of requests with forced tokens (budget forcing, the calculator tool).

A verified token that budget forcing replaces (or after which a tool forces its result) is the last
token its chunk keeps: the positions verified after it scored a history the sequence does not have.
* Greedy rows, and sampled rows at top_k=1 (the device verification path, deterministic): n-gram,
  draft-model and gated-LoRA MTP speculation (its drafts by lookup) emit exactly the tokens and masks
  of the same engine without speculation, on a prompt that ends in a cycle of the target's own greedy
  text holding the suppress token, so that proposals carry it and verified tokens follow it
  (`spec_forced_cuts` > 0: the cut is exercised). With the target as its own draft every chunk not
  cut accepts all its proposals: the draft's KV mirror stays consistent across cuts.
* Sampled rows (temperature 0.5, top-k 3): no suppress token before the budget, and every sampled
  token lies in the target's top 3 given the sequence's actual history (a naive full recompute).
* The calculator: a python-end marker put into a verified chunk by hand gets its result forced, and
  the text then continues as a naive greedy recompute of the sequence.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.llm import LLM
from engine.models.attention_context import AttentionMetadata, attention_context
from engine.sampling_params import BudgetForcing, SamplingParams, ToolConfig
from tests.reference import NaiveGenerator

pytestmark = pytest.mark.engine
K = 2
MAX_TOKENS, MIN_TOKENS = 48, 40


def make_llm(model_dir, method: str | None = None, mtp_dir=None) -> LLM:
    spec = None
    if method == "mtp":  # gated-LoRA MTP; its drafts: see lookup_drafts
        spec = {"method": "gated_lora_mtp", "model": str(mtp_dir), "num_speculative_tokens": K}
    elif method == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 1,
        }
    elif method == "self":  # the target as its own draft: greedy proposals are its argmaxes
        spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": K}
    if spec is not None:
        spec["disable_below_acceptance"] = 0.0
    return LLM(str(model_dir), speculative_config=spec, dtype="float64", device="cpu")


def generate(llm: LLM, prompts, params) -> list[tuple[list[int], list[int]]]:
    """(token ids, masks) of every request; the KV audit must be clean and every block free after."""
    results = llm.generate(prompts, params)
    assert llm.engine.audit() == []
    assert llm.engine.block_manager.num_used == 0
    return [(r.outputs[0].token_ids, r.outputs[0].token_masks) for r in results]


def spy_records(llm: LLM) -> list[tuple[int, int, bool]]:
    """Every Speculator.record call's (positions, num_accepted, cut)."""
    speculator, calls = llm.engine.speculator, []
    record = speculator.record

    def spy(seq, positions, num_accepted, cut=False):
        calls.append((positions, num_accepted, cut))
        record(seq, positions, num_accepted, cut)

    speculator.record = spy
    return calls


@pytest.fixture(scope="module")
def cycle(tiny_model_dir):
    """(prompts, the suppress string, its token): the first prompt is [5, 6, 7] plus 60 tokens of the
    target's greedy text, which ends in a repeated cycle; the suppress token is the cycle's most frequent
    token that a tokenizer round trip keeps."""
    llm = make_llm(tiny_model_dir)
    tok = llm.engine.tokenizer
    base = [5, 6, 7]
    ((text, _),) = generate(llm, [base], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    counts = Counter(t for t in text if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    token, seen = counts.most_common(1)[0]
    assert seen >= 2, "no repeated token to suppress: pick another prompt"
    return [base + text, base], tok.decode([token]), token


def forcing(suppress: str, **kw) -> SamplingParams:
    bf = BudgetForcing(suppress=suppress, replacements=["Wait", "Hmm"], min_tokens=MIN_TOKENS)
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, budget_forcing=bf, **kw)


MODES = {"greedy": dict(temperature=0.0), "top1": dict(temperature=1.0, top_k=1, seed=3)}


@pytest.fixture(scope="module")
def mtp_dir(tiny_model_dir, tmp_path_factory):
    from scripts.make_mtp import write_mtp_dir

    return write_mtp_dir(tmp_path_factory.mktemp("mtp") / "head", tiny_model_dir, num_mask_tokens=K, rank=4)


def lookup_drafts(llm: LLM) -> None:
    """MTP drafts by lookup in the history the sequence will have after this step (the random head's
    are never right): they follow the prompt's greedy cycle, suppress token included."""
    from engine.spec.ngram import NgramIndex
    from tests.test_spec_mtp import with_drafts

    def future(seq, kept, bonus):
        history = seq.token_ids[: seq.num_computed + 1] + seq.draft[:kept] + [bonus]
        return (NgramIndex(4, 1).propose(history, K) + [0] * K)[:K]

    with_drafts(llm, future)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("method", ["ngram", "self", "mtp"])
def test_budget_forcing_with_speculation_matches_plain(tiny_model_dir, cycle, mtp_dir, method, mode):
    prompts, suppress, _ = cycle
    params = forcing(suppress, **MODES[mode])
    plain = generate(make_llm(tiny_model_dir), prompts, params)
    assert all(0 in masks for _, masks in plain), "budget forcing never replaced a token"
    llm = make_llm(tiny_model_dir, method, mtp_dir)
    if method == "mtp":
        lookup_drafts(llm)
    records = spy_records(llm)
    assert generate(llm, prompts, params) == plain
    stats = llm.engine.get_stats()
    assert stats["spec_verify_rows"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["spec_forced_cuts"] > 0, "no verified token followed a replaced one"
    assert sum(cut for *_, cut in records) == stats["spec_forced_cuts"]
    if method == "self":  # a stale draft KV would propose off the target's argmax somewhere
        assert all(cut or accepted == positions for positions, accepted, cut in records)


@torch.inference_mode()
def target_top(reference: NaiveGenerator, ids: list[int], k: int) -> list[list[int]]:
    """The target's top k after every prefix of ids (one full forward, no KV cache)."""
    meta = AttentionMetadata.for_full_sequences([len(ids)])
    with attention_context(meta):
        hidden = reference.model(torch.tensor(ids), torch.arange(len(ids)))
    return reference.model.compute_logits(hidden).topk(k).indices.tolist()


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_sampled_budget_forcing_speculates_within_the_budget(tiny_model_dir, cycle, method):
    prompts, suppress, token = cycle
    n = 4
    params = [forcing(suppress, temperature=0.5, top_k=3, seed=i) for i in range(n)]
    llm = make_llm(tiny_model_dir, method)
    outs = generate(llm, [prompts[0]] * n, params)
    assert llm.engine.get_stats()["spec_verify_rows"] > 0
    reference = NaiveGenerator(tiny_model_dir)
    forced = 0
    for ids, masks in outs:
        assert len(ids) == MAX_TOKENS
        assert token not in ids[:MIN_TOKENS], "a suppress token before the budget was spent"
        forced += masks.count(0)
        top = target_top(reference, prompts[0] + ids, 3)[len(prompts[0]) - 1 :]
        drawn = [i for i, mask in enumerate(masks) if mask]
        assert all(ids[i] in top[i] for i in drawn), "a token drawn after a history it does not follow"
    assert forced > 0


def test_calculator_result_is_forced_inside_a_verified_chunk(tiny_model_dir):
    """Verified chunks are rewritten on the host: the first ones emit one token each of
    "<python_start>6*7" (a shorter chunk keeps fewer positions: its KV stays exact), then one emits the
    end marker followed by the K tokens the target verified after its first position."""
    llm = make_llm(tiny_model_dir, "self")
    tok, tool = llm.engine.tokenizer, ToolConfig()
    end = tok.token_id(tool.python_end)
    call = [tok.token_id(tool.python_start)] + tok.encode("6*7", add_special_tokens=False)
    script = [[t] for t in call] + [None]  # None: the marker, then the chunk's own tokens after it
    spec = llm.engine.runner.spec
    verifier = spec.verifier

    def scripted(logits, rows, plain, drafter=None):
        pending = verifier(logits, rows, plain, drafter)
        resolve = pending.resolve

        def resolved():
            result = resolve()
            if script:
                forced = script.pop(0)
                ((first, *after),) = result.spec_tokens
                assert forced is not None or len(after) == K  # tokens follow the marker: they must go
                result.spec_tokens = [forced or [end, *after]]
            return result

        pending.resolve = resolved
        return pending

    spec.verifier = scripted
    prompt = tok.encode("Compute:", add_special_tokens=False)
    params = SamplingParams(max_tokens=20, tool=tool, temperature=0.0, ignore_eos=True)
    ((got, masks),) = generate(llm, [prompt], [params])
    assert not script
    result = [tok.token_id(tool.output_start)] + tok.encode("42", add_special_tokens=False)
    result += [tok.token_id(tool.output_end)]
    head = 1 + len(call) + 1 + len(result)  # the prefill's token, the call, the marker, the result
    reference = NaiveGenerator(tiny_model_dir)
    assert got[:1] == reference.greedy(prompt, 1)
    assert got[1:head] == call + [end] + result
    assert masks[:head] == [1] * (head - len(result)) + [0] * len(result)
    assert got[head:] == reference.greedy(prompt + got[:head], 20 - head)
    assert llm.engine.get_stats()["spec_forced_cuts"] == 1
