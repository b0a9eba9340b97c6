"""Gated-LoRA MTP on a GPU: its steps through the Triton visibility attention, eagerly and as captured
graphs, give in float32 exactly the greedy text of plain decoding (CUDA-graph decode through the decode
kernel), with the random head (every proposal rejected) and with proposals from the plain run (most
accepted), and leak no KV block."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from scripts.make_mtp import write_mtp_dir
from tests.test_spec_mtp import with_drafts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
K = 3


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 1500) for _ in range(rng.randint(5, 90))] for _ in range(6)]


def _run(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    out = [r.outputs[0].token_ids for r in llm.generate(_prompts(), params)]
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
    step, replays = llm.engine.runner.mtp, []
    if step.graphs is not None:
        run = step.graphs.run
        step.graphs.run = lambda *a: replays.append(1) or run(*a)
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
    assert bool(replays) == (not eager)
