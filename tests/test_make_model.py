"""scripts.make_model: generated checkpoints load in transformers, are deterministic, and the real-shape
tables agree with transformers' own models and with the published parameter counts."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from scripts.make_model import main, make_model
from scripts.model_shapes import SPECS, get_spec, hf_config, param_count, tensor_shapes

TINY = ["tiny", "tiny-qwen3", "tiny-gemma3"]
END_OF_TURN = {"tiny": "<|eot_id|>", "tiny-qwen3": "<|im_end|>", "tiny-gemma3": "<end_of_turn>"}
# Published totals (model cards / safetensors metadata) of the real checkpoints.
PUBLISHED_PARAMS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "qwen3-0.6b": 596_049_920,
    "gemma-3-1b": 999_885_952,
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_model(name, root / name, seed=0) for name in TINY}


@pytest.mark.parametrize("name", TINY)
def test_tiny_checkpoint_loads_in_transformers_with_our_weights(tiny_dirs, name):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert (
        type(model).__name__ == json.loads((tiny_dirs[name] / "config.json").read_text())["architectures"][0]
    )
    ours = load_file(tiny_dirs[name] / "model.safetensors")
    theirs = model.state_dict()
    assert set(ours) == set(tensor_shapes(get_spec(name)))
    for key, value in ours.items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(theirs[key], value, rtol=0, atol=0)
    if get_spec(name).tie_word_embeddings:
        assert theirs["lm_head.weight"].data_ptr() == theirs["model.embed_tokens.weight"].data_ptr()


@pytest.mark.parametrize("name", TINY)
def test_tiny_tokenizer_covers_vocab_and_names_end_of_turn(tiny_dirs, name):
    from transformers import AutoTokenizer

    model_dir = tiny_dirs[name]
    config = json.loads((model_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert len(tok) == config["vocab_size"] == get_spec(name).vocab_size
    eot = tok.convert_tokens_to_ids(END_OF_TURN[name])
    eos = config["eos_token_id"]
    assert eot in (eos if isinstance(eos, list) else [eos])
    assert eot in json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    specials = [
        "<|python_start|>",
        "<|python_end|>",
        "<|output_start|>",
        "<|output_end|>",
        "<think>",
        "</think>",
    ]
    for token in specials:  # each is one id, in range, and decodes back to itself
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] < config["vocab_size"] and tok.decode(ids) == token
    if config.get("bos_token_id") is not None and name != "tiny-qwen3":
        assert tok.encode("hi")[0] == config["bos_token_id"]
    assert "chat_template" in json.loads((model_dir / "tokenizer_config.json").read_text())


def test_same_seed_same_bytes_and_other_seed_other_weights(tiny_dirs, tmp_path):
    again = make_model("tiny", tmp_path / "again", seed=0)
    other = make_model("tiny", tmp_path / "other", seed=1)
    for filename in ["model.safetensors", "tokenizer.json", "tokenizer_config.json"]:
        assert (again / filename).read_bytes() == (tiny_dirs["tiny"] / filename).read_bytes(), filename
    a, b = load_file(again / "model.safetensors"), load_file(other / "model.safetensors")
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"]
    )


def test_init_scales(tiny_dirs):
    llama = load_file(tiny_dirs["tiny"] / "model.safetensors")
    gemma = load_file(tiny_dirs["tiny-gemma3"] / "model.safetensors")
    assert abs(llama["model.layers.0.mlp.up_proj.weight"].std().item() - 0.02) < 0.002
    assert abs(llama["model.norm.weight"].mean().item() - 1.0) < 0.05  # RMSNorm weight w: scale by w
    assert abs(gemma["model.norm.weight"].mean().item()) < 0.05  # Gemma scales by (1 + w)


def test_sharded_checkpoint_matches_single_file(tiny_dirs, tmp_path):
    sharded = make_model("tiny", tmp_path / "sharded", seed=0, max_shard_bytes=300_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert not (sharded / "model.safetensors").exists()
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged = {}
    for filename in files:
        part = load_file(sharded / filename)
        assert all(index["weight_map"][k] == filename for k in part)
        merged.update(part)
    single = load_file(tiny_dirs["tiny"] / "model.safetensors")
    assert merged.keys() == single.keys() and all(torch.equal(merged[k], single[k]) for k in single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())


def test_cli_writes_bf16(tmp_path, capsys):
    main(["tiny-qwen3", str(tmp_path / "q"), "--dtype", "bf16", "--seed", "3"])
    weights = load_file(tmp_path / "q" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert "229,824 parameters" in capsys.readouterr().out


def test_unknown_name_lists_choices(tmp_path):
    with pytest.raises(ValueError, match="tiny-gemma3"):
        make_model("gpt-5", tmp_path)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_real_shapes_match_transformers_and_published_counts(name, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = SPECS[name]
    assert param_count(spec) == PUBLISHED_PARAMS[name]
    (tmp_path / "config.json").write_text(json.dumps(hf_config(spec, "bf16", 1, [2, 3], None)))
    config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(config)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = tensor_shapes(spec)
    if spec.tie_word_embeddings:
        assert config.tie_word_embeddings and "lm_head.weight" not in ours
        theirs.pop("lm_head.weight")
    assert ours == theirs
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name]


def test_real_configs_carry_published_values(tmp_path):
    from transformers import AutoConfig

    def load(name):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(hf_config(SPECS[name], "bf16", 1, [2, 3], None)))
        return AutoConfig.from_pretrained(d)

    llama8 = load("llama-3.1-8b")
    assert llama8.rope_parameters["rope_type"] == "llama3" and llama8.rope_parameters["factor"] == 8.0
    assert llama8.rope_parameters["rope_theta"] == 500000.0 and not llama8.tie_word_embeddings
    assert load("llama-3.2-1b").rope_parameters["factor"] == 32.0
    qwen = load("qwen3-0.6b")
    assert (qwen.head_dim, qwen.vocab_size, qwen.rope_parameters["rope_theta"]) == (128, 151936, 1000000.0)
    gemma = load("gemma-3-1b")
    assert (gemma.sliding_window, gemma.query_pre_attn_scalar, gemma.vocab_size) == (512, 256, 262144)
    assert gemma.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert [i for i, t in enumerate(gemma.layer_types) if t == "full_attention"] == [5, 11, 17, 23]


def test_262k_vocab_tokenizer_is_complete_and_loads_fast(tmp_path):
    from engine.tokenizer import Tokenizer
    from scripts.make_tokenizer import write_tokenizer

    write_tokenizer("gemma3", 262144, tmp_path, "{{ bos_token }}", 32768)
    start = time.perf_counter()
    tok = Tokenizer.from_dir(tmp_path)
    assert time.perf_counter() - start < 5.0
    assert tok.vocab_size == 262144
    assert tok.token_id("<bos>") == 2 and tok.token_id("<end_of_turn>") is not None
    text = "The river reaches the sea."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
