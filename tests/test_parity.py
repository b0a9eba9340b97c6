"""Our models against transformers (eager attention, fp32) on tiny random checkpoints of every family.

* packed varlen prefill of prompts of 1..300 tokens in one call == per-prompt HF logits (single-file and
  sharded checkpoints);
* greedy decoding by full recompute == HF generate(do_sample=False), token for token;
* the paged-KV path (shuffled blocks, chunked prefill mixed with decodes) == cache-free recompute;
* a multimodal Gemma 3 checkpoint serves its language model (both weight-prefix spellings);
* 4.x and 5.x config.json spellings parse to the same ModelConfig.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.attention_context import AttentionMetadata, attention_context
from engine.models.layers import Attention
from engine.models.loader import load_model
from engine.models.registry import config_from_dict, config_from_dir
from tests.conftest_models import (
    FAMILIES,
    hf_logits,
    paged_step_metadata,
    save_checkpoint,
    shuffled_block_tables,
    tiny_hf_config,
    tiny_hf_model,
)

pytestmark = pytest.mark.parity
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
PROMPT_LENS = [1, 2, 17, 64, 300]  # 17 > Gemma's window of 16; 300 > llama3's original_max of 64


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    family = request.param
    hf = tiny_hf_model(family)
    root = tmp_path_factory.mktemp(family)
    single = save_checkpoint(hf, root / "single", sharded=False)
    sharded = save_checkpoint(hf, root / "sharded", sharded=True)
    model, cfg = load_model(single, progress=False)
    return {"family": family, "hf": hf, "single": single, "sharded": sharded, "model": model, "cfg": cfg}


def _random_prompts(lengths: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def _packed_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt in one flat batch, no cache: logits for every token, prompts back to back."""
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with attention_context(AttentionMetadata.for_full_sequences([len(p) for p in prompts])):
        return model.compute_logits(model(ids, positions))


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_packed_prefill_logits_match_transformers(checkpoint, layout):
    if layout == "sharded":
        shards = list(checkpoint["sharded"].glob("model-*.safetensors"))
        assert len(shards) > 1 and (checkpoint["sharded"] / "model.safetensors.index.json").is_file()
        model, cfg = load_model(checkpoint["sharded"], progress=False)
    else:
        model, cfg = checkpoint["model"], checkpoint["cfg"]
    assert next(model.parameters()).dtype == torch.float32  # CPU default
    prompts = _random_prompts(PROMPT_LENS, cfg.vocab_size)
    ours = _packed_logits(model, prompts)
    ref = torch.cat([hf_logits(checkpoint["hf"], p) for p in prompts])
    assert ref.std() > 0.3  # logits far from uniform, so the comparison is meaningful
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_greedy_recompute_matches_generate(checkpoint):
    model, hf = checkpoint["model"], checkpoint["hf"]
    for prompt in _random_prompts([5, 20], checkpoint["cfg"].vocab_size, seed=2):
        ids = list(prompt)
        for _ in range(32):
            ids.append(int(_packed_logits(model, [ids])[-1].argmax()))
        gen = transformers.GenerationConfig(
            max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), generation_config=gen)[0].tolist()
        assert ids == ref


# Each step: {sequence index: new tokens}. Step 0-1 are chunked prefills (sequence 2 joins at step 1),
# step 2 mixes decodes with sequence 2's second chunk, steps 3-4 are pure decodes.
PAGED_STEPS = [
    {0: 3, 1: 10},
    {0: 2, 1: 13, 2: 17},
    {0: 1, 1: 1, 2: 23},
    {0: 1, 1: 1, 2: 1},
    {0: 1, 1: 1, 2: 1},
]


