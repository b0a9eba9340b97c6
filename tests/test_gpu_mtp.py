"""Gated-LoRA MTP on a GPU: its steps through the Triton visibility attention, eagerly and as captured
graphs, give in float32 exactly the greedy text of plain decoding (CUDA-graph decode through the decode
kernel), with the random head (every proposal rejected) and with proposals from the plain run (most
accepted), and leak no KV block; the captured drafting gives the eager drafting's tokens. On two GPUs
the same holds under tensor parallelism (eager MTP steps, every rank running the mask rows under its
share of the gate), and for requests with a LoRA adapter through the captured MTP graphs (real rows
under the adapter, mask rows under the gate)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from scripts.make_lora import make_lora
from scripts.make_mtp import write_mtp_dir
from tests.test_spec_mtp import with_drafts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
K = 3


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 1500) for _ in range(rng.randint(5, 90))] for _ in range(6)]


def _run(llm: LLM, loras: list | None = None) -> list[list[int]]:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    out = [r.outputs[0].token_ids for r in llm.generate(_prompts(), params, lora_request=loras)]
    assert llm.engine.audit() == [] and llm.engine.block_manager.num_used == 0
    return out


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> list[list[int]]:
    return _run(LLM(str(tiny_model_dir), dtype="float32", device="cuda", max_num_seqs=16, num_blocks=400))


@pytest.mark.parametrize("drafts", ["head", "plain run"])
@pytest.mark.parametrize("eager", [True, False])
def test_mtp_steps_give_plain_greedy_text(tiny_model_dir, tmp_path, plain, eager, drafts):
    head = write_mtp_dir(tmp_path / "mtp", tiny_model_dir, num_mask_tokens=K, rank=8)
    spec = {"method": "gated_lora_mtp", "num_speculative_tokens": K, "model": str(head),
            "disable_below_acceptance": 0.0}  # fmt: skip
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda", max_num_seqs=16, num_blocks=400,
              enforce_eager=eager, speculative_config=spec)  # fmt: skip
    step, replays, drafted = llm.engine.runner.mtp, [], []
    if step.graphs is not None:
        run, draft_run = step.graphs.run, step.draft_graphs.run
        step.graphs.run = lambda *a: replays.append(1) or run(*a)

        def draft_replay(n, accepted, bonus):  # the captured drafting against the eager one, same inputs
            got = draft_run(n, accepted, bonus)
            first = step.draft_graphs.first[:n]
            drafted.append(torch.equal(got, step.drafts(step.graphs.hidden, first, accepted, bonus)))
            return got

        step.draft_graphs.run = draft_replay
    if drafts == "plain run":
        full = {tuple(p): p + o for p, o in zip(_prompts(), plain)}

        def future(seq, kept, bonus):
            at = seq.num_computed + kept + 2
            return (full[tuple(seq.request.prompt_ids)][at : at + K] + [0] * K)[:K]

        with_drafts(llm, future)
    assert _run(llm) == plain
    stats = llm.engine.get_stats()
    assert stats["spec_verify_rows"] > 0
    assert (stats["spec_accepted_tokens"] > stats["spec_draft_tokens"] // 2) == (drafts == "plain run")
    assert bool(replays) == (not eager) and bool(drafted) == (not eager) and all(drafted)


def test_an_fp8_head_drafts_in_its_graphs_as_eagerly_and_keeps_plain_text(tiny_model_dir, tmp_path, plain):
    """quantization fp8 with a draft vocabulary: the float8 GEMVs of the head run inside the captured
    drafting, which gives the eager drafting's tokens; the text is plain decoding's."""
    vocab = 512  # of the tiny model's 2048 tokens
    head = write_mtp_dir(tmp_path / "mtp", tiny_model_dir, num_mask_tokens=K, rank=8, draft_vocab_size=vocab)
    spec = {"method": "gated_lora_mtp", "num_speculative_tokens": K, "model": str(head),
            "disable_below_acceptance": 0.0, "quantization": "fp8"}  # fmt: skip
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda", max_num_seqs=16, num_blocks=400,
              speculative_config=spec)  # fmt: skip
    step, drafted = llm.engine.runner.mtp, []
    assert llm.engine.runner.mtp_head.draft_weight.dtype == torch.float8_e4m3fn
    draft_run = step.draft_graphs.run

    def draft_replay(n, accepted, bonus):
        got = draft_run(n, accepted, bonus)
        first = step.draft_graphs.first[:n]
        drafted.append(torch.equal(got, step.drafts(step.graphs.hidden, first, accepted, bonus)))
        return got

    step.draft_graphs.run = draft_replay
    assert _run(llm) == plain
    assert drafted and all(drafted)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_mtp_under_tensor_parallelism_gives_plain_greedy_text(tiny_model_dir, tmp_path, plain):
    """One engine (a CUDA process runs one tensor-parallel engine, engine/runner/tp_group.close): the
    head's drafts (all rejected), then the plain run's (most accepted)."""
    head = write_mtp_dir(tmp_path / "mtp", tiny_model_dir, num_mask_tokens=K, rank=8)
    spec = {"method": "gated_lora_mtp", "num_speculative_tokens": K, "model": str(head),
            "disable_below_acceptance": 0.0}  # fmt: skip
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda", max_num_seqs=16, num_blocks=400,
              tensor_parallel_size=2, speculative_config=spec)  # fmt: skip
    full = {tuple(p): p + o for p, o in zip(_prompts(), plain)}

    def future(seq, kept, bonus):
        at = seq.num_computed + kept + 2
        return (full[tuple(seq.request.prompt_ids)][at : at + K] + [0] * K)[:K]

    keys, stats = ("spec_verify_rows", "spec_draft_tokens", "spec_accepted_tokens"), []
    try:
        assert llm.engine.runner.tp is not None and llm.engine.runner.mtp is not None
        for drafts in ("head", "plain run"):
            if drafts == "plain run":
                with_drafts(llm, future)
            assert _run(llm) == plain, drafts
            stats.append([llm.engine.get_stats()[k] for k in keys])
    finally:
        llm.engine.runner.shutdown()
    (rows_1, drafted_1, kept_1), (rows_2, drafted_2, kept_2) = stats[0], [b - a for a, b in zip(*stats)]
    assert rows_1 > 0 and rows_2 > 0
    assert kept_1 <= drafted_1 // 2 and kept_2 > drafted_2 // 2


def test_mtp_for_adapter_requests_through_graphs(tiny_model_dir, tmp_path, plain):
    adapter = LoRARequest("a1", 1, str(make_lora(tiny_model_dir, tmp_path / "a1", rank=8, targets="all")))
    loras = [adapter, None] * 3
    head = write_mtp_dir(tmp_path / "mtp", tiny_model_dir, num_mask_tokens=K, rank=8)
    spec = {"method": "gated_lora_mtp", "num_speculative_tokens": K, "model": str(head),
            "disable_below_acceptance": 0.0}  # fmt: skip
    kw = dict(dtype="float32", device="cuda", max_num_seqs=16, num_blocks=400, enable_lora=True,
              max_loras=2, max_lora_rank=8)  # fmt: skip
    adapted = _run(LLM(str(tiny_model_dir), **kw), loras)
    llm = LLM(str(tiny_model_dir), speculative_config=spec, **kw)
    step, replays = llm.engine.runner.mtp, []
    run = step.graphs.run
    step.graphs.run = lambda *a: replays.append(1) or run(*a)
    assert _run(llm, loras) == adapted and replays
    assert llm.engine.get_stats()["spec_verify_rows"] > 0
    base = [i for i, lora in enumerate(loras) if lora is None]
    assert [adapted[i] for i in base] == [plain[i] for i in base]
    assert sum(adapted[i] != plain[i] for i in range(len(loras)) if i not in base) >= 2  # the adapter acts
