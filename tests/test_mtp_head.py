"""The gated-LoRA MTP directory (speculative method gated_lora_mtp, issue 49): scripts.make_mtp writes
what engine/spec/mtp_head.py and engine/lora load (and peft too), the sampler head equals a float64
recompute written here, and every broken directory is refused naming the file, field or tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.lora.adapter import ModuleShapes, check_adapter
from engine.models.registry import config_from_dir, get_model_class
from engine.spec.mtp_chain import DraftChain
from engine.spec.mtp_head import check_mtp_dir, load_mtp_head, load_mtp_lora
from scripts.make_mtp import target, write_mtp_dir

pytestmark = pytest.mark.engine
HEAD, CONFIG = "mtp_head.safetensors", "mtp_config.json"
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return config_from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def good(tiny_model_dir, tmp_path_factory):
    """K = 4 mask tokens, a rank-8 LoRA, fp32, for the tiny checkpoint."""
    return write_mtp_dir(
        tmp_path_factory.mktemp("mtp") / "good", tiny_model_dir, 4, rank=8, seed=1, dtype="fp32"
    )


def test_the_written_directory_loads_for_the_tiny_model(tiny_model_dir, cfg, good):
    head = load_mtp_head(good, cfg, 4, torch.float32, "cpu")
    ours = load_file(good / HEAD)
    assert {n: t.shape for n, t in head.state_dict().items()} == {n: t.shape for n, t in ours.items()}
    assert all(torch.equal(head.state_dict()[n], t) for n, t in ours.items())
    assert head.eps == cfg.rms_norm_eps and head.source.num_mask_tokens == 4
    embed = load_file(tiny_model_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert 0.7 < head.mask_embeddings.std() / embed.std() < 1.4  # the scale of the inputs it replaces

    spec = check_adapter(good, ModuleShapes.of(cfg), max_lora_rank=8)  # what the multi-LoRA loader reads
    assert len(spec.modules) == 7 * cfg.num_layers and (spec.rank, spec.alpha) == (8, 16.0)
    assert head.source.adapter == spec and head.source.lora_rank == 8
    weights = load_mtp_lora(head.source, torch.float32)
    a, b = weights.modules[(0, "q_proj")]
    file = load_file(good / "adapter_model.safetensors")
    assert torch.equal(a, file[f"{Q0}.lora_A.weight"])
    torch.testing.assert_close(b, file[f"{Q0}.lora_B.weight"] * 2.0)  # alpha / r folded in
    assert weights.request.lora_path == str(good)


def test_a_shape_name_gives_a_directory_for_that_shape_with_gemmas_embedding_scale(tmp_path):
    cfg = target("tiny-gemma3")[0]
    out = write_mtp_dir(tmp_path / "g", "tiny-gemma3", 2, rank=4)
    head = load_mtp_head(out, cfg, 2, torch.bfloat16, "cpu")
    assert head.mask_embeddings.dtype == torch.bfloat16 and head.source.lora_rank == 4
    std = head.mask_embeddings.float().std().item()
    assert 0.7 < std / (0.02 * cfg.hidden_size**0.5) < 1.4  # Gemma's embed multiplies by sqrt(H)


def test_the_writer_is_deterministic_per_seed(tiny_model_dir, tmp_path):
    paths = [
        write_mtp_dir(tmp_path / str(i), tiny_model_dir, 2, 4, seed, "fp32")
        for i, seed in enumerate([5, 5, 6])
    ]
    heads = [load_file(p / HEAD)["sampler.fc1.weight"] for p in paths]
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])


def test_the_command_line_writes_a_loadable_directory(cfg, tmp_path):
    from scripts.make_model import main

    main(["--mtp", "tiny", str(tmp_path / "cli"), "--num-mask-tokens", "3", "--rank", "4", "--seed", "2"])
    mtp = check_mtp_dir(tmp_path / "cli", cfg, 3)
    assert (mtp.num_mask_tokens, mtp.lora_rank, mtp.adapter.alpha) == (3, 4, 8.0)


@pytest.mark.parametrize("family", ["tiny", "tiny-gemma3"])  # untied lm_head; tied with an embed scale
def test_draft_logits_equal_a_float64_recompute(family, tmp_path):
    cfg = target(family)[0]
    model = get_model_class(cfg.model_type)(cfg)
    gen = torch.Generator().manual_seed(0)
    for p in (model.model.embed_tokens.weight, *([] if model.lm_head is None else [model.lm_head.weight])):
        p.copy_(torch.randn(p.shape, generator=gen))
    head = load_mtp_head(
        write_mtp_dir(tmp_path / "d", family, 4, 4, dtype="fp32"), cfg, 4, torch.float32, "cpu"
    )
    with torch.no_grad():  # larger than the writer's, so the sampler's update moves the logits
        head.sampler.fc2.weight.mul_(20.0)
    h, prev = (
        torch.randn(5, cfg.hidden_size, generator=gen),
        torch.randint(0, cfg.vocab_size, (5,), generator=gen),
    )
    got = head.draft_logits(h, prev, model.embed, model.compute_logits)

    w = {n: t.double() for n, t in head.state_dict().items()}
    table = model.model.embed_tokens.weight.double()
    scale = cfg.hidden_size**0.5 if cfg.model_type == "gemma3_text" else 1.0
    u = torch.cat([h.double(), table[prev] * scale], dim=-1) @ w["sampler.fc1.weight"].T
    z = h.double() + (u * torch.sigmoid(u)) @ w["sampler.fc2.weight"].T
    n = z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w["sampler.norm.weight"]
    want = n @ (table if model.lm_head is None else model.lm_head.weight.double()).T
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    plain = model.compute_logits(h)  # h alone, without the sampler: a different answer
    assert (plain.double() - want).abs().max() > 1e-2
    assert torch.equal(head.draft(h, prev, model.embed, model.compute_logits), want.argmax(-1))
    rows = torch.tensor([3, 0, 3])
    assert torch.equal(head.mask_embedding(rows), head.mask_embeddings[[3, 0, 3]])


def edited(good, tmp_path, config=None, tensors=None, drop_file=None):
    """A copy of the good directory with mtp_config.json fields, head tensors (None: drop) or a file gone."""
    out = tmp_path / "bad"
    shutil.copytree(good, out)
    cfg = json.loads((out / CONFIG).read_text()) | (config or {})
    (out / CONFIG).write_text(json.dumps(cfg))
    weights = load_file(out / HEAD)
    for name, value in (tensors or {}).items():
        weights.pop(name, None) if value is None else weights.__setitem__(name, value)
    save_file(weights, out / HEAD)
    if drop_file:
        (out / drop_file).unlink()
    return out


@pytest.mark.parametrize(
    "edit,k,parts",
    [
        (dict(drop_file=CONFIG), 4, [f"no {CONFIG}", "--mtp"]),
        (dict(drop_file=HEAD), 4, [f"no {HEAD}"]),
        (dict(drop_file="adapter_model.safetensors"), 4, ["gated LoRA", "no adapter_model.safetensors"]),
        (dict(config={"format": "peft"}), 4, [CONFIG, "format is 'peft'", "minserve-gated-lora-mtp"]),
        (dict(config={"version": 2}), 4, [CONFIG, "version is 2", "version 1"]),
        (dict(), 5, [CONFIG, "num_mask_tokens is 4", "num_speculative_tokens is 5", "<= 4"]),
        (dict(config={"num_mask_tokens": 0}), 1, [CONFIG, "num_mask_tokens is 0"]),
        (dict(config={"hidden_size": 32}), 4, [CONFIG, "hidden_size is 32", "target's is 64"]),
        (dict(tensors={"sampler.fc1.weight": torch.zeros(64, 64)}), 4,
         [HEAD, "sampler.fc1.weight", "shape [64, 64]", "expected [64, 128]"]),
        (dict(tensors={"mask_embeddings": torch.zeros(3, 64)}), 4,
         [HEAD, "mask_embeddings", "expected [4, 64]"]),
        (dict(tensors={"sampler.norm.weight": None}), 4, [HEAD, "sampler.norm.weight is missing", "[64]"]),
        (dict(tensors={"sampler.norm.weight": torch.ones(64, dtype=torch.int32)}), 4,
         [HEAD, "sampler.norm.weight", "dtype I32"]),
        (dict(tensors={"lm_head.weight": torch.zeros(2, 2)}), 4, [HEAD, "unexpected", "lm_head.weight"]),
        (dict(config={"draft_vocab_size": 8}), 4, [HEAD, "draft_token_ids is missing", "[8]"]),
        (dict(tensors={"draft_token_ids": torch.arange(8)}), 4, [HEAD, "unexpected", "draft_token_ids"]),
        (dict(config={"draft_vocab_size": 0}), 4, [CONFIG, "draft_vocab_size is 0"]),
        (dict(config={"draft_vocab_size": 10**6}), 4, [CONFIG, "draft_vocab_size is 1000000", "vocabulary"]),
        (dict(config={"draft_vocab_size": 3}, tensors={"draft_token_ids": torch.tensor([1.0, 2.0, 3.0])}), 4,
         [HEAD, "draft_token_ids", "dtype F32"]),
        (dict(config={"draft_vocab_size": 3}, tensors={"draft_token_ids": torch.tensor([4, 9, 4])}), 4,
         [HEAD, "draft_token_ids repeats ids"]),
        (dict(config={"draft_vocab_size": 2}, tensors={"draft_token_ids": torch.tensor([4, 10**6])}), 4,
         [HEAD, "draft_token_ids holds ids outside the target's vocabulary 0..2047"]),
    ],
)  # fmt: skip
def test_a_broken_directory_is_refused_naming_what_is_wrong(cfg, good, tmp_path, edit, k, parts):
    bad = edited(good, tmp_path, **edit)
    with pytest.raises(ValueError, match=r"^speculative_config\.model: ") as info:
        load_mtp_head(bad, cfg, k, torch.float32, "cpu")
    assert all(p in str(info.value) for p in parts), str(info.value)


@pytest.mark.parametrize("family", ["tiny", "tiny-gemma3"])
def test_drafts_over_a_draft_vocabulary_are_the_argmax_of_its_rows(family, tmp_path):
    """With draft_token_ids the head drafts the best of those tokens by the full logits (float64
    recompute, every other column masked), which is not always the full argmax."""
    cfg = target(family)[0]
    model = get_model_class(cfg.model_type)(cfg)
    gen = torch.Generator().manual_seed(1)
    for p in (model.model.embed_tokens.weight, *([] if model.lm_head is None else [model.lm_head.weight])):
        p.copy_(torch.randn(p.shape, generator=gen))
    n = cfg.vocab_size // 8
    out = write_mtp_dir(tmp_path / "v", family, 4, 4, dtype="fp32", draft_vocab_size=n)
    head = load_mtp_head(out, cfg, 4, torch.float32, "cpu")
    ids = head.draft_token_ids
    assert ids.dtype == torch.long and len(set(ids.tolist())) == n and torch.equal(ids, ids.sort().values)
    assert torch.equal(ids, load_file(out / HEAD)["draft_token_ids"].sort().values)
    with torch.no_grad():
        head.sampler.fc2.weight.mul_(20.0)
    h, prev = (
        torch.randn(64, cfg.hidden_size, generator=gen),
        torch.randint(0, cfg.vocab_size, (64,), generator=gen),
    )
    full = head.draft_logits(h, prev, model.embed, model.compute_logits).double()
    head.bind_logits_weight(model.logits_weight())
    got = head.draft(h, prev, model.embed, model.compute_logits)
    masked = torch.full_like(full, float("-inf"))
    masked[:, ids] = full[:, ids]
    assert torch.equal(got, masked.argmax(-1))
    assert (got != full.argmax(-1)).any()  # the restriction changes some drafts


def recompute_chain(head, model, masks, bonus, family):
    """The k passes in float64, written here: pass i scores the draft vocabulary's rows of the LM head
    for norm(h_i + fc2(silu(fc1([h_i, embed(p)])))), p the bonus, then the previous draft."""
    w = {n: t.double() for n, t in head.state_dict().items()}
    table = model.model.embed_tokens.weight.double()
    scale = model.cfg.hidden_size**0.5 if family == "tiny-gemma3" else 1.0
    rows = model.logits_weight().double()[head.draft_token_ids]
    prev, out = bonus, []
    for i in range(masks.shape[1]):
        h = masks[:, i].double()
        u = torch.cat([h, table[prev] * scale], dim=-1) @ w["sampler.fc1.weight"].T
        z = h + (u * torch.sigmoid(u)) @ w["sampler.fc2.weight"].T
        n = z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + head.eps) * w["sampler.norm.weight"]
        prev = head.draft_token_ids[(n @ rows.T).argmax(-1)]
        out.append(prev)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("family,fp8", [("tiny", False), ("tiny-gemma3", False), ("tiny", True)])
def test_the_draft_chain_drafts_what_the_heads_passes_draft(family, fp8, tmp_path):
    """DraftChain (fc1 in two halves, the draft vocabulary's half precomputed) gives the k drafts of a
    float64 recompute of the passes (fp32 head) or of the head's own passes (fp8 head)."""
    cfg = target(family)[0]
    model = get_model_class(cfg.model_type)(cfg)
    gen = torch.Generator().manual_seed(2)
    for p in (model.model.embed_tokens.weight, *([] if model.lm_head is None else [model.lm_head.weight])):
        p.copy_(torch.randn(p.shape, generator=gen))
    out = write_mtp_dir(tmp_path / "c", family, 4, 4, dtype="fp32", draft_vocab_size=cfg.vocab_size // 4)
    head = load_mtp_head(out, cfg, 4, torch.float32, "cpu")
    with torch.no_grad():
        head.sampler.fc2.weight.mul_(20.0)
    head.bind_logits_weight(model.logits_weight())
    if fp8:
        head.quantize_fp8()
    chain = DraftChain(head, model.embed)
    masks = torch.randn(48, 4, cfg.hidden_size, generator=gen)
    bonus = torch.randint(0, cfg.vocab_size, (48,), generator=gen)
    got = chain.run(masks, bonus)
    if fp8:
        prev, want = bonus, []
        for i in range(4):
            prev = head.draft(masks[:, i], prev, model.embed, model.compute_logits)
            want.append(prev)
        want = torch.stack(want, dim=1)
    else:
        want = recompute_chain(head, model, masks, bonus, family)
    assert got.shape == (48, 4) and torch.equal(got, want)
    assert len(set(got[:, 1:].flatten().tolist())) > 8  # later passes follow their own previous drafts


def test_an_adapter_that_does_not_fit_the_target_is_refused(cfg, good, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    weights = load_file(bad / "adapter_model.safetensors")
    weights[f"{Q0}.lora_A.weight"] = torch.zeros(8, 48)
    save_file(weights, bad / "adapter_model.safetensors")
    with pytest.raises(
        ValueError, match=rf"^speculative_config\.model: the gated LoRA: .*{Q0}\.lora_A\.weight"
    ):
        check_mtp_dir(bad, cfg, 4)
    with pytest.raises(ValueError, match="is not a directory"):
        check_mtp_dir(tmp_path / "nowhere", cfg, 4)


def test_peft_loads_the_gated_lora_onto_the_hf_model(tiny_model_dir, good):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, good)
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    ours = load_file(good / "adapter_model.safetensors")
    down = "base_model.model.model.layers.1.mlp.down_proj"
    assert torch.equal(layer.lora_A["default"].weight, ours[f"{down}.lora_A.weight"])
    assert torch.equal(layer.lora_B["default"].weight, ours[f"{down}.lora_B.weight"])
    assert layer.scaling["default"] == 2.0