@torch.no_grad()
def test_paged_kv_cache_matches_full_recompute(checkpoint):
    model, cfg = checkpoint["model"], checkpoint["cfg"]
    block_size = 4
    final_lens = [sum(step.get(s, 0) for step in PAGED_STEPS) for s in range(3)]
    tokens = _random_prompts(final_lens, cfg.vocab_size, seed=3)
    tables, num_blocks = shuffled_block_tables(final_lens, block_size, spare=5)
    ref = _packed_logits(model, tokens)  # before any cache exists
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:  # NaN everywhere: reading a slot that was never written poisons the logits
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        layer.k_cache, layer.v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    try:
        starts = torch.tensor([0, *final_lens]).cumsum(0).tolist()
        done = [0, 0, 0]
        for step in PAGED_STEPS:
            seqs = list(step)
            seq_lens = [done[s] + step[s] for s in seqs]
            meta = paged_step_metadata(
                [step[s] for s in seqs], seq_lens, [tables[s] for s in seqs], block_size
            )
            ids = torch.tensor([t for s in seqs for t in tokens[s][done[s] : done[s] + step[s]]])
            positions = torch.cat([torch.arange(done[s], done[s] + step[s]) for s in seqs])
            with attention_context(meta):
                ours = model.compute_logits(model(ids, positions))
            rows = torch.cat([torch.arange(starts[s] + done[s], starts[s] + done[s] + step[s]) for s in seqs])
            torch.testing.assert_close(ours, ref[rows], atol=ATOL, rtol=0)
            for s in seqs:
                done[s] += step[s]
    finally:
        for layer in layers:
            layer.k_cache = layer.v_cache = None


def _tiny_gemma3_multimodal():
    torch.manual_seed(0)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
    )
    text = tiny_hf_config("gemma3")
    # Gemma3ForConditionalGeneration never applies final_logit_softcapping (real Gemma 3 configs set it
    # to null); we apply whatever config.json says, so leave it unset here to compare like with like.
    text.final_logit_softcapping = None
    cfg = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=300,
        boi_token_index=301,
        eoi_token_index=302,
        attn_implementation="eager",
    )
    return transformers.Gemma3ForConditionalGeneration(cfg).float().eval()


def test_gemma3_multimodal_wrapper_serves_language_model(tmp_path):
    hf = _tiny_gemma3_multimodal()
    hf.save_pretrained(tmp_path / "a")  # transformers writes language_model.model.* and vision_tower.*
    # The other spelling (model.language_model.*), as some transformers versions save it.
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    weights = load_file(tmp_path / "a" / "model.safetensors")
    renamed = {k.replace("language_model.model.", "model.language_model.", 1): v for k, v in weights.items()}
    save_file(renamed, tmp_path / "b" / "model.safetensors", metadata={"format": "pt"})
    prompts = _random_prompts([9, 40], 300, seed=4)  # ids < 300: text tokens only
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    for variant in ("a", "b"):
        model, cfg = load_model(tmp_path / variant, progress=False)
        assert cfg.model_type == "gemma3_text" and cfg.is_multimodal_wrapper
        torch.testing.assert_close(_packed_logits(model, prompts), ref, atol=ATOL, rtol=0)


def _to_4x_spelling(raw: dict) -> dict:
    """Rewrite a 5.x config.json the way 4.x wrote it: rope_theta + rope_scaling ("type" key), Gemma's
    rope_local_base_freq and integer sliding_window_pattern instead of layer_types, torch_dtype."""
    old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types", "dtype")}
    params = raw["rope_parameters"]
    if "full_attention" in params:
        old["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        params = params["full_attention"]
    old["rope_theta"] = params["rope_theta"]
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type")}
    if params["rope_type"] != "default":
        old["rope_scaling"] = {"type": params["rope_type"], **scaling}
    old["torch_dtype"] = "bfloat16"
    return old


@pytest.mark.parametrize("family", FAMILIES)
def test_config_spellings_agree(family, tmp_path):
    tiny_hf_config(family).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    new = config_from_dir(tmp_path)
    old = config_from_dict(_to_4x_spelling(raw))
    for name in (
        "rope_theta",
        "rope_scaling",
        "rope_local_base_freq",
        "layer_types",
        "sliding_windows",
        "num_kv_heads",
        "head_dim",
        "tie_word_embeddings",
        "eos_token_ids",
        "hidden_activation",
    ):
        assert getattr(old, name) == getattr(new, name), name
    assert old.torch_dtype == "bfloat16"
    if family == "gemma3":
        assert new.sliding_windows == (16, None, 16, None) and new.rope_local_base_freq == 10000.0
        assert new.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    if family == "llama":
        assert new.rope_scaling["rope_type"] == "llama3"
        assert new.rope_scaling["original_max_position_embeddings"] == 64
